"""Loopback ports for servers a test starts next, picked under the kernel's ephemeral range.

A port the kernel hands out (any ``bind(0)`` or outgoing connection of the tests running beside, thousands of
them) can be taken between the pick and the server's own bind; in CI a vLLM server died of "Address already in
use" that way. Ports under the ephemeral range are only ever taken by a server that chose them."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def _below_ephemeral() -> tuple[int, int]:
    """Ports under the kernel's ephemeral range, or (0, 0) where that range leaves too few below it."""
    try:
        lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return (max(10000, lo - 12000), lo) if lo - 10000 >= 2000 else (0, 0)


_PORTS = _below_ephemeral()


def free_port(n: int = 1) -> int:
    """A port free now on loopback, the first of ``n`` consecutive free ones (a parallel prefill's ranks listen
    on ``base + rank``)."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(_PORTS[0], _PORTS[1] - n + 1) if _PORTS[1] else 0
        if base == 0 and n > 1:
            base = rng.randrange(20000, 60000 - n)
        socks: list[socket.socket] = []
        try:
            for k in range(n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + k if base else 0))
            return socks[0].getsockname()[1]
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free consecutive ports in {_PORTS}")
