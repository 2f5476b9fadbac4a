"""Paged-KV geometry: which bytes of registered memory hold block ``b``, and what those bytes mean.

A layout is a list of *segments*. Segment ``s`` holds ``seg_bytes[s]`` contiguous bytes of every block, at
``regions[seg_region[s]].ptr + seg_offset[s] + b * seg_stride[s]``. The concatenation of a block's segments in
order is the block's *byte stream*; two layouts are compatible when their streams mean the same bytes (same
fingerprint), however differently the two sides split them into segments.

The geometry is derived from each tensor's shape and byte strides, never from an assumed layout: the block
dimension picks the block stride, dimensions laid out inside a block must be dense (they form the segment), and
dimensions laid out outside the block dimension (K/V in ``[2, num_blocks, ...]``, heads in an HND cache whose
heads are outermost) each add segments.

What the bytes mean comes from the *role* of every tensor dimension, one letter each (``DIMS``). The
fingerprint's ``order`` lists the roles and sizes of the byte stream's dimensions, outermost first, with size-1
dimensions dropped and neighbours of one role merged: ``"L32 N16 H8 D256"`` is 32 layers, each 16 tokens, each
8 kv heads of 256 values. Equal sizes can no longer stand in for each other: NHD and HND differ even when
``block_size == kv_heads``.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from collections.abc import Mapping, Sequence

import msgspec
import numpy as np

from . import wire
from .errors import IncompatibleError, LayoutError
from .memory import HOST, Region, TensorView, as_view, merge_regions

log = logging.getLogger("kvxfer")

MAX_SEGMENTS = wire.MAX_SEGMENTS
MAX_BLOCKS = wire.MAX_BLOCKS
_I64 = (1 << 63) - 1

DIMS = {
    "B": "block (its index is the block id)",
    "L": "layer",
    "K": "K/V (size 2, K first)",
    "N": "token within the block (block_size)",
    "H": "kv head",
    "D": "feature: head_dim, K and V packed side by side, or an MLA latent",
}
_LEGEND = ", ".join(f"{k} = {v}" for k, v in DIMS.items())
VLLM_DIMS = "BHND"  # vLLM's logical per-layer view [num_blocks, kv_heads, block_size, C], any memory order


def _segments_of(view: TensorView, block_dim: int) -> tuple[int, int, int, list[int], list[int]]:
    """(num_blocks, block stride, chunk bytes, segment base addresses, stream dims outermost first).

    The stream dims are the dims outside the block (one segment each index, in logical order) followed by
    the dims inside a segment in memory order.
    """
    nd = len(view.shape)
    nblocks, bstride = view.shape[block_dim], view.strides[block_dim]
    dims = [(view.strides[d], view.shape[d], d) for d in range(nd) if d != block_dim and view.shape[d] > 1]
    inner = sorted((st, n, d) for st, n, d in dims if st < bstride or nblocks == 1)
    outer = [(st, n, d) for st, n, d in dims if (st, n, d) not in inner]
    chunk = view.itemsize
    for st, n, d in inner:
        if st != chunk:
            raise LayoutError(
                f"a block is not an affine slice: dim {d} (size {n}) has byte stride {st}, expected {chunk} "
                f"for a dense block; shape {view.shape}, strides {view.strides}"
            )
        chunk *= n
    extent = chunk
    for st, n, d in sorted([(bstride, nblocks, block_dim), *outer]):
        if n > 1 and st < extent:
            raise LayoutError(f"dim {d} overlaps the block contents (stride {st} < extent {extent})")
        extent = st * (n - 1) + extent
    outer.sort(key=lambda t: t[2])  # stream order follows logical dim order (K before V, head 0 first, ...)
    bases = [
        view.ptr + sum(i * st for i, (st, _, _) in zip(idx, outer, strict=True))
        for idx in itertools.product(*(range(n) for _, n, _ in outer))
    ]
    stream = [d for _, _, d in outer] + [d for _, _, d in sorted(inner, reverse=True)]
    return nblocks, (bstride if nblocks > 1 else chunk), chunk, bases, stream


def _check_dims(dims: str, shape: tuple, paired: bool) -> str:
    """Validate a caller's ``dims`` for a tensor of ``shape``."""
    if not isinstance(dims, str) or len(dims) != len(shape):
        raise LayoutError(
            f"dims {dims!r} must name each of the {len(shape)} dims of a tensor of shape {shape}, "
            f"one letter each from {''.join(DIMS)}"
        )
    bad = sorted(set(dims) - set(DIMS))
    if bad:
        raise LayoutError(f"dims {dims!r}: unknown letters {bad}; use {_LEGEND}")
    if len(set(dims)) != len(dims) or "B" not in dims:
        raise LayoutError(f"dims {dims!r} must name B exactly once and every other letter at most once")
    if paired and "K" in dims:
        raise LayoutError(f"dims {dims!r}: a (K, V) pair of tensors has no K dim of its own")
    if "K" in dims and shape[dims.index("K")] != 2:
        raise LayoutError(f"dims {dims!r}: the K dim has size {shape[dims.index('K')]}, not 2")
    return dims


def _infer_dims(shape: tuple, block_dim: int, block_size: int, layers: int, paired: bool) -> str:
    """Read a tensor's dims from its sizes, or raise ``LayoutError`` asking for ``dims`` when they cannot tell.

    The block dim is ``block_dim``, the last dim is D; among the rest (size-1 dims do not matter) one has
    size ``block_size`` (N), one has size ``layers`` in a tensor holding several layers (L), one more is H and
    a second more is K (size 2).
    """
    nd = len(shape)
    if block_dim == nd - 1:
        raise LayoutError(f"the block dim is the last dim of shape {shape}: pass dims (one letter per dim)")
    fixed = {block_dim: "B", nd - 1: "D"}
    free = [d for d in range(nd) if d not in fixed and shape[d] > 1]
    need = [r for r, want in (("N", block_size > 1), ("L", layers > 1)) if want]
    extra = len(free) - len(need)
    if extra < 0 or extra > (1 if paired else 2):
        raise LayoutError(
            f"cannot tell what the dims of shape {shape} mean (block_size {block_size}, "
            f"{layers} layer(s) per tensor): pass dims, one letter per dim from {''.join(DIMS)}"
        )
    need += ["H", "K"][:extra]
    size = {"N": block_size, "L": layers, "K": 2}
    found = set()
    for perm in itertools.permutations(need):
        if all(size.get(r, shape[d]) == shape[d] for r, d in zip(perm, free, strict=True)):
            roles = {**fixed, **dict(zip(free, perm, strict=True))}
            spare = iter(r for r in "HKLN" if r not in roles.values())
            found.add("".join(roles[d] if d in roles else next(spare, "?") for d in range(nd)))
    if len(found) != 1:
        why = (
            "could be " + " or ".join(f"dims={f!r}" for f in sorted(found))
            if found
            else f"no dim has the size of {' / '.join(f'{r} ({size[r]})' for r in need if r in size)}"
        )
        raise LayoutError(
            f"cannot tell what the dims of shape {shape} mean ({why}): pass dims naming each dim, {_LEGEND}"
        )
    return found.pop()


def _rows_meet(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether two sorted lists of disjoint inclusive row ranges share a row."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][0] <= b[j][1] and b[j][0] <= a[i][1]:
            return True
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return False


_SHARED = "two layers (or K and V) share bytes of memory (a tensor given twice, [t] * n, or views that overlap)"


def _shared_memory(regions: list[Region], seg_region, seg_offset, seg_stride, seg_bytes, nblocks: int) -> str:
    """Why two blocks or two segments share bytes of memory ("" when none do): tensors given twice (``[t] * 2``)
    or views that overlap land one layer's bytes over another's.

    Segments of one stride in one region form a grid of ``stride``-byte rows (a block per row): segment ``i``
    is the columns ``[offset % stride, + bytes)`` (wrapping into the next row) of rows ``offset // stride`` on,
    one per block. Two overlap where their columns and their rows do. Segments of other strides in one region
    must not even interleave."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, (r, st) in enumerate(zip(seg_region, seg_stride, strict=True)):
        groups.setdefault((r, st if nblocks > 1 else 0), []).append(i)
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for (r, st), members in groups.items():
        width = st or regions[r].nbytes + 1  # one block: a single row as wide as the region
        cols: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for i in members:
            off, n = seg_offset[i], seg_bytes[i]
            q, c = divmod(off, width)
            if c + n <= width:
                cols.setdefault((c, c + n), []).append((q, q + nblocks - 1))
            else:
                cols.setdefault((c, width), []).append((q, q + nblocks - 1))
                cols.setdefault((0, c + n - width), []).append((q + 1, q + nblocks))
            spans.setdefault(r, []).append((off, off + (nblocks - 1) * st + n, st))
        keys = sorted(cols)
        for k in keys:
            rows = cols[k] = sorted(cols[k])
            if any(b[0] <= a[1] for a, b in itertools.pairwise(rows)):
                return _SHARED
        for x, a in enumerate(keys):
            for b in keys[x + 1 :]:
                if b[0] >= a[1]:
                    break
                if _rows_meet(cols[a], cols[b]):
                    return _SHARED
    for items in spans.values():
        if len({st for *_, st in items}) > 1:  # strides differ: their spans may not even interleave
            items.sort()
            for (_, hi, sa), (lo, _, sb) in itertools.pairwise(items):
                if lo < hi and sa != sb:
                    return "tensors of different block strides interleave in one allocation"
    return ""


def _merge(tokens: list) -> list:
    """Drop size-1 dims and merge neighbours of one role (their indices compose row-major)."""
    out: list = []
    for role, n in tokens:
        if n == 1:
            continue
        if out and out[-1][0] == role and n and out[-1][1]:
            out[-1] = (role, out[-1][1] * n)
        else:
            out.append((role, n))
    return out


def _text(tokens: list) -> str:
    return " ".join(f"{r}{n}" if n else r for r, n in tokens)


def _repeat(role: str, parts: list[list]) -> list:
    """``parts`` one after another along ``role``: one dim when all parts mean the same, else spelled out."""
    if all(p == parts[0] for p in parts):
        return _merge([(role, len(parts))] + parts[0])
    runs = [(len(list(g)), p) for p, g in itertools.groupby(parts, key=_text)]
    return [(f"{role}[" + " | ".join(f"{k}x({p})" for k, p in runs) + "]", 0)]


class KVLayout:
    """Where every block of a paged KV cache lives, local (with the tensors kept alive) or remote (a peer's)."""

    def __init__(
        self,
        regions: Sequence[Region],
        seg_region,
        seg_offset,
        seg_stride,
        seg_bytes,
        num_blocks: int,
        fingerprint: wire.Fingerprint,
        owners: tuple = (),
        heads: tuple[int, int] | None = None,
        layers: tuple[int, int] | None = None,
        packed: bool = False,
    ):
        self.regions = list(regions)
        self.seg_region = _int64("segment regions", seg_region)
        self.seg_offset = _int64("segment offsets", seg_offset)
        self.seg_stride = _int64("segment strides", seg_stride)
        self.seg_bytes = _int64("segment sizes", seg_bytes)
        self.num_blocks = int(num_blocks)
        self._block_bytes = sum(self.seg_bytes.tolist())  # Python ints: a peer's sizes must not wrap the sum
        self.fingerprint = fingerprint
        self._owners = owners
        self.heads = None if heads is None else (int(heads[0]), int(heads[1]))
        self.layers = None if layers is None else (int(layers[0]), int(layers[1]))
        self.packed = packed  # an attention kernel lays out each block its own way: no token slices (local only)
        self._check()

    @property
    def num_segments(self) -> int:
        return len(self.seg_bytes)

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    @property
    def fingerprint_id(self) -> str:
        """A short stable name of the fingerprint: two layouts pair exactly when their ids are equal, so a
        ticket can carry it and a fetching side can refuse a mismatch before any connection."""
        return hashlib.sha256(msgspec.msgpack.encode(self.fingerprint)).hexdigest()[:32]

    @property
    def device(self) -> int:
        """HOST when every region is host memory, else the CUDA ordinal of the first device region."""
        return next((r.device for r in self.regions if r.device != HOST), HOST)

    def _check(self) -> None:
        """Every number in range and every segment inside its region, in arithmetic that cannot wrap."""
        n = self.num_segments
        if not 0 < n <= MAX_SEGMENTS:
            raise LayoutError(f"a layout needs 1..{MAX_SEGMENTS} segments, got {n}")
        if not (len(self.seg_region) == len(self.seg_offset) == len(self.seg_stride) == n):
            raise LayoutError("segment arrays differ in length")
        if not 0 < self.num_blocks <= MAX_BLOCKS:
            raise LayoutError(f"a layout needs 1..{MAX_BLOCKS} blocks, got {self.num_blocks}")
        for r in self.regions:
            if not (r.ptr >= 0 and 0 <= r.nbytes <= _I64 and r.ptr + r.nbytes <= 1 << 64):
                raise LayoutError(f"region {r} is out of range")
        if (self.seg_bytes <= 0).any() or (self.seg_offset < 0).any() or (self.seg_stride < 0).any():
            raise LayoutError("segment sizes, offsets and strides must be positive")
        if (self.seg_region < 0).any() or (self.seg_region >= len(self.regions)).any():
            raise LayoutError("segment names a region that does not exist")
        room = np.array([r.nbytes for r in self.regions], dtype=np.int64)[self.seg_region]
        if (self.seg_offset > room).any() or (self.seg_bytes > room - self.seg_offset).any():
            raise LayoutError("a segment runs past the end of its region")
        if (
            self.num_blocks > 1
            and (self.seg_stride > (room - self.seg_offset - self.seg_bytes) // (self.num_blocks - 1)).any()
        ):
            raise LayoutError("a segment runs past the end of its region")
        if self.block_bytes > _I64 // self.num_blocks:
            raise LayoutError(f"{self.num_blocks} blocks of {self.block_bytes} bytes overflow int64")
        fp = self.fingerprint
        if fp.block_bytes != self.block_bytes:
            raise LayoutError(f"fingerprint says {fp.block_bytes} bytes per block, segments hold {self.block_bytes}")
        if self.heads is not None:
            try:
                held = [k for r, k in order_dims(fp) if r == "H"] or [1]  # a one-head cache has no H dim
            except IncompatibleError as e:
                raise LayoutError(f"a cache declaring its heads needs an order with one size per dim: {e}") from None
            lo, hi = self.heads
            if not (0 <= lo < hi and len(held) == 1 and hi - lo == held[0]):
                raise LayoutError(f"heads [{lo}, {hi}) do not match the {held} kv heads of order {fp.order!r}")
        if self.layers is not None:
            lo, hi = self.layers
            if not (0 <= lo < hi and hi - lo == fp.num_layers):
                raise LayoutError(f"layers [{lo}, {hi}) do not match the {fp.num_layers} layers of the cache")

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_tensors(
        cls,
        caches,
        *,
        dims: str | None = None,
        block_dim: int | None = None,
        block_size: int | None = None,
        num_layers: int | None = None,
        heads: tuple[int, int] | None = None,
        layers: tuple[int, int] | None = None,
        packed: bool = False,
    ) -> KVLayout:
        """Describe a KV cache.

        ``heads``: the ``[start, stop)`` of the model's kv heads this cache holds, when it is one tensor-parallel
        rank's shard (``kvxfer.shard.heads_of``). Declared on both sides, it lets shards holding different heads
        pair over the heads they share (prefill TP into another decode TP); undeclared, a layout pairs only with
        an equal one. ``layers``: likewise the ``[start, stop)`` of the model's layers this cache holds, when it
        is one pipeline stage's (its tensors are those layers, in order). ``packed``: the attention kernel lays
        out the inside of each block its own way, whatever the tensors' shape says (vLLM's CPU attention keeps a
        head's K and V as ``[2, block_size, head_size]`` in kernel order): whole blocks, heads and layers still
        move, but blocks of another size cannot map into or out of it by tokens (refused in the handshake).

        ``caches`` is one cross-layer tensor, a sequence of per-layer tensors, or a mapping layer name ->
        tensor; a layer may also be a (K, V) pair of tensors. Layers keep the given order on both sides.

        ``dims`` names what every dim of each tensor means, one letter per dim (``DIMS``): ``"BHND"`` is vLLM's
        ``[num_blocks, kv_heads, block_size, C]``, ``"BNHD"`` a ``[num_blocks, block_size, kv_heads, head_dim]``
        tensor, ``"KBNHD"`` ``[2, num_blocks, ...]``, ``"BLNHD"`` a cross-layer tensor. It fixes ``block_dim``
        (where B is), ``block_size`` (the size of N) and the layers a tensor holds (the size of L). Without it
        the dims are read from their sizes (``_infer_dims``): 4-D tensors with no ``block_size`` are vLLM's
        view by position; otherwise sizes that collide (``block_size == kv_heads``, say) raise ``LayoutError``
        asking for ``dims``. ``num_layers`` defaults to the layers the tensors hold.
        """
        if isinstance(caches, Mapping):
            given = list(caches.values())
        elif isinstance(caches, (list, tuple)):
            given = list(caches)
        else:
            given = [caches]
        per_layer = [[as_view(t) for t in (lay if isinstance(lay, (list, tuple)) else [lay])] for lay in given]
        views = [v for lay in per_layer for v in lay]
        if not views:
            raise LayoutError("no tensors given")
        if any(len(lay) > 2 for lay in per_layer):
            raise LayoutError("a layer is one tensor or a (K, V) pair")
        dtypes = {v.dtype for v in views}
        if len(dtypes) != 1:
            raise LayoutError(f"mixed dtypes {sorted(dtypes)}")
        devices = {v.device for v in views}
        if len(devices) != 1:
            raise LayoutError(f"tensors on several devices {sorted(devices)}")
        v0 = views[0]
        if dims is not None:
            _check_dims(dims, v0.shape, False)
            if block_dim is not None and block_dim % len(dims) != dims.index("B"):
                raise LayoutError(f"block_dim {block_dim} disagrees with dims {dims!r}")
            block_dim = dims.index("B")
            if block_size is None:
                if "N" not in dims:
                    raise LayoutError(f"dims {dims!r} has no N (token) dim: pass block_size")
                block_size = v0.shape[dims.index("N")]
            if num_layers is None and "L" in dims:
                num_layers = len(per_layer) * v0.shape[dims.index("L")]
        block_dim = 0 if block_dim is None else block_dim
        if not -len(v0.shape) <= block_dim < len(v0.shape):
            raise LayoutError(f"block_dim {block_dim} out of range for a {len(v0.shape)}-D tensor")
        if block_size is None:  # neither given nor named by dims: vLLM's view, by position
            if len(v0.shape) != 4 or block_dim % 4 != 0:
                raise LayoutError("block_size is needed unless tensors are 4-D [num_blocks, heads, block_size, C]")
            dims, block_size = VLLM_DIMS, v0.shape[2]
        n_layers = num_layers if num_layers is not None else len(per_layer)
        if n_layers <= 0 or n_layers % len(per_layer):
            raise LayoutError(f"{len(per_layer)} layer entries cannot hold {n_layers} layers")
        held = n_layers // len(per_layer)  # layers inside each tensor

        regions = merge_regions(views)
        starts = np.array([r.ptr for r in regions])
        seg_region, seg_offset, seg_stride, seg_bytes = [], [], [], []
        nblocks, entries = None, []
        for lay in per_layer:
            parts = []
            for v in lay:
                bd = block_dim % len(v.shape)
                if dims is None:
                    roles = _infer_dims(v.shape, bd, block_size, held, len(lay) == 2)
                else:
                    roles = _check_dims(dims, v.shape, len(lay) == 2)
                _check_sizes(roles, v.shape, block_size, held)
                nb, stride, chunk, bases, stream = _segments_of(v, bd)
                if nblocks not in (None, nb):
                    raise LayoutError(f"tensors disagree on the number of blocks ({nblocks} vs {nb})")
                nblocks = nb
                parts.append(_merge([(roles[d], v.shape[d]) for d in stream]))
                for base in bases:
                    r = int(np.searchsorted(starts, base, side="right") - 1)
                    seg_region.append(r)
                    seg_offset.append(base - regions[r].ptr)
                    seg_stride.append(stride)
                    seg_bytes.append(chunk)
            entries.append(_repeat("K", parts) if len(parts) == 2 else parts[0])
        assert nblocks is not None  # every layer entry holds a tensor
        if len(seg_bytes) > MAX_SEGMENTS:
            raise LayoutError(f"{len(seg_bytes)} segments exceed the limit of {MAX_SEGMENTS}")
        if why := _shared_memory(regions, seg_region, seg_offset, seg_stride, seg_bytes, nblocks):
            # not refused: a layout made only to compare fingerprints may alias; bytes moved through it would not
            log.warning("kvxfer layout: %s; a transfer lands one layer's bytes over another's", why)
        total = int(sum(seg_bytes))
        if total % n_layers:
            raise LayoutError(f"{total} bytes per block do not split into {n_layers} layers")
        fp = wire.Fingerprint(
            version=wire.VERSION,
            dtype=dtypes.pop(),
            block_size=int(block_size),
            num_layers=int(n_layers),
            layer_bytes=total // n_layers,
            block_bytes=total,
            order=_text(_repeat("L", entries)),
        )
        return cls(
            regions, seg_region, seg_offset, seg_stride, seg_bytes, nblocks, fp, tuple(views), heads, layers, packed
        )

    def desc(self) -> wire.LayoutDesc:
        """What a peer needs to address this layout (sent in the handshake)."""
        return wire.LayoutDesc(
            num_blocks=self.num_blocks,
            regions=[wire.RegionDesc(r.ptr, r.nbytes, r.device) for r in self.regions],
            seg_region=self.seg_region.tolist(),
            seg_offset=self.seg_offset.tolist(),
            seg_stride=self.seg_stride.tolist(),
            seg_bytes=self.seg_bytes.tolist(),
            fingerprint=self.fingerprint,
            heads=None if self.heads is None else list(self.heads),
            layers=None if self.layers is None else list(self.layers),
        )

    @classmethod
    def from_desc(cls, d: wire.LayoutDesc) -> KVLayout:
        """A peer's layout, checked for internal consistency (it is untrusted input)."""
        if len(d.regions) > MAX_SEGMENTS:
            raise LayoutError("too many regions")
        regions = [Region(r.ptr, r.nbytes, r.device) for r in d.regions]
        heads = None if d.heads is None else (d.heads[0], d.heads[1])
        layers = None if d.layers is None else (d.layers[0], d.layers[1])
        segs = (d.seg_region, d.seg_offset, d.seg_stride, d.seg_bytes)
        return cls(regions, *segs, d.num_blocks, d.fingerprint, (), heads, layers)

    def __repr__(self) -> str:
        fp = self.fingerprint
        return (
            f"KVLayout({self.num_blocks} blocks x {self.block_bytes} B, {self.num_segments} segments, "
            f"{len(self.regions)} regions, {fp.num_layers} layers, {fp.dtype}, order {fp.order})"
        )


def _check_sizes(roles: str, shape: tuple, block_size: int, held: int) -> None:
    """N and L must have the sizes the rest of the description gives them. A tensor holding several layers needs
    its L dim; one without an N dim holds its tokens inside another dim, opaquely (say, ``"BD"`` for raw bytes)."""
    for role, want, what in (("N", block_size, "block_size"), ("L", held, "layers per tensor")):
        got = shape[roles.index(role)] if role in roles else None if role == "N" else 1
        if got not in (None, want):
            raise LayoutError(f"dims {roles!r} of shape {shape}: the {role} dim has size {got}, but {what} is {want}")


def _int64(what: str, values) -> np.ndarray:
    """``values`` as int64, refusing (not wrapping) what does not fit."""
    try:
        return np.asarray(values, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        raise LayoutError(f"{what} out of range") from None


def check_compatible(local: wire.Fingerprint, remote: wire.Fingerprint) -> None:
    """Raise ``IncompatibleError`` naming every field the two sides disagree on."""
    diffs = [
        f"{name}: local {getattr(local, name)!r} != remote {getattr(remote, name)!r}"
        for name in local.__struct_fields__
        if getattr(local, name) != getattr(remote, name)
    ]
    if diffs:
        raise IncompatibleError("incompatible KV layouts: " + "; ".join(diffs))


def order_dims(fp: wire.Fingerprint) -> list[tuple[str, int]]:
    """The fingerprint's ``order`` as (role, size) pairs, outermost first; an order whose parts differ (spelled
    ``K[...]``) has no single size per role and raises ``IncompatibleError``."""
    dims = []
    for tok in fp.order.split():
        m = re.fullmatch(r"([A-Z])(\d+)", tok)
        if m is None:
            raise IncompatibleError(f"order {fp.order!r}: {tok!r} cannot be sliced (its parts differ)")
        dims.append((m.group(1), int(m.group(2))))
    return dims
