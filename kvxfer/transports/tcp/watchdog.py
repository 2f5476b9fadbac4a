"""One thread that stops data moving on blocking sockets when its transfer must stop.

Data moves on blocking sockets: a socket timeout would make Python poll before every call and split the copy
into many short non-blocking calls (measured: about 9% of loopback goodput). Cancel, deadlines and failed
grants are enforced from this thread instead, by shutting the socket down under the mover.
"""

from __future__ import annotations

import itertools
import socket
import threading
from collections.abc import Callable

from ...errors import KVXferError
from ...sockets import mapped, shutdown

WATCH = 0.05  # how often the watchdog looks at the transfers moving on blocking sockets


class Watchdog:
    """Calls each watched ``check`` every ``WATCH`` seconds; the first reason it raises shuts the socket down."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[socket.socket, Callable[[], None]]] = {}
        self._why: dict[int, BaseException] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, sock: socket.socket, check: Callable[[], None]) -> int:
        with self._lock:
            token = next(self._ids)
            self._items[token] = (sock, check)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True, name="kvxfer-tcp-watchdog")
                self._thread.start()
        return token

    def unwatch(self, token: int) -> BaseException | None:
        """Stop watching; the reason the watchdog shut the socket down, if it did."""
        with self._lock:
            self._items.pop(token, None)
            return self._why.pop(token, None)

    def _loop(self) -> None:
        while not self._stop.wait(WATCH):
            with self._lock:
                items = list(self._items.items())
            for token, (sock, check) in items:
                try:
                    check()
                except BaseException as e:  # any reason to stop is recorded for the mover
                    with self._lock:
                        if self._items.pop(token, None) is None:
                            continue
                        self._why[token] = e
                    shutdown(sock)

    def guarded(self, sock: socket.socket, check: Callable[[], None], move: Callable[[], None]) -> None:
        """Run ``move()`` on ``sock`` in blocking mode, stopped early (with ``check``'s error) if it must."""
        token = self.watch(sock, check)
        watching = True
        try:
            with mapped("moving data"):
                sock.settimeout(None)
            move()
        except KVXferError:
            why, watching = self.unwatch(token), False
            if why is not None:
                raise why from None
            raise
        finally:
            if watching:
                why = self.unwatch(token)
                if why is not None:  # fired as the move ended: the socket is shut, the caller drops it
                    raise why

    def close(self) -> None:
        self._stop.set()
