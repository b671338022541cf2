"""`tiercache pin --tag T [--ttl S]`: keep the records of a tag (a corpus) through eviction.

A pin is a control entry (`vllm_tiercache.shared.store.control`) in every shared tier that keeps them, with
its optional end; every serving process's store polls them (``control_poll_s``), so running instances
and restarts see a pin. What it means per tier:

- memory (per process) and disk/gds: eviction skips the records of pinned tags while unpinned ones
  remain, up to the tier's ``pin_budget`` (a share of its capacity); the disk tier reads the pins in the
  index transaction in which it evicts, so every process sharing the directory agrees.
- redis: the pinned records' keys are PERSISTed (no TTL), and records of a pinned tag written later get
  none; `tiercache unpin` (or the pin's end) gives ``ttl_s`` back. Keys without a TTL are never the
  server's victims under a ``volatile-*`` ``maxmemory-policy``; under ``allkeys-*`` Redis may evict any
  key, pinned or not (docs/operations.md, pins): `pin` warns then. Its budget is counted against the
  server's ``maxmemory`` (a cluster: summed over its primaries), when it has one.

A pin is refused, with nothing written, when a tier's ``pin_budget`` is 0 (the message names the key) or
when the records of every pinned tag, this one included, would exceed a tier's budget (the message names
the budget and the bytes). A memory tier's budget cannot be counted from here: it protects what fits.

A tier that does not answer (Redis down or hung past its ``timeout_s``) while the pin is checked refuses
it, with nothing written (`PinError`, naming the tier); one that fails while the pin is being written
leaves the pin on the tiers that took it and is reported as FAILED (run the command again once it
answers: pinning and unpinning are idempotent). `unpin` goes on past a failed tier the same way.

Exit status: 0; 1 when a tier failed while writing; 2 when refused or the command cannot start (one line
on stderr, `cli.main`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

from vllm_tiercache.shared.store.api import ExpiresRecords, KeepsControl, TierAdminUnsupported
from vllm_tiercache.shared.store.control import Control, parse_control, pin_changes
from vllm_tiercache.shared.store.series import tier_names
from vllm_tiercache.shared.store.tags import validate_tags
from vllm_tiercache.shared.store.tier_config import format_bytes
from vllm_tiercache.tools.cli import UsageError, one_line
from vllm_tiercache.tools.jobs import admin_config, load_store_arg
from vllm_tiercache.tools.tag_args import add_tag_argument

#: The longest a pin may last (a year): beyond it, pin without --ttl.
MAX_PIN_TTL_S = 366 * 86400.0


class PinError(RuntimeError):
    """The pin cannot be checked against a tier (it does not answer): refused, nothing written."""


def _unanswered(names: Sequence[str], i: int, exc: Exception) -> PinError:
    return PinError(f"pin refused, nothing written: tier {names[i]} (tiers[{i}]) did not answer while its pins "
                    f"were counted ({one_line(exc)}); run the command again once it answers")


def pin(store_config: dict[str, Any] | None, tags: Sequence[str], ttl_s: float | None = None) -> dict[str, Any]:
    """Pin ``tags`` on every tier (checked against each tier's budget first); returns per-tier pinned bytes."""
    from vllm_tiercache.shared.store import build_store

    tags = validate_tags(tags)
    if not tags:
        raise UsageError("give at least one --tag to pin")
    config = admin_config(store_config)
    names = tier_names(config.tiers)
    for i, tc in enumerate(config.tiers):
        if tc.pin_budget <= 0:
            raise UsageError(f"pin refused: pins are off on tier {names[i]} (tiers[{i}].pin_budget is 0); set "
                             f"tiers[{i}].pin_budget to the share of its capacity pins may hold, e.g. 0.2")
    result: dict[str, Any] = {"tags": tags, "until": time.time() + ttl_s if ttl_s else None, "tiers": []}
    with build_store(config) as store:
        control = Control()
        for i, tier in enumerate(store.tiers):
            try:
                read_pins([tier], control)
            except Exception as exc:
                raise _unanswered(names, i, exc) from exc
        pinned = control.pinned_now() | set(tags)
        for i, tier in enumerate(store.tiers):
            try:
                result["tiers"].append(_check_budget(tier, config.tiers[i].pin_budget, pinned, f"tiers[{i}]"))
            except UsageError:
                raise
            except Exception as exc:
                raise _unanswered(names, i, exc) from exc
        changes = pin_changes(tags, result["until"], pin=True)
        for entry, tier in zip(result["tiers"], store.tiers, strict=True):
            try:  # from here on a failed tier is reported and the others are still pinned
                if isinstance(tier, KeepsControl):
                    tier.write_control(changes)
                if isinstance(tier, ExpiresRecords):
                    entry["persisted"] = tier.hold_tagged(tags, True)
            except Exception as exc:
                entry["error"] = one_line(exc)
        if result["until"] is not None and time.time() >= result["until"]:
            _ended_while_written(store.tiers, tags, result["tiers"])
    return result


def _ended_while_written(tiers: Sequence[Any], tags: Sequence[str], entries: list[dict[str, Any]]) -> None:
    """A pin that ended before this command had persisted its records (a ``--ttl`` shorter than the command
    took): a serving process's poll may have claimed it and given the records their TTL back first, and
    the records persisted after that would keep none for good. The tags whose pin entry is gone (claimed)
    get their TTL back here; one still there is claimed, and its TTL given back, by a later poll."""
    try:
        left = read_pins(tiers).pins
    except Exception:  # a tier that does not answer now: whether it was claimed is not known, left as it is
        return
    claimed = [tag for tag in tags if tag not in left]
    if not claimed:
        return
    for entry, tier in zip(entries, tiers, strict=True):
        if isinstance(tier, ExpiresRecords) and "error" not in entry:
            try:
                tier.hold_tagged(claimed, False)
            except Exception as exc:
                entry["error"] = one_line(exc)


def unpin(store_config: dict[str, Any] | None, tags: Sequence[str]) -> dict[str, Any]:
    """Remove the pins of ``tags``; Redis records get their TTL back. Returns per-tier counts."""
    from vllm_tiercache.shared.store import build_store

    tags = validate_tags(tags)
    if not tags:
        raise UsageError("give at least one --tag to unpin")
    result: dict[str, Any] = {"tags": tags, "tiers": []}
    with build_store(admin_config(store_config)) as store:
        known: dict[str, float | None] = {}
        all_read = True
        for tier in store.tiers:
            try:
                known.update(read_pins([tier]).pins)
            except Exception:
                all_read = False  # reported below, when its entries are removed
        result["unknown"] = [tag for tag in tags if tag not in known] if all_read else []
        for tier in store.tiers:
            entry: dict[str, Any] = {"name": tier.name, "kind": tier.kind}
            try:  # a failed tier is reported; the others are still unpinned
                if isinstance(tier, KeepsControl):
                    tier.write_control(pin_changes(tags, None, pin=False))
                if isinstance(tier, ExpiresRecords):
                    entry["expiring"] = tier.hold_tagged(tags, False)
            except Exception as exc:
                entry["error"] = one_line(exc)
            result["tiers"].append(entry)
    return result


def read_pins(tiers: Sequence[Any], into: Control | None = None) -> Control:
    """The control entries of every tier keeping them, merged (into ``into`` when given)."""
    control = into if into is not None else Control()
    for tier in tiers:
        if isinstance(tier, KeepsControl):
            parse_control(tier.read_control(), control)
    return control


def _check_budget(tier: Any, share: float, pinned: set[str], path: str) -> dict[str, Any]:
    """The tier's pinned bytes against its budget; `UsageError` naming both when they do not fit."""
    entry: dict[str, Any] = {"name": tier.name, "kind": tier.kind}
    try:
        pinned_bytes = sum(r.nbytes or 0 for r in tier.iter_stored() if not pinned.isdisjoint(r.tags))
    except TierAdminUnsupported:
        entry["note"] = "per process: each serving process protects what fits its pin budget"
        return entry
    usage = tier.usage()
    capacity = usage.get("capacity")
    entry["pinned_bytes"] = pinned_bytes
    policy = usage.get("eviction_policy") or ""
    if "allkeys-" in policy:  # Redis may evict any key: PERSIST protects nothing
        entry["warning"] = (f"its maxmemory-policy is {policy}: Redis may evict pinned records when full; run it "
                            "with a volatile-* policy (volatile-lru, volatile-lfu) to keep them")
    if not isinstance(capacity, int):
        entry["note"] = "no capacity known (Redis: no maxmemory set): the budget is not counted here"
        return entry
    budget = int(share * capacity)
    entry["budget"] = budget
    if pinned_bytes > budget:
        raise UsageError(
            f"pin refused: tier {tier.name} would hold {pinned_bytes:,} bytes ({format_bytes(pinned_bytes)}) of "
            f"pinned records (tags {', '.join(sorted(pinned))}), above its pin budget of {budget:,} bytes "
            f"({path}.pin_budget {share:g} of its capacity {format_bytes(capacity)}); raise {path}.pin_budget "
            "or unpin other tags")
    return entry


def _ttl(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= MAX_PIN_TTL_S:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a number of seconds above 0 and at "
                                         f"most {MAX_PIN_TTL_S:g} (a year); leave --ttl out for a pin without end")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Keep the records of a tag through eviction, up to each tier's pin_budget."
    parser.add_argument("--config", required=True, metavar="STORE", help="store config: YAML/JSON file or inline JSON")
    add_tag_argument(parser, "the tag to pin (repeatable), e.g. corpus:v3", required=True)
    parser.add_argument("--ttl", type=_ttl, default=None, metavar="SECONDS", help="the pin ends after SECONDS")
    parser.add_argument("--json", action="store_true", help="print JSON")


def failed_tiers(result: dict[str, Any]) -> list[str]:
    """The names of the tiers `pin` or `unpin` could not write (their entries carry an ``error``)."""
    return [t["name"] for t in result["tiers"] if t.get("error")]


def failed_line(entry: dict[str, Any]) -> str:
    """How `pin` and `unpin` print a tier they could not write: what failed, and that a rerun finishes it."""
    return f"tier {entry['name']} ({entry['kind']}): FAILED: {entry['error']}; run the command again once it answers"


def run(args: argparse.Namespace) -> int:
    result = pin(load_store_arg(args.config), args.tags, args.ttl)
    failed = failed_tiers(result)
    if args.json:
        print(json.dumps(result, indent=2))
        return 1 if failed else 0
    for t in result["tiers"]:
        if t.get("error"):
            print(failed_line(t))
            continue
        if t.get("note"):
            detail = t["note"]
        elif "budget" in t:
            detail = f"{t['pinned_bytes']:,} of {t['budget']:,} pinned bytes"
        else:
            detail = f"{t['pinned_bytes']:,} pinned bytes"
        print(f"tier {t['name']} ({t['kind']}): {detail}")
        if t.get("warning"):
            print(f"tier {t['name']} ({t['kind']}): warning: {t['warning']}")
    print(f"pinned {', '.join(result['tags'])}" + (f" for {args.ttl:g} s" if args.ttl else "")
          + (f", except on {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
