"""A transfer's byte stream cut into windows that move in parallel, one connection each."""

from __future__ import annotations

import itertools

import numpy as np

from ...errors import ProtocolError
from ...plan import Extents


def split(total: int, k: int) -> list[tuple[int, int]]:
    """``k`` nearly equal (offset, length) windows of ``total`` bytes (fewer when ``total`` is small)."""
    cuts = np.linspace(0, total, k + 1).astype(np.int64).tolist()
    return [(a, b - a) for a, b in itertools.pairwise(cuts) if b > a]


def checked(ext: Extents, offset: int, length: int) -> Extents:
    """The extents of stream bytes ``[offset, offset + length)``, which a peer named: checked first."""
    if offset < 0 or length <= 0 or offset + length > ext.total:
        raise ProtocolError(f"window [{offset}, +{length}) outside {ext.total} bytes")
    return ext.window(offset, length)
