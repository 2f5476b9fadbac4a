"""Deterministic random cache contents, and byte-exact verification of what arrived.

Both halves of the benchmark derive the source contents from one seed, so the consumer can check every
transferred byte without the producer shipping it a copy: block ``b`` of layer ``l`` holds the
``layer_block_bytes`` bytes of a random pool starting at an 8-byte aligned offset that is a bijective function
of ``(l, b)`` (an affine map modulo a power of two). Every layer-block is therefore distinct random data: a
byte written to the wrong block, the wrong layer or the wrong offset, a lost or a torn write all show up.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.lib.stride_tricks import as_strided

POOL_WORDS = 1 << 21  # 16 MiB of random words; distinct offsets for up to 2M layer-blocks
POISON = 0xA5  # what destination blocks hold before a transfer writes them
CHUNK_BYTES = 32 << 20  # verification works through this many bytes at a time


@dataclass
class Mismatch:
    """One layer-block whose bytes differ from what its source block holds."""

    layer: int
    src: int
    dst: int
    first_byte: int


@dataclass
class Report:
    checked_bytes: int = 0
    bad_blocks: int = 0
    examples: list[Mismatch] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.bad_blocks == 0

    def merge(self, other: Report) -> None:
        self.checked_bytes += other.checked_bytes
        self.bad_blocks += other.bad_blocks
        self.examples.extend(other.examples[: max(0, 5 - len(self.examples))])

    def describe(self) -> str:
        if self.ok:
            return f"{self.checked_bytes} bytes verified"
        ex = "; ".join(
            f"layer {m.layer} src block {m.src} -> dst block {m.dst} differs from byte {m.first_byte}"
            for m in self.examples
        )
        return f"{self.bad_blocks} layer-blocks wrong out of {self.checked_bytes} bytes checked ({ex})"


class Content:
    """The source contents of a cache of ``num_blocks`` blocks x ``layers`` layers, from ``seed``."""

    def __init__(self, seed: int, layers: int, num_blocks: int, layer_block_bytes: int):
        self.layers = layers
        self.num_blocks = num_blocks
        self.nbytes = layer_block_bytes
        rng = np.random.default_rng([seed, layers, num_blocks, layer_block_bytes])
        pad = -(-layer_block_bytes // 8) * 8
        self.pool = np.frombuffer(rng.bytes(POOL_WORDS * 8 + pad), dtype=np.uint8)
        self._mult = int(rng.integers(1, POOL_WORDS // 2)) * 2 + 1  # odd: a bijection modulo 2**21
        self._add = int(rng.integers(0, POOL_WORDS))
        self._windows = as_strided(self.pool, shape=(POOL_WORDS, layer_block_bytes), strides=(8, 1), writeable=False)

    def offsets(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """Word index into the pool where layer ``layer`` of each block in ``ids`` starts."""
        ids = np.asarray(ids, dtype=np.int64)
        return (self._mult * (layer * self.num_blocks + ids) + self._add) & (POOL_WORDS - 1)

    def expected(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """A (len(ids), layer_block_bytes) copy of what those source blocks hold in ``layer``."""
        return self._windows[self.offsets(layer, ids)]

    def fill(self, arrays: list[np.ndarray]) -> None:
        """Write the source contents into per-layer arrays (this also faults their pages in)."""
        for layer, arr in enumerate(arrays):
            flat = _rows(arr)
            for lo, hi in _chunks(len(flat), self.nbytes):
                flat[lo:hi] = self.expected(layer, np.arange(lo, hi))

    def verify(self, arrays: list[np.ndarray], dst_ids, src_ids) -> Report:
        """Compare destination blocks ``dst_ids`` of ``arrays`` with source blocks ``src_ids``, every byte."""
        dst_ids = np.asarray(dst_ids, dtype=np.int64)
        src_ids = np.asarray(src_ids, dtype=np.int64)
        if dst_ids.shape != src_ids.shape:
            raise ValueError(f"{len(dst_ids)} destination blocks for {len(src_ids)} source blocks")
        rep = Report()
        for layer, arr in enumerate(arrays):
            flat = _rows(arr)
            if flat.shape[1] != self.nbytes:
                raise ValueError(f"destination rows hold {flat.shape[1]} bytes, source {self.nbytes}")
            for lo, hi in _chunks(len(dst_ids), self.nbytes):
                got = flat[dst_ids[lo:hi]]
                want = self.expected(layer, src_ids[lo:hi])
                rep.checked_bytes += got.nbytes
                if np.array_equal(got, want):
                    continue
                diff = got != want
                rows = np.flatnonzero(diff.any(axis=1))
                rep.bad_blocks += len(rows)
                for r in rows[: max(0, 5 - len(rep.examples))].tolist():
                    rep.examples.append(
                        Mismatch(layer, int(src_ids[lo + r]), int(dst_ids[lo + r]), int(np.argmax(diff[r])))
                    )
        return rep


def poison(arrays: list[np.ndarray], ids=None) -> None:
    """Overwrite blocks ``ids`` (all blocks if None) of every layer with the poison byte."""
    for arr in arrays:
        flat = _rows(arr)
        if ids is None:
            flat[:] = POISON
        else:
            ids = np.asarray(ids, dtype=np.int64)
            for lo, hi in _chunks(len(ids), flat.shape[1]):
                flat[ids[lo:hi]] = POISON


def _rows(arr: np.ndarray) -> np.ndarray:
    """A (num_blocks, bytes per block) uint8 view of a C-contiguous per-layer array."""
    if not arr.flags.c_contiguous:
        raise ValueError("benchmark caches are C-contiguous per layer")
    return arr.reshape(arr.shape[0], -1).view(np.uint8)


def _chunks(n: int, row_bytes: int):
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for lo in range(0, n, step):
        yield lo, min(n, lo + step)
