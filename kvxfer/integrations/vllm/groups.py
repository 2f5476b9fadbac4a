"""KV-cache groups: which of a request's blocks ship, per group, for models with more than one kind of attention.

vLLM keeps one block table per KV-cache group (full attention beside sliding-window layers, say). Its groups alias
one allocation (layer ``i`` of every group lives in the same tensor), and a block id belongs to one group at a time,
so one registered layout moves every group: a group's blocks are its own ids in the same tensors.

A full-attention group ships every prompt block. A sliding-window group ships only the blocks the next token still
attends to: vLLM frees the ones before them (``get_num_skipped_tokens``) when the request finishes, before the
connector's ``request_finished``, and reuses them at once. The decode instance allocates real blocks only from the
same place on, so both sides agree on the span without asking each other.

The last prompt token is where they would not: a decode instance that loads the whole prompt recomputes its last
token, whose window reaches one token further back than the prefill kept. A prefill of a model with a window
therefore holds a prompt without its last token (vLLM's own NixlConnector does the same for its Mamba and bounded
replay models), and the decode instance computes that token itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NULL_BLOCK = 0  # vLLM's null block: a freed sliding-window position, never shipped


@dataclass(frozen=True)
class Group:
    """One KV-cache group that ships."""

    index: int  # its place in vLLM's ``kv_cache_groups`` (and in every tuple of block ids)
    retained: int | None = None  # a sliding window: tokens before the next one that attention still reads

    def first_block(self, tokens: int, block_size: int) -> int:
        """The first block vLLM keeps once ``tokens`` tokens are computed: 0 for full attention."""
        if self.retained is None:
            return 0
        return max(0, tokens - self.retained) // block_size


ONE = (Group(0),)  # a model with one full-attention group: every prompt block ships


def of_config(kv_cache_config: Any) -> tuple[Group, ...]:
    """The groups that ship, from vLLM's ``KVCacheConfig``; ``ValueError`` for attention kinds whose state is not
    every prompt block or a window's tail of them (Mamba, chunked local, cross attention)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return ONE
    ids = getattr(kv_cache_config, "transfer_group_ids", range(len(groups)))
    out = tuple(_group(int(i), groups[i].kv_cache_spec) for i in ids)
    sizes = {int(groups[g.index].kv_cache_spec.block_size) for g in out}
    if len(sizes) > 1:
        raise ValueError(f"KVXferConnector: KV-cache groups of different block sizes {sorted(sizes)}: not supported")
    return out


def _group(index: int, spec: Any) -> Group:
    from vllm.v1 import kv_cache_interface as kv

    specs = list(spec.kv_cache_specs.values()) if isinstance(spec, kv.UniformTypeKVCacheSpecs) else [spec]
    if all(isinstance(s, kv.FullAttentionSpec) for s in specs):
        # every prompt block stays while the request runs (MLA, attention sinks; R-SWA evicts only generated ones)
        return Group(index)
    if isinstance(spec, kv.SlidingWindowSpec):  # vLLM's get_num_skipped_tokens keeps this many tokens back
        return Group(index, int(spec.sliding_window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0))
    raise ValueError(
        f"KVXferConnector ships full-attention and sliding-window KV-cache groups; group {index} is "
        f"{type(spec).__name__}: not supported"
    )


def windowed(groups: tuple[Group, ...]) -> bool:
    """Whether some group is a sliding window (a hold then leaves the last prompt token to the decode side)."""
    return any(g.retained is not None for g in groups)


def tables(groups: tuple[Group, ...], block_ids: Any) -> list[list[int]]:
    """Each shipping group's block table, from vLLM's tuple of every group's block ids."""
    ids = tuple(block_ids or ())
    return [list(ids[g.index]) if g.index < len(ids) else [] for g in groups]


def spans(groups: tuple[Group, ...], tokens: int, block_size: int) -> list[tuple[int, int]]:
    """``(first block, number of blocks)`` of each group that hold ``tokens`` tokens once they are computed."""
    n = -(-tokens // block_size)
    return [(first, n - first) for first in (g.first_block(tokens, block_size) for g in groups)]
