"""Producer processes for the receive-service tests: a kvxfer Producer in a child process, driven through a
pipe, with the few hooks these tests need (hold a granted push before it moves, retry on busy, send a
duplicate Done)."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from conformance.kvspec import Spec
from procs import PipedProcess, RemoteError, serve  # noqa: F401 - RemoteError is what the tests catch


def _main(conn, spec: Spec, transport: str, seed: int, options: dict) -> None:
    from kvxfer import BusyError, Producer, wire

    tensors, kw, _, _ = spec.build(seed=seed)
    producer = Producer(spec.layout(tensors, kw), transport=transport, **options)
    gate = threading.Event()
    gate.set()
    move = producer._move

    def held_move(s, t):  # "hold": a granted push waits here before moving a byte
        gate.wait(60)
        move(s, t)

    producer._move = held_move
    inflight, retrying = {}, {}

    def push(address, req, ids, kwargs, wait, retry):
        def attempt():
            end = time.monotonic() + 20
            while True:  # a producer's retry loop: back off as the consumer's Busy says
                t = inflight[req] = producer.push(address, req, np.asarray(ids), **kwargs)
                try:
                    return t.wait()
                except BusyError as e:
                    if time.monotonic() > end:
                        raise
                    time.sleep(e.retry_after)

        if retry:
            th = retrying[req] = threading.Thread(target=lambda: _quiet(attempt), daemon=True)
            th.start()
            return None
        t = inflight[req] = producer.push(address, req, np.asarray(ids), **kwargs)
        if wait:
            t.wait()
        return {"status": t.status.value, "gen": t.gen, "dst_ids": None if t.dst_ids is None else t.dst_ids.tolist()}

    def wait(req, timeout):
        if req in retrying:
            retrying.pop(req).join(timeout)
        t = inflight[req]
        t.wait(timeout)
        return {"status": t.status.value, "gen": t.gen}

    def redone(address, req):  # a duplicate Done for a transfer that already completed
        t = inflight[req]
        producer._sessions[address].send(wire.Done(req=t.req, gen=t.gen, nbytes=t.nbytes, meta=t.meta))

    try:
        serve(conn, None, {"push": push, "wait": wait, "hold": gate.clear, "go": gate.set, "redone": redone})
    finally:
        producer.close()


def _quiet(fn) -> None:
    with contextlib.suppress(Exception):  # "wait" reports the transfer's own error
        fn()


class Sender(PipedProcess):
    """A kvxfer Producer in its own process, its KV filled with bytes seeded by ``seed``."""

    what = "producer process"

    def __init__(self, spec: Spec, transport: str, seed: int = 0, **options):
        self.spec, self.seed = spec, seed
        super().__init__(_main, spec, transport, seed, options)

    def push(self, address, req, ids, wait=True, retry=False, **kwargs):
        return self.call("push", address, req, list(map(int, ids)), kwargs, wait, retry)
