"""A real Producer in a child process that records how each of its transfers ended, for fault tests and the
soak run. Each request's source blocks (taken from the producer's own free list) are filled with bytes only
that request carries (``content(req)``), so a consumer can check every arrived block and a byte written
outside its grant shows up as a corrupted neighbour.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import traceback

from conformance.kvspec import Spec
from procs import TRANSPORT_ONLY, PipedProcess, serve

from .blocks import BlockBytes, content


class _Untyped(logging.Handler):
    """Counts failures kvxfer only logged: an exception caught by a catch-all (a session, the reaper)."""

    def __init__(self, sink: list):
        super().__init__(logging.ERROR)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            e, tb = record.exc_info[1], traceback.extract_tb(record.exc_info[2])[-1:]
            where = f" at {tb[0].filename}:{tb[0].lineno}" if tb else ""
            self.sink.append(f"logged {type(e).__name__}: {record.getMessage()}: {e}{where}")


def watch_untyped(sink: list) -> None:
    """Record into ``sink`` every exception kvxfer logs and every thread that dies of one."""
    logging.getLogger("kvxfer").addHandler(_Untyped(sink))
    old = threading.excepthook

    def hook(args):
        sink.append(
            f"thread {args.thread.name if args.thread else '?'} died: {args.exc_type.__name__}: {args.exc_value}"
        )
        old(args)

    threading.excepthook = hook


def _main(conn, spec: Spec, transport: str, seed: int, options: dict) -> None:
    from kvxfer import FreeList, KVXferError, Producer

    tensors, kw, _, _ = spec.build(seed=seed)
    layout = spec.layout(tensors, kw)
    producer = Producer(layout, transport=transport, **options)
    blocks = BlockBytes(layout)
    free = FreeList(layout.num_blocks)
    untyped: list[str] = []
    watch_untyped(untyped)
    live: dict[str, object] = {}
    ended: list[dict] = []
    lock = threading.Lock()

    def record(req, t, src, error, typed=True):
        with lock:
            if live.get(req) is t:
                del live[req]
            ended.append(
                {
                    "req": req,
                    "status": getattr(getattr(t, "status", None), "value", "failed"),
                    "error": type(error).__name__ if error is not None else None,
                    "typed": typed,
                    "message": str(error) if error is not None else "",
                    "ended": time.monotonic(),
                    "deadline": getattr(t, "deadline", 0.0),
                }
            )
        if src is not None:
            free.free(src)

    def start(kind, address, req, n, kwargs, fill=True):
        src = free.allocate(n)
        if src is None:
            raise RuntimeError(f"producer has no {n} free source blocks")
        if fill:
            blocks.write(src, content(req, n, layout.block_bytes))
        cancel_after = kwargs.pop("cancel_after", None)
        at = time.monotonic()
        try:
            t = getattr(producer, kind)(address, req, src, **kwargs)
        except KVXferError as e:
            record(req, None, src, e)
            return None
        except Exception as e:
            untyped.append(f"{kind}() raised {type(e).__name__}: {e}")
            record(req, None, src, e, typed=False)
            return None
        with lock:
            live[req] = t

        def done(t):
            typed = t.error is None or isinstance(t.error, KVXferError)
            if not typed:
                untyped.append(f"{kind} {req} ended with {type(t.error).__name__}: {t.error}")
            record(req, t, src, t.error, typed)

        t.add_done_callback(done)
        if cancel_after is not None:
            threading.Timer(cancel_after, t.cancel, args=("cancelled by the test",)).start()
        return {"src": src.tolist(), "at": at}

    def cancel(req):
        with lock:
            t = live.get(req)
        return bool(t is not None and t.cancel("cancelled by the test"))

    def take_ended():
        with lock:
            out = list(ended)
            ended.clear()
        return out

    def state():
        with lock:
            pending = [(r, t.status.value, t.deadline) for r, t in live.items()]
        return {
            "live": pending,
            "leases": len(producer.leases.active),
            "free_src": free.num_free,
            "capacity": free.capacity,
            "untyped": list(untyped),
            "now": time.monotonic(),
        }

    try:
        serve(
            conn,
            layout.block_bytes,
            {"start": start, "cancel": cancel, "ended": take_ended, "state": state, "close_producer": producer.close},
        )
    finally:
        producer.close()


class ProducerChild(PipedProcess):
    """A kvxfer Producer in its own process over a seeded ``spec`` layout, driven through a pipe."""

    what = "producer process"

    def __init__(self, spec: Spec, transport: str, seed: int = 0, **options):
        super().__init__(_main, spec, transport, seed, {**TRANSPORT_ONLY, **options})
        self.block_bytes = self.ready

    def start(self, kind: str, address: str, req: str, n: int, fill: bool = True, **kwargs):
        """Push (``kind="push"``) or offer (``"offer"``) ``n`` blocks carrying ``content(req)`` (with ``fill``;
        else whatever the blocks hold); ``cancel_after`` seconds cancels it. Its source ids and start time
        (``{"src", "at"}``), or ``None`` if it failed at once."""
        return self.call("start", kind, address, req, n, kwargs, fill)

    def cancel(self, req: str) -> bool:
        return self.call("cancel", req)

    def ended(self) -> list[dict]:
        return self.call("ended")

    def state(self) -> dict:
        return self.call("state")

    def close_producer(self) -> None:
        self.call("close_producer")

    def wait_ended(self, req: str, timeout: float) -> dict:
        """How ``req`` ended (records of other requests are kept in ``self.seen``)."""
        end = time.monotonic() + timeout
        self.seen = getattr(self, "seen", {})
        while req not in self.seen:
            for r in self.ended():
                self.seen[r["req"]] = r
            if req in self.seen:
                break
            if time.monotonic() > end:
                raise AssertionError(f"{req} did not end within {timeout}s")
            time.sleep(0.01)
        return self.seen.pop(req)


class Throttle:
    """Slows a process down by stopping it for ``stop`` seconds out of every ``stop + run`` (SIGSTOP /
    SIGCONT from a thread), so that a transfer it serves takes long enough to end it midway."""

    def __init__(self, proc: PipedProcess, run: float = 0.001, stop: float = 0.049):
        self.proc, self.run, self.stop_s = proc, run, stop
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            while not self._halt.is_set():
                self.proc.stop()
                time.sleep(self.stop_s)
                self.proc.cont()
                time.sleep(self.run)
        except ProcessLookupError:
            pass

    def __enter__(self):
        self._thread.start()
        return self

    def freeze(self) -> None:
        """Stop slowing down and leave the process stopped (SIGCONT it later)."""
        self._halt.set()
        self._thread.join()
        self.proc.stop()

    def __exit__(self, *exc):
        self._halt.set()
        self._thread.join()
        with contextlib.suppress(ProcessLookupError):
            self.proc.cont()


def _consumer_main(conn, spec: Spec, transport: str, options: dict) -> None:
    from kvxfer import Consumer, DeadlineError

    from .guard import GuardedAllocator

    tensors, kw, _, _ = spec.build(fill=0)
    layout = spec.layout(tensors, kw)
    guard = GuardedAllocator(layout)
    rcvbuf = options.pop("rcvbuf", None)
    consumer = Consumer(layout, transport=transport, allocator=guard, **options)
    if rcvbuf:
        # connections accepted from now on inherit the listener's receive buffer (Linux copies it at accept)
        consumer._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    blocks = BlockBytes(layout)
    untyped: list[str] = []
    watch_untyped(untyped)

    def wait_bytes(n, timeout):
        """The granted blocks once ``n`` of them are granted and bytes are landing in them."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            ids = guard.allocated()
            if len(ids) == n and guard.touched(ids):
                return ids.tolist()
            time.sleep(0.0005)
        raise AssertionError("no bytes arrived")

    def wait_failed(ids, timeout):
        """Wait until no request is in flight; the share of ``ids``'s bytes that had landed at that moment."""
        end = time.monotonic() + timeout
        while consumer.stats()["inflight"]:
            if time.monotonic() > end:
                raise AssertionError("the request never ended on the consumer")
            time.sleep(0.0005)
        return guard.progress(ids)

    def get(timeout):
        try:
            a = consumer.get(timeout)
        except DeadlineError:
            return None
        return {
            "req": a.req,
            "ids": a.block_ids.tolist(),
            "intact": bool((blocks.read(a.block_ids) == content(a.req, len(a.block_ids), layout.block_bytes)).all()),
        }

    def settle(linger, timeout):
        """Release what arrived, wait until every block is back, then ``linger`` for late writers; the figures."""
        end = time.monotonic() + timeout
        while True:
            while (a := get(0)) is not None:
                consumer.release(a["req"])
            s = consumer.stats()
            if (s["inflight"] == s["handed"] == s["dying"] == 0 and guard.full) or time.monotonic() > end:
                break
            time.sleep(0.01)
        time.sleep(linger)
        return {
            "stats": consumer.stats(),
            "full": guard.full,
            "untyped": list(untyped),
            "after_free": [str(f) for f in guard.check()],
            "bad_frees": [str(f) for f in guard.bad_frees()],
        }

    try:
        serve(
            conn,
            consumer.address,
            {
                "wait_bytes": wait_bytes,
                "wait_failed": wait_failed,
                "get": get,
                "cancel": consumer.cancel,
                "release": consumer.release,
                "settle": settle,
                "stats": consumer.stats,
                "close_consumer": consumer.close,
            },
        )
    finally:
        consumer.close()


class ConsumerChild(PipedProcess):
    """A kvxfer Consumer over a ``GuardedAllocator`` in its own process (so a test can slow it down).

    ``rcvbuf``: the kernel receive buffer of every TCP connection it accepts (a host with smaller socket buffers
    than this one, whose ``tcp_rmem`` lets a stopped consumer's buffer fill with tens of MiB).
    """

    what = "consumer process"

    def __init__(self, spec: Spec, transport: str, **options):
        super().__init__(_consumer_main, spec, transport, options)
        self.address = self.ready

    def wait_bytes(self, n: int, timeout: float = 20.0) -> list[int]:
        return self.call("wait_bytes", n, timeout)

    def wait_failed(self, ids, timeout: float = 10.0) -> float:
        return self.call("wait_failed", ids, timeout)

    def get(self, timeout: float) -> dict | None:
        return self.call("get", timeout, timeout=timeout + 60)

    def cancel(self, req: str) -> bool:
        return self.call("cancel", req)

    def release(self, req: str) -> bool:
        return self.call("release", req)

    def close_consumer(self) -> None:
        self.call("close_consumer")

    def settle(self, linger: float = 0.2, timeout: float = 5.0) -> dict:
        return self.call("settle", linger, timeout)
