"""`tiercache evict`: remove records after a model or adapter update, or by age.

Keys carry the namespace and the model name as their first and third fields
(``{ns}|kv|{model}|...``, ``{ns}|enc|{model}|...``, read by `vllm_tiercache.shared.naming.keys.parse_key_text`),
so invalidation is a filter over key texts, handed to each tier's `Tier.delete_stored` (this command
never asks which kind a tier is):

- disk / gds: the index is scanned and matches are removed batch by batch under the index's write
  transaction, safely beside serving processes (a reader mid-read keeps its open file; a later reader
  gets a miss and recomputes).
- redis: SCAN over ``key_prefix``, then head, parts and key text of each match are deleted.
- memory: per process (the tier raises `TierAdminUnsupported`); serving processes drop their memory
  copies by LRU or on restart. A new model or adapter changes the key fingerprint anyway, so stale
  memory copies are never served for it.

``--tag T`` (repeatable: a record carrying any of the tags) removes the records tagged T (a document,
an image, a corpus version: `tiercache precompute ... --tag`, requests' ``tiercache_tags``), with the
other filters as AND. Tiers find tags without reading payloads (disk: the index's ``tags`` database;
Redis: each record's ``#tags`` key). A real run (not ``--dry-run``) then writes an invalidation per tag
into the shared control entries (`vllm_tiercache.shared.store.control`); every serving process's store
polls them every ``control_poll_s`` and its memory tier drops the tag's records written before the
command (all of them: the other filters do not reach memory tiers).

``--key-id ID`` (repeatable) removes the records sealed under key id ID (their ``sealed-key:ID`` tag, which
the sealing store adds: `vllm_tiercache.shared.store.sealing.sealer`): after a key is retired from the ring its
records are misses, and this reclaims their space. It reads no payload and needs no key ring.

``--older-than`` compares with the last access (disk: index access time, refreshed at most once a
minute on reads; redis: OBJECT IDLETIME of the record head). Records without a key text (disk index
rebuilt from headers, Redis records written before texts were stored) match only filters that do not
need the text (``--older-than`` alone).

Exit status: 0; 1 when a tier could not be changed (an unreachable Redis: the others still are); 2 when
the command cannot start (no filter, a bad duration, a wrong config, a tier whose directory is unusable),
with one line on stderr (`vllm_tiercache.tools.cli.main`).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_tiercache.shared.naming.keys import parse_key_text
from vllm_tiercache.shared.naming.weights_identity import model_names
from vllm_tiercache.shared.store.api import KeepsControl, StoredRecord, TierAdminUnsupported
from vllm_tiercache.shared.store.control import invalidation_changes
from vllm_tiercache.shared.store.sealing.ring import KEY_ID_PATTERN
from vllm_tiercache.shared.store.sealing.sealer import key_tag
from vllm_tiercache.shared.store.tags import validate_tags
from vllm_tiercache.tools.cli import UsageError
from vllm_tiercache.tools.jobs import admin_config, load_store_arg
from vllm_tiercache.tools.tag_args import add_tag_argument

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: What a tier that only its own process can change (`TierAdminUnsupported`) reports instead of counts.
_PER_PROCESS_NOTE = "per process: not reachable from here (see docs/jobs.md)"


def parse_duration(text: str) -> float:
    """``"30m"`` -> 1800.0; units s, m, h, d, w. Raises ArgumentTypeError with the accepted form."""
    match = _DURATION.match(text or "")
    if not match:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}; use e.g. 30m, 12h, 7d")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def make_predicate(namespace: str | None, model: str | None, older_than_s: float | None,
                   tags: Sequence[str] = (), key_ids: Sequence[str] = ()) -> Callable[[StoredRecord], bool]:
    """``predicate(record)``: True for a record every given filter matches.

    ``model`` matches every name keys may carry for it (`model_names`): keys name a model by its canonical
    name (a directory's name, or ``org/name`` for a hub snapshot), older builds by the string as given.
    """
    models = model_names(model) if model is not None else set()
    wanted = frozenset(tags)
    sealed_under = frozenset(key_tag(kid) for kid in key_ids)

    def predicate(record: StoredRecord) -> bool:
        if wanted and wanted.isdisjoint(record.tags):
            return False
        if sealed_under and sealed_under.isdisjoint(record.tags):
            return False
        fields = parse_key_text(record.text)
        if namespace is not None and (fields is None or fields.namespace != namespace):
            return False
        if model is not None and (fields is None or fields.model not in models):
            return False
        return not (older_than_s is not None and (record.idle_s is None or record.idle_s < older_than_s))

    return predicate


def evict(store_config: dict[str, Any] | None, *, namespace: str | None = None, model: str | None = None,
          older_than_s: float | None = None, dry_run: bool = False, tags: Sequence[str] = (),
          key_ids: Sequence[str] = ()) -> dict[str, Any]:
    """Remove matching records from every shared tier; returns per-tier counts and bytes. With ``tags``, a
    real run also tells the serving processes' memory tiers (`invalidate_tags`). ``key_ids``: only records
    sealed under one of these key ids (their ``sealed-key:<id>`` tag), e.g. a retired key's.

    The command never reads a payload, so it needs no key ring: a config's ``encryption`` is left out.

    No filter at all is a `UsageError` (a `ValueError`): this command never empties a whole store.
    """
    from vllm_tiercache.shared.store import build_store

    if namespace is None and model is None and older_than_s is None and not tags and not key_ids:
        raise UsageError("give at least one of --namespace, --model, --older-than, --tag, --key-id "
                         "(to drop a whole store, delete its directory or Redis database)")
    tags = validate_tags(tags)
    for kid in key_ids:
        if not KEY_ID_PATTERN.match(kid):
            raise UsageError(f"--key-id: invalid key id {kid[:64]!r}; allowed: letters, digits, '.', '_', '-' "
                             "(at most 64), as in the ring")
    predicate = make_predicate(namespace, model, older_than_s, tags, key_ids)
    config = admin_config(store_config)
    result: dict[str, Any] = {"dry_run": dry_run, "tiers": []}
    with build_store(config) as store:
        at = time.time()
        for tier in store.tiers:
            result["tiers"].append(_evict_tier(tier, predicate, dry_run))
        if tags and not dry_run:
            result["invalidated"] = invalidate_tags(store.tiers, tags, at)
    result["records"] = sum(t["records"] for t in result["tiers"])
    result["bytes"] = sum(t["bytes"] for t in result["tiers"])
    return result


def invalidate_tags(tiers: Sequence[Any], tags: Sequence[str], at: float) -> list[str]:
    """Write an invalidation of ``tags`` at ``at`` into every tier keeping control entries (`KeepsControl`);
    returns the names of the tiers written (an unreachable one is reported in its tier line already)."""
    written = []
    for tier in tiers:
        if not isinstance(tier, KeepsControl):
            continue
        try:
            tier.write_control(invalidation_changes(tags, at, tier.read_control()))
            written.append(tier.name)
        except Exception:
            continue
    return written


def _evict_tier(tier: Any, predicate: Callable[[StoredRecord], bool], dry_run: bool) -> dict[str, Any]:
    """One tier's line of the result: counts, a note (a per-process tier) or the error (report, go on)."""
    entry: dict[str, Any] = {"name": tier.name, "kind": tier.kind, "records": 0, "bytes": 0}
    try:
        entry["records"], entry["bytes"] = tier.delete_stored(predicate, dry_run=dry_run)
    except TierAdminUnsupported:
        entry["note"] = _PER_PROCESS_NOTE
    except Exception as exc:  # report the tier, go on with the others
        entry["error"] = str(exc)
    return entry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Remove records by namespace, model, age, tag or sealing key id from the disk/gds and "
                          "Redis tiers.")
    parser.add_argument("--config", required=True, metavar="STORE", help="store config: YAML/JSON file or inline JSON")
    parser.add_argument("--namespace", default=None, type=_non_empty, help="only records of this namespace")
    parser.add_argument("--model", default=None, type=_non_empty,
                        help="only records of this model (a path, its directory name or a hub id)")
    parser.add_argument("--older-than", type=parse_duration, default=None, metavar="D",
                        help="only records not used for D (e.g. 30m, 12h, 7d)")
    add_tag_argument(parser, "only records carrying TAG (repeatable: any of them), e.g. doc:1234; running "
                             "instances' memory tiers drop them within control_poll_s")
    parser.add_argument("--key-id", dest="key_ids", action="append", default=[], metavar="ID",
                        help="only records sealed under key id ID (repeatable: any of them), e.g. a retired "
                             "key's; needs no key ring")
    parser.add_argument("--dry-run", action="store_true", help="count what would be removed; remove nothing")
    parser.add_argument("--json", action="store_true", help="print JSON")


def _non_empty(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a non-empty name")
    return text


def run(args: argparse.Namespace) -> int:
    """Remove (or count) the matching records; 1 when a tier failed. A usage or config error raises
    (`UsageError`, `ConfigError`, `DiskTierError`): `cli.main` prints it in one line and exits 2."""
    result = evict(load_store_arg(args.config), namespace=args.namespace, model=args.model,
                   older_than_s=args.older_than, dry_run=args.dry_run, tags=args.tags, key_ids=args.key_ids)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for t in result["tiers"]:
            if t.get("error"):
                print(f"tier {t['name']} ({t['kind']}): FAILED: {t['error']}")
            elif t.get("note"):
                print(f"tier {t['name']} ({t['kind']}): skipped ({t['note']})")
            else:
                print(f"tier {t['name']} ({t['kind']}): {verb} {t['records']} records, {t['bytes']:,} bytes")
        print(f"total: {verb} {result['records']} records, {result['bytes']:,} bytes")
        if result.get("invalidated"):
            print(f"memory tiers of running instances drop tags {', '.join(args.tags)} at their next control poll "
                  f"(written to: {', '.join(result['invalidated'])})")
    return 1 if any(t.get("error") for t in result["tiers"]) else 0
