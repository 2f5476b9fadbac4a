"""The pieces of one transfer run at once, one thread each (TCP windows, NIXL lanes)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence

from ..errors import PeerError

MAX = 4  # the most pieces one transfer runs at once by default


def per_core() -> int:
    """One piece per core, up to ``MAX``."""
    return max(1, min(MAX, os.cpu_count() or 1))


def run_all(fn: Callable[..., None], pieces: Sequence[tuple], name: str) -> None:
    """Run ``fn(*piece)`` for every piece, the first in this thread; every piece has ended when this returns
    (no byte of any still lands). Raises the first error that is not a ``PeerError`` (the others are usually
    its consequence), else the first."""
    errors: list[BaseException] = []

    def run(piece: tuple) -> None:
        try:
            fn(*piece)
        except BaseException as e:  # re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,), daemon=True, name=name) for p in pieces[1:]]
    for th in threads:
        th.start()
    run(pieces[0])
    for th in threads:
        th.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, PeerError)), errors[0])
