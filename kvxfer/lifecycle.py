"""What a Producer and a Consumer share: their transport, a reaper thread, a worker pool, and closing."""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import transports
from .errors import ClosedEmptyError, ClosedError, ConfigError, DeadlineError, KVXferError, TransportError
from .layout import KVLayout
from .transports.base import Transport

log = logging.getLogger("kvxfer")

REAP_INTERVAL = 0.02


LONGEST = 30 * 86400.0  # the longest deadline or lease a handle keeps: longer ones are taken as this long
FOREVER = 1e9  # a wait at least this long waits until the thing happens (the OS refuses longer timeouts)


def given_seconds(value, what: str) -> float:
    """A deadline, lease or timeout a caller gave: a finite number of seconds above zero, else ``ConfigError``
    (NaN and infinity would pass every comparison, or none, and end no wait); at most ``LONGEST`` (a larger
    one would overflow the OS's timeouts and the wire's milliseconds)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < float(value) < math.inf:
        raise ConfigError(f"{what} must be a finite number of seconds above zero, got {value!r}")
    return min(float(value), LONGEST)


def wait_limit(timeout) -> float | None:
    """A wait's ``timeout``: ``None`` (or infinity, or ``FOREVER`` and more) waits until the thing happens, zero
    or less only looks (as a deadline already reached would); anything but a number is a ``ConfigError``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) or math.isnan(timeout):
        raise ConfigError(f"timeout must be a number of seconds or None, got {timeout!r}")
    seconds = float(timeout)
    return None if seconds >= FOREVER else max(0.0, seconds)


class Mailbox:
    """What a handle hands to its user one at a time (arrivals, hand-offs): a queue whose ``get`` ends in
    time and, once the handle closed and nothing is left, raises ``ClosedError`` at once in every waiter."""

    _CLOSED = object()

    def __init__(self, what: str):
        self.what = what
        self.closed = False
        self._q: queue.Queue = queue.Queue()

    def put(self, item) -> None:
        self._q.put(item)

    def get(self, timeout=None):
        try:
            item = self._q.get(timeout=wait_limit(timeout))
        except queue.Empty:
            raise DeadlineError(f"no {self.what} within {timeout}s") from None
        if item is Mailbox._CLOSED:
            self._q.put(item)  # for the next waiter
            raise ClosedEmptyError(f"closed: no {self.what} will come")
        return item

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._q.put(Mailbox._CLOSED)

    def empty(self) -> bool:
        return self.qsize() == 0

    def qsize(self) -> int:
        return max(0, self._q.qsize() - self.closed)  # the closing mark is no item


def deadline_in(seconds: float) -> float:
    """The monotonic time ``seconds`` from now."""
    return time.monotonic() + seconds


def ms(seconds: float) -> int:
    """Seconds as the wire's milliseconds, at least 1."""
    return max(1, int(seconds * 1000))


@contextlib.contextmanager
def gate(lock: threading.Lock, deadline: float, what: str):
    """Hold ``lock`` (one handshake to a peer at a time), waiting no later than ``deadline``: a transfer queued
    behind another's handshake still ends at its own deadline (``DeadlineError``)."""
    if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise DeadlineError(f"{what}: the deadline passed while another handshake to that peer was running")
    try:
        yield
    finally:
        lock.release()


def _open_transports(names: list[str], layout: KVLayout, host, options: dict) -> dict[str, Transport]:
    """Every named transport that can serve this memory; the first failure is raised only when none can."""
    opened: dict[str, Transport] = {}
    first: KVXferError | None = None
    for name in names:
        try:
            opened[name] = transports.get(name)(layout, host, **options)
        except KVXferError as e:
            first = first or e
            if len(names) == 1:
                raise
    if not opened:
        raise first or TransportError("no transport available")
    return opened


class HandleBase:
    """A transport bound to this handle (its host), a reaper that enforces deadlines every 20 ms, and a
    worker pool; subclasses say what reaping and closing mean for their side."""

    def __init__(
        self,
        layout: KVLayout,
        transport: str,
        auth: str,
        transport_options: dict | None,
        peer_id: str | None,
        workers: int,
    ):
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ConfigError(f"workers must be a whole number of threads, 1 or more, got {workers!r}")
        auth = "" if auth is None else auth  # None: no token, as ""
        if not isinstance(auth, str):
            raise ConfigError(f'auth must be a token string ("" for none), got {type(auth).__name__}')
        if not isinstance(transport, str):
            raise ConfigError(f'transport must be a name ("tcp", "nixl", "auto", ...), got {transport!r}')
        self.layout = layout
        self.auth = auth
        self.peer_id = peer_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.transports = _open_transports(
            transports.candidates(transport), layout, self, dict(transport_options or {})
        )
        self.transport = next(iter(self.transports.values()))  # the preferred one
        self.transport_name = self.transport.name
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvxfer-worker")
        self.closed = False
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, daemon=True, name="kvxfer-reaper")

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_INTERVAL):
            try:
                self._reap(time.monotonic())
            except Exception:  # the reaper must survive anything to keep deadlines
                log.exception("kvxfer reaper")

    def _reap(self, now: float) -> None:
        raise NotImplementedError

    def _submit(self, fn, *args, dropped: Callable[[], None] = lambda: None) -> None:
        """Run ``fn(*args)`` on the worker pool, or ``dropped()`` if it never will: the pool shut down before
        (a thread that read a message before the close may still be handling it) or cancelled the task at the
        close while it waited for a worker. Whatever the task would have ended then ends in ``dropped``."""
        try:
            future = self.pool.submit(fn, *args)
        except RuntimeError:
            return dropped()
        future.add_done_callback(lambda f: dropped() if f.cancelled() else None)

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("handle is closed")

    def _close_common(self) -> None:
        self.closed = True
        self._stop.set()
        for t in self.transports.values():
            t.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError
