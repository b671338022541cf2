"""The CUDA mover's staging pool: buffers reused, never handed out while a copy may still use them, and
bounded (the pool waits for a busy buffer rather than pin more memory than its limit)."""

from __future__ import annotations

from vllm_tiercache.kvcache.blocks.pinned_pool import GRANULE, PinnedPool


class FakeEvent:
    """A `torch.cuda.Event` stand-in: done once `finish` (or `synchronize`) ran."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_buffers_are_reused_not_allocated_per_call():
    pool = PinnedPool(pin=False)
    for _ in range(50):
        a = pool.take(3 * GRANULE // 2)
        b = pool.take(100)
        pool.give(a)
        pool.give(b)
    assert pool.allocations == 2 and pool.allocated_bytes == 3 * GRANULE
    assert pool.take(GRANULE).numel() == GRANULE  # the smallest free buffer that fits


def test_a_buffer_comes_back_only_after_its_copy():
    pool = PinnedPool(pin=False)
    buffer = pool.take(GRANULE)
    event = FakeEvent()
    pool.give_after(buffer, event)
    other = pool.take(GRANULE)
    assert other.data_ptr() != buffer.data_ptr() and pool.allocations == 2
    pool.give(other)
    event.done = True
    taken = {pool.take(GRANULE).data_ptr(), pool.take(GRANULE).data_ptr()}
    assert taken == {buffer.data_ptr(), other.data_ptr()} and pool.allocations == 2


def test_past_its_limit_the_pool_waits_for_a_busy_buffer():
    pool = PinnedPool(pin=False, limit_bytes=2 * GRANULE)
    events = []
    for _ in range(2):
        events.append(FakeEvent())
        pool.give_after(pool.take(GRANULE), events[-1])
    again = pool.take(GRANULE)
    assert pool.allocations == 2 and pool.allocated_bytes == 2 * GRANULE
    assert events[0].waited and not events[1].waited  # the oldest copy was waited for, and only it
    assert again.numel() == GRANULE


def test_a_request_larger_than_every_free_buffer_replaces_one_at_the_limit():
    pool = PinnedPool(pin=False, limit_bytes=2 * GRANULE)
    pool.give(pool.take(GRANULE))
    pool.give(pool.take(GRANULE + 1))  # the free 1 MiB buffer is let go rather than go past the limit
    assert (pool.allocations, pool.allocated_bytes, pool.free_buffers) == (2, 2 * GRANULE, 1)
    big = pool.take(2 * GRANULE + 1)  # larger than the limit: still served, alone
    assert big.numel() == 3 * GRANULE
    assert (pool.allocated_bytes, pool.free_buffers) == (3 * GRANULE, 0)


def test_two_threads_never_get_the_same_buffer():
    """The CUDA mover takes buffers on the forward thread (gathers) and the loader thread (scatters)."""
    import threading

    pool = PinnedPool(pin=False)
    in_use: set[int] = set()
    guard = threading.Lock()
    clashes = []

    def churn() -> None:
        for _ in range(3000):
            buffer = pool.take(GRANULE)
            with guard:
                if buffer.data_ptr() in in_use:
                    clashes.append(buffer.data_ptr())
                in_use.add(buffer.data_ptr())
            with guard:
                in_use.discard(buffer.data_ptr())
            pool.give(buffer)

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not clashes
    assert pool.allocations <= 3 and pool.free_buffers == pool.allocations
