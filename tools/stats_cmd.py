"""`tiercache stats`: what a store holds (entries and bytes per tier and per namespace) and hit counters.

Every number comes from the tier contract (`Tier.iter_stored`, `Tier.usage`), so this command never
asks which kind a tier is; key texts are read with `vllm_tiercache.shared.naming.keys.parse_key_text`. Where
each tier gets them, and why:

- disk / gds: the LMDB index (no record file is read). Each entry keeps its key text, so records are
  grouped by namespace, kind (``kv`` / ``enc``) and model; entries restored by an index rebuild have no
  key text and are listed under ``?``.
- redis: SCAN over ``key_prefix`` (never KEYS), with the head of each record for its size and the
  ``#text`` key for its key text (records written before key texts were stored are listed under ``?``).
- ``--by-tag``: records and bytes per tag, from the same listing (disk: the index's ``tags`` database;
  Redis: each record's ``#tags`` key), never from the payloads.
- memory: a memory tier lives inside one process (it raises `TierAdminUnsupported`); this command's
  own is always empty. Serving processes report theirs through their stats files.
- hit counters are per process too: connectors write theirs, with their store's per-tier counters, to
  ``$TIERCACHE_STATS_DIR/<name>-<pid>.json`` (``kv-worker-*``, ``ec-*``...). ``--stats-dir`` (default:
  ``$TIERCACHE_STATS_DIR``) prints those files.

Exit status: 0; 1 when a tier could not be read (an unreachable Redis: the other tiers are still
printed); 2 when the command cannot start (a wrong config, a tier whose directory is unusable, a
``--stats-dir`` that is not a directory), with one line on stderr (`vllm_tiercache.tools.cli.main`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from vllm_tiercache.shared.naming.keys import parse_key_text
from vllm_tiercache.shared.store.api import TierAdminUnsupported
from vllm_tiercache.tools.cli import UsageError
from vllm_tiercache.tools.jobs import admin_config, load_store_arg

#: Tier counters shown per stats file (all are in the JSON output).
_SHOWN = ("hits", "misses", "puts", "bytes_read", "bytes_written", "evictions", "corrupt", "partial",
          "dropped_writes", "writes_admitted", "writes_refused")
#: What a tier that only its own process can list (`TierAdminUnsupported`) shows instead of contents.
_PER_PROCESS_NOTE = "per process: empty in this process; see the stats files"


def group_of(key_text: str) -> tuple[str, str, str]:
    """(namespace, kind, model) of a key text; ``("?", "?", "?")`` when the text is unknown."""
    fields = parse_key_text(key_text)
    if fields is None:
        return "?", "?", "?"
    return fields.namespace, fields.kind, fields.model


def tier_contents(tier: Any, by_tag: bool = False) -> dict[str, Any]:
    """Entries and bytes of one tier, in total and per (namespace, kind, model); ``by_tag``: per tag too
    (a record with several tags counts under each)."""
    groups: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0])
    per_tag: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    out: dict[str, Any] = {"name": tier.name, "kind": tier.kind}
    try:
        for record in tier.iter_stored():
            g = groups[group_of(record.text)]
            g[0] += 1
            g[1] += record.nbytes or 0
            for tag in record.tags if by_tag else ():
                per_tag[tag][0] += 1
                per_tag[tag][1] += record.nbytes or 0
    except TierAdminUnsupported:
        out.update(entries=0, bytes=0, note=_PER_PROCESS_NOTE)
        return out
    except Exception as exc:  # an unreachable Redis must not hide the other tiers
        out.update(entries=None, bytes=None, error=str(exc))
        return out
    out["entries"] = sum(g[0] for g in groups.values())
    out["bytes"] = sum(g[1] for g in groups.values())
    usage = tier.usage()
    if usage.get("capacity") is not None:
        out["capacity"] = usage["capacity"]
    out["groups"] = [
        {"namespace": ns, "kind": kind, "model": model, "entries": n, "bytes": b}
        for (ns, kind, model), (n, b) in sorted(groups.items())
    ]
    if by_tag:
        out["tags"] = [{"tag": tag, "entries": n, "bytes": b} for tag, (n, b) in sorted(per_tag.items())]
    return out


def read_stats_files(directory: str) -> list[dict[str, Any]]:
    """Every ``*.json`` stats file of ``directory`` (unreadable ones are reported, not fatal)."""
    out = []
    for path in sorted(Path(directory).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            data = {"error": f"unreadable: {exc}"}
        out.append({"file": path.name, **(data if isinstance(data, dict) else {"value": data})})
    return out


def collect(store_config: dict[str, Any] | None, stats_dir: str | None, by_tag: bool = False) -> dict[str, Any]:
    from vllm_tiercache.shared.store import build_store

    config = admin_config(store_config)
    with build_store(config) as store:
        tiers = [tier_contents(tier, by_tag) for tier in store.tiers]
    result: dict[str, Any] = {"namespace": config.namespace, "tiers": tiers}
    if stats_dir:
        result["stats_dir"] = stats_dir
        result["processes"] = read_stats_files(stats_dir)
    return result


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def format_text(result: dict[str, Any]) -> str:
    lines = []
    for tier in result["tiers"]:
        head = f"tier {tier['name']} ({tier['kind']}): "
        if tier.get("error"):
            lines.append(head + f"unavailable: {tier['error']}")
            continue
        cap = f" of {_fmt_bytes(tier['capacity'])}" if tier.get("capacity") else ""
        lines.append(head + f"{tier['entries']} entries, {_fmt_bytes(tier['bytes'])}{cap}")
        if tier.get("note"):
            lines.append(f"  ({tier['note']})")
        for g in tier.get("groups", []):
            lines.append(f"  {g['namespace']:<16} {g['kind']:<4} {g['model'][-48:]:<48} "
                         f"{g['entries']:>8} entries {_fmt_bytes(g['bytes']):>11}")
        if "tags" in tier:
            lines.append(f"  by tag ({len(tier['tags'])} tags):")
            for t in tier["tags"]:
                lines.append(f"    tag {t['tag'][:48]:<48} {t['entries']:>8} entries {_fmt_bytes(t['bytes']):>11}")
    if "processes" in result:
        lines.append(f"\nhit counters from {result['stats_dir']} ({len(result['processes'])} files, one per process):")
        for proc in result["processes"]:
            lines.append(f"  {proc['file']}")
            connector = proc.get("counters") or proc.get("connector")
            if isinstance(connector, dict):
                shown = {k: v for k, v in connector.items() if isinstance(v, int | float) and v}
                lines.append(f"    connector: {shown or 'all zero'}")
            tiers = (proc.get("store") or {}).get("tiers") or {}
            for name, c in tiers.items():
                lines.append("    " + f"{name:<8} " + " ".join(f"{k}={c.get(k, 0)}" for k in _SHOWN))
    else:
        lines.append("\nhit counters: none shown (they are per process; pass --stats-dir or set "
                     "TIERCACHE_STATS_DIR for the engines and for this command)")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Entries, bytes and hit counters per tier and per namespace of a tiercache store."
    parser.add_argument("--config", required=True, metavar="STORE", help="store config: YAML/JSON file or inline JSON")
    parser.add_argument("--stats-dir", default=None,
                        help="directory of the engines' stats files (default: $TIERCACHE_STATS_DIR)")
    parser.add_argument("--by-tag", action="store_true",
                        help="also records and bytes per tag (tiercache precompute --tag, requests' tiercache_tags)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    """Print what the store holds; 1 when a tier could not be read (the others are printed all the same).

    A wrong config or an unusable tier directory raises (`ConfigError`, `DiskTierError`): `cli.main`
    prints it in one line and exits 2.
    """
    stats_dir = args.stats_dir
    if stats_dir is not None and not os.path.isdir(stats_dir):
        raise UsageError(f"--stats-dir: {stats_dir!r} is not a directory; allowed: the directory the engines "
                         "write their stats files to (their TIERCACHE_STATS_DIR)")
    # $TIERCACHE_STATS_DIR may name a directory no engine has created yet: no files, no error
    result = collect(load_store_arg(args.config), stats_dir or os.environ.get("TIERCACHE_STATS_DIR") or None,
                     by_tag=args.by_tag)
    print(json.dumps(result, indent=2, default=str) if args.json else format_text(result))
    return 1 if any(tier.get("error") for tier in result["tiers"]) else 0
