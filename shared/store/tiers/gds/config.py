"""The GDS tier's config: `GdsTierConfig`, the disk tier's config with another kind.

Why the same fields: a GDS tier is a disk tier read through cuFile (same files, same index), so
everything but ``kind`` is `DiskTierConfig`'s. Apart from `tier.py`, which imports kvikio and torch, since
parsing a config must not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import Field

from vllm_tiercache.shared.store.tiers.disk.config import DiskTierConfig


@dataclass(frozen=True)
class GdsTierConfig(DiskTierConfig):
    """The disk layout, read through cuFile (kvikio) straight into GPU memory where CUDA and GPUDirect
    Storage exist, through the POSIX path otherwise (`kind: gds`)."""

    kind: Annotated[Literal["gds"], Field(description="The tier kind.")] = "gds"  # type: ignore[assignment]
