"""TCP through host staging, the path CUDA memory takes, run here on host memory with the host copy engine:
the row math, the CUDA kernel's piece table, the chunked pipeline over a real socket (errors included), and
two processes moving every byte both ways with ``staging=True``. The CUDA engine itself runs on a GPU in
scripts/gpu_check.py."""

import socket
import threading

import numpy as np
import pytest

from conformance.conftest import CONSUMER_OPTIONS, SENTINEL, LocalConsumer, pick, source_views
from conformance.kvspec import KINDS, Spec, block_bytes, untouched
from conformance.peers import ProducerProcess
from kvxfer import PeerError
from kvxfer.memory import Region
from kvxfer.plan import Extents
from kvxfer.staging import HostEngine, Rings, recv_staged, send_staged
from kvxfer.staging.cuda import pieces
from kvxfer.staging.engine import rows


def _memory(rng, sizes):
    arrays = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    return arrays, [Region(a.ctypes.data, a.nbytes) for a in arrays]


def _extents(rng, sizes, n, grain):
    """``n`` non-overlapping extents of multiples of ``grain`` bytes, in random order over the regions."""
    region, offset, nbytes = [], [], []
    for r, size in enumerate(sizes):
        units = size // grain
        cuts = np.sort(rng.choice(units, size=2 * min(n, units // 2), replace=False)) * grain
        for a, b in cuts.reshape(-1, 2):
            region.append(r)
            offset.append(a)
            nbytes.append(b - a)
    order = rng.permutation(len(region))[:n]
    return Extents(*(np.array(x, dtype=np.int64)[order] for x in (region, offset, nbytes)))


def _reference(arrays, ext):
    parts = zip(ext.region.tolist(), ext.offset.tolist(), ext.nbytes.tolist(), strict=True)
    return np.concatenate([arrays[r][o : o + k] for r, o, k in parts])


@pytest.mark.parametrize("grain", [1, 2, 48, 4096])
def test_host_engine_gathers_and_scatters_exact_bytes(grain):
    rng = np.random.default_rng(grain)
    sizes = [1 << 16, 3 << 14, 1 << 15]
    arrays, regions = _memory(rng, sizes)
    ext = _extents(rng, sizes, 20, grain)
    engine = HostEngine(regions)
    slot = engine.slot(ext.total + 7)
    engine.gather(ext, slot).wait()
    assert bytes(slot.view[: ext.total]) == _reference(arrays, ext).tobytes()
    before = [a.copy() for a in arrays]
    fresh = rng.integers(0, 256, ext.total, dtype=np.uint8)
    slot.view[: ext.total] = fresh.tobytes()
    engine.scatter(slot, ext).wait()
    assert _reference(arrays, ext).tobytes() == fresh.tobytes()
    touched = [np.zeros(n, dtype=bool) for n in sizes]
    for r, o, k in zip(ext.region.tolist(), ext.offset.tolist(), ext.nbytes.tolist(), strict=True):
        touched[r][o : o + k] = True
    for a, b, t in zip(arrays, before, touched, strict=True):
        np.testing.assert_array_equal(a[~t], b[~t])  # nothing outside the extents moved


def test_rows_use_the_largest_common_unit():
    ext = Extents(np.array([0, 1, 0]), np.array([4096, 0, 12288]), np.array([8192, 4096, 4096]))
    rw = rows(ext)
    assert rw.unit == 4096
    assert [(r, s.tolist(), d.tolist()) for r, s, d in rw.groups] == [(0, [1, 2, 3], [0, 1, 3]), (1, [0], [2])]


def test_kernel_piece_table_splits_and_covers_every_byte():
    src = np.array([1000, 1 << 40, 77])
    dst = np.array([0, 5000, 300000])
    nbytes = np.array([10, 150000, 65536])
    p = pieces(src, dst, nbytes, limit=65536)
    assert p.dtype == np.uint64 and p.shape == (3, 5)
    assert p[2].tolist() == [10, 65536, 65536, 18928, 65536]
    assert p[0].tolist() == [1000, 1 << 40, (1 << 40) + 65536, (1 << 40) + 131072, 77]
    assert p[1].tolist() == [0, 5000, 5000 + 65536, 5000 + 131072, 300000]


def test_split_cuts_the_stream_into_chunks_that_cover_it():
    ext = Extents(np.array([0, 1, 0]), np.array([100, 0, 50]), np.array([3, 5, 2]))
    parts = ext.split(4)
    assert [p.total for p in parts] == [4, 4, 2]
    assert [(p.region.tolist(), p.offset.tolist(), p.nbytes.tolist()) for p in parts] == [
        ([0, 1], [100, 0], [3, 1]),
        ([1], [1], [4]),
        ([0], [50], [2]),
    ]
    assert [p.total for p in Extents(np.array([0]), np.array([0]), np.array([8])).split(4)] == [4, 4]
    empty = np.array([], dtype=np.int64)
    assert Extents(empty, empty, empty).split(4) == []


class CountingEngine(HostEngine):
    """The host engine, recording which issued copies were waited for."""

    def __init__(self, regions):
        super().__init__(regions)
        self.issued, self.waited = 0, 0

    def _track(self):
        self.issued += 1
        engine = self

        class Done:
            def wait(self):
                engine.waited += 1

        return Done()

    def gather(self, ext, into):
        super().gather(ext, into)
        return self._track()

    def scatter(self, src, ext):
        super().scatter(src, ext)
        return self._track()


@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("chunk", [4093, 1 << 16])
def test_pipeline_moves_every_byte_over_a_socket(depth, chunk):
    rng = np.random.default_rng(depth * chunk)
    sizes = [1 << 18, 1 << 17]
    src_arrays, src_regions = _memory(rng, sizes)
    dst_arrays, dst_regions = _memory(rng, sizes)
    src_ext = _extents(rng, sizes, 40, 16)
    # the same byte count, laid out elsewhere on the receiving side
    dst_ext = Extents(np.zeros(1, dtype=np.int64), np.array([1000]), np.array([src_ext.total]))
    send_engine, recv_engine = CountingEngine(src_regions), CountingEngine(dst_regions)
    a, b = socket.socketpair()
    errors = []

    def sender():
        try:
            send_staged(a, src_ext, Rings(send_engine, chunk, depth))
        except BaseException as e:
            errors.append(e)

    th = threading.Thread(target=sender)
    th.start()
    recv_staged(b, dst_ext, Rings(recv_engine, chunk, depth))
    th.join(10)
    a.close()
    b.close()
    assert not errors
    assert dst_arrays[0][1000 : 1000 + src_ext.total].tobytes() == _reference(src_arrays, src_ext).tobytes()
    for e in (send_engine, recv_engine):
        assert e.issued == e.waited == len(src_ext.split(chunk))


def test_a_peer_closing_mid_window_fails_the_receive_with_no_copy_in_flight():
    rng = np.random.default_rng(7)
    arrays, regions = _memory(rng, [1 << 20])
    ext = Extents(np.zeros(1, dtype=np.int64), np.array([0]), np.array([1 << 20]))
    engine = CountingEngine(regions)
    a, b = socket.socketpair()

    def peer():  # a bit over four chunks, then the peer is gone
        a.sendall(bytes(300_000))
        a.close()

    th = threading.Thread(target=peer)
    th.start()
    with pytest.raises(PeerError):
        recv_staged(b, ext, Rings(engine, 1 << 16, 2))
    th.join(10)
    b.close()
    assert engine.issued == engine.waited == 4
    assert not arrays[0][: 4 << 16].any() and arrays[0][300_000:].any()


def test_a_receiver_gone_fails_the_send_and_the_ring_comes_back_idle():
    rng = np.random.default_rng(8)
    _, regions = _memory(rng, [1 << 22])
    ext = Extents(np.zeros(1, dtype=np.int64), np.array([0]), np.array([1 << 22]))
    engine = CountingEngine(regions)
    rings = Rings(engine, 1 << 16, 3)
    a, b = socket.socketpair()
    b.close()
    with pytest.raises(PeerError):
        send_staged(a, ext, rings)
    a.close()
    assert engine.issued == engine.waited
    with rings.ring() as slots:  # the same ring, handed back for the next move
        assert len(slots) == 3


def _same_blocks(spec, seed, ids, consumer, arrival):
    src, dst = block_bytes(source_views(spec, seed), ids), block_bytes(consumer.views, arrival.block_ids)
    for x, y in zip(src, dst, strict=True):
        np.testing.assert_array_equal(x, y)


STAGED = {"staging": True, "stage_chunk": 12_289, "stage_depth": 2}  # chunks end mid-piece


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_processes_move_every_byte_through_staging(kind, mode):
    spec = Spec(kind=kind)
    consumer = LocalConsumer(spec, "tcp", **CONSUMER_OPTIONS, transport_options=STAGED)
    producer = ProducerProcess(spec, "tcp", seed=4, transport_options=STAGED)
    try:
        ids = pick("permuted", 23, spec.num_blocks, np.random.default_rng(len(kind)))
        getattr(producer, mode)(consumer.address, f"{kind}-{mode}", ids)
        arrival = consumer.get(10)
        _same_blocks(spec, 4, ids, consumer, arrival)
        assert untouched(consumer.views, arrival.block_ids, SENTINEL)
        consumer.release(arrival.req)
        assert consumer.stats()["free_blocks"] == spec.num_blocks
    finally:
        producer.close()
        consumer.c.close()


def test_parallel_streams_through_staging():
    spec = Spec(kind="nhd", num_blocks=64)
    opts = {**STAGED, "streams": 4, "window_min": 1}
    consumer = LocalConsumer(spec, "tcp", **CONSUMER_OPTIONS, transport_options=opts)
    producer = ProducerProcess(spec, "tcp", seed=6, transport_options=opts)
    try:
        for mode in ("push", "pull"):
            ids = np.random.default_rng(1).permutation(64)[:50]
            getattr(producer, mode)(consumer.address, mode, ids)
            arrival = consumer.get(10)
            _same_blocks(spec, 6, ids, consumer, arrival)
            consumer.release(arrival.req)
    finally:
        producer.close()
        consumer.c.close()
