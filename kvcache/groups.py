"""KV cache groups under vLLM's hybrid KV cache manager (HMA): what each group stores, loads and needs.

The design, in vLLM's own terms (`vllm/v1/core/single_type_kv_cache_manager.py`,
`.../kv_connector/v1/offloading/scheduler.py`):

* Groups. vLLM gives every KV cache group its own block table. A full-attention group (`FullAttentionSpec`
  and its subclasses, MLA included) keeps every block of a request; a sliding-window group
  (`SlidingWindowSpec`, window W tokens) keeps only the blocks a next token can attend to: for a request
  with T computed tokens its blocks below `get_num_skipped_tokens(T) = T - W + 1 (- extra_retained)` are
  the null block. Any other kind (mamba state, chunked local attention, cross attention, ...) is not
  supported for external loads here: the connector then claims no hit and saves nothing for the model
  (one log line at start), and never turns HMA off.
* Chunks and hits are cut on the engine's block hashes as before: a chunk is `chunk_size` tokens of
  blocks and is named by vLLM's chain hash at its last block, so one name never covers two prefixes.
  Every group's block size must equal the engine's block size (hybrid models whose groups use other
  block sizes claim no hit).
* Records. A full-attention group stores, per layer, the chunk's blocks `[chunk_start, end)` (as
  before: its keys are unchanged, so full-attention-only models keep their records). A sliding-window
  group stores, per layer, only the chunk's blocks a hit ending at the chunk end, or one block before
  it, attends to: `[max(chunk_start, end - window_blocks - 1), end)` with
  `window_blocks = cdiv(W - 1 + extra_retained, block_size)`. Its keys carry the group's tag
  (`sw<W>+<extra>b<block_size>`: kind, window, block size); the model fingerprint already covers dtype,
  head geometry and layout, and the chain hash covers the whole prefix, so a window is never mixed
  with another prefix, model or layout.
* Lookup. A hit may end at a stored chunk end E, cut to vLLM's limit (the last prompt token is always
  computed: at most one block short of E). It needs every full-attention record of chunks 1..k and the
  sliding-window records of the chunks that overlap `[E - window_blocks - 1, E)`; the answer is the
  longest such prefix, the one every group can supply.
* Loads. For a hit ending at block H after a local hit of L blocks, a full-attention group loads blocks
  `[L, H)`; a sliding-window group loads `[max(L, H - window_blocks), H)`: exactly the blocks vLLM
  allocated for it (the rest of its table is the null block).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

FULL = "full"
SLIDING = "sliding"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def layer_index(name: str) -> int:
    """The model layer index in a KV cache layer name (``model.layers.3.self_attn.attn`` -> 3)."""
    numbers = re.findall(r"\.(\d+)\.", f".{name}.")
    if not numbers:
        raise ValueError(f"cannot tell the layer index of KV cache layer {name!r}")
    return int(numbers[0])


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups, as the connector stores and loads it."""

    index: int
    kind: str
    block_size: int
    #: model layer indices of this group's layers (record keys use them)
    layers: tuple[int, ...]
    window: int = 0
    extra_retained: int = 0

    @property
    def tag(self) -> str | None:
        """What the keys of this group's records carry besides the layer (None: full attention, whose
        keys are those of a model without HMA)."""
        if self.kind == FULL:
            return None
        return f"sw{self.window}+{self.extra_retained}b{self.block_size}"

    @property
    def window_blocks(self) -> int:
        """Blocks a sliding-window group keeps below a block-aligned hit end (vLLM's skipped-token rule)."""
        if self.kind == FULL:
            return 0
        return _cdiv(self.window - 1 + self.extra_retained, self.block_size)

    def record_start(self, chunk_start: int, end: int) -> int:
        """First block of this group's record of the chunk `[chunk_start, end)`."""
        if self.kind == FULL:
            return chunk_start
        return max(chunk_start, end - self.window_blocks - 1)

    def load_first(self, local_blocks: int, hit_end: int) -> int:
        """First block this group loads for a hit ending at block `hit_end` after `local_blocks` local ones."""
        if self.kind == FULL:
            return local_blocks
        return max(local_blocks, hit_end - self.window_blocks)


@dataclass(frozen=True)
class KVGroups:
    """The engine's KV cache groups, or why the connector cannot load for this model."""

    groups: tuple[KVGroup, ...]
    #: None when every group is supported; else the reason, for the start-up log line
    unsupported: str | None = None

    @classmethod
    def single(cls, num_layers: int, block_size: int) -> KVGroups:
        """One full-attention group over every layer: a model without HMA (and offline naming)."""
        return cls((KVGroup(0, FULL, block_size, tuple(range(num_layers))),))

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, block_size: int, num_layers: int) -> KVGroups:
        """Read vLLM's `KVCacheConfig.kv_cache_groups`; None or no groups gives `single`."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        specs = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if not specs:
            return cls.single(num_layers, block_size)
        groups: list[KVGroup] = []
        problems: list[str] = []
        # A layer's number in keys is its position among all KV cache layers sorted by model layer index:
        # the order the worker registers them in (`vllm_tiercache.kvcache.blocks.layout.PagedLayout.learn`).
        try:
            names = sorted({name for group in specs for name in group.layer_names}, key=layer_index)
        except ValueError as exc:
            return cls(tuple(), f"{exc}")
        position = {name: i for i, name in enumerate(names)}
        for index, group in enumerate(specs):
            spec = group.kv_cache_spec
            kind_name = type(spec).__name__
            layers = tuple(sorted(position[name] for name in group.layer_names))
            group_block_size = int(getattr(spec, "block_size", 0) or 0)
            if isinstance(spec, SlidingWindowSpec):
                kind, window, extra = SLIDING, int(spec.sliding_window), int(spec.extra_retained_tokens)
            elif isinstance(spec, FullAttentionSpec):
                kind, window, extra = FULL, 0, 0
            else:
                problems.append(f"group {index} is {kind_name}, which TieredKVConnector cannot load")
                continue
            if group_block_size != block_size:
                problems.append(f"group {index} ({kind_name}) has block_size={group_block_size}, the engine "
                                f"hashes blocks of {block_size}")
                continue
            groups.append(KVGroup(index, kind, block_size, layers, window, extra))
        if len(specs) == 1 and not problems and groups[0].kind == FULL:
            # no HMA (or a model with one group): the naming of a model without groups, unchanged
            return cls.single(num_layers, block_size)
        return cls(tuple(groups), "; ".join(problems) or None)

    @property
    def supported(self) -> bool:
        return self.unsupported is None

    @property
    def hybrid(self) -> bool:
        return any(g.kind != FULL for g in self.groups)

    @property
    def full(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.kind == FULL)

    @property
    def sliding(self) -> tuple[KVGroup, ...]:
        return tuple(g for g in self.groups if g.kind != FULL)

    @property
    def max_window_blocks(self) -> int:
        return max((g.window_blocks for g in self.groups), default=0)

    def tag_of_layer(self) -> dict[int, str | None]:
        return {layer: g.tag for g in self.groups for layer in g.layers}

    def group_of_layer(self) -> dict[int, int]:
        return {layer: g.index for g in self.groups for layer in g.layers}

    def to_json(self) -> dict[str, Any]:
        """A plain description (the worker's stats file carries it; `tiercache precompute docs` reads it back
        to name a hybrid model's records as the engine does: offline naming knows no groups)."""
        return {"groups": [dataclasses.asdict(g) for g in self.groups], "unsupported": self.unsupported}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KVGroups:
        groups = tuple(KVGroup(**{**g, "layers": tuple(g["layers"])}) for g in data["groups"])
        return cls(groups, data.get("unsupported"))

    def describe(self) -> str:
        parts = []
        for g in self.groups:
            what = "full" if g.kind == FULL else f"sliding window {g.window} ({g.window_blocks} blocks)"
            parts.append(f"group {g.index}: {what}, {len(g.layers)} layers")
        return "; ".join(parts)
