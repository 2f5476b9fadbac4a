"""Real peer processes for the conformance suite: a producer or a consumer in a child process, driven
through a pipe. The parent holds the other side, so every test moves bytes between two processes."""

from __future__ import annotations

import time
import traceback

import numpy as np

from procs import PipedProcess, RemoteError

from .kvspec import Spec


def _producer_main(conn, spec: Spec, transport: str, seed: int, options: dict) -> None:
    from kvxfer import Producer

    tensors, kw, _, raw = spec.build(seed=seed)
    producer = Producer(spec.layout(tensors, kw), transport=transport, **options)
    inflight = {}
    conn.send(("ready", None))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "close":
                break
            if cmd in ("push", "offer"):
                address, req, ids, kwargs, wait = args
                t = getattr(producer, cmd)(address, req, np.asarray(ids), **kwargs)
                inflight[req] = t
                if wait:
                    t.wait()
                    conn.send(("ok", _summary(t)))
                else:
                    conn.send(("ok", None))
            elif cmd == "wait":
                (req, timeout) = args
                t = inflight[req]
                t.wait(timeout)
                conn.send(("ok", _summary(t)))
            elif cmd == "cancel":
                conn.send(("ok", inflight[args[0]].cancel()))
            elif cmd == "state":
                with producer._lock:
                    n = sum(len(s.transfers) for s in producer._sessions.values())
                conn.send(("ok", {"transfers": n, "leases": len(producer.leases.active)}))
            else:
                conn.send(("err", "ValueError", f"unknown command {cmd}"))
        except Exception as e:  # noqa: BLE001 - report to the parent, typed by name
            conn.send(("err", type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    producer.close()


def _summary(t) -> dict:
    return {"status": t.status.value, "nbytes": t.nbytes, "dst_ids": None if t.dst_ids is None else t.dst_ids.tolist(),
            "descriptors": t.descriptors}


PeerError = RemoteError  # what the conformance tests catch: an exception raised in the peer process


class ProducerProcess(PipedProcess):
    """A kvxfer Producer in its own process, filled with seeded random bytes."""

    what = "producer process"

    def __init__(self, spec: Spec, transport: str, seed: int = 0, **options):
        super().__init__(_producer_main, spec, transport, seed, options)

    def push(self, address, req, ids, wait=True, **kwargs):
        return self.call("push", address, req, list(map(int, ids)), kwargs, wait)

    def offer(self, address, req, ids, wait=True, **kwargs):
        return self.call("offer", address, req, list(map(int, ids)), kwargs, wait)

    pull = offer  # the producer's side of a pull is an offer


def _consumer_main(conn, spec: Spec, transport: str, options: dict) -> None:
    from kvxfer import Consumer

    tensors, kw, _, _ = spec.build(fill=0)
    consumer = Consumer(spec.layout(tensors, kw), transport=transport, **options)
    conn.send(("ready", consumer.address))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            break
        if cmd == "close":
            break
        if cmd == "stats":
            conn.send(("ok", consumer.stats()))
        elif cmd == "get":
            try:
                a = consumer.get(args[0])
                conn.send(("ok", {"req": a.req, "ids": a.block_ids.tolist()}))
            except Exception as e:  # noqa: BLE001
                conn.send(("err", type(e).__name__, str(e)))
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
