"""Raw NIXL, no kvxfer: one thread posting a scattered READ against several lanes posting shares of it at once.

    python bench/nixl_lanes.py [PIECE_BYTES] [LANES] [REPEATS]     # default 16384 bytes, 2 lanes, 5 repeats

Two processes, 640 MiB in PIECE-sized pieces, both sides' orders permuted. One thread: one request of every
descriptor on one agent (what kvxfer did before lanes). Lanes: the descriptors cut into LANES runs, each one
request posted from its own thread on an agent of its own, all registered over the same buffer (what
``transports/nixl.py`` does for a large transfer). Milliseconds per READ, the first of each left out
(connection set-up).
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import statistics
import sys
import time
from typing import NamedTuple

import numpy as np

from kvxfer.bench.baselines import RawNixl
from kvxfer.transports import parallel

PIECE = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
LANES = int(sys.argv[2]) if len(sys.argv) > 2 else 2
REPEATS = int(sys.argv[3]) if len(sys.argv) > 3 else 5
N = (640 << 20) // PIECE


class _Region(NamedTuple):
    ptr: int
    nbytes: int


def _agents(name: str, lanes: int, fill: int) -> tuple[list[RawNixl], np.ndarray]:
    """One agent per lane, each over the same buffer filled with ``fill``."""
    buf = np.full(N * PIECE, fill, dtype=np.uint8)
    return [RawNixl(f"{name}-{i}", [_Region(buf.ctypes.data, buf.nbytes)]) for i in range(lanes)], buf


def _target(lanes: int, out, back) -> None:
    (raw,), buf = _agents(f"lanes-target-{lanes}", 1, 1)
    out.put((raw.metadata(), buf.ctypes.data))
    raw.add_peer(back.get())
    while back.empty():  # the passive side progresses, as kvxfer's poller does
        raw.poll()
        time.sleep(0.0005)


def _descs(base: int, order: np.ndarray) -> np.ndarray:
    d = np.zeros((len(order), 3), dtype=np.uint64)
    d[:, 0] = base + order.astype(np.uint64) * PIECE
    d[:, 1] = PIECE
    return d


def run(lanes: int) -> list[float]:
    out, back = mp.Queue(), mp.Queue()
    proc = mp.Process(target=_target, args=(lanes, out, back))
    proc.start()
    meta, remote_base = out.get()
    agents, buf = _agents(f"lanes-reader-{lanes}", lanes, 0)
    peers = [raw.add_peer(meta) for raw in agents]
    back.put(agents[0].metadata())  # the others only initiate: the target never needs to know them

    def read(lane: int, local: np.ndarray, remote: np.ndarray) -> None:
        agents[lane].xfer("READ", local, remote, peers[lane])

    rng = np.random.default_rng(1)
    times = []
    for _ in range(REPEATS + 1):
        local, remote = _descs(buf.ctypes.data, rng.permutation(N)), _descs(remote_base, rng.permutation(N))
        cuts = np.linspace(0, N, lanes + 1).astype(int)
        parts = [(i, local[a:b], remote[a:b]) for i, (a, b) in enumerate(itertools.pairwise(cuts))]
        t0 = time.perf_counter()
        parallel.run_all(read, parts, "nixl-lanes-bench")  # what transports/nixl.py runs its lanes with
        times.append(time.perf_counter() - t0)
    if not (buf == 1).all():
        raise SystemExit("the READs left bytes unread")
    back.put("stop")
    proc.join()
    return times[1:]


if __name__ == "__main__":
    mp.set_start_method("spawn")
    print(f"{N} permuted READs of {PIECE} B ({N * PIECE >> 20} MiB), {REPEATS} repeats")
    for k in (1, LANES):
        ms = [t * 1e3 for t in run(k)]
        each = " ".join(f"{m:.0f}" for m in ms)
        print(f"{k} lane{'s' if k > 1 else ' '}: median {statistics.median(ms):6.1f} ms   ({each})")
