"""Block ids -> coalesced (offset, offset, nbytes) descriptors, vectorised with numpy.

Two layouts are first *paired*: their segment streams are cut at the union of both sides' segment
boundaries into pieces that are contiguous on both sides. A transfer of ``n`` blocks is then ``pieces x n``
extents in piece-major order (the canonical byte-stream order both sides agree on), and runs that are adjacent
on both sides (or on one side, for a stream transport) merge into one descriptor. There is no per-block Python
loop: a million blocks plan in a few milliseconds.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import numpy as np

from . import _kvx
from .errors import BlockError, IncompatibleError
from .layout import KVLayout, order_dims
from .wire import Fingerprint


def check_ids(ids, num_blocks: int, what: str = "block ids") -> np.ndarray:
    """``ids`` as an int64 vector, each in ``[0, num_blocks)`` and none repeated, else ``BlockError``."""
    a = _int_ids(ids, num_blocks, what)
    _verdict(_kvx.check_ids(a, max(int(num_blocks), 0)), a, num_blocks, what)  # one pass over a bitmap, native
    return a


def is_whole(value) -> bool:
    """Whether ``value`` is a whole number (any integral type, numpy's too, but not a bool)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def whole(value, what: str, lo: int = 0) -> int:
    """A caller's count or index: a whole number (not a bool) of at least ``lo``, else ``BlockError``."""
    if not is_whole(value) or int(value) < lo:
        raise BlockError(f"{what} must be a whole number, {lo} or more, got {value!r}")
    return int(value)


def check_tokens(tokens, blocks: int, block_size: int) -> int | None:
    """A caller's ``tokens`` for ``blocks`` blocks: None (every block full) or a whole number the blocks hold
    with the last one partly filled at most, else ``BlockError``."""
    if tokens is None:
        return None
    real = isinstance(tokens, numbers.Real) and not isinstance(tokens, bool)
    if not (real and math.isfinite(tokens) and float(tokens).is_integer()):
        raise BlockError(f"tokens must be a whole number, got {tokens!r}")
    n = int(tokens)
    if not (blocks - 1) * block_size < n <= blocks * block_size:
        raise BlockError(f"{n} tokens do not fill {blocks} blocks of {block_size} tokens")
    return n


PARALLEL_MIN = 65536  # ids per side from which a plan's two sides are worked on at once
T = TypeVar("T")


def _both(n: int, fn: Callable[..., T], a: tuple, b: tuple) -> tuple[T, T]:
    """``fn(*a), fn(*b)``; with ``n`` ids or more per side, the second on a thread of its own (started per call,
    so a forked child plans as well as its parent). Every ``fn`` given is a native pass that releases the GIL and
    is latency-bound (a bitmap, fresh pages), so two cores do the two sides of a big plan in the time of one."""
    if n < PARALLEL_MIN:
        return fn(*a), fn(*b)
    box: list[tuple[bool, Any]] = []

    def second() -> None:
        try:
            box.append((True, fn(*b)))
        except BaseException as e:  # handed to the caller below
            box.append((False, e))

    t = threading.Thread(target=second, name="kvxfer-plan", daemon=True)
    t.start()
    try:
        first = fn(*a)
    finally:
        t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return first, value


def _int_ids(ids, num_blocks: int, what: str) -> np.ndarray:
    """``ids`` as an int64 vector (not yet range- or duplicate-checked)."""
    a = np.asarray(ids)
    if a.ndim != 1:
        raise BlockError(f"{what} must be a 1-D sequence")
    if a.size == 0:
        raise BlockError(f"{what} are empty")
    if a.dtype.kind not in "iu":
        raise BlockError(f"{what} must be integers, got {a.dtype}")
    if a.dtype == np.uint64 and a.max() > np.iinfo(np.int64).max:
        raise BlockError(f"{what} out of range: {int(a.max())} not within [0, {num_blocks})")
    return a.astype(np.int64, copy=False)


def _verdict(status: int, a: np.ndarray, num_blocks: int, what: str) -> None:
    if status == 1:
        raise BlockError(f"{what} out of range: [{int(a.min())}, {int(a.max())}] not within [0, {num_blocks})")
    if status == 2:
        raise BlockError(f"{what} contain duplicates")


@dataclass(frozen=True)
class Side:
    """One side of a pairing: per piece, region index, offset of block 0 and block stride."""

    region: np.ndarray
    offset: np.ndarray
    stride: np.ndarray


@dataclass(frozen=True)
class Pairing:
    """The common refinement of two layouts' segment streams (computed once per peer)."""

    a: Side
    b: Side
    nbytes: np.ndarray

    @cached_property  # every small request asks
    def block_bytes(self) -> int:
        return int(self.nbytes.sum())


def _side(layout: KVLayout, bounds: np.ndarray) -> Side:
    cuts = np.concatenate([[0], np.cumsum(layout.seg_bytes)])
    seg = np.searchsorted(cuts, bounds, side="right") - 1
    within = bounds - cuts[seg]
    return Side(layout.seg_region[seg], layout.seg_offset[seg] + within, layout.seg_stride[seg])


FEW_RANGES = 64


def byte_ranges(ranges, block_bytes: int) -> np.ndarray:
    """``ranges`` as an Nx2 int64 array of ``[start, end)`` bytes of a block (``None``: the whole block), else
    ``BlockError`` unless they are sorted, disjoint, non-empty and within ``block_bytes``."""
    if ranges is None:
        return np.array([[0, block_bytes]], dtype=np.int64)
    r = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    if len(r) <= FEW_RANGES:  # every admission checks its ranges: a few numbers compare faster as Python ints
        f = r.ravel().tolist()  # start, end, start, end, ...: ends after starts, starts at or after the last end
        ok = bool(f) and f[0] >= 0 and f[-1] <= block_bytes
        ok = ok and all(a < b for a, b in zip(f[0::2], f[1::2], strict=True))
        ok = ok and all(a <= b for a, b in zip(f[1:-1:2], f[2::2], strict=True))
    else:
        ok = not ((r[:, 0] >= r[:, 1]).any() or r.min() < 0 or r.max() > block_bytes or (r[1:, 0] < r[:-1, 1]).any())
    if not ok:
        raise BlockError(f"byte ranges {r.tolist()} are not sorted, disjoint and within a block")
    return r


def range_bytes(r: np.ndarray) -> int:
    """The bytes of a block that ranges ``r`` (as ``byte_ranges`` returns them) cover."""
    if len(r) <= FEW_RANGES:
        f = r.ravel().tolist()
        return sum(f[1::2]) - sum(f[0::2])
    return int((r[:, 1] - r[:, 0]).sum())


def _virtual(r: np.ndarray) -> np.ndarray:
    """Where each range starts in the stream of the selected bytes alone."""
    return np.concatenate([[0], np.cumsum(r[:, 1] - r[:, 0])[:-1]])


def pair(a: KVLayout, b: KVLayout, ranges=None, ranges_b=None) -> Pairing:
    """Cut both layouts' block streams into pieces contiguous on both sides.

    ``ranges`` (an Nx2 array of ``[start, end)`` byte ranges of the block stream, sorted and disjoint)
    restricts the pairing to those bytes of every block, e.g. a subset of layers (``layer_ranges``): a
    transfer then moves only them, in the same piece-major stream order on both sides. ``ranges_b``, when
    given, selects other bytes on side ``b`` (the selections must be equally long): a shard's whole block into
    its slice of a larger block (``dim_ranges``), or one slice into another.
    """
    ra = byte_ranges(ranges, a.block_bytes)
    rb = ra if ranges_b is None else byte_ranges(ranges_b, b.block_bytes)
    if ranges is None and ranges_b is None and a.block_bytes != b.block_bytes:
        raise IncompatibleError(f"block sizes differ: {a.block_bytes} vs {b.block_bytes} bytes")
    total, total_b = int((ra[:, 1] - ra[:, 0]).sum()), int((rb[:, 1] - rb[:, 0]).sum())
    if total != total_b:
        raise IncompatibleError(f"the selected bytes differ: {total} vs {total_b} per block")
    bounds, sel = [], []
    for lay, r in ((a, ra), (b, rb)):
        v = _virtual(r)
        cuts = np.cumsum(lay.seg_bytes)[:-1]
        i = np.searchsorted(r[:, 0], cuts, side="right") - 1
        inside = (i >= 0) & (cuts < r[np.maximum(i, 0), 1])
        bounds += [v, v[i[inside]] + cuts[inside] - r[i[inside], 0]]
        sel.append((lay, r, v))
    vb = np.unique(np.concatenate(bounds))
    sizes = np.diff(np.append(vb, total))
    sides = []
    for lay, r, v in sel:
        i = np.searchsorted(v, vb, side="right") - 1
        sides.append(_side(lay, r[i, 0] + vb - v[i]))
    return Pairing(sides[0], sides[1], sizes.astype(np.int64))


def intersect(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The bytes in both sorted, disjoint range lists, as one such list (adjacent ranges merged)."""
    pts = np.unique(np.concatenate([x.ravel(), y.ravel()]))
    lo, hi = pts[:-1], pts[1:]
    keep = np.ones(len(lo), dtype=bool)
    for r in (x, y):
        i = np.searchsorted(r[:, 0], lo, side="right") - 1
        keep &= (i >= 0) & (lo < r[np.maximum(i, 0), 1])
    lo, hi = lo[keep], hi[keep]
    brk = np.ones(len(lo), dtype=bool)
    brk[1:] = lo[1:] != hi[:-1]
    return np.stack([lo[brk], hi[np.append(brk[1:], True)]], 1).astype(np.int64)


def dim_ranges(fp: Fingerprint, role: str, start: int, stop: int) -> np.ndarray:
    """The block-stream byte ranges holding indices ``[start, stop)`` of the dimension ``role`` (``"H"``: kv
    heads, ``"L"``: layers, ...), read from the fingerprint's ``order``, the meaning both sides agreed on.
    Ranges come in stream order: a head slice of an HND cache is one range per layer and K/V, of an NHD cache
    one per token; the whole dim is the whole block. This is how a shard (a tensor-parallel rank's heads, a
    pipeline stage's layers) addresses its bytes inside a whole block."""
    dims = order_dims(fp)
    at = [i for i, (r, _) in enumerate(dims) if r == role]
    if len(at) != 1:
        raise IncompatibleError(f"order {fp.order!r} has {len(at)} {role!r} dims; slicing needs exactly one")
    i, n = at[0], dims[at[0]][1]
    if not 0 <= start < stop <= n:
        raise BlockError(f"[{start}, {stop}) is not a slice of the {n} {role!r} of order {fp.order!r}")
    sizes = [k for _, k in dims]
    elems = int(np.prod(sizes))
    if fp.block_bytes % elems:
        raise IncompatibleError(f"order {fp.order!r} does not divide {fp.block_bytes} bytes per block")
    if start == 0 and stop == n:
        return np.array([[0, fp.block_bytes]], dtype=np.int64)
    inner = fp.block_bytes // elems * int(np.prod(sizes[i + 1 :]))
    outer = int(np.prod(sizes[:i]))
    base = np.arange(outer, dtype=np.int64) * (n * inner)
    return np.stack([base + start * inner, base + stop * inner], 1)


def layer_ranges(layout: KVLayout, layers) -> np.ndarray:
    """The block-stream byte ranges of ``layers`` (layer ``l`` is bytes ``[l, l+1) * layer_bytes`` of a
    block, as the fingerprint both sides agreed on defines it), adjacent layers merged."""
    n, lb = layout.fingerprint.num_layers, layout.fingerprint.layer_bytes
    ls = np.unique(np.asarray(list(layers), dtype=np.int64))
    if not len(ls) or ls[0] < 0 or ls[-1] >= n or len(ls) != len(list(layers)):
        raise BlockError(f"layers {list(layers)} are not distinct layers of [0, {n})")
    brk = np.flatnonzero(np.diff(ls) != 1) + 1
    starts = ls[np.concatenate([[0], brk])]
    ends = ls[np.concatenate([brk - 1, [len(ls) - 1]])] + 1
    return np.stack([starts * lb, ends * lb], 1)


@dataclass(frozen=True)
class Extents:
    """Descriptors on one side: region index, byte offset inside it, length."""

    region: np.ndarray
    offset: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    @property
    def total(self) -> int:
        return int(self.nbytes.sum())

    def window(self, start: int, length: int) -> Extents:
        """The sub-extents covering stream bytes ``[start, start + length)``."""
        return self._cut(np.cumsum(self.nbytes), start, length)

    def split(self, size: int) -> list[Extents]:
        """Consecutive windows of at most ``size`` stream bytes covering every byte (running sums computed once,
        not once per window)."""
        ends = np.cumsum(self.nbytes)
        total = int(ends[-1]) if len(ends) else 0
        return [self._cut(ends, o, min(size, total - o)) for o in range(0, total, size)]

    def _cut(self, ends: np.ndarray, start: int, length: int) -> Extents:
        first = int(np.searchsorted(ends, start, side="right"))
        last = int(np.searchsorted(ends, start + length, side="left"))
        sl = slice(first, last + 1)
        region, offset, nbytes = self.region[sl], self.offset[sl].copy(), self.nbytes[sl].copy()
        begins = ends[sl] - self.nbytes[sl]
        head = start - int(begins[0])
        offset[0] += head
        nbytes[0] -= head
        nbytes[-1] -= int(ends[last]) - (start + length)
        return Extents(region, offset, nbytes)


@dataclass(frozen=True)
class Plan:
    """A two-sided transfer: descriptor ``i`` moves ``nbytes[i]`` from ``src`` to ``dst``."""

    src: Extents
    dst: Extents

    def __len__(self) -> int:
        return len(self.src)

    @property
    def total(self) -> int:
        return self.src.total


def _offsets(side: Side, ids: np.ndarray) -> np.ndarray:
    """Piece-major byte offsets of every piece of every block (one native pass per piece)."""
    n = len(ids)
    out = np.empty(len(side.offset) * n, dtype=np.int64)
    for k, (o, s) in enumerate(zip(side.offset.tolist(), side.stride.tolist(), strict=True)):
        _kvx.affine(ids, s, o, out[k * n : (k + 1) * n])
    return out


def _all_offsets(sides: list[tuple[Side, np.ndarray]]) -> list[np.ndarray]:
    """``_offsets`` of each (side, ids): two sides at once when large (``_both``)."""
    if len(sides) == 2:
        return list(_both(len(sides[0][1]), _offsets, sides[0], sides[1]))
    return [_offsets(s, ids) for s, ids in sides]


RARE_MERGES = 0.01  # below this share of merges, extents stay unmerged: merging is optional, gathers are not free


BROADCAST_MIN = 4096  # extents from which a constant column is a zero-copy broadcast (below, a copy costs less)


def _column(values: np.ndarray, n: int) -> np.ndarray:
    """Each piece's ``values`` repeated for ``n`` blocks: a small request's latency feels every numpy call."""
    if len(values) * n >= BROADCAST_MIN and bool((values == values[0]).all()):
        return np.broadcast_to(values[0], len(values) * n)
    return np.repeat(values, n)


def _unmerged(sides, offs, nbytes: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Every piece x block as its own extent."""
    out = []
    for (s, _), off in zip(sides, offs, strict=True):
        out += [_column(s.region, n), off]
    return (*out, _column(nbytes, n))


SAMPLE = 4096  # ids whose neighbours are looked at before a million are


def _merges_likely(sides) -> bool:
    """Whether the first ``SAMPLE`` ids run on (adjacent on every side) often enough to look for merges at all:
    a shuffled request skips the full scan, whose temporaries cost more than its answer saves."""
    head = np.ones(min(SAMPLE, len(sides[0][1])) - 1, dtype=bool)
    for _, ids in sides:
        head &= np.diff(ids[:SAMPLE]) == 1
    return bool(np.count_nonzero(head) >= RARE_MERGES * len(head))


def _packed(sides, nbytes: np.ndarray) -> bool:
    """Whether every piece is packed on every side: its block stride is its size, so consecutive ids are adjacent
    bytes in every piece alike."""
    return all(bool((s.stride == nbytes).all()) for s, _ in sides)


def _packed_runs(sides, nbytes: np.ndarray, n: int) -> tuple[np.ndarray, ...] | None:
    """Packed pieces' extents: runs of consecutive ids are found once for all pieces (native) and offsets computed
    only where runs start, so a sequential request of 32 layers plans 32 extents, not 32 x n (page faults of fresh
    8-byte arrays dominate at a million blocks); a piece's last run goes on into the next piece's first where both
    sides hold them back to back, as in the general scan. None when the ids barely run on."""
    starts = np.empty(n, dtype=np.int64)  # pages only as far as written: one entry for a sequential request
    runs = _kvx.run_starts(sides[0][1], sides[-1][1], starts)
    if runs > n * (1 - RARE_MERGES):
        return None
    starts = starts[:runs]
    p = len(nbytes)
    lens = (np.diff(np.append(starts, n)) * nbytes[:, None]).ravel()
    offs = [(ids[starts] * s.stride[:, None] + s.offset[:, None]).ravel() for s, ids in sides]
    keep: slice | np.ndarray = slice(None)
    if p > 1:
        last, first = np.arange(1, p) * runs - 1, np.arange(1, p) * runs
        join = np.ones(p - 1, dtype=bool)
        for (s, _), off in zip(sides, offs, strict=True):
            join &= (s.region[1:] == s.region[:-1]) & (off[last] + lens[last] == off[first])
        if join.any():
            brk = np.ones(p * runs, dtype=bool)
            brk[first[join]] = False
            keep = np.flatnonzero(brk)
            lens = np.add.reduceat(lens, keep)
    out = []
    for (s, _), off in zip(sides, offs, strict=True):
        out += [np.repeat(s.region, runs)[keep], off[keep]]
    return (*out, lens)


def _coalesce(sides: list[tuple[Side, np.ndarray]], nbytes: np.ndarray, n: int) -> tuple[np.ndarray, ...]:
    """Piece-major extents for each (side, ids), merged where adjacent on every given side."""
    p = len(nbytes)
    if n > 1 and _packed(sides, nbytes):
        if n > SAMPLE and not _merges_likely(sides):  # shuffled: skip the scan, whose pages cost more than it saves
            return _unmerged(sides, _all_offsets(sides), nbytes, n)
        runs = _packed_runs(sides, nbytes, n)
        if runs is not None:
            return runs
    if p == 1:  # one piece merges only within itself: packed above, else never
        return _unmerged(sides, _all_offsets(sides), nbytes, n)
    total = p * n
    offs = _all_offsets(sides)
    lens = np.repeat(nbytes, n)
    brk = np.zeros(total, dtype=bool)
    brk[0] = True
    scratch = np.empty(total - 1, dtype=np.int64)
    hits = np.empty(total - 1, dtype=bool)
    for off in offs:
        np.add(off[:-1], lens[:-1], out=scratch)
        np.not_equal(off[1:], scratch, out=hits)
        brk[1:] |= hits
    change = np.zeros(p, dtype=bool)
    for s, _ in sides:
        change[1:] |= s.region[1:] != s.region[:-1]
    brk[np.flatnonzero(change) * n] = True
    starts = np.flatnonzero(brk)
    if len(starts) > total * (1 - RARE_MERGES):
        return _unmerged(sides, offs, nbytes, n)
    run = np.add.reduceat(lens, starts)
    piece = starts // n
    out = []
    for (s, _), off in zip(sides, offs, strict=True):
        out += [s.region[piece], off[starts]]
    return (*out, run.astype(np.int64))


def make_plan(pairing: Pairing, src_ids, dst_ids, src_blocks: int, dst_blocks: int, *, coalesce: bool = True) -> Plan:
    """Two-sided plan from side ``a`` (source) blocks ``src_ids`` to side ``b`` (destination) ``dst_ids``.
    ``coalesce=False`` keeps one descriptor per piece and block (a baseline for what coalescing saves)."""
    s = _int_ids(src_ids, src_blocks, "source block ids")
    d = _int_ids(dst_ids, dst_blocks, "destination block ids")
    n = min(len(s), len(d))
    vs, vd = _both(n, _kvx.check_ids, (s, max(int(src_blocks), 0)), (d, max(int(dst_blocks), 0)))
    _verdict(vs, s, src_blocks, "source block ids")
    _verdict(vd, d, dst_blocks, "destination block ids")
    if len(s) != len(d):
        raise BlockError(f"{len(s)} source blocks but {len(d)} destination blocks")
    sides = [(pairing.a, s), (pairing.b, d)]
    if coalesce:
        sr, so, dr, do, nb = _coalesce(sides, pairing.nbytes, len(s))
    else:
        sr, so, dr, do, nb = _unmerged(sides, _all_offsets(sides), pairing.nbytes, len(s))
    return Plan(Extents(sr, so, nb), Extents(dr, do, nb))


def extents(side: Side, nbytes: np.ndarray, ids, num_blocks: int) -> Extents:
    """One side of a transfer in stream order, merged where adjacent on this side alone (stream transports)."""
    a = check_ids(ids, num_blocks)
    r, o, nb = _coalesce([(side, a)], nbytes, len(a))
    return Extents(r, o, nb)
