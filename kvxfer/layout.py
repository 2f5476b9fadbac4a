"""Paged-KV geometry: which bytes of registered memory hold block ``b``.

A layout is a list of *segments*. Segment ``s`` holds ``seg_bytes[s]`` contiguous bytes of every block, at
``regions[seg_region[s]].ptr + seg_offset[s] + b * seg_stride[s]``. The concatenation of a block's segments in
order is the block's *byte stream*; two layouts are compatible when their streams mean the same bytes (same
fingerprint), however differently the two sides split them into segments.

The geometry is derived from each tensor's shape and byte strides, never from an assumed layout: the block
dimension picks the block stride, dimensions laid out inside a block must be dense (they form the segment), and
dimensions laid out outside the block dimension (K/V in ``[2, num_blocks, ...]``, heads in an HND cache whose
heads are outermost) each add segments.
"""

from __future__ import annotations

import itertools
from typing import Mapping, Sequence

import numpy as np

from . import wire
from .errors import IncompatibleError, LayoutError
from .memory import HOST, Region, TensorView, as_view, merge_regions

MAX_SEGMENTS = 1 << 16


def _segments_of(view: TensorView, block_dim: int) -> tuple[int, int, int, list[int], tuple[int, ...]]:
    """(num_blocks, block stride, chunk bytes, segment base addresses, inner sizes in memory order)."""
    nd = len(view.shape)
    if not -nd <= block_dim < nd:
        raise LayoutError(f"block_dim {block_dim} out of range for a {nd}-D tensor")
    block_dim %= nd
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
    for st, n, d in sorted([(bstride, nblocks, block_dim)] + outer):
        if n > 1 and st < extent:
            raise LayoutError(f"dim {d} overlaps the block contents (stride {st} < extent {extent})")
        extent = st * (n - 1) + extent
    outer.sort(key=lambda t: t[2])  # stream order follows logical dim order (K before V, head 0 first, ...)
    bases = [view.ptr + sum(i * st for i, (st, _, _) in zip(idx, outer))
             for idx in itertools.product(*(range(n) for _, n, _ in outer))]
    order = tuple(n for _, n, _ in sorted(inner, reverse=True))
    return nblocks, (bstride if nblocks > 1 else chunk), chunk, bases, order


class KVLayout:
    """Where every block of a paged KV cache lives, local (with the tensors kept alive) or remote (a peer's)."""

    def __init__(self, regions: Sequence[Region], seg_region, seg_offset, seg_stride, seg_bytes,
                 num_blocks: int, fingerprint: wire.Fingerprint, owners: tuple = ()):
        self.regions = list(regions)
        self.seg_region = np.asarray(seg_region, dtype=np.int64)
        self.seg_offset = np.asarray(seg_offset, dtype=np.int64)
        self.seg_stride = np.asarray(seg_stride, dtype=np.int64)
        self.seg_bytes = np.asarray(seg_bytes, dtype=np.int64)
        self.num_blocks = int(num_blocks)
        self.fingerprint = fingerprint
        self._owners = owners
        self._check()

    @property
    def num_segments(self) -> int:
        return len(self.seg_bytes)

    @property
    def block_bytes(self) -> int:
        return int(self.seg_bytes.sum())

    @property
    def device(self) -> int:
        """HOST when every region is host memory, else the CUDA ordinal of the first device region."""
        return next((r.device for r in self.regions if r.device != HOST), HOST)

    def _check(self) -> None:
        n = self.num_segments
        if not 0 < n <= MAX_SEGMENTS:
            raise LayoutError(f"a layout needs 1..{MAX_SEGMENTS} segments, got {n}")
        if not (len(self.seg_region) == len(self.seg_offset) == len(self.seg_stride) == n):
            raise LayoutError("segment arrays differ in length")
        if self.num_blocks <= 0:
            raise LayoutError("a layout needs at least one block")
        if (self.seg_bytes <= 0).any() or (self.seg_offset < 0).any() or (self.seg_stride < 0).any():
            raise LayoutError("segment sizes, offsets and strides must be positive")
        if (self.seg_region < 0).any() or (self.seg_region >= len(self.regions)).any():
            raise LayoutError("segment names a region that does not exist")
        sizes = np.array([r.nbytes for r in self.regions], dtype=np.int64)[self.seg_region]
        end = self.seg_offset + (self.num_blocks - 1) * self.seg_stride + self.seg_bytes
        if (end > sizes).any():
            raise LayoutError("a segment runs past the end of its region")
        fp = self.fingerprint
        if fp.block_bytes != self.block_bytes:
            raise LayoutError(f"fingerprint says {fp.block_bytes} bytes per block, segments hold {self.block_bytes}")

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_tensors(cls, caches, *, block_dim: int = 0, block_size: int | None = None,
                     num_layers: int | None = None, order: str | None = None) -> "KVLayout":
        """Describe a KV cache.

        ``caches`` is one cross-layer tensor, a sequence of per-layer tensors, or a mapping layer name ->
        tensor; a layer may also be a (K, V) pair of tensors. Layers keep the given order on both sides.
        ``block_size`` (tokens per block) defaults to ``shape[2]`` of a 4-D vLLM view
        ``[num_blocks, kv_heads, block_size, C]``. ``order`` names the content order of a block for the
        fingerprint; by default it is derived from the sizes of the in-block dimensions in memory order.
        """
        if isinstance(caches, Mapping):
            layers = list(caches.values())
        elif isinstance(caches, (list, tuple)):
            layers = list(caches)
        else:
            layers = [caches]
        per_layer = [[as_view(t) for t in (lay if isinstance(lay, (list, tuple)) else [lay])] for lay in layers]
        views = [v for lay in per_layer for v in lay]
        if not views:
            raise LayoutError("no tensors given")
        dtypes = {v.dtype for v in views}
        if len(dtypes) != 1:
            raise LayoutError(f"mixed dtypes {sorted(dtypes)}")
        devices = {v.device for v in views}
        if len(devices) != 1:
            raise LayoutError(f"tensors on several devices {sorted(devices)}")
        regions = merge_regions(views)
        starts = np.array([r.ptr for r in regions])
        seg_region, seg_offset, seg_stride, seg_bytes = [], [], [], []
        nblocks, orders = None, []
        for v in views:
            nb, stride, chunk, bases, inner = _segments_of(v, block_dim)
            if nblocks not in (None, nb):
                raise LayoutError(f"tensors disagree on the number of blocks ({nblocks} vs {nb})")
            nblocks = nb
            orders.append(inner)
            for base in bases:
                r = int(np.searchsorted(starts, base, side="right") - 1)
                seg_region.append(r)
                seg_offset.append(base - regions[r].ptr)
                seg_stride.append(stride)
                seg_bytes.append(chunk)
        if len(seg_bytes) > MAX_SEGMENTS:
            raise LayoutError(f"{len(seg_bytes)} segments exceed the limit of {MAX_SEGMENTS}")
        if block_size is None:
            v0 = views[0]
            if len(v0.shape) != 4 or block_dim % 4 != 0:
                raise LayoutError("block_size is needed unless tensors are 4-D [num_blocks, heads, block_size, C]")
            block_size = v0.shape[2]
        n_layers = num_layers if num_layers is not None else len(per_layer)
        total = int(sum(seg_bytes))
        if n_layers <= 0 or total % n_layers:
            raise LayoutError(f"{total} bytes per block do not split into {n_layers} layers")
        if order is None:
            inner = orders[0]
            if len(views) == 1 and n_layers > 1 and inner and inner[0] == n_layers:
                inner = inner[1:]  # a cross-layer block holds the same per-layer content, layer after layer
            order = "x".join(map(str, inner)) if len(set(orders)) == 1 else "mixed"
        fp = wire.Fingerprint(version=wire.VERSION, dtype=dtypes.pop(), block_size=int(block_size),
                              num_layers=int(n_layers), layer_bytes=total // n_layers, block_bytes=total,
                              order=order)
        return cls(regions, seg_region, seg_offset, seg_stride, seg_bytes, nblocks, fp, tuple(views))

    def desc(self) -> wire.LayoutDesc:
        """What a peer needs to address this layout (sent in the handshake)."""
        return wire.LayoutDesc(
            num_blocks=self.num_blocks,
            regions=[wire.RegionDesc(r.ptr, r.nbytes, r.device) for r in self.regions],
            seg_region=self.seg_region.tolist(), seg_offset=self.seg_offset.tolist(),
            seg_stride=self.seg_stride.tolist(), seg_bytes=self.seg_bytes.tolist(),
            fingerprint=self.fingerprint,
        )

    @classmethod
    def from_desc(cls, d: wire.LayoutDesc) -> "KVLayout":
        """A peer's layout, checked for internal consistency (it is untrusted input)."""
        if len(d.regions) > MAX_SEGMENTS:
            raise LayoutError("too many regions")
        regions = [Region(r.ptr, r.nbytes, r.device) for r in d.regions]
        return cls(regions, d.seg_region, d.seg_offset, d.seg_stride, d.seg_bytes, d.num_blocks, d.fingerprint)

    def __repr__(self) -> str:
        fp = self.fingerprint
        return (f"KVLayout({self.num_blocks} blocks x {self.block_bytes} B, {self.num_segments} segments, "
                f"{len(self.regions)} regions, {fp.num_layers} layers, {fp.dtype}, order {fp.order})")


def check_compatible(local: wire.Fingerprint, remote: wire.Fingerprint) -> None:
    """Raise ``IncompatibleError`` naming every field the two sides disagree on."""
    diffs = [f"{name}: local {getattr(local, name)!r} != remote {getattr(remote, name)!r}"
             for name in local.__struct_fields__ if getattr(local, name) != getattr(remote, name)]
    if diffs:
        raise IncompatibleError("incompatible KV layouts: " + "; ".join(diffs))

