"""The ucx transport's bounce buffers: reused between transfers, never handed to two at once, bounded."""

from kvxfer.transports.ucx import _Bounces


def test_a_buffer_given_back_is_reused_by_the_next_transfer_that_fits():
    b = _Bounces(keep=1 << 20)
    first = b.take(4096)
    assert len(first) >= 4096
    b.give(first)
    again = b.take(1000)
    assert again is first
    assert b.take(1000) is not first  # out again: never handed to two transfers at once


def test_the_smallest_buffer_that_fits_is_taken():
    b = _Bounces(keep=1 << 20)
    small, large = b.take(1000), b.take(100_000)
    b.give(large)
    b.give(small)
    assert b.take(500) is small
    assert b.take(50_000) is large
    assert len(b.take(200_000)) >= 200_000  # none fits: a new one


def test_at_most_keep_bytes_wait_and_the_largest_stay():
    b = _Bounces(keep=150_000)
    bufs = [b.take(n) for n in (40_000, 60_000, 100_000)]
    for buf in bufs:
        b.give(buf)
    assert [len(x) for x in b.free] == [100_000]
    assert _Bounces(keep=0).take(10) is not None
    none = _Bounces(keep=0)
    none.give(none.take(10))
    assert none.free == []
