"""The tier contract of `shared/store/api.py` is the whole contract: what the store asks of a tier is declared there.

Why: a tier author reads `Tier` and the capability classes (`TIER_CAPABILITIES`) and nothing else. That holds
only while no product code probes a tier for an attribute the contract does not declare (``getattr`` /
``hasattr`` on a tier, or setting one of its attributes from outside), and while nothing outside the registry
decides by a tier's kind (``tier.kind == "memory"``). An AST scan of the product folders enforces both, in the
manner of `tests/project/test_layout.py`; then each registered tier class must declare exactly the capabilities
whose members it has, so a method written without its declaration (never called by the store) fails here.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vllm_tiercache.shared.config import StoreConfig
from vllm_tiercache.shared.store import api, registry
from vllm_tiercache.shared.store.api import (
    TIER_CAPABILITIES,
    InProcessTier,
    Record,
    StoreKey,
    Tier,
)
from vllm_tiercache.shared.store.counters import TierCounters

REPO = Path(__file__).resolve().parents[2]
#: The product folders (the wheel's packages), as in `tests/project/test_layout.py`.
PRODUCT_FOLDERS = ("shared", "kvcache", "eccache", "tools", "vllm_tiercache")
#: The one module that maps kinds to classes, and so may look at a kind.
REGISTRY = Path("shared/store/registry.py")
#: Names of an expression that holds a tier: ``tier``, ``memory_tier``, ``self.tier``, ``store.tiers[0]``.
_TIER_NAME = re.compile(r"(^|_)tier$")
#: Names of an expression that holds a kind: ``kind``, ``tier_kind``, ``t.kind``, ``shared_kinds``.
_KIND_NAME = re.compile(r"(^|_)kinds?$")
_PROBES = ("getattr", "hasattr", "setattr", "delattr")


def _members(cls: type) -> set[str]:
    """The public names a contract class declares: methods, properties and annotated attributes."""
    names = {name for name in vars(cls) if not name.startswith("_")}
    return names | {name for name in vars(cls).get("__annotations__", {}) if not name.startswith("_")}


#: Every name of the tier contract: `Tier`'s and each optional capability's.
CONTRACT_NAMES = frozenset(_members(Tier).union(*(_members(cap) for cap in TIER_CAPABILITIES)))


def _last_name(node: ast.expr) -> str | None:
    """The identifier an expression ends in (``tier`` of ``self.tier``, ``tiers`` of ``store.tiers[0]``)."""
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _names_a_tier(node: ast.expr) -> bool:
    if isinstance(node, ast.Subscript):  # tiers[i]
        return _last_name(node.value) == "tiers"
    name = _last_name(node)
    return name is not None and bool(_TIER_NAME.search(name))


def _names_a_kind(node: ast.expr) -> bool:
    """``x.kind``, ``tier_kind``, ``getattr(x, "kind")``, ``x.get("kind")``, ``x["kind"]``."""
    if isinstance(node, ast.Call):
        func, args = node.func, node.args
        probe = isinstance(func, ast.Name) and func.id == "getattr" and len(args) >= 2
        get = isinstance(func, ast.Attribute) and func.attr == "get" and len(args) >= 1
        key = args[1] if probe else args[0] if get else None
        return isinstance(key, ast.Constant) and key.value == "kind"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
    name = _last_name(node)
    return name is not None and bool(_KIND_NAME.search(name))


def _kind_literals(node: ast.expr, kinds: frozenset[str]) -> list[str]:
    """The registered kinds an expression spells out: ``"memory"``, ``("disk", "gds")``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value] if node.value in kinds else []
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [found for element in node.elts for found in _kind_literals(element, kinds)]
    return []


def contract_breaches(source: str, kinds: frozenset[str]) -> Iterator[tuple[int, str]]:
    """(line, what) for every tier probe and every decision by a literal tier kind in ``source``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _PROBES:
            if len(node.args) < 2:
                continue
            target, attribute = node.args[0], node.args[1]
            literal = attribute.value if isinstance(attribute, ast.Constant) else None
            if _names_a_tier(target) or literal in CONTRACT_NAMES:
                yield node.lineno, f"{node.func.id}({ast.unparse(target)}, {ast.unparse(attribute)}) probes a tier"
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if isinstance(target, ast.Attribute) and _names_a_tier(target.value):
                    yield node.lineno, f"{ast.unparse(target)} = ... sets a tier's attribute from outside"
        elif isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_a_kind(op) for op in operands):
                spelled = [kind for op in operands for kind in _kind_literals(op, kinds)]
                if spelled:
                    yield node.lineno, f"`{ast.unparse(node)}` decides by the tier kind {spelled[0]!r}"
        elif isinstance(node, ast.Match) and _names_a_kind(node.subject):
            for case in node.cases:
                pattern = case.pattern
                if isinstance(pattern, ast.MatchValue) and _kind_literals(pattern.value, kinds):
                    yield pattern.lineno, f"`case {ast.unparse(pattern.value)}` decides by a tier kind"


KINDS = frozenset(registry.tier_kinds())


def test_no_product_code_probes_a_tier_or_decides_by_its_kind() -> None:
    wrong = []
    for folder in PRODUCT_FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            relative = path.relative_to(REPO)
            if relative == REGISTRY:
                continue
            wrong += [f"{relative}:{line}: {what}" for line, what in contract_breaches(path.read_text(), KINDS)]
    assert not wrong, ("declare what the store asks of a tier in shared/store/api.py (a capability class) and ask "
                       "isinstance; kinds are the registry's alone:\n" + "\n".join(wrong))


@pytest.mark.parametrize("snippet", [
    'if getattr(tier, "remote", False): pass',
    'hasattr(tier, "get_many_into")',
    'getattr(self.tiers[0], "whatever", None)',
    'getattr(store.memory_tier, "clear")',
    'any(hasattr(t, "prefetch_many") for t in tiers)',  # a contract name on any object
    'setattr(fast_tier, "payload_allocator", f)',
    'tier.payload_allocator = f',
    'x = tiers[0].kind == "memory"',
    'shared = tc.kind != "memory"',
    'if tier_kind != "memory": pass',
    'if getattr(tier, "kind", None) == "disk": pass',
    'ok = item.get("kind") in ("disk", "gds")',
    'ok = "redis" == spec["kind"]',
    'match t.kind:\n    case "gds":\n        pass',
])
def test_the_scan_flags_each_way_of_probing_a_tier(snippet: str) -> None:
    assert list(contract_breaches(snippet, KINDS)), snippet


@pytest.mark.parametrize("snippet", [
    'shared = isinstance(tier, ReadsInto)',
    'getattr(tier_config, "path", None)',  # a config's own optional fields
    'getattr(t.counters, "version", None)',
    'if g.kind == FULL: pass',  # another kind: a KV cache group's
    'if kind == "kv": pass',  # a key's kind, not a registered tier kind
    'ok = item.get("kind") not in kinds',  # validation against the registry's kinds
    'if "disk" in selected: pass',  # a benchmark's choice of tiers to build
    'self.tier = tier',
])
def test_the_scan_leaves_what_is_not_a_tier_probe(snippet: str) -> None:
    assert not list(contract_breaches(snippet, KINDS)), snippet


# --------------------------------------------------------------------- declared capabilities against real methods

def _tier_classes() -> list[tuple[str, type]]:
    return [(kind, registry.tier_class(kind)) for kind in registry.tier_kinds()]


@pytest.mark.parametrize(("kind", "cls"), _tier_classes(), ids=registry.tier_kinds())
def test_each_tier_class_declares_exactly_the_capabilities_it_has(kind: str, cls: type) -> None:
    assert cls.kind == kind
    assert isinstance(cls.shared_across_processes, bool)
    for name in _members(Tier) - {"name", "counters"}:  # those two are set per instance
        assert hasattr(cls, name), f"{cls.__name__} lacks Tier.{name}"
    assert not getattr(cls, "__abstractmethods__", None), \
        f"{cls.__name__} declares capabilities it does not implement: {sorted(cls.__abstractmethods__)}"
    for capability in TIER_CAPABILITIES:
        members = _members(capability)
        if issubclass(cls, capability):
            for name in members:
                mine, declared = inspect.getattr_static(cls, name), inspect.getattr_static(capability, name)
                if inspect.isfunction(mine) and inspect.isfunction(declared):
                    assert list(inspect.signature(mine).parameters) == list(inspect.signature(declared).parameters), \
                        f"{cls.__name__}.{name} takes other parameters than {capability.__name__}.{name}"
        else:
            undeclared = sorted(name for name in members if hasattr(cls, name))
            assert not undeclared, (f"{cls.__name__} has {undeclared} but does not declare {capability.__name__}: "
                                    "the store never calls them")
    assert issubclass(cls, InProcessTier) == (not cls.shared_across_processes), \
        "an in-process tier is the one other processes can't see (and the only such built-in tier)"


def test_every_capability_is_in_the_list_and_says_why() -> None:
    declared = {obj for obj in vars(api).values()
                if isinstance(obj, type) and obj.__module__ == api.__name__ and obj in TIER_CAPABILITIES}
    assert declared == set(TIER_CAPABILITIES)
    assert all(cap.__doc__ and cap.__doc__.strip() for cap in TIER_CAPABILITIES)


class _Undeclared:
    """A tier that has a `get_many_into` and a `prefetch_many` but declares neither: the store must not call them."""

    kind = "undeclared"
    shared_across_processes = True

    def __init__(self) -> None:
        self.name, self.counters, self.items, self.called = "undeclared", TierCounters(), {}, []

    def contains_many(self, keys: list[StoreKey]) -> list[bool]:
        return [k.digest in self.items for k in keys]

    def get_many(self, keys: list[StoreKey]) -> list[Record | None]:
        return [self.items.get(k.digest) for k in keys]

    def put_many(self, items: list[tuple[StoreKey, torch.Tensor, dict[str, Any] | None]]) -> None:
        self.items.update((key.digest, Record(tensor, dict(meta or {}))) for key, tensor, meta in items)

    def get_many_into(self, keys: list[StoreKey], into: Any) -> list[Record | None]:
        self.called.append("get_many_into")
        return self.get_many(keys)

    def prefetch_many(self, keys: list[StoreKey]) -> None:
        self.called.append("prefetch_many")

    def usage(self) -> dict[str, Any]:
        return {"entries": len(self.items), "bytes_used": None}

    def close(self) -> None:
        self.items.clear()


def test_the_store_uses_only_what_a_tier_declares() -> None:
    from vllm_tiercache.shared.store.records import byte_view
    from vllm_tiercache.shared.store.tiered import TieredStore

    tier = _Undeclared()
    store = TieredStore(StoreConfig.load({"tiers": [{"kind": "memory"}]}), tiers=[tier])
    try:
        key, value = StoreKey("ns|undeclared|0"), torch.arange(4, dtype=torch.int32)
        store.put(key, value)
        store.prefetch([key])
        (record,) = store.get_many([key], into=[[byte_view(torch.zeros(4, dtype=torch.int32))]])
        assert record is not None and not record.in_place and torch.equal(record.tensor, value)
        assert tier.called == [] and not store.reads_into and store.memory_tier is None
        store.set_payload_allocator(lambda n: torch.empty(n, dtype=torch.uint8))  # nobody takes it: no error
        assert store.gauge_report()["tiers"]["undeclared"]["up"] == 1
    finally:
        store.close()
