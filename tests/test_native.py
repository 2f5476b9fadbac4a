"""The native layer (``kvxfer._kvx``, built from native/kvx.c by pip install): scatter/gather socket I/O straight
from extent arrays, and block-id checks, used as a careless or hostile caller would.

The I/O runs over real socket pairs with small kernel buffers, so every transfer is cut into many partial
``sendmsg`` / ``recvmsg`` calls that end inside pieces and inside batches of 1024 iovecs.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvxfer import _kvx
from kvxfer.errors import BlockError, DeadlineError, PeerError
from kvxfer.plan import check_ids
from kvxfer.sockets import recv_extents, send_extents


def _pair(buf: int = 16384) -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buf)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buf)
    return a, b


class Regions:
    """Host regions and the (bases, sizes) vectors the native calls take."""

    def __init__(self, *sizes: int, fill: int | None = None, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.arrays = [
            rng.integers(0, 256, n, dtype=np.uint8) if fill is None else np.full(n, fill, np.uint8) for n in sizes
        ]
        self.bases = np.array([a.ctypes.data for a in self.arrays], dtype=np.uint64)
        self.sizes = np.array(sizes, dtype=np.int64)

    def gather(self, region, offset, nbytes) -> bytes:
        return b"".join(self.arrays[r][o : o + n].tobytes() for r, o, n in zip(region, offset, nbytes, strict=True))


def _laid_out(rng, lengths: np.ndarray, regions: int, gap: int = 7):
    """Extents of ``lengths`` (some empty) spread over ``regions`` regions, in shuffled order with gaps between
    them; the region sizes that hold them."""
    region = rng.integers(0, regions, len(lengths)).astype(np.int64)
    offset = np.zeros(len(lengths), np.int64)
    sizes = []
    for r in range(regions):
        at = rng.permutation(np.flatnonzero(region == r))
        ends = np.cumsum(lengths[at] + gap)
        offset[at] = ends - lengths[at] - gap
        sizes.append(int(ends[-1]) + gap if len(at) else 1)
    return (region, offset, lengths.astype(np.int64)), sizes


def _cut(rng, total: int, count: int) -> np.ndarray:
    """``total`` bytes cut into ``count`` pieces at random points (empty pieces included)."""
    points = np.sort(rng.integers(0, total + 1, count - 1))
    return np.diff(np.concatenate([[0], points, [total]]))


@pytest.mark.parametrize("count,max_piece", [(1, 1 << 20), (3000, 700), (5000, 64)])
def test_scatter_gather_moves_every_byte_in_stream_order(count, max_piece):
    """Pieces on each side cut the same stream at different points, in shuffled places of several regions."""
    rng = np.random.default_rng(count)
    lengths = rng.integers(0, max_piece + 1, count)
    (sr, so, sn), ssizes = _laid_out(rng, lengths, 3)
    (dr, do, dn), dsizes = _laid_out(rng, _cut(rng, int(lengths.sum()), count + 17), 2)
    src, dst = Regions(*ssizes, seed=1), Regions(*dsizes, fill=0)
    a, b = _pair()
    out: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(out, send_extents, a, src.bases, src.sizes, sr, so, sn))
    t.start()
    recv_extents(b, dst.bases, dst.sizes, dr, do, dn)
    t.join(10)
    assert not out
    assert dst.gather(dr, do, dn) == src.gather(sr, so, sn)
    untouched = np.ones(sum(dsizes), bool)
    cuts = np.concatenate([[0], np.cumsum(dsizes)])
    for r, o, n in zip(dr, do, dn, strict=True):
        untouched[cuts[r] + o : cuts[r] + o + n] = False
    assert not np.concatenate(dst.arrays)[untouched].any(), "bytes landed outside the extents"


def _catch(out: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # handed to the test thread
        out.append(e)


def test_a_broadcast_region_column_and_many_batches():
    """One region index for every piece as a zero-stride view (what the planner hands over), 3 batches' worth."""
    n, piece = 2500, 512
    src, dst = Regions(n * 2 * piece, seed=2), Regions(n * 2 * piece, fill=0)
    region = np.broadcast_to(np.int64(0), n)
    offset = np.random.default_rng(3).permutation(n).astype(np.int64) * 2 * piece
    nbytes = np.broadcast_to(np.int64(piece), n)
    a, b = _pair()
    t = threading.Thread(target=send_extents, args=(a, src.bases, src.sizes, region, offset, nbytes))
    t.start()
    recv_extents(b, dst.bases, dst.sizes, region, offset[::-1].copy(), nbytes)
    t.join(10)
    assert dst.gather(region, offset[::-1], nbytes) == src.gather(region, offset, nbytes)


@pytest.mark.parametrize(
    "region,offset,nbytes",
    [
        ([1], [0], [16]),  # no such region
        ([-1], [0], [16]),
        ([0], [4090], [16]),  # runs past the end
        ([0], [-8], [16]),
        ([0], [0], [-1]),
        ([0], [2**62], [2**62]),  # wraps in 64 bits
        ([0, 0], [0, 4095], [16, 2]),  # the second piece is the bad one
    ],
)
def test_an_extent_outside_its_region_moves_nothing(region, offset, nbytes):
    src = Regions(4096)
    a, b = _pair()
    with pytest.raises(ValueError, match="outside its region"):
        _kvx.sendv(a.fileno(), src.bases, src.sizes, *(np.array(v, np.int64) for v in (region, offset, nbytes)), -1)
    b.setblocking(False)
    with pytest.raises(BlockingIOError):
        b.recv(1)  # not one byte went out


def test_vectors_of_the_wrong_kind_are_refused():
    src = Regions(4096)
    a, _ = _pair()
    ok = np.zeros(1, np.int64)
    with pytest.raises(TypeError, match="8-byte integers"):
        _kvx.sendv(a.fileno(), src.bases, src.sizes, ok.astype(np.int32), ok, ok + 1, -1)
    with pytest.raises(TypeError, match="8-byte integers"):
        _kvx.sendv(a.fileno(), src.bases, src.sizes, ok, ok.astype(np.float64), ok + 1, -1)
    with pytest.raises(TypeError):
        _kvx.sendv(a.fileno(), src.bases, src.sizes, np.zeros((1, 1), np.int64), ok, ok + 1, -1)
    with pytest.raises(ValueError, match="differ in length"):
        _kvx.sendv(a.fileno(), src.bases, src.sizes, ok, np.zeros(2, np.int64), ok + 1, -1)


def test_a_peer_closing_mid_transfer_is_a_peer_error():
    dst = Regions(1 << 20, fill=0)
    a, b = _pair()
    a.sendall(b"x" * 1000)
    a.close()
    one = np.ones(1, np.int64)
    with pytest.raises(PeerError, match="closed"):
        recv_extents(b, dst.bases, dst.sizes, 0 * one, 0 * one, one << 20)
    assert dst.arrays[0][:1000].tobytes() == b"x" * 1000


def test_a_socket_timeout_is_a_deadline_error():
    dst = Regions(4096, fill=0)
    _a, b = _pair()
    b.settimeout(0.2)
    one = np.ones(1, np.int64)
    with pytest.raises(DeadlineError):
        recv_extents(b, dst.bases, dst.sizes, 0 * one, 0 * one, one * 100)


def test_a_shut_down_socket_ends_a_blocked_send():
    """The watchdog's way out of a stuck transfer: shutdown() from another thread returns the blocked call."""
    src = Regions(8 << 20)
    a, _b = _pair()
    one = np.ones(1, np.int64)
    threading.Timer(0.3, lambda: a.shutdown(socket.SHUT_RDWR)).start()
    with pytest.raises(PeerError):
        send_extents(a, src.bases, src.sizes, 0 * one, 0 * one, one * (8 << 20))


def test_a_descriptor_closed_under_a_send_is_not_written_through_once_its_number_is_reused():
    """A careless close of the socket object while a native send is under way: the send goes on through its own
    duplicate of the descriptor, and the socket that reuses the freed number receives nothing."""
    src = Regions(4 << 20)
    a, b = _pair()
    pieces = np.arange(4096, dtype=np.int64)  # 1 KiB each: four batches of 1024 iovecs, four sendmsg calls
    old = a.fileno()
    got = bytearray()
    sent: list = []
    sender = threading.Thread(
        target=lambda: sent.append(send_extents(a, src.bases, src.sizes, 0 * pieces, pieces << 10, 0 * pieces + 1024))
    )
    sender.start()
    got += b.recv(1 << 16)  # the send is under way and blocked on the small buffers
    a.close()
    reuse, witness = socket.socketpair()
    assert reuse.fileno() == old, "the test needs the freed number reused"
    while len(got) < 4 << 20:
        piece = b.recv(1 << 20)
        assert piece, f"the stream ended after {len(got)} bytes"
        got += piece
    sender.join(10)
    assert not sender.is_alive() and sent == [None]
    assert bytes(got) == src.arrays[0][: 4 << 20].tobytes()
    witness.setblocking(False)
    with pytest.raises(BlockingIOError):
        witness.recv(1)
    for s in (reuse, witness, b):
        s.close()


# ---- block ids ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "ids,num_blocks,match",
    [
        ([0, 1, 1], 4, "duplicates"),
        ([3, 0, 3], 4, "duplicates"),
        ([0, 4], 4, "out of range"),
        ([-1, 2], 4, "out of range"),
        ([5], 4, "out of range"),
        ([0, 2**40, 2**40], 2**41, "duplicates"),  # few ids in a huge range: no bitmap of 2**41 bits
        ([0, 2**41], 2**41, "out of range"),
        (np.array([2**64 - 1], np.uint64), 4, "out of range"),
        (np.array([0, 2**63], np.uint64), 2**62, "out of range"),
        ([0], 0, "out of range"),
        ([0, 1], -5, "out of range"),
    ],
)
def test_bad_block_ids(ids, num_blocks, match):
    with pytest.raises(BlockError, match=match):
        check_ids(ids, num_blocks)


def test_good_block_ids_pass_in_every_integer_type():
    ids = np.random.default_rng(4).permutation(100_000)
    for dt in (np.int64, np.uint64, np.int32):
        out = check_ids(ids.astype(dt), 100_000)
        assert out.dtype == np.int64 and (out == ids).all()
    assert (check_ids([2**40 - 1, 5], 2**40) == [2**40 - 1, 5]).all()
    assert (check_ids(ids[::-3], 100_000) == ids[::-3]).all()  # a strided view
    assert check_ids([7], 8).tolist() == [7]


def test_a_repeat_anywhere_in_a_million_ids_is_found():
    rng = np.random.default_rng(5)
    ids = rng.permutation(1_000_000)
    for at in (1, 500_000, 999_999):
        bad = ids.copy()
        bad[at] = bad[rng.integers(0, at)]
        with pytest.raises(BlockError, match="duplicates"):
            check_ids(bad, 1_000_000)


def test_run_starts_matches_numpy_on_runs_of_every_length():
    rng = np.random.default_rng(6)
    starts, lengths = rng.integers(0, 10**6, 300), rng.integers(1, 40, 300)
    a = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    b = a.copy()
    b[rng.integers(0, len(b), 50)] += 7  # breaks on one side only
    for x, y in ((a, b), (b, a), (a, a), (a[::-1], a[::-1])):  # a reversed view: strided, no run at all
        want = np.flatnonzero(np.concatenate([[True], (np.diff(x) != 1) | (np.diff(y) != 1)]))
        out = np.empty(len(x), np.int64)
        k = _kvx.run_starts(x, y, out)
        assert out[:k].tolist() == want.tolist()
    out = np.empty(5, np.int64)
    assert _kvx.run_starts(np.arange(5), np.arange(10, 15), out) == 1 and out[0] == 0  # one run: one start


def test_run_starts_refuses_vectors_of_different_lengths():
    with pytest.raises(ValueError, match="one 8-byte integer per id"):
        _kvx.run_starts(np.arange(4), np.arange(5), np.empty(4, np.int64))
    with pytest.raises(ValueError, match="one 8-byte integer per id"):
        _kvx.run_starts(np.arange(4), np.arange(4), np.empty(3, np.int64))
    with pytest.raises(TypeError):
        _kvx.run_starts(np.arange(4, dtype=np.int32), np.arange(4), np.empty(4, np.int64))


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_gather_and_scatter_move_every_piece_in_stream_order(threads):
    """Pieces of every size over three regions, the stream cut between threads inside pieces (2-byte pieces
    beside 9 MiB ones): gather puts each in order, scatter puts it back, and no byte outside them changes."""
    rng = np.random.default_rng(8)
    mems = [rng.integers(0, 256, size, dtype=np.uint8) for size in (24 << 20, 3 << 20, 4096)]
    bases = np.array([m.ctypes.data for m in mems], dtype=np.uint64)
    sizes = np.array([len(m) for m in mems], dtype=np.int64)
    pieces = [
        (0, 0, 9 << 20),
        (2, 100, 2),
        (1, 5, 3 << 20 - 5),
        (0, 10 << 20, 7),
        (2, 4094, 2),
        (0, 12 << 20, 12 << 20),
    ]
    region, offset, nbytes = (np.array(c, dtype=np.int64) for c in zip(*pieces, strict=True))
    want = b"".join(mems[r][o : o + n].tobytes() for r, o, n in pieces)
    out = np.zeros(len(want) + 5, dtype=np.uint8)
    assert _kvx.gather(bases, sizes, region, offset, nbytes, out, threads) == len(want)
    assert out[: len(want)].tobytes() == want and not out[len(want) :].any()
    before = [m.copy() for m in mems]
    back = rng.integers(0, 256, len(want), dtype=np.uint8)
    assert _kvx.scatter(bases, sizes, region, offset, nbytes, back, threads) == len(want)
    at = 0
    for r, o, n in pieces:
        assert (mems[r][o : o + n] == back[at : at + n]).all()
        before[r][o : o + n] = back[at : at + n]
        at += n
    assert all((m == b).all() for m, b in zip(mems, before, strict=True))  # nothing else was touched


def test_gather_and_scatter_refuse_a_piece_outside_its_region_or_a_short_buffer():
    mem = np.zeros(4096, dtype=np.uint8)
    bases, sizes = np.array([mem.ctypes.data], np.uint64), np.array([4096], np.int64)
    one = np.zeros(1, np.int64)
    with pytest.raises(ValueError, match="outside its region"):
        _kvx.gather(bases, sizes, one, np.array([4000]), np.array([97]), np.zeros(97, np.uint8), 1)
    with pytest.raises(ValueError, match="outside its region"):
        _kvx.scatter(bases, sizes, np.ones(1, np.int64), one, np.array([1]), np.zeros(1, np.uint8), 1)
    with pytest.raises(ValueError, match="holds 99 bytes"):
        _kvx.gather(bases, sizes, one, one, np.array([100]), np.zeros(99, np.uint8), 1)
    with pytest.raises(BufferError):
        _kvx.gather(bases, sizes, one, one, np.array([8]), b"read-only", 1)  # gathering needs a writable buffer


@pytest.mark.parametrize("seed", range(4))
def test_block_copies_match_the_extents_of_the_same_blocks(seed):
    """gather_blocks / scatter_blocks (a small request's inline bytes) put every piece of every block in the
    stream order its extents give, on random layouts (several layers, K and V in separate or shared tensors,
    heads sliced): the bytes the extents path gathers, and nothing outside the blocks changes on scatter."""
    from kvxfer.layout import KVLayout
    from kvxfer.paging import paging
    from kvxfer.staging.engine import HostEngine

    rng = np.random.default_rng(seed)
    layers, heads, nb = int(rng.integers(1, 4)), int(rng.integers(1, 4)), 32
    tokens = int(rng.choice([4, 16]))
    shape = (nb, 2, tokens, heads, 8) if seed % 2 else (2, nb, tokens, heads, 8)
    caches = {f"l{i}": rng.integers(-100, 100, shape).astype(np.float16) for i in range(layers)}
    layout = KVLayout.from_tensors(caches, dims="BKNHD" if seed % 2 else "KBNHD")
    pg = paging(layout, layout)
    p = pg.pairings[0]
    engine = HostEngine(layout.regions)
    ids = rng.choice(nb, size=int(rng.integers(1, 9)), replace=False).astype(np.int64)
    ext = pg.side(True, ids, None, nb)
    want = np.zeros(ext.total, np.uint8)
    _kvx.gather(engine.bases, engine.sizes, ext.region, ext.offset, ext.nbytes, want, 1)
    got = _kvx.gather_blocks(engine.bases, engine.sizes, p.a.region, p.a.offset, p.a.stride, p.nbytes, ids)
    assert isinstance(got, bytes) and got == want.tobytes()
    before = {k: v.copy() for k, v in caches.items()}
    back = rng.integers(0, 256, len(got), dtype=np.uint8)
    _kvx.scatter_blocks(engine.bases, engine.sizes, p.b.region, p.b.offset, p.b.stride, p.nbytes, ids, back)
    again = np.zeros(ext.total, np.uint8)
    _kvx.gather(engine.bases, engine.sizes, ext.region, ext.offset, ext.nbytes, again, 1)
    assert (again == back).all()
    others = np.setdiff1d(np.arange(nb), ids)
    axis = 0 if seed % 2 else 1
    for k, v in caches.items():
        assert (np.take(v, others, axis=axis) == np.take(before[k], others, axis=axis)).all()


def test_block_copies_refuse_a_block_outside_its_region_or_a_wrong_buffer():
    """A hostile or careless piece table or id (negative, past the region, overflowing) is a ValueError and
    copies nothing; a message of the wrong length is refused before a byte lands."""
    mem = np.zeros(4096, dtype=np.uint8)
    bases, sizes = np.array([mem.ctypes.data], np.uint64), np.array([4096], np.int64)
    table = (np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([1024], np.int64), np.array([1024], np.int64))
    ok = _kvx.gather_blocks(bases, sizes, *table, np.array([3], np.int64))
    assert len(ok) == 1024
    for bad in ([4], [-1], [1 << 62], [0, 4]):
        with pytest.raises(ValueError, match="outside region"):
            _kvx.gather_blocks(bases, sizes, *table, np.array(bad, np.int64))
        with pytest.raises(ValueError, match="outside region"):
            _kvx.scatter_blocks(bases, sizes, *table, np.array(bad, np.int64), bytes(1024 * len(bad)))
    assert not mem.any()
    with pytest.raises(ValueError, match="holds 1023 bytes"):
        _kvx.scatter_blocks(bases, sizes, *table, np.array([1], np.int64), bytes(1023))
    with pytest.raises(ValueError, match="not a piece"):
        _kvx.gather_blocks(bases, sizes, np.ones(1, np.int64), *table[1:], np.array([0], np.int64))
    with pytest.raises(ValueError, match="differ in length"):
        _kvx.gather_blocks(bases, sizes, np.zeros(2, np.int64), *table[1:], np.array([0], np.int64))
    with pytest.raises(TypeError):
        _kvx.gather_blocks(bases, sizes, *table, np.array([0], np.int32))
    assert not mem.any()


# ---- spin_readable: the reader's busy-wait -------------------------------------------------------------------
def _until(seconds: float) -> np.ndarray:
    return np.array([time.monotonic_ns() + int(seconds * 1e9)], np.int64)


def test_spin_readable_sees_bytes_at_once_and_gives_up_at_its_deadline():
    a, b = _pair()
    try:
        start = time.monotonic()
        assert _kvx.spin_readable(a.fileno(), _until(0.02)) is False
        assert 0.019 < time.monotonic() - start < 1.0  # spun to the deadline, then gave up
        b.sendall(b"x")
        start = time.monotonic()
        assert _kvx.spin_readable(a.fileno(), _until(5.0)) is True
        assert time.monotonic() - start < 1.0
        assert a.recv(1) == b"x"  # looked, took nothing
    finally:
        a.close()
        b.close()


def test_spin_readable_follows_a_deadline_moved_while_it_spins_and_sees_a_peer_close():
    a, b = _pair()
    until = _until(0.05)
    try:

        def later():
            until[0] = time.monotonic_ns() + int(5e9)  # a send of ours: its answer is due, spin on
            time.sleep(0.2)
            b.close()

        th = threading.Thread(target=later)
        start = time.monotonic()
        th.start()
        assert _kvx.spin_readable(a.fileno(), until) is True  # the close, past the first deadline
        assert 0.15 < time.monotonic() - start < 4.0
        th.join()
        assert a.recv(1) == b""
    finally:
        a.close()


def test_spin_readable_lets_other_threads_run():
    a, b = _pair()
    counted = []
    try:
        th = threading.Thread(target=lambda: counted.append(sum(range(2_000_000))))
        th.start()
        _kvx.spin_readable(a.fileno(), _until(0.5))
        th.join(5)
        assert counted, "a spinning reader held the GIL"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("until", [np.zeros(2, np.int64), np.zeros(1, np.int32), bytearray(7)])
def test_spin_readable_refuses_a_closed_socket_or_a_deadline_of_the_wrong_shape(until):
    a, b = _pair()
    with pytest.raises(ValueError):
        _kvx.spin_readable(a.fileno(), until)
    a.close()
    b.close()
    with pytest.raises(ValueError):
        _kvx.spin_readable(-1, np.zeros(1, np.int64))
    with pytest.raises(TypeError):
        _kvx.spin_readable(3, b"\0" * 8)  # read-only: the reader's deadline must be writable
