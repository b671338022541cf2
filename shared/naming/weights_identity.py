"""What a model's weights are, named by their content: the part of every cache key that changes with them.

Why: a key made of the model string as typed, its config and dtype does not change when the weights do.
Regenerating a model in the same directory (the everyday fine-tuning workflow: same path, same
`config.json`) left every key as it was, and a restarted engine served the old weights' KV as hits,
giving outputs that matched neither the old nor the new weights. The other way round, `/models/x`,
`/models/x/` and a symlink to it are one model but were three keys, so replicas that spelled the path
differently never shared a record.

So the identity is a digest of the files of the model directory, computed once per file and remembered by
(real path, size, mtime, ctime, inode) in a small JSON file beside the disk tier's default directory, so
a restart reads no weights again. A hub id resolves to its downloaded snapshot (then it is the same
directory, hence the same digest, as the snapshot's path); when no local copy is found, the snapshot's
commit (vLLM's config carries it) names the weights instead. Operators who version their models may set
`model_version`: it replaces the digest (no file is read) and they vouch that a new version gets a new
value.

The display name that keys and `tiercache stats` show is canonical too: ``org/name`` for a hub snapshot,
else the resolved directory's name; keys of different models that share a name still differ by digest.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from vllm_tiercache.shared.files import replace_json

log = logging.getLogger(__name__)

__all__ = ["DIGEST_CACHE_NAME", "WeightsIdentity", "digest_directory", "model_names", "resolve_weights"]

#: File, under the cache directory, that remembers each weight file's digest by its stat signature.
DIGEST_CACHE_NAME = "weight-digests.json"

#: Files that describe a model without changing what it computes; editing a README must not cost hits.
_IGNORED_FILE = re.compile(r"(?i)^(readme|license|licence|notice|citation)(\..*)?$|.*\.md$")

#: A snapshot in the Hugging Face cache: .../models--{org}--{name}/snapshots/{commit}
_HF_SNAPSHOT = re.compile(r"^models--(?P<repo>.+)$")

_READ_BYTES = 16 << 20


@dataclass(frozen=True)
class WeightsIdentity:
    """The weights one engine serves: a display name and a digest that changes whenever they do."""

    #: canonical name for key texts and stats: ``org/name`` for a hub snapshot, else the directory's name
    name: str
    #: ``files:<hex>`` (content digest), ``hf-commit:<sha>``, ``version:<model_version>`` or ``name-only:<model>``
    digest: str
    #: bytes of the files behind ``digest`` (0 when no file was read)
    nbytes: int = 0

    @property
    def verified(self) -> bool:
        """False when nothing names the weights themselves (the digest is only the model string)."""
        return not self.digest.startswith("name-only:")


def resolve_weights(
    model: str,
    *,
    revision: str | None = None,
    hub_commit: str | None = None,
    model_version: str | None = None,
    download_dir: str | None = None,
    cache_dir: Path | None = None,
) -> WeightsIdentity:
    """The identity of the weights an engine loads for ``model`` (a local path or a hub id).

    ``hub_commit`` is the snapshot commit vLLM read the config from (``hf_config._commit_hash``), used when
    the snapshot's files are not found locally. ``cache_dir`` holds the digest cache (default: the
    default disk tier's directory).
    """
    local = _local_directory(model, revision, download_dir)
    name = _display_name(model, local)
    if model_version:
        return WeightsIdentity(name=name, digest=f"version:{model_version}")
    if local is not None:
        digest, nbytes = digest_directory(local, cache_dir=cache_dir)
        return WeightsIdentity(name=name, digest=f"files:{digest}", nbytes=nbytes)
    if hub_commit:
        return WeightsIdentity(name=name, digest=f"hf-commit:{hub_commit}")
    log.warning(
        "tiercache: cannot find the files of model %r (not a directory, no local hub snapshot) nor its hub "
        "commit, so cache keys name it only by that string: new weights under the same name would meet "
        "old records. Set `model_version` in the connector config to name the weights yourself.", model,
    )
    return WeightsIdentity(name=name, digest=f"name-only:{model}@{revision or ''}")


def digest_directory(directory: Path, cache_dir: Path | None = None) -> tuple[str, int]:
    """(hex digest, bytes) over every file of a model directory that can change what it computes.

    Each file's digest comes from the cache when its stat signature is unchanged; the directory's digest
    combines the files' relative paths and digests, so a renamed, added or removed file changes it too.
    """
    files = sorted(_model_files(directory))
    if not files:
        raise ValueError(f"model directory {directory} holds no files to identify the weights by")
    combined = xxhash.xxh3_128()
    total = 0
    with _DigestCache.open(cache_dir) as cache:
        for rel in files:
            path = directory / rel
            digest, size = cache.digest(path)
            combined.update(f"{rel.as_posix()}\0{digest}\n".encode())
            total += size
    return combined.hexdigest(), total


def _model_files(directory: Path) -> Iterator[Path]:
    """Relative paths of the regular files (symlinks followed) under ``directory``, hidden ones skipped."""
    for root, dirs, names in os.walk(directory, followlinks=True):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if name.startswith(".") or _IGNORED_FILE.match(name):
                continue
            path = Path(root) / name
            if path.is_file():
                yield path.relative_to(directory)


def _local_directory(model: str, revision: str | None, download_dir: str | None) -> Path | None:
    """The directory holding the model's files: the path itself, or the hub snapshot already downloaded."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path.resolve()
    if model.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        found = snapshot_download(model, revision=revision, cache_dir=download_dir, local_files_only=True)
    except Exception:  # not downloaded, not a hub id, hub library missing: the caller falls back
        return None
    return Path(found).resolve()


def model_names(model: str) -> set[str]:
    """Every name keys may carry for a model given as ``model`` (`tiercache evict --model`): the canonical
    name, and the string itself, as builds before the weights identity wrote it."""
    names = {model, _display_name(model, _local_directory(model, None, None))}
    if model.startswith((".", "/", "~")):  # a path whose directory is gone (old weights removed)
        names.add(Path(model.rstrip("/")).name or model)
    return names


def _display_name(model: str, local: Path | None) -> str:
    """``org/name`` for a hub snapshot directory, the directory's name for another local one, else ``model``."""
    if local is None:
        return model.rstrip("/") or model
    if local.parent.name == "snapshots":
        match = _HF_SNAPSHOT.match(local.parent.parent.name)
        if match:
            return match["repo"].replace("--", "/")
    return local.name or str(local)


class _DigestCache:
    """Per-file digests remembered across processes, keyed by real path and stat signature.

    The signature includes ctime and the inode: a rewrite in place that kept size and mtime still changes
    ctime, which no user call can set back. The file is locked while in use, so the scheduler and the
    worker starting together hash each file once between them.
    """

    def __init__(self, path: Path | None, entries: dict[str, list[object]]) -> None:
        self._path = path
        self._entries = entries
        self._dirty = False

    @classmethod
    @contextlib.contextmanager
    def open(cls, cache_dir: Path | None) -> Iterator[_DigestCache]:
        path = _cache_file(cache_dir)
        if path is None:
            yield cls(None, {})
            return
        with open(path.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                cache = cls(path, _read_entries(path))
                yield cache
                cache._save()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def digest(self, path: Path) -> tuple[str, int]:
        real = os.path.realpath(path)
        st = os.stat(real)
        signature = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        known = self._entries.get(real)
        if known is not None and known[:4] == signature:
            return str(known[4]), st.st_size
        digest = _digest_file(real)
        self._entries[real] = [*signature, digest]
        self._dirty = True
        return digest, st.st_size

    def _save(self) -> None:
        if not self._dirty or self._path is None:
            return
        # Forget files that are gone (old checkpoints, test directories), or the cache only ever grows.
        kept = {path: entry for path, entry in self._entries.items() if os.path.exists(path)}
        try:
            replace_json(self._path, {"format": 1, "files": kept})
        except OSError as exc:
            log.warning("tiercache: could not remember weight digests in %s (%s); they are recomputed at "
                        "the next start", self._path, exc)


def _cache_file(cache_dir: Path | None) -> Path | None:
    """The digest cache's path, or None (digests not remembered) when its directory cannot be created."""
    if cache_dir is None:
        from vllm_tiercache.shared.store.tier_config import default_cache_dir

        cache_dir = default_cache_dir()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.warning("tiercache: cannot create %s (%s); weight digests are not remembered", cache_dir, exc)
        return None
    return cache_dir / DIGEST_CACHE_NAME


def _read_entries(path: Path) -> dict[str, list[object]]:
    """The remembered digests; an unreadable or foreign file counts as empty (it is only a cache)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) and data.get("format") == 1 else None
    return {k: v for k, v in files.items() if isinstance(v, list) and len(v) == 5} if isinstance(files, dict) else {}


def _digest_file(path: str) -> str:
    hasher = xxhash.xxh3_128()
    buf = bytearray(_READ_BYTES)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            hasher.update(view[:n])
    return hasher.hexdigest()
