"""Different tokens per block on each side: a request's blocks map through token positions.

Token ``t`` of a request sits in source block ``src_ids[t // a.block_size]`` and lands in destination block
``dst_ids[t // b.block_size]``. With ``g`` the smaller block size and ``k`` the larger over it (block sizes must
be multiples), the request moves as *chunks* of ``g`` tokens: chunk ``c`` is the ``c``-th block of the side with
small blocks, whole, and slice ``c % k`` of block ``c // k`` of the other. A ``Paging`` holds ``k`` pairings
(pairing ``j`` moves a small block into slice ``j`` of a big one) and lists chunks slice-major: every chunk of
slice 0, then of slice 1, and so on. Each side finds its bytes from its own block ids and the chunk count alone,
so a stream transport's receiver never needs the sender's ids. Either side's last block may be partial: a big
source block's tokens past the request are not moved, and a big destination block's unused slots stay
untouched. Equal block sizes are the one-pairing case (``k == 1``: one chunk per block), planned exactly as
before. Tensor-parallel heads and layer parts compose: each slice's bytes are those of the part within it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import BlockError
from .layout import KVLayout
from .plan import Extents, Pairing, Plan, dim_ranges, extents, intersect, make_plan, pair
from .shard import Selection, check_pair, link_pairing, sides


@dataclass(frozen=True)
class Paging:
    """How the blocks of a producer's layout (side ``a``, ``src_block`` tokens each) map onto a consumer's
    (side ``b``, ``dst_block`` tokens each) for one selection of their bytes."""

    pairings: tuple[Pairing, ...]
    src_block: int
    dst_block: int

    @property
    def k(self) -> int:
        return len(self.pairings)

    @property
    def chunk_tokens(self) -> int:
        return min(self.src_block, self.dst_block)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk (a small block's share of the selection)."""
        return self.pairings[0].block_bytes

    def tokens(self, src_blocks: int) -> int:
        """A request's tokens when its ``src_blocks`` source blocks are all full (the default)."""
        return src_blocks * self.src_block

    def chunks(self, tokens: int) -> int:
        return -(-tokens // self.chunk_tokens)

    def src_blocks(self, tokens: int) -> int:
        return -(-tokens // self.src_block)

    def dst_blocks(self, tokens: int) -> int:
        return -(-tokens // self.dst_block)

    def nbytes(self, chunks: int) -> int:
        return chunks * self.chunk_bytes

    def check(self, tokens: int, src_blocks: int | None = None, dst_blocks: int | None = None) -> int:
        """The chunk count of a request of ``tokens`` tokens, after checking that it fills exactly the given
        block counts (``BlockError``)."""
        if tokens < 1:
            raise BlockError(f"a request of {tokens} tokens")
        for have, side, want in ((src_blocks, "source", self.src_blocks), (dst_blocks, "destination", self.dst_blocks)):
            if have is not None and have != want(tokens):
                raise BlockError(f"{tokens} tokens fill {want(tokens)} {side} blocks, not {have}")
        return self.chunks(tokens)

    def _slices(self, ids: np.ndarray, small: bool, chunks: int):
        """Per pairing ``j``: this side's block ids for the chunks of slice ``j``, in chunk order."""
        k = self.k
        need = chunks if small else -(-chunks // k)
        if len(ids) != need:
            raise BlockError(f"{len(ids)} blocks for {chunks} chunks of {self.chunk_tokens} tokens, need {need}")
        for j in range(min(k, chunks)):
            n = len(range(j, chunks, k))
            yield j, (ids[j::k][:n] if small else ids[:n])

    def alike(self, chunks: int | None, n: int) -> Pairing | None:
        """The one pairing when ``n`` blocks map one to one (equal block sizes: a chunk is a block), else None."""
        return self.pairings[0] if self.k == 1 and chunks in (None, n) else None

    def plan(self, src_ids, dst_ids, chunks: int | None, src_total: int, dst_total: int) -> Plan:
        """Both sides' extents of ``chunks`` chunks (None: one per block, equal block sizes only)."""
        one = self.alike(chunks, len(np.asarray(src_ids)))
        if one is not None:
            return make_plan(one, src_ids, dst_ids, src_total, dst_total)
        if chunks is None:
            raise BlockError("blocks of different sizes map through a token count")
        src, dst = np.asarray(src_ids, dtype=np.int64), np.asarray(dst_ids, dtype=np.int64)
        small_src = self.src_block <= self.dst_block
        pairs = zip(self._slices(src, small_src, chunks), self._slices(dst, not small_src, chunks), strict=True)
        plans = [make_plan(self.pairings[j], s, d, src_total, dst_total) for (j, s), (_, d) in pairs]
        return Plan(*(_concat([getattr(p, f) for p in plans]) for f in ("src", "dst")))

    def side(self, src: bool, ids, chunks: int | None, total: int) -> Extents:
        """One side's extents of ``chunks`` chunks in stream order (a stream transport's view: it never needs
        the other side's ids)."""
        a = np.asarray(ids, dtype=np.int64)
        p = self.alike(chunks, len(a))
        if p is not None:
            return extents(p.a if src else p.b, p.nbytes, a, total)
        if chunks is None:
            raise BlockError("blocks of different sizes map through a token count")
        small = (self.src_block <= self.dst_block) == src
        xs = [
            extents(self.pairings[j].a if src else self.pairings[j].b, self.pairings[j].nbytes, s, total)
            for j, s in self._slices(a, small, chunks)
        ]
        return _concat(xs)


def _concat(xs: list[Extents]) -> Extents:
    return Extents(*(np.concatenate([getattr(x, f) for x in xs]) for f in ("region", "offset", "nbytes")))


def paging(a: KVLayout, b: KVLayout, part: Selection | None = None) -> Paging:
    """The paging of producer layout ``a`` into consumer layout ``b`` for ``part`` (None: a whole request,
    or for shards the heads both hold). Equal block sizes pair as the handshake always did."""
    fa, fb = a.fingerprint, b.fingerprint
    if fa.block_size == fb.block_size:
        p = link_pairing(a, b) if part is None else part.pairing(a, b)
        return Paging((p,), fa.block_size, fb.block_size)
    check_pair(a, b, tokens=True)
    ra, rb = sides(a, b, part)
    g = min(fa.block_size, fb.block_size)
    big_is_a = fa.block_size > fb.block_size
    out = []
    for j in range(max(fa.block_size, fb.block_size) // g):
        cut = dim_ranges(fa if big_is_a else fb, "N", j * g, (j + 1) * g)
        sa, sb = (intersect(ra, cut), rb) if big_is_a else (ra, intersect(rb, cut))
        out.append(pair(a, b, sa, sb))
    return Paging(tuple(out), fa.block_size, fb.block_size)
