"""A transfer's byte stream cut into windows that move in parallel, one connection each."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

import numpy as np

from ...errors import PeerError, ProtocolError
from ...plan import Extents


def split(total: int, k: int) -> list[tuple[int, int]]:
    """``k`` nearly equal (offset, length) windows of ``total`` bytes (fewer when ``total`` is small)."""
    cuts = np.linspace(0, total, k + 1).astype(np.int64).tolist()
    return [(a, b - a) for a, b in itertools.pairwise(cuts) if b > a]


def run_all(fn: Callable[[int, int], None], windows: list[tuple[int, int]]) -> int:
    """Run ``fn(offset, length)`` for every window, the first in this thread; every window has ended when
    this returns (no byte of any window still lands). Raises the first error that is not a ``PeerError``
    (the others are usually its consequence), else the first."""
    errors: list[BaseException] = []

    def run(w: tuple[int, int]) -> None:
        try:
            fn(*w)
        except BaseException as e:  # re-raised below in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,), daemon=True, name="kvxfer-tcp-window") for w in windows[1:]]
    for th in threads:
        th.start()
    run(windows[0])
    for th in threads:
        th.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, PeerError)), errors[0])
    return sum(n for _, n in windows)


def checked(ext: Extents, offset: int, length: int) -> Extents:
    """The extents of stream bytes ``[offset, offset + length)``, which a peer named: checked first."""
    if offset < 0 or length <= 0 or offset + length > ext.total:
        raise ProtocolError(f"window [{offset}, +{length}) outside {ext.total} bytes")
    return ext.window(offset, length)
