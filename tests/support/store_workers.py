"""Child processes for the store-level fault tests: a writer, a reader, an evictor and a disk filler.

Why separate processes: the faults that matter (SIGKILL mid-write, a full filesystem, a precompute job,
a serving engine and `tiercache evict` on one directory at once) only happen between real processes
with their own LMDB handles and background writer threads. Each mode is started as
``python -m tests.support.store_workers MODE 'JSON options'`` and prints one JSON line (the last line
of its stdout) with what it did, so the test can check it.

Every record's content is a pure function of its id (`expected_tensor`, `expected_meta`), so any
reader, in any process, can tell a correct record from a wrong one without being told what was written.
"""

from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

from vllm_tiercache.shared.store.api import Record, StoreKey

#: Namespace of every key the workers write (the evictor filters on the model field).
NAMESPACE = "faults"


def fault_key(i: int, model: str = "keep") -> StoreKey:
    """The key of record ``i``: a KV-shaped key text, so `tiercache evict --model` can filter it."""
    return StoreKey(f"{NAMESPACE}|kv|{model}|fp0|tp1r0|{i:08d}|L0")


def key_id(text: str) -> int | None:
    """Record id from a key text written by `fault_key` (None for any other text, e.g. an empty one)."""
    fields = text.split("|")
    if len(fields) != 7 or fields[0] != NAMESPACE or not fields[5].isdigit():
        return None
    return int(fields[5])


def model_of(i: int) -> str:
    """Which model field record ``i`` carries in the soak test: odd ids are the evictor's targets."""
    return "evict" if i % 2 else "keep"


def expected_tensor(i: int) -> torch.Tensor:
    """Deterministic content of record ``i``; sizes vary (1-33 KiB) so kills and truncations vary too."""
    n = 512 + (i * 7919) % 16384
    g = torch.Generator().manual_seed(1_000_003 * i + 17)
    return torch.randn(n, generator=g).to(torch.float16)


def expected_meta(i: int) -> dict[str, Any]:
    return {"i": i}


def matches(i: int, rec: Record) -> bool:
    """Whether ``rec`` is exactly what record ``i`` must hold (dtype, shape, every byte, meta)."""
    exp = expected_tensor(i)
    t = rec.tensor
    return t.dtype == exp.dtype and tuple(t.shape) == tuple(exp.shape) and torch.equal(t, exp) and \
        rec.meta == expected_meta(i)


def digest_map(ids: Iterable[int], models: Iterable[str] = ("keep",)) -> dict[bytes, tuple[int, str]]:
    """digest -> (id, model) for every (id, model) pair: names the orphan files a killed writer left."""
    models = tuple(models)
    return {fault_key(i, m).digest: (i, m) for i in ids for m in models}


def _say(line: str) -> None:
    """Write one whole line to stdout in a single ``write(2)``.

    Why not ``print(..., flush=True)``: under ``PYTHONUNBUFFERED=1`` (set on the dev machines) stdout is
    an unbuffered FileIO and ``print`` writes the text and the newline in two system calls. A writer
    SIGKILLed between them leaves ``written 12`` without its newline; the zygote's ``exit`` line was glued
    onto it and the kill test waited for an ``exit`` line that never came (a CI run failed that way). A
    pipe write of at most PIPE_BUF bytes is atomic, so a line is now either all there or not at all.
    """
    data = (line + "\n").encode()
    while data:
        data = data[os.write(sys.stdout.fileno(), data):]


def _emit(result: dict[str, Any]) -> None:
    _say(json.dumps(result))


def _disk_store(path: str, capacity: int, *, memory: bool, fsync: bool = True) -> Any:
    from vllm_tiercache.shared.store import build_store

    tiers: list[dict[str, Any]] = [{"kind": "memory", "capacity": "256MiB"}] if memory else []
    tiers.append({"kind": "disk", "path": path, "capacity": capacity, "fsync": fsync})
    return build_store({"namespace": NAMESPACE, "tiers": tiers, "write_queue_size": 1024})


def audit_disk_dir(path: str, capacity: int, known: dict[bytes, tuple[int, str]]) -> dict[str, Any]:
    """Open a fresh disk tier on ``path`` and read back every record the index or the files name.

    Returns counts: ``good`` (byte-exact hits), ``wrong`` (hits with other content: must be 0),
    ``unknown_files`` (record files no writer could have made: must be 0), ``misses`` (clean misses,
    e.g. an index entry whose file a killed eviction had already unlinked), ``corrupt`` (the tier's
    counter), and after the reads ``index_ok``: every index entry has its file with the indexed size,
    the byte total equals the sum of the entries, and every record file left is indexed.
    """
    from pathlib import Path

    from vllm_tiercache.shared.config import DiskTierConfig
    from vllm_tiercache.shared.store.tiers.disk.tier import DiskTier

    root = Path(path)
    tier = DiskTier(DiskTierConfig(path=path, capacity=capacity))
    try:
        digests = {d for d, _, _, _ in tier.iter_index()} | {bytes.fromhex(f.stem) for f in root.glob("??/*.rec")}
        good = wrong = misses = unknown = 0
        for digest in sorted(digests):
            if digest not in known:
                unknown += 1
                continue
            i, model = known[digest]
            rec = tier.get_many([fault_key(i, model)])[0]
            if rec is None:
                misses += 1
            elif matches(i, rec):
                good += 1
            else:
                wrong += 1
        entries = {d: size for d, size, _, _ in tier.iter_index()}
        files = {bytes.fromhex(f.stem): f.stat().st_size for f in root.glob("??/*.rec")}
        usage = tier.usage()
        index_ok = entries == files and usage["bytes_used"] == sum(entries.values())
        return {"good": good, "wrong": wrong, "misses": misses, "unknown_files": unknown,
                "corrupt": tier.counters.get("corrupt"), "index_ok": index_ok, "entries": len(entries),
                "bytes_used": usage["bytes_used"], "tmp_files": len(list(root.glob("??/.tmp-*")))}
    finally:
        tier.close()


# ------------------------------------------------------------------------------------------------ modes
def writer(opts: dict[str, Any]) -> None:
    """A precompute-like producer: memory + disk tier, puts in batches, flushes the background writer.

    ``start``: first id; ``count``: ids to write (None: until killed or ``duration_s`` ends);
    ``alternate_models``: odd ids get model "evict" (the soak test's eviction target).
    """
    store = _disk_store(opts["path"], int(opts["capacity"]), memory=True, fsync=opts.get("fsync", True))
    batch = int(opts.get("batch", 4))
    start, count = int(opts.get("start", 0)), opts.get("count")
    deadline = time.monotonic() + float(opts["duration_s"]) if opts.get("duration_s") else None
    alternate = bool(opts.get("alternate_models", False))
    _say("ready")
    i = start
    while (count is None or i < start + count) and (deadline is None or time.monotonic() < deadline):
        ids = range(i, i + batch if count is None else min(i + batch, start + count))
        store.put_many([(fault_key(j, model_of(j) if alternate else "keep"), expected_tensor(j),
                         expected_meta(j)) for j in ids], owned=True)
        store.flush()
        i = ids[-1] + 1
        _say(f"written {i}")
    disk = store.stats()["tiers"]["disk"]
    store.close()
    _emit({"written_until": i, "start": start, "disk_puts": disk["puts"],
           "disk_dropped": disk["dropped_writes"], "disk_errors": disk["errors"]})


def reader(opts: dict[str, Any]) -> None:
    """A serving-like consumer: a disk-only store, reading what the index lists plus random probes.

    Every hit is checked byte for byte; a mismatch is a torn or wrong read, the thing that must not happen.
    """
    store = _disk_store(opts["path"], int(opts["capacity"]), memory=False)
    disk = store.tiers[0]
    rng = random.Random(int(opts.get("seed", 0)))
    deadline = time.monotonic() + float(opts["duration_s"])
    reads = hits = mismatches = 0
    _say("ready")
    while True:  # at least one pass, however slow the machine
        listed = [(key_id(text), text) for _, _, _, text in disk.iter_index()]
        listed = [(i, text) for i, text in listed if i is not None]
        sample = rng.sample(listed, min(len(listed), 16))
        top = max((i for i, _ in listed), default=0)
        probes = [(i, fault_key(i, model_of(i)).text) for i in (rng.randrange(top + 2) for _ in range(4))]
        pairs = sample + probes
        recs = store.get_many([StoreKey(text) for _, text in pairs])
        for (i, _), rec in zip(pairs, recs, strict=True):
            reads += 1
            if rec is not None:
                hits += 1
                mismatches += 0 if matches(i, rec) else 1  # type: ignore[arg-type]
        if time.monotonic() >= deadline:
            break
    stats = store.stats()["tiers"]["disk"]
    store.close()
    _emit({"reads": reads, "hits": hits, "mismatches": mismatches, "corrupt": stats["corrupt"],
           "errors": stats["errors"]})


def evictor(opts: dict[str, Any]) -> None:
    """`tiercache evict --model evict` (its function, the one the CLI runs) in a loop until the deadline."""
    from vllm_tiercache.tools.evict_cmd import evict

    config = {"namespace": NAMESPACE, "tiers": [{"kind": "disk", "path": opts["path"],
                                                  "capacity": int(opts["capacity"])}]}
    deadline = time.monotonic() + float(opts["duration_s"])
    runs = removed = 0
    _say("ready")
    while runs == 0 or time.monotonic() < deadline:
        result = evict(config, model="evict")
        if any(t.get("error") for t in result["tiers"]):
            _emit({"runs": runs, "removed": removed, "error": result})
            return
        runs += 1
        removed += int(result["records"])
        time.sleep(float(opts.get("pause_s", 0.2)))
    _emit({"runs": runs, "removed": removed})


def fill(opts: dict[str, Any]) -> None:
    """Write ``count`` records into a disk tier on a (small) filesystem, then read every one back.

    Run inside a size-limited tmpfs (or under RLIMIT_FSIZE): every write must either land or be
    skipped and counted, no exception may reach this caller, and reads must keep working.
    """
    store = _disk_store(opts["path"], 1 << 30, memory=False, fsync=True)
    if opts.get("rlimit_fsize"):  # set once the index exists: LMDB's lock file alone is 64 KiB
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death, as a full disk gives ENOSPC
        limit = int(opts["rlimit_fsize"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    count, raised = int(opts["count"]), []
    for i in range(count):
        try:
            store.put_many([(fault_key(i), expected_tensor(i), expected_meta(i))], owned=True)
            store.flush()
        except Exception as exc:  # the point of the test: nothing may get here
            raised.append(repr(exc))
    ids = list(range(count))
    present = store.contains_many([fault_key(i) for i in ids])
    recs = store.get_many([fault_key(i) for i in ids])
    good = sum(1 for i, r in zip(ids, recs, strict=True) if r is not None and matches(i, r))
    wrong = sum(1 for i, r in zip(ids, recs, strict=True) if r is not None and not matches(i, r))
    stats = store.stats()["tiers"]["disk"]
    # free space by evicting the first half, then writing must work again (serving goes on)
    disk = store.tiers[0]
    freed = disk.delete_where(lambda text, size, atime: (key_id(text) or 0) < count // 2)[0]
    after = fault_key(10_000)
    store.put_many([(after, expected_tensor(10_000), expected_meta(10_000))], owned=True)
    store.flush()
    rec_after = store.get(after)
    store.close()
    _emit({"raised": raised, "present": sum(present), "good_reads": good, "wrong_reads": wrong,
           "puts": stats["puts"], "dropped_writes": stats["dropped_writes"], "errors": stats["errors"],
           "freed": freed, "write_after_free": rec_after is not None and matches(10_000, rec_after),
           "statvfs_total": os.statvfs(opts["path"]).f_blocks * os.statvfs(opts["path"]).f_frsize})


def half_line(_opts: dict[str, Any]) -> None:
    """Say ``ready``, then leave a line without its newline and wait to be killed.

    What a process killed between the two system calls of an unbuffered ``print`` leaves in the pipe;
    the zygote's ``exit`` line after it must still be read as its own line.
    """
    os.write(sys.stdout.fileno(), b"ready\nwritten 1")  # one write: the half line is there before any kill
    time.sleep(600)


def object_writer(opts: dict[str, Any]) -> None:
    """A precompute-like producer on a store whose one tier is the object tier ``opts["tier"]`` (credentials
    from this process's environment): writes ``count`` records from ``start`` (tagged ``tag``) in batches,
    flushing after each (with ``until_put``, more until ``count`` were put), then one last sweep of its
    janitor; reports puts, drops and evictions. Patient, as a job's store is."""
    from vllm_tiercache.shared.store import build_store

    # patient, as a precompute job's store (`write_patience_s`): a loaded machine's slow second of SeaweedFS is
    # waited out, not a dropped write (what the janitor does not admit is still dropped)
    store = build_store({"namespace": NAMESPACE, "tiers": [opts["tier"]], "write_queue_size": 1024,
                         "control_poll_s": 0.2, "write_patience_s": 300.0})
    tier = store.tiers[0]
    start, count, batch = int(opts.get("start", 0)), int(opts["count"]), int(opts.get("batch", 4))
    meta_tags = {"tags": [opts["tag"]]} if opts.get("tag") else {}
    # ``until_put``: new records until ``count`` were put, not only tried (a record no grant holds is dropped,
    # and a loaded machine's slow sweeps drop many), within ``limit_s``
    until_put, limit = bool(opts.get("until_put")), time.monotonic() + float(opts.get("limit_s", 300.0))
    _say("ready")
    i = start
    while i < start + count or (until_put and tier.counters.get("puts") < count and time.monotonic() < limit):
        ids = range(i, i + batch) if until_put else range(i, min(i + batch, start + count))
        store.put_many([(fault_key(j), expected_tensor(j), {**expected_meta(j), **meta_tags}) for j in ids],
                       owned=True, always_admit=True)
        store.flush()
        i += batch
    stats = store.stats()["tiers"][tier.name]
    store.close()
    _emit({"puts": stats["puts"], "dropped": stats["dropped_writes"], "evictions": stats["evictions"],
           "errors": stats["errors"]})


MODES = {"writer": writer, "object_writer": object_writer, "half_line": half_line, "reader": reader,
         "evictor": evictor, "fill": fill}


def zygote(_opts: dict[str, Any]) -> None:
    """Fork one worker per stdin line ``{"mode": ..., "opts": {...}}``; report ``pid N`` and ``exit N RC``.

    Why: the kill test needs many short-lived writer processes, and a fresh interpreter importing torch
    costs seconds on a busy CI machine. Each forked child is still its own process, killed for real, with
    its own store, LMDB handle and writer thread, all made after the fork (this process opens none).
    """
    torch.set_num_threads(1)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # the test's stall report
    # Import the tiers once here, not in every child (the store package imports them lazily).
    import vllm_tiercache.shared.store.tiers.disk.tier
    import vllm_tiercache.shared.store.tiers.redis.tier  # noqa: F401

    _say("zygote ready")
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                MODES[job["mode"]](job.get("opts", {}))
            except BaseException as exc:
                _say(f"worker failed: {exc!r}")
                code = 1
            finally:
                sys.stdout.flush()
                os._exit(code)
        # A leading newline here too: the child may run first and leave a half line before this one.
        _say(f"\npid {pid}")
        _, status = os.waitpid(pid, 0)
        # A leading newline ends whatever half line a killed child left, so ``exit`` always starts a line.
        _say(f"\nexit {pid} {status}")


def main(argv: list[str]) -> int:
    mode, opts = argv[0], json.loads(argv[1]) if len(argv) > 1 else {}
    if mode == "zygote":
        zygote(opts)
    else:
        MODES[mode](opts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
