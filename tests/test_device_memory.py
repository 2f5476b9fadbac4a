"""The CUDA path without a GPU: what can be checked here with a fake CUDA array (an object exposing
``__cuda_array_interface__`` over no real device memory). The real VRAM registration and CUDA IPC run on a
GPU machine through scripts/gpu_check.py."""

import numpy as np
import pytest

from kvxfer import KVLayout, TransportError
from kvxfer.memory import as_view


class FakeCudaArray:
    """Looks like a cupy array on device 1 to kvxfer; never dereferenced."""

    def __init__(self, shape, typestr="<f2", ptr=0x7F0000000000, strides=None):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": strides,
            "version": 3,
        }
        self.device = type("Dev", (), {"id": 1})()


def test_fake_cuda_array_is_device_memory():
    v = as_view(FakeCudaArray((4, 2, 16, 8)))
    assert v.device == 1 and v.itemsize == 2 and v.strides == (512, 256, 16, 2)


def test_fake_cuda_layout_registers_as_vram():
    lay = KVLayout.from_tensors([FakeCudaArray((4, 2, 16, 8), ptr=0x7F0000000000 + i * 2048) for i in range(2)])
    assert lay.device == 1
    # two touching arrays of unknown allocations stay two regions: CUDA IPC maps one allocation at a time
    assert [r.mem_type for r in lay.regions] == ["VRAM", "VRAM"]
    assert lay.desc().regions[0].device == 1


def test_views_of_one_device_allocation_merge_and_two_allocations_do_not():
    """Per-layer views of one cudaMalloc merge into one region; adjacent allocations (the caching allocator
    hands them out back to back) never do, as a region across two breaks CUDA IPC."""

    class Mem:
        def __init__(self, ptr, size):
            self.ptr, self.size = ptr, size

    def array(ptr, mem):
        a = FakeCudaArray((4, 2, 16, 8), ptr=ptr)
        a.data = type("Ptr", (), {"mem": mem})()
        return a

    one = Mem(0x7F0000000000, 4096)
    two = Mem(0x7F0000000000 + 4096, 4096)
    same = KVLayout.from_tensors([array(one.ptr, one), array(one.ptr + 2048, one)])
    assert [(r.ptr, r.nbytes) for r in same.regions] == [(one.ptr, 4096)]
    apart = KVLayout.from_tensors([array(one.ptr, one), array(two.ptr, two)])
    assert [(r.ptr, r.nbytes) for r in apart.regions] == [(one.ptr, 2048), (two.ptr, 2048)]


def test_tcp_over_a_fake_cuda_layout_needs_a_gpu_for_its_staging():
    """TCP stages CUDA memory through pinned host buffers; on a machine without a GPU it says so at once."""
    from kvxfer.transports.tcp import TcpTransport

    lay = KVLayout.from_tensors([FakeCudaArray((4, 2, 16, 8))])
    with pytest.raises(TransportError, match="CUDA"):
        TcpTransport(lay, host=None)


def test_nixl_descriptors_carry_the_device_id():
    pytest.importorskip("nixl_cu13")
    from kvxfer.plan import Extents
    from kvxfer.transports.nixl import NixlLink

    ext = Extents(np.array([0, 1]), np.array([0, 64]), np.array([32, 32]))
    d = NixlLink._descs(ext, np.array([1000, 5000], dtype=np.uint64), np.array([1, 3], dtype=np.uint64))
    assert d.dtype == np.uint64 and d.tolist() == [[1000, 32, 1], [5064, 32, 3]]
