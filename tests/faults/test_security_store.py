"""Store security: no unpickling of stored bytes, an owner-only disk store no key can escape, Redis with
a password and with TLS against real servers so configured, and tier-down messages that say what was
tried.

Why: a cache directory or a Redis database is shared state; whoever can write it must not be able to
run code in the engine (pickle), read other users' cached prompts (permissions), or make the store touch
files outside its directory (keys as paths). A misconfigured or unreachable Redis must cost only misses,
with a log line an operator can act on.
"""

from __future__ import annotations

import ast
import json
import logging
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_tiercache.shared.config import DiskTierConfig, RedisTierConfig, StoreConfig
from vllm_tiercache.shared.store import DiskTier, RedisTier, StoreKey
from vllm_tiercache.tools.redis_server import RedisServer

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("vllm_tiercache", "shared", "kvcache", "eccache", "tools")
#: Modules whose loaders execute code from bytes; none of them may read what a store holds.
_UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle", "joblib"}
_LOADERS = {"load", "loads", "Unpickler", "_load", "_loads"}
#: pickle.dumps only serialises for hashing (vLLM's sha256/xxhash prefix hashes); nothing is unpickled.
_PICKLE_FOR_HASHING_ONLY = {"shared/naming/hashing.py"}


def unsafe_deserialization(source: str, filename: str) -> list[str]:
    """Every unpickling-style load in ``source``: pickle/marshal/dill/... loads, torch.load, numpy.load
    with allow_pickle, and any import of those modules outside the hashing module."""
    found: list[str] = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            for alias in node.names:
                root = alias.name.split(".")[0]
                if root in _UNSAFE_MODULES and not (root == "pickle" and filename in _PICKLE_FOR_HASHING_ONLY):
                    found.append(f"{where}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            names = {a.name for a in node.names}
            if root in _UNSAFE_MODULES or (root == "torch" and "load" in names) or \
                    (root in ("numpy", "torch") and node.module.endswith("serialization")):
                found.append(f"{where}: from {node.module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            attr = node.func.attr
            if attr in _LOADERS and name in _UNSAFE_MODULES | {"torch", "serialization"}:
                found.append(f"{where}: {name}.{attr}(...)")
            if attr == "load" and name in ("np", "numpy"):
                for kw in node.keywords:
                    safe = isinstance(kw.value, ast.Constant) and kw.value.value is False
                    if kw.arg == "allow_pickle" and not safe:
                        found.append(f"{where}: {name}.load(allow_pickle=...)")
    return found


def test_no_pickle_or_torch_load_in_the_product() -> None:
    """Stored bytes are parsed by `vllm_tiercache.shared.records` only (cbor header + raw tensor bytes)."""
    files = [p for pkg in PRODUCT for p in (REPO / pkg).rglob("*.py")]
    assert len(files) > 30
    found = [hit for p in files for hit in unsafe_deserialization(p.read_text(), str(p.relative_to(REPO)))]
    assert found == []


@pytest.mark.parametrize("snippet", [
    "import pickle\npickle.loads(b)", "import marshal", "from pickle import loads", "torch.load(f)",
    "from torch import load", "np.load(f, allow_pickle=True)", "import dill", "x = cloudpickle.loads(b)",
    "torch.serialization.load(f)",
])
def test_the_scan_finds_each_unsafe_loader(snippet: str) -> None:
    """The scan above would fail on each of these (so its passing means something)."""
    assert unsafe_deserialization(snippet, "kvcache/x.py")


# ------------------------------------------------------------------------------------------ disk
_PERMISSIONS_CHILD = r"""
import json, os, stat, sys
os.umask(0)  # the most permissive umask: modes must come from the code, not from the environment
from pathlib import Path
import torch
from vllm_tiercache.shared.config import DiskTierConfig
from vllm_tiercache.shared.store import DiskTier, StoreKey
tmp_modes = []
real_fsync = os.fsync
def spy(fd):
    tmp_modes.append(stat.S_IMODE(os.fstat(fd).st_mode))
    return real_fsync(fd)
os.fsync = spy
root = Path(sys.argv[1]) / "store"
tier = DiskTier(DiskTierConfig(path=str(root), capacity=1 << 20))
tier.put_many([(StoreKey(f"k{i}"), torch.arange(100 + i), None) for i in range(5)])
tier.close()
modes = {str(p.relative_to(root.parent)): stat.S_IMODE(p.stat().st_mode) for p in [root, *root.rglob("*")]}
print(json.dumps({"modes": modes, "tmp_modes": tmp_modes}))
"""


def test_disk_store_is_owner_only_even_with_umask_0(tmp_path: Path) -> None:
    """Store dir, fan-out dirs and the LMDB index dir 0700; records, temp files and index files 0600."""
    proc = subprocess.run([sys.executable, "-c", _PERMISSIONS_CHILD, str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    modes: dict[str, int] = result["modes"]
    dirs = {p: m for p, m in modes.items() if (tmp_path / p).is_dir()}
    files = {p: m for p, m in modes.items() if not (tmp_path / p).is_dir()}
    assert "store/index.lmdb" in dirs and any(p.endswith(".rec") for p in files)
    assert {p: oct(m) for p, m in dirs.items() if m != 0o700} == {}
    assert {p: oct(m) for p, m in files.items() if m != 0o600} == {}
    assert len(result["tmp_modes"]) == 5 and set(result["tmp_modes"]) == {0o600}


HOSTILE_KEYS = ["../../etc/passwd", "/etc/passwd", "..", ".", "", "a\x00b", "..\\..\\windows", "~root/.ssh",
                "x/" * 2000, "ns|kv|m|../../../tmp/evil|L0", "\u202e\udcff", "index.lmdb/data.mdb"]


def test_no_key_names_a_path_outside_the_store(tmp_path: Path) -> None:
    """Keys are digests: the file name is 32 hex digits under a 2-digit fan-out dir, whatever the text."""
    root = tmp_path / "store"
    outside_before = sorted(p.name for p in tmp_path.iterdir())
    tier = DiskTier(DiskTierConfig(path=str(root), capacity=1 << 24))
    try:
        keys = [StoreKey(text) for text in HOSTILE_KEYS]
        for i, key in enumerate(keys):
            path = tier.path_for(key)
            assert path.resolve().parent.parent == root.resolve()
            assert path.parent.name == key.hex[:2] and path.name == f"{key.hex}.rec"
            assert all(c in "0123456789abcdef" for c in key.hex) and len(key.hex) == 32
            tier.put_many([(key, torch.full((8,), i), {"i": i})])
        recs = tier.get_many(keys)
        assert [int(r.tensor[0]) for r in recs] == list(range(len(keys)))  # type: ignore[union-attr]
        assert [r.meta["i"] for r in recs] == list(range(len(keys)))  # type: ignore[union-attr]
        assert tier.usage()["entries"] == len(keys)
        # a caller-supplied digest is still only ever hex-encoded into a name
        forged = StoreKey("forged", digest=b"../../etc/passwd")
        assert tier.path_for(forged).resolve().parent.parent == root.resolve()
    finally:
        tier.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({*outside_before, "store"})
    names = {p.name for p in root.rglob("*")}
    assert not any(".." in n or "passwd" in n for n in names)


def test_redis_names_are_digests_too() -> None:
    """Redis key names carry the digest only, so key text cannot reach another record's names."""
    tier = RedisTier(RedisTierConfig(url="redis://127.0.0.1:1/0", timeout_s=0.1, retry_after_s=60))
    try:
        for text in HOSTILE_KEYS:
            key = StoreKey(text)
            base = f"tiercache:{{{key.hex}}}"
            assert [tier._head(key), tier._part(key, 0), tier._text_name(key)] == [base, f"{base}:0", f"{base}#text"]
    finally:
        tier.close()


# ----------------------------------------------------------------------------------------- redis
def _tier(url: str, **kw: object) -> RedisTier:
    cfg = StoreConfig.from_dict({"tiers": [{"kind": "redis", "url": url, "timeout_s": 2.0, "retry_after_s": 60,
                                            **kw}]}).tiers[0]
    return RedisTier(cfg)  # type: ignore[arg-type]


def _k(i: int) -> StoreKey:
    return StoreKey(f"sec|redis|{i}")


def _down_line(caplog: pytest.LogCaptureFixture) -> str:
    lines = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.redis
def test_redis_password_right_wrong_and_missing(caplog: pytest.LogCaptureFixture) -> None:
    """requirepass: the right password works (URL or field); a wrong or missing one is a clean tier-down
    whose one log line names the address (never the password) and the server's reason."""
    with RedisServer(password="s3cret-pw") as srv:
        ok = _tier(srv.url)
        ok.put_many([(_k(1), torch.arange(10), None)])
        assert ok.get_many([_k(1)])[0] is not None and not ok.down
        ok.close()
        by_field = _tier(srv.url.replace(":s3cret-pw@", ""), password="s3cret-pw")
        assert by_field.get_many([_k(1)])[0] is not None
        by_field.close()
        address = f"127.0.0.1:{srv.port}"
        for url, reason in ((srv.url.replace("s3cret-pw", "wrong-pw"), "invalid username-password"),
                            (srv.url.replace(":s3cret-pw@", ""), "authenticated")):
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="vllm_tiercache.shared.store.tiers.redis.tier"):
                bad = _tier(url)
                assert bad.get_many([_k(1)]) == [None]
                assert bad.contains_many([_k(1)]) == [False]
                bad.put_many([(_k(2), torch.arange(3), None)])
            assert bad.down and bad.counters.get("dropped_writes") == 1
            line = _down_line(caplog)
            assert address in line and reason.lower() in line.lower(), line
            assert "wrong-pw" not in line and "s3cret-pw" not in line, line
            bad.close()


@pytest.mark.redis
def test_redis_tls_with_ca_and_plain_client_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A TLS-only server with a password: rediss:// + ssl_ca_certs works; a plain redis:// client and a
    TLS client that does not trust the CA are clean tier-downs naming the address and the TLS setting."""
    with RedisServer(tls=True, password="tls-pw") as srv:
        assert srv.url.startswith("rediss://")
        good = _tier(srv.url, **srv.ssl_kwargs)
        good.put_many([(_k(1), torch.arange(10), {"tls": True})])
        rec = good.get_many([_k(1)])[0]
        assert rec is not None and torch.equal(rec.tensor, torch.arange(10)) and rec.meta == {"tls": True}
        good.close()
        address = f"127.0.0.1:{srv.port}"
        cases = [(srv.url.replace("rediss://", "redis://"), {}, "plain TCP (no TLS)"),
                 (srv.url, {}, "certificate verify failed")]
        for url, kw, expect in cases:
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="vllm_tiercache.shared.store.tiers.redis.tier"):
                bad = _tier(url, **kw)
                assert bad.get_many([_k(1)]) == [None]
                bad.put_many([(_k(3), torch.arange(3), None)])
            assert bad.down and bad.counters.get("dropped_writes") == 1
            line = _down_line(caplog)
            assert address in line and expect in line, line
            bad.close()


def test_unreachable_redis_names_address_and_what_was_tried(caplog: pytest.LogCaptureFixture) -> None:
    """A closed loopback port: misses and skipped writes, and one line with the address, the error,
    the transport, the timeout and the retry policy."""
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="vllm_tiercache.shared.store.tiers.redis.tier"):
        tier = _tier(f"redis://127.0.0.1:{port}/0", timeout_s=0.3)
        assert tier.get_many([_k(1)]) == [None]
        tier.put_many([(_k(1), torch.arange(3), None)])
        assert tier.contains_many([_k(1)]) == [False]
    assert tier.down and tier.counters.get("dropped_writes") == 1
    line = _down_line(caplog)
    for piece in (f"redis://127.0.0.1:{port}/0", "ConnectionError", "refused", "plain TCP", "0.3s connect/read timeout",
                  "1 immediate retry", "retrying every 60.0s"):
        assert piece in line, (piece, line)
    tier.close()



def test_unusable_disk_path_names_the_path_and_what_was_tried(tmp_path: Path) -> None:
    """A disk tier path under a regular file: one clear error at start, naming the directory, the OS
    error and what was attempted, instead of a bare errno from deep inside LMDB."""
    from vllm_tiercache.shared.store.tiers.disk.tier import DiskTierError

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    path = blocker / "cache"
    with pytest.raises(DiskTierError) as info:
        DiskTier(DiskTierConfig(path=str(path), capacity=1 << 20))
    msg = str(info.value)
    for piece in (str(path), "NotADirectoryError", "create the directory (mode 0700)", "LMDB index",
                  f"{path}/index.lmdb"):
        assert piece in msg, (piece, msg)
    assert isinstance(info.value, OSError)
