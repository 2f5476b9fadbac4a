"""Buffer adapters: torch / cupy / numpy arrays (or a raw pointer) -> one neutral strided view.

kvxfer never copies the caller's KV cache; it needs the address, shape, byte strides, dtype and device of each
tensor, and the memory regions they span (what a transport registers). Views of one allocation (vLLM's CPU
cache is per-layer views of one tensor) collapse into one region.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from operator import itemgetter

import numpy as np

from .errors import LayoutError

HOST = -1  # device id of host memory


@dataclass(frozen=True)
class TensorView:
    """A strided array somewhere in memory. ``strides`` are in bytes; ``device`` is HOST or a CUDA ordinal."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    dtype: str
    device: int = HOST
    owner: object = field(default=None, repr=False, compare=False)

    def span(self) -> tuple[int, int]:
        """(first byte, one past the last byte) this view touches."""
        if any(s < 0 for s in self.strides):
            raise LayoutError("negative strides are not supported")
        if 0 in self.shape:
            return self.ptr, self.ptr
        last = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
        return self.ptr, self.ptr + last + self.itemsize


@dataclass(frozen=True)
class Region:
    """A contiguous range of registered memory."""

    ptr: int
    nbytes: int
    device: int = HOST

    @property
    def mem_type(self) -> str:
        return "DRAM" if self.device == HOST else "VRAM"


def _c_strides(shape, itemsize):
    strides, acc = [], itemsize
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _from_interface(obj, iface: dict, device: int) -> TensorView:
    dt = np.dtype(iface["typestr"])
    if dt.hasobject:  # pointers to Python objects: copied, they would be references nobody counts
        raise LayoutError(f"{dt} holds Python objects, not KV bytes")
    shape = tuple(int(n) for n in iface["shape"])
    strides = iface.get("strides")
    strides = _c_strides(shape, dt.itemsize) if strides is None else tuple(int(s) for s in strides)
    name = getattr(getattr(obj, "dtype", None), "name", None) or dt.name
    return TensorView(int(iface["data"][0]), shape, strides, dt.itemsize, name, device, obj)


def as_view(obj) -> TensorView:
    """Describe a torch tensor, a cupy/numba CUDA array, a numpy array or a TensorView."""
    if isinstance(obj, TensorView):
        return obj
    mod = type(obj).__module__.split(".")[0]
    if mod == "torch":
        dev = obj.device
        if dev.type not in ("cpu", "cuda"):
            raise LayoutError(f"unsupported torch device {dev}")
        size = obj.element_size()
        return TensorView(
            obj.data_ptr(),
            tuple(obj.shape),
            tuple(s * size for s in obj.stride()),
            size,
            str(obj.dtype).removeprefix("torch."),
            HOST if dev.type == "cpu" else (dev.index or 0),
            obj,
        )
    if hasattr(obj, "__cuda_array_interface__"):
        dev = getattr(getattr(obj, "device", None), "id", 0)
        return _from_interface(obj, obj.__cuda_array_interface__, int(dev))
    if isinstance(obj, np.ndarray):
        return _from_interface(obj, obj.__array_interface__, HOST)
    raise LayoutError(f"cannot describe {type(obj).__name__} as KV memory (want torch, cupy or numpy)")


def _allocation(view: TensorView) -> tuple[int, int] | None:
    """The allocation a device view lies in, where its library says (a torch storage, a cupy memory)."""
    storage = getattr(view.owner, "untyped_storage", None)
    if callable(storage):
        st = storage()
        return st.data_ptr(), st.nbytes()
    mem = getattr(getattr(view.owner, "data", None), "mem", None)
    if mem is not None and hasattr(mem, "ptr"):
        return int(mem.ptr), int(mem.size)
    return None


def merge_regions(views: list[TensorView]) -> list[Region]:
    """The minimal set of regions covering ``views``: overlapping spans on one device merge, and so do touching
    spans of host memory or of one device allocation. Touching device spans of two allocations stay apart:
    CUDA IPC maps one allocation at a time, and a region across two fails or lands bytes wrong."""
    spans = [(v.device, *v.span(), None if v.device == HOST else _allocation(v)) for v in views]
    spans.sort(key=itemgetter(0, 1, 2))
    out: list[tuple[int, int, int, tuple[int, int] | None]] = []
    for dev, lo, hi, alloc in spans:
        if out and _joins(out[-1], dev, lo, alloc):
            last = out[-1]
            out[-1] = (dev, last[1], max(last[2], hi), last[3])
        else:
            out.append((dev, lo, hi, alloc))
    return [Region(lo, hi - lo, dev) for dev, lo, hi, _ in out]


def _joins(last, dev: int, lo: int, alloc) -> bool:
    """Whether a span starting at ``lo`` extends region ``last`` (device, lo, hi, allocation)."""
    if last[0] != dev or lo > last[2]:
        return False
    return lo < last[2] or dev == HOST or (alloc is not None and alloc == last[3])


def host_buffer(region: Region) -> memoryview:
    """A writable byte view of host memory at ``region`` (the caller keeps the owner alive)."""
    if region.device != HOST:
        raise LayoutError("not host memory")
    return memoryview((ctypes.c_ubyte * region.nbytes).from_address(region.ptr)).cast("B")
