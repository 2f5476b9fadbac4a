"""A pull connection the producer shut down as the read it served ended, after the consumer had taken it back as
idle. Under load the producer's data thread can lose the CPU between the last byte of a read and the end of the
watch over it; the consumer's ``Released`` then ends the lease first, and the producer's watchdog shuts the
connection down for that reason. CI saw the next fetch on it fail with "connection closed by peer" (a vLLM decode
recomputed a prompt it should have loaded). Real producer and consumer over real sockets; the lost CPU is a
sleep in the producer's read server before it stops watching."""

import threading
import time

import numpy as np

from kvxfer import Consumer, KVLayout, Producer
from kvxfer.transports.tcp import watchdog

BLOCKS = 8


def _cache(fill: int) -> list[np.ndarray]:
    return [np.full((BLOCKS, 2, 16, 2, 32), fill, np.float16) for _ in range(2)]


def test_a_pull_connection_shut_as_its_read_ended_costs_the_next_read_nothing(monkeypatch):
    unwatch = watchdog.Watchdog.unwatch

    def late(self, token):
        if threading.current_thread().name == "kvxfer-tcp-serve_reads":  # the producer's side of a read
            time.sleep(4 * watchdog.WATCH)  # the consumer's Released lands, then the watchdog looks
        return unwatch(self, token)

    monkeypatch.setattr(watchdog.Watchdog, "unwatch", late)
    src, dst = _cache(0), _cache(0)
    for b in range(BLOCKS):
        for t in src:
            t[b] = b + 1
    one = {"transport_options": {"streams": 1}}  # one pull connection: the next read finds the one shut down
    with (
        Consumer(KVLayout.from_tensors(dst, dims="BKNHD"), transport="tcp", **one) as c,
        Producer(KVLayout.from_tensors(src, dims="BKNHD"), transport="tcp", inline_max=0, **one) as p,
    ):
        for i in range(4):
            t = p.offer(c.address, f"r{i}", [i, i + 1], lease=10)
            a = c.get(10)
            for s, d in zip(src, dst, strict=True):
                assert (d[a.block_ids] == s[[i, i + 1]]).all()
            c.release(a.req)
            t.wait(10)
            assert t.error is None, t.error
