"""Real peer processes for the conformance suite: a producer or a consumer in a child process, driven
through a pipe. The parent holds the other side, so every test moves bytes between two processes."""

from __future__ import annotations

import time

import numpy as np

from procs import TRANSPORT_ONLY, PipedProcess, RemoteError, serve

from .kvspec import Spec


def _producer_main(conn, spec: Spec, transport: str, seed: int, options: dict) -> None:
    import threading

    from kvxfer import Producer, wire

    tensors, kw, _, _ = spec.build(seed=seed)
    producer = Producer(spec.layout(tensors, kw), transport=transport, **options)
    gate = threading.Event()
    gate.set()
    move = producer._move

    def held_move(s, t):  # fault injection ("hold"): a granted push waits here before moving a byte
        gate.wait(60)
        move(s, t)

    producer._move = held_move
    inflight = {}

    def start(kind, address, req, ids, kwargs, wait):
        t = inflight[req] = getattr(producer, kind)(address, req, np.asarray(ids), **kwargs)
        return _summary(t.wait()) if wait else None

    def wait(req, timeout):
        return _summary(inflight[req].wait(timeout))

    def keep(req, ids, kwargs):  # hold blocks for a consumer to fetch; its ticket
        t = inflight[req] = producer.hold(req, np.asarray(ids), **kwargs)
        return t.ticket

    def ended(req):
        t = inflight[req]
        return {"done": t.done(), "status": t.status.value, "error": type(t.error).__name__ if t.error else None}

    def redone(address, req):  # a duplicate Done for a transfer that already completed
        t = inflight[req]
        producer._sessions[address].send(wire.Done(req=t.req, gen=t.gen, nbytes=t.nbytes, meta=t.meta))

    try:
        serve(
            conn,
            producer.address,
            {
                "push": lambda *a: start("push", *a),
                "offer": lambda *a: start("offer", *a),
                "wait": wait,
                "hold": gate.clear,
                "go": gate.set,
                "redone": redone,
                "keep": keep,
                "ended": ended,
                "leases": lambda: len(producer.leases.active),
                "sessions": lambda: len(producer._sessions) + len(producer._fetchers),  # live: the dialed, the fetching
            },
        )
    finally:
        producer.close()


def _summary(t) -> dict:
    return {
        "status": t.status.value,
        "nbytes": t.nbytes,
        "gen": t.gen,
        "dst_ids": None if t.dst_ids is None else t.dst_ids.tolist(),
        "descriptors": t.descriptors,
    }


PeerError = RemoteError  # what the conformance tests catch: an exception raised in the peer process


class ProducerProcess(PipedProcess):
    """A kvxfer Producer in its own process, filled with seeded random bytes. Beside push and offer it answers
    ``call("wait", req, timeout)``, ``call("hold")`` / ``call("go")`` (granted pushes wait before moving a byte)
    and ``call("redone", address, req)`` (a duplicate Done). With ``listen=`` it also keeps blocks for a
    consumer to fetch (``keep``; ``address`` is where)."""

    what = "producer process"

    def __init__(self, spec: Spec, transport: str, seed: int = 0, **options):
        self.spec, self.seed = spec, seed
        super().__init__(_producer_main, spec, transport, seed, {**TRANSPORT_ONLY, **options})
        self.address = self.ready

    def keep(self, req, ids, **kwargs) -> dict:
        """``Producer.hold``: the ticket."""
        return self.call("keep", req, list(map(int, ids)), kwargs)

    def ended(self, req) -> dict:
        return self.call("ended", req)

    def push(self, address, req, ids, wait=True, **kwargs):
        return self.call("push", address, req, list(map(int, ids)), kwargs, wait)

    def offer(self, address, req, ids, wait=True, **kwargs):
        return self.call("offer", address, req, list(map(int, ids)), kwargs, wait)

    pull = offer  # the producer's side of a pull is an offer


def _consumer_main(conn, spec: Spec, transport: str, options: dict) -> None:
    from kvxfer import Consumer

    tensors, kw, _, _ = spec.build(fill=0)
    consumer = Consumer(spec.layout(tensors, kw), transport=transport, **options)

    def get(timeout):
        a = consumer.get(timeout)
        return {"req": a.req, "ids": a.block_ids.tolist()}

    try:
        serve(conn, consumer.address, {"stats": consumer.stats, "get": get})
    finally:
        consumer.close()


class ConsumerProcess(PipedProcess):
    """A kvxfer Consumer in its own process (for killing or stopping the consumer side)."""

    what = "consumer process"

    def __init__(self, spec: Spec, transport: str, **options):
        super().__init__(_consumer_main, spec, transport, options)
        self.address = self.ready


def wait_for(predicate, timeout: float = 10.0, interval: float = 0.01):
    """Poll ``predicate`` until it returns truthy; its last value, or AssertionError after ``timeout``."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)
