"""What the TCP transport's socket timeouts cost on a contiguous transfer, two processes, no kvxfer protocol.

    python bench/socket_timeouts.py [REPEATS]

Moves 512 MiB (32 views of 16 MiB, the shape of a Llama-3-8B 4k-token cache) three ways, interleaved: plain
``sendall``/``recv_into``; kvxfer's ``channel.send_views``/``recv_views`` on sockets with a 0.25 s timeout (what
``transports/tcp.py`` does, so it can look at cancel and deadlines; CPython then poll()s before every call); the
same helpers on blocking sockets.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import time

import numpy as np

from kvxfer.channel import recv_views, send_views

REPEATS = int(sys.argv[1]) if len(sys.argv) > 1 else 11
N, V = 512 << 20, 32
L = N // V
MODES = {"plain sendall / recv_into": ("p", None),
         "send_views / recv_views, 0.25 s timeouts": ("t", 0.25),
         "send_views / recv_views, blocking": ("b", None)}


def _views(mv):
    return [mv[i * L:(i + 1) * L] for i in range(V)]


def _receiver(q):
    srv = socket.create_server(("127.0.0.1", 0))
    q.put(srv.getsockname()[1])
    c, _ = srv.accept()
    buf = np.ones(N, np.uint8)
    mv = memoryview(buf)
    while True:
        c.settimeout(None)
        h = c.recv(1)
        if not h:
            return
        if h == b"p":
            got = 0
            while got < N:
                got += c.recv_into(mv[got:], N - got)
        else:
            c.settimeout(0.25 if h == b"t" else None)
            recv_views(c, _views(mv))
        c.settimeout(None)
        c.sendall(b"k")


def main():
    mp.set_start_method("spawn")
    q = mp.Queue()
    p = mp.Process(target=_receiver, args=(q,))
    p.start()
    s = socket.create_connection(("127.0.0.1", q.get()))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mv = memoryview(np.ones(N, np.uint8))
    res = {m: [] for m in MODES}
    for i in range(REPEATS + 1):
        for name, (h, timeout) in MODES.items():
            s.settimeout(None)
            s.sendall(h.encode())
            s.settimeout(timeout)
            t = time.perf_counter()
            if h == "p":
                s.sendall(mv)
            else:
                send_views(s, _views(mv))
            s.settimeout(None)
            s.recv(1)
            if i:
                res[name].append(N / (time.perf_counter() - t) / 1e9)
    s.close()
    p.join()
    for name, v in res.items():
        print(f"{name:42s} median {np.median(v):.2f} GB/s  {np.round(v, 2).tolist()}")


if __name__ == "__main__":
    main()
