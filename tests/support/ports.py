"""Loopback ports for servers a test starts next, picked outside the kernel's ephemeral range.

A port the kernel hands out (any ``bind(0)`` or outgoing connection of the tests running beside, thousands of
them) can be taken between the pick and the server's own bind; in CI a vLLM server died of "Address already in
use" that way. Ports outside the ephemeral range are only ever taken by a server that chose them."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _outside_ephemeral() -> tuple[int, int]:
    """A range of ports the kernel does not hand out on its own: under its ephemeral range, else above it, else
    (a range that leaves no room either side) every unprivileged port."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[:2])
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    if lo - 10000 >= 2000:
        return max(10000, lo - 12000), lo
    if 65535 - hi >= 2000:
        return hi + 1, 65536
    return 1024, 65536


_PORTS = _outside_ephemeral()


def free_port(n: int = 1) -> int:
    """A port free now on loopback, the first of ``n`` consecutive free ones (a parallel prefill's ranks listen
    on ``base + rank``)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(_PORTS[0], _PORTS[1] - n + 1)
        socks: list[socket.socket] = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free consecutive ports in [{_PORTS[0]}, {_PORTS[1]})")
