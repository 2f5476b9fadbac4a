"""Tensor-parallel shards of a KV cache: which kv heads a rank holds, which producer rank ships each head to a
consumer rank, and the pairing that moves one rank's heads into another's.

vLLM splits the kv heads of every layer evenly across the tensor-parallel ranks; when there are fewer kv heads
than ranks, each head is replicated on ``tp // num_heads`` consecutive ranks. A rank's cache is then a whole
cache of its own (its fingerprint says ``H<its heads>``), and the bytes of head ``h`` sit at the same place in
every block of every rank that holds it, as ``dim_ranges`` reads from the fingerprint. Prefill TP ``p`` and decode
TP ``d`` may differ: a consumer rank gathers its heads from every producer rank that holds some of them, and a
replicated head is shipped once, by the lowest producer rank holding it.

Layouts declare the heads they hold (``KVLayout.heads``); the handshake pairs two of them with ``link_pairing``,
and a ``Selection`` names what one part of a multi-sender request carries (layers or heads): the pairing that moves
it and the bytes of the consumer's blocks it fills. Different tokens per block map through ``paging``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import IncompatibleError
from .layout import KVLayout, check_compatible, order_dims
from .plan import Pairing, dim_ranges, intersect, layer_ranges, pair
from .wire import Fingerprint

Heads = tuple[int, int]  # [start, stop) of the model's kv heads


def heads_of(rank: int, tp: int, num_heads: int) -> Heads:
    """The kv heads tensor-parallel rank ``rank`` of ``tp`` holds, as vLLM shards them."""
    if not 0 <= rank < tp or num_heads < 1:
        raise IncompatibleError(f"rank {rank} of tensor-parallel size {tp} with {num_heads} kv heads")
    if num_heads >= tp:
        if num_heads % tp:
            raise IncompatibleError(f"{num_heads} kv heads do not split across {tp} ranks")
        n = num_heads // tp
        return rank * n, (rank + 1) * n
    if tp % num_heads:
        raise IncompatibleError(f"{num_heads} kv heads cannot be replicated evenly across {tp} ranks")
    h = rank // (tp // num_heads)
    return h, h + 1


def sources(dst_rank: int, dst_tp: int, src_tp: int, num_heads: int) -> list[tuple[int, Heads]]:
    """For consumer rank ``dst_rank`` of ``dst_tp``: ``(producer rank, heads)`` for every producer rank of
    ``src_tp`` that ships some of its heads, each head from the lowest producer rank holding it."""
    h0, h1 = heads_of(dst_rank, dst_tp, num_heads)
    out: list[tuple[int, Heads]] = []
    for r in range(src_tp):
        s0, s1 = heads_of(r, src_tp, num_heads)
        lo, hi = max(h0, s0), min(h1, s1)
        if lo >= hi:
            continue
        if out and out[-1][1][1] > lo:  # an earlier rank holds these heads already (replicas)
            lo = out[-1][1][1]
            if lo >= hi:
                continue
        out.append((r, (lo, hi)))
    return out


def stripe(rank: int, tp: int, num_layers: int) -> tuple[int, ...]:
    """The layers rank ``rank`` of ``tp`` ships of a cache every rank holds whole (an MLA latent cache, replicated
    on every tensor-parallel rank): ``layer % tp == rank``, as TileRT stripes them, so every rank's link carries a
    share and each layer ships once. Ranks past the layer count ship nothing (an empty tuple)."""
    if not 0 <= rank < tp:
        raise IncompatibleError(f"rank {rank} of tensor-parallel size {tp}")
    return tuple(range(rank, num_layers, tp))


def unsized(fp: Fingerprint, roles: str, heads: Heads | None = None) -> list[tuple[str, int | None]]:
    """The order with the sizes of ``roles`` masked (what differs between two sides), after checking, when
    ``heads`` is given, that the order holds that many heads."""
    dims = order_dims(fp)
    if heads is not None:
        n = [k for r, k in dims if r == "H"] or [1]  # a one-head shard has no H dim: size-1 dims are dropped
        if len(n) != 1 or n[0] != heads[1] - heads[0] or heads[0] < 0:
            raise IncompatibleError(f"order {fp.order!r} does not hold the {heads[1] - heads[0]} heads {list(heads)}")
    return [(r, None if r in roles else k) for r, k in dims]


def same_cache(a: Fingerprint, b: Fingerprint, roles: str, a_heads: Heads | None = None, b_heads: Heads | None = None):
    """Whether ``a`` and ``b`` are caches of one model that may differ only in the sizes of ``roles`` (``H``:
    the heads a shard holds, each as many as it says; ``L``: the layers a stage holds; ``N``: tokens per
    block, one a multiple of the other)."""
    da, db = unsized(a, roles, a_heads), unsized(b, roles, b_heads)
    for r in roles:  # a dim of size 1 is dropped from the order: where one head or layer sits changes no byte
        if (r, None) not in da or (r, None) not in db:
            da, db = [d for d in da if d[0] != r], [d for d in db if d[0] != r]
    if da != db or a.dtype != b.dtype:
        return False
    if "N" in roles and max(a.block_size, b.block_size) % min(a.block_size, b.block_size):
        return False
    return ("N" in roles or a.block_size == b.block_size) and ("L" in roles or a.num_layers == b.num_layers)


def check_shards(a: Fingerprint, a_heads: Heads, b: Fingerprint, b_heads: Heads) -> None:
    """Raise ``IncompatibleError`` unless ``a`` and ``b`` are caches of one model that differ only in which
    heads they hold (and each holds as many heads as it says)."""
    if not same_cache(a, b, "H", a_heads, b_heads):
        raise _different(a, b)


def _different(a: Fingerprint, b: Fingerprint) -> IncompatibleError:
    return IncompatibleError(
        f"shards of different caches: {a.dtype} {a.order!r} ({a.num_layers} layers, block_size {a.block_size}) "
        f"vs {b.dtype} {b.order!r} ({b.num_layers} layers, block_size {b.block_size})"
    )


def _head_bytes(layout: KVLayout, held: Heads, lo: int, hi: int):
    if held == (lo, hi):
        return [[0, layout.block_bytes]]
    return dim_ranges(layout.fingerprint, "H", lo - held[0], hi - held[0])


def shard_pairing(a: KVLayout, a_heads: Heads, b: KVLayout, b_heads: Heads, heads: Heads | None = None) -> Pairing:
    """The pairing moving kv heads ``heads`` (default: all both sides hold) from ``a``, which holds
    ``a_heads``, into ``b``, which holds ``b_heads``."""
    a_heads, b_heads = (int(a_heads[0]), int(a_heads[1])), (int(b_heads[0]), int(b_heads[1]))
    check_shards(a.fingerprint, a_heads, b.fingerprint, b_heads)
    lo, hi = heads or (max(a_heads[0], b_heads[0]), min(a_heads[1], b_heads[1]))
    _shared("heads", lo, hi, a_heads, b_heads)
    return pair(a, b, _head_bytes(a, a_heads, lo, hi), _head_bytes(b, b_heads, lo, hi))


def held(layout: KVLayout) -> Heads:
    """The kv heads ``layout`` holds: as it declared them, else all of its own (``[0, its H size)``)."""
    if layout.heads is not None:
        return layout.heads
    try:
        n = [k for r, k in order_dims(layout.fingerprint) if r == "H"] or [1]
    except IncompatibleError:
        n = [1]
    return 0, n[0]


def held_layers(layout: KVLayout) -> tuple[int, int]:
    """The model's layers ``layout`` holds: as it declared them (a pipeline stage), else ``[0, its layers)``."""
    return layout.layers if layout.layers is not None else (0, layout.fingerprint.num_layers)


def sharded(a: KVLayout, b: KVLayout) -> bool:
    """Whether ``a`` and ``b`` hold different heads of one cache: at least one declared its heads (a layout that
    does not say holds every head of the model, ``[0, its H size)``), and they differ."""
    return (a.heads is not None or b.heads is not None) and held(a) != held(b)


def staged(a: KVLayout, b: KVLayout) -> bool:
    """Whether ``a`` and ``b`` hold different layers of one model (pipeline stages), as for ``sharded``."""
    return (a.layers is not None or b.layers is not None) and held_layers(a) != held_layers(b)


def check_pair(a: KVLayout, b: KVLayout, tokens: bool = False) -> None:
    """Raise ``IncompatibleError`` unless producer layout ``a`` pairs with consumer layout ``b``: equal
    fingerprints, or caches of one model holding other heads or layers (and with ``tokens``, paging with
    other tokens per block)."""
    roles = ("H" if sharded(a, b) else "") + ("L" if staged(a, b) else "") + ("N" if tokens else "")
    if not roles:
        check_compatible(a.fingerprint, b.fingerprint)
        return
    fa, fb = a.fingerprint, b.fingerprint
    hs = (held(a), held(b)) if "H" in roles else (None, None)
    if same_cache(fa, fb, roles, *hs):
        return
    if tokens:
        raise IncompatibleError(
            f"blocks of {fa.block_size} tokens ({fa.dtype} {fa.order!r}) do not map onto blocks of "
            f"{fb.block_size} tokens ({fb.dtype} {fb.order!r})"
        )
    raise _different(fa, fb)


def _shared(what: str, lo: int, hi: int, a: tuple[int, int], b: tuple[int, int]) -> None:
    if not (a[0] <= lo < hi <= a[1] and b[0] <= lo < hi <= b[1]):
        raise IncompatibleError(f"{what} [{lo}, {hi}) are not held by both {list(a)} and {list(b)}")


def sides(a: KVLayout, b: KVLayout, part: Selection | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of a block of ``a`` and of a block of ``b`` that ``part`` moves (None: a whole request: for
    shards or stages, the heads and layers both hold), whatever their tokens per block. Heads and layers
    compose: a part of a tensor- and pipeline-parallel prefill carries its heads of its layers."""
    ra = np.array([[0, a.block_bytes]], dtype=np.int64)
    rb = np.array([[0, b.block_bytes]], dtype=np.int64)
    if (part is not None and part.heads is not None) or sharded(a, b):
        (a0, a1), (b0, b1) = held(a), held(b)
        lo, hi = part.heads if part is not None and part.heads is not None else (max(a0, b0), min(a1, b1))
        _shared("heads", lo, hi, (a0, a1), (b0, b1))
        ra = intersect(ra, np.asarray(_head_bytes(a, (a0, a1), lo, hi), dtype=np.int64))
        rb = intersect(rb, np.asarray(_head_bytes(b, (b0, b1), lo, hi), dtype=np.int64))
    if (part is not None and part.layers is not None) or staged(a, b):
        (a0, a1), (b0, b1) = held_layers(a), held_layers(b)
        ls = np.asarray(
            part.layers if part is not None and part.layers is not None else range(max(a0, b0), min(a1, b1))
        )
        if not len(ls) or ls.min() < max(a0, b0) or ls.max() >= min(a1, b1):
            raise IncompatibleError(f"layers {ls.tolist()} are not held by both {[a0, a1]} and {[b0, b1]}")
        ra = intersect(ra, layer_ranges(a, ls - a0))
        rb = intersect(rb, layer_ranges(b, ls - b0))
    return ra, rb


def link_pairing(a: KVLayout, b: KVLayout) -> Pairing:
    """The pairing of a producer's layout ``a`` with a consumer's ``b`` (the handshake's): equal layouts pair
    whole; shards or stages of one model pair over the heads and layers they share, and sharing none is
    ``IncompatibleError``."""
    check_pair(a, b)
    if not (sharded(a, b) or staged(a, b)):
        return pair(a, b)
    return pair(a, b, *sides(a, b))


@dataclass(frozen=True)
class Selection:
    """What one part of a multi-sender request carries of every block: some layers (a pipeline stage, a layer
    split, an MLA stripe), some kv heads (a tensor-parallel rank's, ``[start, stop)`` of the model's heads),
    or both; layers are the model's, whatever a stage holds."""

    layers: tuple[int, ...] | None = None
    heads: Heads | None = None

    def pairing(self, a: KVLayout, b: KVLayout) -> Pairing:
        """The pairing moving this selection from producer layout ``a`` into consumer layout ``b``."""
        return pair(a, b, *sides(a, b, self))

    def ranges(self, a: KVLayout, b: KVLayout) -> np.ndarray:
        """The bytes of every block of consumer layout ``b`` this selection fills (sorted ``[start, stop)``)."""
        return sides(a, b, self)[1]


def coverage(a: KVLayout, b: KVLayout) -> np.ndarray:
    """The bytes of every block of consumer layout ``b`` that a whole push from ``a`` fills: all of them, or for
    a shard or stage those of the heads and layers both hold."""
    return sides(a, b)[1]
