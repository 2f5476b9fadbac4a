"""Where fragmented TCP loses: scattered pieces over one loopback socket, two processes, no kvxfer protocol.

    python bench/scatter_gather.py [PIECE_BYTES] [REPEATS]      # default 8192 bytes, 9 repeats

Moves 160 MiB three ways, interleaved: one contiguous ``sendall``/``recv_into``; the same bytes as PIECE-sized
pieces spaced 2x apart through kvxfer's own ``channel.send_views``/``recv_views`` (``sendmsg``/``recvmsg_into``
in batches of IOV_MAX views); and the same loops with each call's batch capped at 256 KiB.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time

import numpy as np

from kvxfer.sockets import _advance, recv_views, send_views

PIECE = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
REPEATS = int(sys.argv[2]) if len(sys.argv) > 2 else 9
N = 160 << 20
K = N // PIECE
MODES = ("plain contiguous", "kvxfer channel (IOV_MAX batches)", "batches capped at 256 KiB")


def _capped(send: bool):
    def run(sock, views, cap=256 << 10):
        i, n = 0, len(views)
        while i < n:
            j, acc = i, 0
            while j < n and j - i < 1024 and acc < cap:
                acc += len(views[j])
                j += 1
            batch = views[i:j]
            k = sock.sendmsg(batch) if send else sock.recvmsg_into(batch)[0]
            if k == 0:
                raise EOFError
            i = _advance(views, i, batch, k)

    return run


def _scattered(buf):
    mv = memoryview(buf)
    return [mv[2 * i * PIECE : (2 * i + 1) * PIECE] for i in range(K)]


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
        elif h == b"k":
            recv_views(c, _scattered(buf))
        else:
            _capped(False)(c, _scattered(buf))
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
            elif mode[0] == "k":
                send_views(s, _scattered(buf))
            else:
                _capped(True)(s, _scattered(buf))
            s.recv(1)
            if i:  # the first round warms up
                res[mode].append(N / (time.perf_counter() - t) / 1e9)
    s.close()
    p.join()
    for mode, v in res.items():
        print(f"{PIECE} B pieces, {mode:34s} median {np.median(v):.2f} GB/s  {np.round(v, 2).tolist()}")


if __name__ == "__main__":
    main()
