"""Where fragmented TCP loses: scattered pieces over one loopback socket, two processes, no kvxfer protocol.

    python bench/scatter_gather.py [PIECE_BYTES] [REPEATS]      # default 8192 bytes, 9 repeats

Moves 160 MiB three ways, interleaved: one contiguous ``sendall``/``recv_into`` (the baseline); the same bytes as
PIECE-sized pieces spaced 2x apart through kvxfer's native ``send_extents``/``recv_extents`` (what the TCP
transport runs: iovecs built in C from the extent arrays, GIL released); and through one Python memoryview per
piece into ``sendmsg``/``recvmsg_into`` (``send_views``/``recv_views``: the TLS path, and the TCP path before the
native layer).
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time

import numpy as np

from kvxfer.sockets import recv_extents, recv_views, send_extents, send_views

PIECE = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 9
N = 160 << 20
K = N // PIECE
MODES = ("plain contiguous", "native extents", "memoryviews")


def _views(buf):
    mv = memoryview(buf)
    return [mv[2 * i * PIECE : (2 * i + 1) * PIECE] for i in range(K)]


def _extents(buf):
    """(bases, sizes, region, offset, nbytes) of the same scattered pieces."""
    bases, sizes = np.array([buf.ctypes.data], np.uint64), np.array([buf.nbytes], np.int64)
    return bases, sizes, np.zeros(K, np.int64), np.arange(K, dtype=np.int64) * 2 * PIECE, np.full(K, PIECE, np.int64)


def _receiver(q):
    srv = socket.create_server(("127.0.0.1", 0))
    q.put(srv.getsockname()[1])
    c, _ = srv.accept()
    c.settimeout(None)
    buf = np.ones(2 * N, np.uint8)
    mv = memoryview(buf)
    while True:
        h = c.recv(1)
        if not h:
            return
        if h == b"p":
            got = 0
            while got < N:
                got += c.recv_into(mv[got:], N - got)
        elif h == b"n":
            recv_extents(c, *_extents(buf))
        else:
            recv_views(c, _views(buf))
        c.sendall(b"k")


def main():
    mp.set_start_method("spawn")
    q = mp.Queue()
    p = mp.Process(target=_receiver, args=(q,))
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get()))
    s.settimeout(None)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.ones(2 * N, np.uint8)
    mv = memoryview(buf)
    res = {m: [] for m in MODES}
    for i in range(REPEATS + 1):
        for mode in MODES:
            s.sendall(mode[0].encode())
            t = time.perf_counter()
            if mode[0] == "p":
                s.sendall(mv[:N])
            elif mode[0] == "n":
                send_extents(s, *_extents(buf))
            else:
                send_views(s, _views(buf))
            s.recv(1)
            if i:  # the first round warms up
                res[mode].append(N / (time.perf_counter() - t) / 1e9)
    s.close()
    p.join()
    base = np.median(res[MODES[0]])
    for mode, v in res.items():
        print(f"{PIECE} B pieces, {mode:18s} median {np.median(v):.2f} GB/s ({np.median(v) / base:.2f}x contiguous)"
              f"  {np.round(v, 2).tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
