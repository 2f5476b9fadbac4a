"""Host copies between scattered pieces and one contiguous buffer (what the ucx transport's bounce buffers, inline
requests and host staging do), side by side with their baselines in one run:

- ``native``: ``HostEngine.gather`` (``_kvx.gather``: one memcpy per piece, GIL released; one thread, then one
  per core);
- ``numpy rows``: numpy's indexed copy over rows of the pieces' common size, the host engine's copy before
  (it goes through a temporary: two copies);
- ``memcpy``: one contiguous copy of the same bytes, the ceiling.

256 MiB of pieces in permuted order over a 512 MiB region. And a small request's inline bytes (1 and 16 blocks
of a 2-layer cache, K and V apart): ``Inline.pack`` straight from block ids against the extents path it replaced.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvxfer.memory import Region
from kvxfer.plan import Extents
from kvxfer.staging.engine import HostEngine, Slot, rows

TOTAL = 256 << 20
PIECES = [16 << 10, 1 << 20]


@pytest.fixture(scope="module")
def memory():
    mem = np.ones(2 * TOTAL, dtype=np.uint8)
    out = np.zeros(TOTAL, dtype=np.uint8)
    return mem, out


def _extents(piece: int) -> Extents:
    n = TOTAL // piece
    offset = np.random.default_rng(0).permutation(2 * n)[:n].astype(np.int64) * piece
    return Extents(np.zeros(n, np.int64), offset, np.full(n, piece, np.int64))


@pytest.mark.parametrize("piece", PIECES, ids=lambda p: f"{p >> 10}KiB")
@pytest.mark.parametrize("threads", [1, None], ids=["one-thread", "per-core"])
def test_native_gather(benchmark, memory, piece, threads):
    mem, out = memory
    engine = HostEngine([Region(mem.ctypes.data, mem.nbytes)], threads)
    ext = _extents(piece)
    benchmark(engine.gather, ext, Slot(out.data, TOTAL))
    benchmark.extra_info["GB/s"] = TOTAL / benchmark.stats.stats.median / 1e9
    first = int(ext.offset[0])
    assert (out[:piece] == mem[first : first + piece]).all()


@pytest.mark.parametrize("piece", PIECES, ids=lambda p: f"{p >> 10}KiB")
def test_numpy_rows_baseline(benchmark, memory, piece):
    mem, out = memory
    rw = rows(_extents(piece))
    u = rw.unit
    (_, src, dst), staging, view = rw.groups[0], out.reshape(-1, u), mem.reshape(-1, u)

    def copy() -> None:
        staging[dst] = view[src]

    benchmark(copy)
    benchmark.extra_info["GB/s"] = TOTAL / benchmark.stats.stats.median / 1e9


def test_memcpy_baseline(benchmark, memory):
    mem, out = memory
    benchmark(np.copyto, out, mem[:TOTAL])
    benchmark.extra_info["GB/s"] = TOTAL / benchmark.stats.stats.median / 1e9


# ---- a small request's inline bytes (kvxfer.inline): straight from block ids against through its extents ------
def _small_layout(blocks: int):
    from kvxfer.layout import KVLayout
    from kvxfer.paging import paging

    caches = {f"l{i}": np.ones((64, 2, 16, 2, 64), np.float16) for i in range(2)}
    layout = KVLayout.from_tensors(caches, dims="BKNHD")
    return layout, paging(layout, layout), np.arange(3, 3 + blocks, dtype=np.int64) * 2


@pytest.mark.parametrize("blocks", [1, 16])
def test_inline_pack_from_block_ids(benchmark, blocks):
    """``Inline.pack``: one native call over the piece table (``_kvx.gather_blocks``)."""
    from kvxfer.inline import Inline

    layout, pg, ids = _small_layout(blocks)
    data = benchmark(Inline(layout).pack, pg, ids, None)
    assert len(data) == blocks * layout.block_bytes


@pytest.mark.parametrize("blocks", [1, 16])
def test_inline_pack_through_extents_baseline(benchmark, blocks):
    """The same bytes the way they were packed before: the request's extents, then ``_kvx.gather``."""
    layout, pg, ids = _small_layout(blocks)
    engine = HostEngine(layout.regions)

    def pack() -> bytes:
        ext = pg.side(True, ids, None, layout.num_blocks)
        slot = engine.slot(ext.total)
        engine.gather(ext, slot)
        return bytes(slot.view)

    assert len(benchmark(pack)) == blocks * layout.block_bytes
