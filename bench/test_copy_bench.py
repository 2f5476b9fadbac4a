"""Host copies between scattered pieces and one contiguous buffer (what the ucx transport's bounce buffers, inline
requests and host staging do), side by side with their baselines in one run:

- ``native``: ``HostEngine.gather`` (``_kvx.gather``: one memcpy per piece, GIL released; one thread, then one
  per core);
- ``numpy rows``: numpy's indexed copy over rows of the pieces' common size, the host engine's copy before
  (it goes through a temporary: two copies);
- ``memcpy``: one contiguous copy of the same bytes, the ceiling.

256 MiB of pieces in permuted order over a 512 MiB region.
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
