"""What a transfer is, as each side sees it: the producer's ``Transfer`` (a future) and the consumer's ``Arrival``."""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import CancelledError, DeadlineError, KVXferError
from .lifecycle import wait_limit
from .shard import Selection

log = logging.getLogger("kvxfer")

_attempts = itertools.count(1)  # every admission attempt has an id of its own: answers name it
_LAZY = threading.Lock()  # makes a transfer's cancel event once


class Status(str, enum.Enum):
    PENDING = "pending"  # waiting for admission (push) or for the consumer to read (pull)
    MOVING = "moving"  # bytes in flight
    COMMITTING = "committing"  # bytes moved, waiting for the other side to confirm
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Transfer:
    """One request's KV crossing, as the producer sees it: a future that always ends in time.

    ``wait`` blocks until it ended; ``add_done_callback`` (the ``concurrent.futures`` contract) runs a function
    when it ends, so a caller with many transfers in flight keeps no thread blocked per transfer.
    """

    _grace = 1.0  # seconds past its deadline by which it has surely ended (the reaper's rounds, a last move)

    def __init__(self, req: str, kind: str, address: str, src_ids: np.ndarray, block_bytes: int, deadline: float):
        self.req = req
        self.kind = kind
        self.address = address
        self.src_ids = src_ids
        self.dst_ids: np.ndarray | None = None
        self.gen = 0
        self.deadline = deadline
        self.status = Status.PENDING
        self.error: KVXferError | None = None
        self.nbytes = len(src_ids) * block_bytes
        self._descriptors: int | Callable[[], int] = 0
        self.attempt = next(_attempts)
        self.meta: dict[str, Any] = {}
        self.meta_size = 1  # encoded bytes of ``meta`` (an empty map takes one)
        self.override: np.ndarray | None = None
        self.part_of: Selection | None = None  # one part of a multi-sender push: only these layers or heads
        self.senders, self.part = 1, 0  # multi-sender: this push is part ``part`` of ``senders``
        self.tokens: int | None = None  # the request's tokens in its source blocks (None: every block full)
        self.chunks: int | None = None  # the other side pages with other tokens per block: chunks moved
        self.inline = False  # the push's bytes travel inside its Admit (kvxfer.inline)
        self.digests = b""
        self.timings: dict[str, float] = {"submitted": time.monotonic()}
        self._cancel: threading.Event | None = None  # made on first use: a small push never needs one
        self._done = False  # set once, under ``_lock``, when it ended
        self._ended: threading.Event | None = None  # made for the first waiter: an Event costs more than the rest
        self._lock = threading.Lock()
        self._on_cancel: Callable[[Transfer, str], None] | None = None
        self._callbacks: list[Callable[[Transfer], Any]] = []
        self.retry_busy = False  # a Busy answer is retried after its retry_after, until the deadline
        self.retry_at = 0.0  # when the next admission attempt goes out (0: none pending)
        self.busy_retries = 0  # Busy answers retried so far
        self.ticket: dict[str, Any] | None = None  # a hold: what a fetching consumer needs (JSON-safe)
        self.fetcher: Any = None  # a hold: the session of the consumer fetching it
        self.readers = 0  # a hold: how many consumers fetch it (their Fetch says; 0 until the first came)
        self.reads: list[Transfer] = []  # a hold fetched by several readers: one transfer per fetch
        self.hold: Transfer | None = None  # one of those reads: the hold it reads
        self._lease: Any = None  # a pull or one read of a hold: its lease (kvxfer.ledger.Lease)
        self._ending: tuple[KVXferError | None, Status | None] | None = None  # a hold's end, waiting for its reads

    def __repr__(self) -> str:
        return f"<Transfer {self.kind} {self.req!r} -> {self.address} {self.status.value}>"

    def done(self) -> bool:
        return self._done

    def _end_event(self) -> threading.Event:
        """The event a waiter blocks on, made on first use (set at once if the transfer ended before)."""
        with self._lock:
            if self._ended is None:
                self._ended = threading.Event()
                if self._done:
                    self._ended.set()
            return self._ended

    @property
    def cancel_event(self) -> threading.Event:
        """Set once the transfer failed or was cancelled: what a mover checks between pieces."""
        ev = self._cancel
        if ev is None:
            with _LAZY:
                if self._cancel is None:
                    self._cancel = threading.Event()  # published first: ``_finish`` sets it from now on
                    if self.error is not None:  # ``_finish`` had set the error before it looked
                        self._cancel.set()
                ev = self._cancel
        return ev

    def wait_ended(self, timeout: float) -> bool:
        """Whether the transfer ended within ``timeout`` seconds (no error raised)."""
        return self._done or self._end_event().wait(wait_limit(timeout))

    def wait(self, timeout: float | None = None) -> Transfer:
        """Block until the transfer ended; raise its error, or ``DeadlineError`` if ``timeout`` passes first."""
        limit, asked = max(0.0, self.deadline - time.monotonic()) + self._grace, wait_limit(timeout)
        if not self._done and not self._end_event().wait(limit if asked is None else min(asked, limit)):
            raise DeadlineError(f"transfer {self.req!r} still {self.status.value} after waiting")
        if self.error is not None:
            raise self.error
        return self

    def add_done_callback(self, fn: Callable[[Transfer], Any]) -> None:
        """Call ``fn(transfer)`` once it ended: at once if it already has, else in the thread that ends it.
        An exception in ``fn`` is logged and ignored, as ``concurrent.futures`` does."""
        if not callable(fn):
            raise TypeError(f"a done callback must be callable, got {fn!r}")
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        self._call(fn)

    def _call(self, fn: Callable[[Transfer], Any]) -> None:
        try:
            fn(self)
        except Exception:  # a caller's callback must not break the transport
            log.exception("kvxfer done callback of %s", self.req)

    def result(self, timeout: float | None = None) -> Transfer:
        """``wait``, under the name ``concurrent.futures`` gives it."""
        return self.wait(timeout)

    def exception(self, timeout: float | None = None) -> KVXferError | None:
        """The error the transfer ended with (``None`` when done), waiting for the end like ``wait``."""
        try:
            self.wait(timeout)
        except KVXferError as e:
            if e is self.error:
                return e
            raise
        return None

    def cancel(self, reason: str = "cancelled by caller") -> bool:
        """Stop the transfer; the other side is told and both release what they hold."""
        if self._finish(CancelledError(reason), Status.CANCELLED):
            if self._on_cancel is not None:
                self._on_cancel(self, reason)
            return True
        return False

    @property
    def descriptors(self) -> int:
        """Descriptors the transfer cost after coalescing (planned again on first access, off the hot path)."""
        if callable(self._descriptors):
            self._descriptors = self._descriptors()
        return self._descriptors

    @property
    def seconds(self) -> float:
        end = self.timings.get("completed", time.monotonic())
        return end - self.timings["submitted"]

    @property
    def gbps(self) -> float:
        start = self.timings.get("admitted", self.timings["submitted"])
        end = self.timings.get("moved")
        return self.nbytes / (end - start) / 1e9 if end and end > start else 0.0

    def _mark(self, status: Status, stamp: str) -> None:
        with self._lock:
            if not self._done:
                self.status = status
                self.timings[stamp] = time.monotonic()

    def _finish(self, error: KVXferError | None, status: Status | None = None) -> bool:
        with self._lock:
            if self._done:
                return False
            self.error = error
            self.status = status or (Status.DONE if error is None else Status.FAILED)
            self.timings["completed"] = time.monotonic()
            if error is not None and self._cancel is not None:
                self._cancel.set()
            self._done = True
            if self._ended is not None:
                self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            self._call(fn)
        return True


@dataclass
class Arrival:
    """A request whose KV landed in the consumer's blocks: hand it to the decode runtime, ``release`` it after."""

    req: str
    block_ids: np.ndarray
    meta: dict[str, Any]
    nbytes: int
    gen: int
    peer: str
    kind: str
    digests: bytes = b""
    timings: dict[str, float] = field(default_factory=dict)
