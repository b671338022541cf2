"""The object tier's row of `tiercache bench tiers`: a batch of records through the store against the same
client's raw requests of the same bytes at the same concurrency, and against boto3 one request at a time.

Why a batch: the object tier is worth using only with many requests in flight (a KV hit is many records,
one per layer and chunk), so one record at a time would measure a round trip, not the tier. The reference is
what the tier's client choice promises: plain boto3 ``get_object`` / ``put_object`` of the same bytes, from
as many threads as the tier's ``concurrency``, on one client with as many pooled connections (the tier's
own tuning, `vllm_tiercache.shared.store.tiers.object.client`); the baseline is boto3 one request after the
other, as a naive caller would use it. Targets (issue 49): get and put at least 0.8 of the raw requests,
get at least 1.5x one-at-a-time. Beside them, the CPU each record's request cost the client and, for a
private SeaweedFS, the server (`CpuMeter`).

Without ``--s3-endpoint`` a private SeaweedFS is started (`vllm_tiercache.tools.s3_server`); with it, the
bucket must exist and the credentials come from the AWS chain, as for the tier. Everything written is
deleted afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_tiercache.tools.cli import UsageError

#: The bytes one batch moves at most (fewer records of large sizes): keeps a default run short.
BATCH_BYTES = 64 << 20
MAX_BATCH = 32
#: Requests in flight, for the tier and the raw reference alike (the tier's default).
CONCURRENCY = 16
OBJECT_TARGET = 0.8
SERIAL_TARGET = 1.5
#: endpoint -> process id of the SeaweedFS `s3_target` started, whose CPU the row reports (a store of the
#: user's is measured from outside: its CPU is not this machine's to read)
_PRIVATE_SERVERS: dict[str, int] = {}


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (psutil, as `bench serve` reads its servers'
    memory), None where it cannot be read."""
    import psutil

    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.Error, OSError):
        return None
    return times.user + times.system


class CpuMeter:
    """CPU per record of a batch's requests: this process's (the client: the tier's threads, or boto3's) and,
    for a private SeaweedFS, the server's. Why: on a machine whose cores the server, the client and vLLM share,
    CPU per request is what a request costs the others (requests in flight hide it from the wall clock); a
    real S3's CPU is not the host's, its client's is."""

    def __init__(self, server_pid: int | None, records: int) -> None:
        self.server_pid = server_pid
        self.records = records
        self.seen: dict[str, list[tuple[float, float | None]]] = {}

    def metered(self, name: str, fn: Callable[[int], Any]) -> Callable[[int], Any]:
        """``fn`` measured under ``name`` (the warm-up round, i < 0, is not counted)."""
        def run(i: int) -> Any:
            server = process_cpu_s(self.server_pid) if self.server_pid else None
            client = time.process_time()
            out = fn(i)
            client = time.process_time() - client
            after = process_cpu_s(self.server_pid) if self.server_pid else None
            if i >= 0:
                self.seen.setdefault(name, []).append(
                    (client, None if server is None or after is None else after - server))
            return out
        return run

    def per_record_ms(self) -> dict[str, dict[str, float | None]]:
        """Median milliseconds per record: ``{"put": {"client": .., "server": ..}, ...}``."""
        out: dict[str, dict[str, float | None]] = {}
        for name, seen in self.seen.items():
            servers = [s for _, s in seen if s is not None]
            out[name] = {"client": round(1000 * statistics.median(c for c, _ in seen) / self.records, 3),
                         "server": round(1000 * statistics.median(servers) / self.records, 3) if servers else None}
        return out


def lookup_budget_arg(text: str) -> float:
    """argparse ``type=`` of the benches' ``--lookup-budget-ms`` (`bench kv`, `bench serve`): milliseconds
    within the store's bounds, refused at parse time rather than inside every engine. Here, beside
    `s3_target`, because the object tier is why they have it: its scheduler lookup is one HEAD per record."""
    from vllm_tiercache.shared.config import MAX_LOOKUP_BUDGET_MS, MIN_LOOKUP_BUDGET_MS

    value = float(text)  # not a number: argparse's "invalid lookup_budget_arg value"
    if not MIN_LOOKUP_BUDGET_MS <= value <= MAX_LOOKUP_BUDGET_MS:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds from {MIN_LOOKUP_BUDGET_MS:g} to "
                                         f"{MAX_LOOKUP_BUDGET_MS:g}")
    return value


def add_s3_arguments(parser: argparse.ArgumentParser, what: str = "") -> None:
    """``--s3-endpoint`` and ``--s3-bucket``, as every bench of the object tier takes them (`s3_target`)."""
    parser.add_argument("--s3-endpoint", help=f"S3 endpoint{what} (its --s3-bucket must exist; credentials from "
                        "the AWS chain); default: start a private SeaweedFS")
    parser.add_argument("--s3-bucket", help=f"bucket{what} with --s3-endpoint")


def check_s3_arguments(args: argparse.Namespace) -> None:
    """Refuse ``--s3-endpoint`` without ``--s3-bucket`` in one line, before anything starts."""
    if getattr(args, "s3_endpoint", None) and not getattr(args, "s3_bucket", None):
        raise UsageError("--s3-endpoint: needs --s3-bucket (an existing bucket)")


@contextlib.contextmanager
def s3_target(endpoint: str | None, bucket: str | None) -> Iterator[dict[str, Any]]:
    """The object tier item to measure: the given endpoint and bucket, or a private SeaweedFS (its
    credentials put in this process's environment for the AWS chain while it runs)."""
    if endpoint:
        yield {"kind": "object", "endpoint": endpoint, "bucket": bucket, "path_style": True}
        return
    from vllm_tiercache.tools.s3_server import SeaweedFSServer

    with SeaweedFSServer() as server:
        saved = {k: os.environ.get(k) for k in server.credentials_env()}
        os.environ.update(server.credentials_env())
        assert server.proc is not None
        _PRIVATE_SERVERS[server.endpoint] = server.proc.pid
        try:
            yield {"kind": "object", "endpoint": server.endpoint, "bucket": server.create_bucket("tiercache-bench"),
                   "path_style": True}
        finally:
            _PRIVATE_SERVERS.pop(server.endpoint, None)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def bench_object(size: int, repeat: int, item: dict[str, Any],
                 measure: Callable[[Sequence[Callable[[int], Any]], int], list[float]]) -> dict[str, Any]:
    """Median seconds (via ``measure``) of one batch: the store's get_many / put_many (owned, then flushed)
    against raw boto3 GETs / PUTs from `CONCURRENCY` threads, and boto3 GETs one at a time."""
    import torch  # here, not at the top: the benches that take `lookup_budget_arg` stay free of torch

    from vllm_tiercache.shared.config import StoreConfig
    from vllm_tiercache.shared.store import StoreKey, TieredStore

    batch = max(1, min(MAX_BATCH, BATCH_BYTES // size))
    data = torch.randint(0, 255, (size,), dtype=torch.uint8)
    raw = data.numpy().tobytes()
    # sweep_share 0.5: a sweep (a listing) at most every half capacity written, far apart from one batch, so the
    # row measures requests, not the janitor (`tiercache bench capacity` measures that)
    config = {**item, "concurrency": CONCURRENCY, "capacity": max(1 << 30, 4 * batch * size * (repeat + 2)),
              "prefix": f"bench-{uuid.uuid4().hex[:8]}/", "timeout_s": 60.0, "sweep_share": 0.5}
    store = TieredStore(StoreConfig.from_dict({"tiers": [config]}))
    from vllm_tiercache.shared.store.tiers.object.client import make_client

    # a client tuned as the tier's own: the reference differs only in what the tier adds
    client = make_client(StoreConfig.from_dict({"tiers": [config]}).tiers[0])
    bucket, prefix = config["bucket"], config["prefix"]
    pool = ThreadPoolExecutor(CONCURRENCY)

    def keys(i: int) -> list[StoreKey]:
        return [StoreKey(f"bench|object|{prefix}|{i}|{j}") for j in range(batch)]

    def names(i: int) -> list[str]:
        return [f"{prefix}ref/{i}/{j}" for j in range(batch)]

    def put(i: int) -> None:
        store.put_many([(key, data, None) for key in keys(i)], owned=True)
        store.flush()

    def ref_put(i: int) -> None:
        list(pool.map(lambda name: client.put_object(Bucket=bucket, Key=name, Body=raw), names(i)))

    def get(i: int) -> None:
        got = store.get_many(keys(i))
        if any(rec is None for rec in got):
            raise RuntimeError(f"the object tier at {config['endpoint']} missed records it was given")

    def ref_get(i: int) -> None:
        list(pool.map(lambda name: client.get_object(Bucket=bucket, Key=name)["Body"].read(), names(i)))

    def serial_get(i: int) -> None:
        for name in names(i):
            client.get_object(Bucket=bucket, Key=name)["Body"].read()

    meter = CpuMeter(_PRIVATE_SERVERS.get(str(config.get("endpoint"))), batch)
    try:
        put_s, ref_put_s = measure([meter.metered("put", put), meter.metered("put boto3", ref_put)], repeat)
        get_s, ref_get_s, serial_s = measure([meter.metered("get", get), meter.metered("get boto3", ref_get),
                                              serial_get], repeat)
    finally:
        store.close()  # first: its janitor's last ledger write lands before the clean-up below
        try:  # the records, the references and the tier's own objects (ledger, usage) under the run's prefix
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                list(pool.map(lambda o: client.delete_object(Bucket=bucket, Key=o["Key"]), page.get("Contents", ())))
        finally:
            pool.shutdown()
    total = size * batch
    gib = float(1 << 30)
    return {"tier": "object", "size": size, "batch": batch,
            "put_gib_s": round(total / put_s / gib, 3), "put_ref_gib_s": round(total / ref_put_s / gib, 3),
            "put_ratio": round(ref_put_s / put_s, 3), "copy_put_gib_s": None, "copy_put_ratio": None,
            "get_gib_s": round(total / get_s / gib, 3), "get_ref_gib_s": round(total / ref_get_s / gib, 3),
            "get_ratio": round(ref_get_s / get_s, 3),
            "get_serial_gib_s": round(total / serial_s / gib, 3), "get_vs_serial": round(serial_s / get_s, 3),
            "cpu_ms_per_record": meter.per_record_ms(), "target": OBJECT_TARGET}
