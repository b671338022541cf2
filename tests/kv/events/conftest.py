from collections.abc import Iterator

import pytest

from tests.kv.events.test_events import Published


@pytest.fixture(autouse=True)
def _close_published() -> Iterator[None]:
    """Each test's `Published` engines are closed after it, so no store thread of theirs outlives it (an
    object tier's janitor once polled a session's S3 server after the server had stopped)."""
    yield
    Published.close_all()
