"""The copy-engine interface and its host implementation.

A copy engine moves one window of planned extents (``plan.Extents``: region, offset, length) between the
registered regions and a contiguous staging slot, without a Python object per piece: the host engine with one
native memcpy per piece, the CUDA engine over rows of the extents' common granularity (``rows``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from .. import _kvx
from ..errors import TransportError
from ..memory import HOST, Region
from ..plan import Extents
from ..transports import parallel


class Pending:
    """An issued copy; ``wait`` returns once its last byte landed. The host engine's copies are already done."""

    def wait(self) -> None:
        return None


DONE = Pending()


@dataclass
class Slot:
    """One staging buffer: ``view`` is the host bytes a socket sends from or receives into; ``extra`` holds
    what an engine keeps per slot (a CUDA stream, a device-side buffer)."""

    view: memoryview
    nbytes: int
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Rows:
    """A window of extents as row copies of ``unit`` bytes: per region, source rows and staging rows."""

    unit: int
    groups: list[tuple[int, np.ndarray, np.ndarray]]  # (region index, region rows, staging rows)


def rows(ext: Extents) -> Rows:
    """Cut ``ext`` into rows of the largest size dividing every offset and length (vectorised)."""
    offset, nbytes = ext.offset.astype(np.int64), ext.nbytes.astype(np.int64)
    unit = int(np.gcd.reduce(np.concatenate([offset, nbytes])))
    counts = nbytes // unit
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
    src = np.repeat(offset // unit, counts) + within
    where = np.repeat(ext.region.astype(np.int64), counts)
    dst = np.arange(total, dtype=np.int64)
    groups = []
    for r in np.unique(where).tolist():
        sel = where == r
        groups.append((r, src[sel], dst[sel]))
    return Rows(unit, groups)


class CopyEngine(ABC):
    """Gathers extents of the registered ``regions`` into a slot and scatters a slot back into them."""

    def __init__(self, regions: list[Region]):
        self.regions = regions

    @abstractmethod
    def slot(self, nbytes: int) -> Slot:
        """A new staging slot of ``nbytes`` host bytes (pinned where the engine copies by DMA)."""

    @abstractmethod
    def gather(self, ext: Extents, into: Slot) -> Pending:
        """Start copying the bytes of ``ext``, in order, to ``into[: ext.total]``."""

    @abstractmethod
    def scatter(self, src: Slot, ext: Extents) -> Pending:
        """Start copying ``src[: ext.total]`` into the bytes of ``ext``, in order."""


class HostEngine(CopyEngine):
    """Host memory to host memory: one memcpy per piece in native code (``_kvx.gather`` / ``scatter``), the GIL
    released, a large copy cut between ``threads`` threads (default one per core, up to 4)."""

    def __init__(self, regions: list[Region], threads: int | None = None):
        super().__init__(regions)
        self.bases = np.array([r.ptr for r in regions], dtype=np.uint64)
        self.sizes = np.array([r.nbytes for r in regions], dtype=np.int64)
        self.threads = parallel.per_core() if threads is None else max(1, int(threads))

    def slot(self, nbytes: int) -> Slot:
        return Slot(memoryview(bytearray(nbytes)), nbytes)

    def gather(self, ext: Extents, into: Slot) -> Pending:
        _kvx.gather(self.bases, self.sizes, ext.region, ext.offset, ext.nbytes, into.view, self.threads)
        return DONE

    def scatter(self, src: Slot, ext: Extents) -> Pending:
        _kvx.scatter(self.bases, self.sizes, ext.region, ext.offset, ext.nbytes, src.view, self.threads)
        return DONE


def engine_for(regions: list[Region]) -> CopyEngine:
    """The engine for these regions: host memory gets the host engine, one CUDA device the CUDA engine."""
    devices = {r.device for r in regions}
    if devices == {HOST} or not devices:
        return HostEngine(regions)
    if len(devices) > 1 or HOST in devices:
        raise TransportError(f"staging needs the regions on one device, not on {sorted(devices)}")
    from .cuda import CudaEngine

    return CudaEngine(regions, devices.pop())
