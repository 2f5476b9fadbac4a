"""The CUDA copy engine: a window's pages are packed on the GPU into device staging, then one DMA copy moves
them to pinned host memory (and the reverse when receiving), on a CUDA stream per slot.

Packing runs the kernel of ``native/pack.cu`` (compiled through NVRTC by cupy, once per process) where cupy is
installed, else torch's indexed copies over the window's rows (``engine.rows``); ``packer`` says which.
scripts/gpu_check.py compares the two on a GPU.
"""

from __future__ import annotations

import importlib.resources
import warnings
from functools import cache
from pathlib import Path

import numpy as np

from ..errors import TransportError
from ..memory import Region
from ..plan import Extents
from .engine import CopyEngine, Pending, Slot, rows

PIECE = 64 << 10  # the kernel's largest piece: one CUDA block each, so a launch is evenly loaded


def kernel_source() -> str:
    """``native/pack.cu``: packaged as ``kvxfer.native``, or beside the package in a source checkout."""
    try:
        return (importlib.resources.files("kvxfer.native") / "pack.cu").read_text()
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).resolve().parents[2] / "native" / "pack.cu").read_text()


@cache
def _kernel(device: int):
    """The compiled pack kernel for ``device``, or None where cupy is missing or cannot compile it."""
    try:
        import cupy
    except ImportError:
        return None
    with cupy.cuda.Device(device):
        return cupy.RawModule(code=kernel_source()).get_function("kvx_copy_pieces")


def pieces(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, limit: int = PIECE) -> np.ndarray:
    """(3, n) uint64 source address, destination address, length of copies of at most ``limit`` bytes."""
    src, dst, nbytes = (np.asarray(a, dtype=np.uint64) for a in (src, dst, nbytes))
    counts = ((nbytes + np.uint64(limit - 1)) // np.uint64(limit)).astype(np.int64)
    first = np.cumsum(counts) - counts
    k = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(first, counts)).astype(np.uint64) * np.uint64(limit)
    left = np.repeat(nbytes, counts) - k
    return np.stack([np.repeat(src, counts) + k, np.repeat(dst, counts) + k, np.minimum(left, np.uint64(limit))])


class _Done(Pending):
    def __init__(self, event):
        self.event = event

    def wait(self) -> None:
        self.event.synchronize()


class _Device:
    """A raw device range as a CUDA array (torch and cupy both import ``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, rows: int, unit: int):
        self.__cuda_array_interface__ = {
            "shape": (rows, unit),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class CudaEngine(CopyEngine):
    """Device regions on CUDA device ``device`` to pinned host slots, through a device staging buffer."""

    def __init__(self, regions: list[Region], device: int, packer: str = "auto"):
        super().__init__(regions)
        try:
            import torch
        except ImportError:
            raise TransportError("staging CUDA memory needs torch with CUDA") from None
        if not torch.cuda.is_available():
            raise TransportError("staging CUDA memory needs a CUDA device, and torch sees none")
        self.torch, self.device = torch, device
        kernel = _kernel(device) if packer in ("auto", "kernel") else None
        if packer == "kernel" and kernel is None:
            raise TransportError("the pack kernel needs cupy (NVRTC) on this machine")
        self.kernel = kernel
        self.packer = "kernel" if kernel is not None else "torch"
        self._bases = np.array([r.ptr for r in regions], dtype=np.uint64)  # per chunk, only indexed

    def slot(self, nbytes: int) -> Slot:
        torch = self.torch
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{self.device}")
        view = memoryview(host.numpy()).cast("B")
        stream = torch.cuda.Stream(device=self.device)
        extra = {"host": host, "dev": dev, "stream": stream}
        if self.kernel is not None:
            import cupy

            with warnings.catch_warnings():  # cupy 14 prefers Stream.from_external; 13 has only this
                warnings.simplefilter("ignore", DeprecationWarning)
                extra["launch"] = cupy.cuda.ExternalStream(stream.cuda_stream, self.device)
        return Slot(view, nbytes, extra)

    def _pack(self, ext: Extents, staging_ptr: int, gather: bool, slot: Slot) -> None:
        """Copy between the extents and the device staging buffer, on the slot's stream."""
        base = self._bases[ext.region] + ext.offset.astype(np.uint64)
        stage = np.uint64(staging_ptr) + (np.cumsum(ext.nbytes) - ext.nbytes).astype(np.uint64)
        if self.kernel is not None:
            import cupy

            src, dst = (base, stage) if gather else (stage, base)
            p = pieces(src, dst, ext.nbytes)
            with cupy.cuda.Device(self.device), slot.extra["launch"]:  # launches and the table's copy go there
                table = cupy.asarray(p)
                n = p.shape[1]
                self.kernel((n,), (256,), (table[0], table[1], table[2], np.int64(n)))
            return
        torch = self.torch
        rw = rows(ext)
        u = rw.unit
        dev = f"cuda:{self.device}"
        staging = torch.as_tensor(_Device(staging_ptr, int(ext.total) // u, u), device=dev)
        for r, src_rows, dst_rows in rw.groups:
            reg = self.regions[r]
            mem = torch.as_tensor(_Device(reg.ptr, reg.nbytes // u, u), device=dev)
            s = torch.from_numpy(src_rows).to(dev, non_blocking=True)
            d = torch.from_numpy(dst_rows).to(dev, non_blocking=True)
            if gather:
                staging.index_copy_(0, d, mem.index_select(0, s))
            else:
                mem.index_copy_(0, s, staging.index_select(0, d))

    def _run(self, ext: Extents, slot: Slot, gather: bool) -> Pending:
        torch = self.torch
        host, dev, stream = slot.extra["host"], slot.extra["dev"], slot.extra["stream"]
        n = int(ext.total)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if gather:
                self._pack(ext, dev.data_ptr(), True, slot)
                host[:n].copy_(dev[:n], non_blocking=True)
            else:
                dev[:n].copy_(host[:n], non_blocking=True)
                self._pack(ext, dev.data_ptr(), False, slot)
            event = torch.cuda.Event()
            event.record(stream)
        return _Done(event)

    def gather(self, ext: Extents, into: Slot) -> Pending:
        return self._run(ext, into, True)

    def scatter(self, src: Slot, ext: Extents) -> Pending:
        return self._run(ext, src, False)
