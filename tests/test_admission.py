"""The sans-IO ledgers, driven without a network or a clock."""

import numpy as np
import pytest

from kvxfer import BlockError, BusyError, CancelledError, FreeList, StaleError, TimeoutError
from kvxfer.admission import Grants, Leases


def _grants(**kw):
    return Grants(FreeList(16), block_bytes=10, **kw)


def test_admit_land_done_release():
    g = _grants()
    slot, _ = g.admit(1, "r", 4, deadline=10, now=0)
    assert len(slot.ids) == 4 and g.allocator.num_free == 12
    g.check_write(1, "r", slot.gen, slot.ids)
    assert g.done(1, "r", slot.gen, 40, {"t": 1}, b"") is None  # bytes not yet landed
    assert g.landed(1, "r", slot.gen, 40) is slot
    assert g.release("r") and g.allocator.num_free == 16


def test_busy_and_inflight_bound():
    g = _grants(max_inflight=1, retry_after=0.5)
    g.admit(1, "a", 2, 10, 0)
    with pytest.raises(BusyError) as e:
        g.admit(1, "b", 2, 10, 0)
    assert e.value.retry_after == 0.5
    g2 = _grants()
    with pytest.raises(BusyError):
        g2.admit(1, "big", 17, 10, 0)


def test_generations_fence_and_tombstones_expire():
    g = _grants(tombstone_ttl=5)
    slot, _ = g.admit(1, "r", 2, 10, 0)
    with pytest.raises(StaleError):
        g.check_write(1, "r", slot.gen + 1, slot.ids)
    with pytest.raises(StaleError):
        g.check_write(2, "r", slot.gen, slot.ids)  # another session
    with pytest.raises(BlockError):
        g.check_write(1, "r", slot.gen, slot.ids[::-1])
    g.fail("r", CancelledError("x"), now=1)
    assert g.allocator.num_free == 16
    with pytest.raises(CancelledError):
        g.admit(1, "r", 2, 10, now=2)
    with pytest.raises(CancelledError):
        g.done(1, "r", slot.gen, 20, {}, b"")
    g.reap(now=7)
    again, _ = g.admit(1, "r", 2, 20, now=7)
    assert again.gen > slot.gen


def test_newer_admission_supersedes():
    g = _grants()
    old, _ = g.admit(1, "r", 2, 10, 0)
    new, superseded = g.admit(2, "r", 2, 10, 0)
    assert superseded == [old] and isinstance(old.error, StaleError) and new.gen > old.gen


def test_receive_in_progress_delays_the_free():
    g = _grants()
    slot, _ = g.admit(1, "r", 4, 10, 0)
    g.begin_receive(slot)
    g.fail("r", TimeoutError("late"), now=1)
    assert g.allocator.num_free == 12  # a receive still writes into them
    g.end_receive(slot, 0, now=1)
    g.reap(now=1)
    assert g.allocator.num_free == 16


def test_one_sided_quarantine():
    g = _grants(quarantine=2.0)
    g.admit(1, "r", 4, 10, 0)
    g.fail("r", TimeoutError("late"), now=1, one_sided=True)
    assert g.allocator.num_free == 12
    g.reap(now=2.5)
    assert g.allocator.num_free == 12
    g.reap(now=3.0)
    assert g.allocator.num_free == 16


def test_peer_lost_frees_at_once():
    g = _grants(quarantine=60)
    g.admit(7, "a", 3, 10, 0)
    g.admit(8, "b", 3, 10, 0)
    lost = g.peer_lost(7, TimeoutError("gone"), now=1)
    assert [s.req for s in lost] == ["a"] and g.allocator.num_free == 13


def test_expired():
    g = _grants()
    g.admit(1, "a", 1, deadline=5, now=0)
    assert [s.req for s in g.expired(now=5)] == ["a"]


def test_leases():
    ls = Leases()
    item = ls.offer(1, "r", np.array([3, 4]), lease=5, now=0)
    ls.check_read(1, "r", item.gen, np.array([3, 4]), now=1)
    with pytest.raises(BlockError):
        ls.check_read(1, "r", item.gen, np.array([3, 5]), now=1)
    with pytest.raises(StaleError):
        ls.check_read(2, "r", item.gen, np.array([3, 4]), now=1)
    with pytest.raises(StaleError):
        ls.release("r", item.gen, now=6)
    item = ls.offer(1, "r", np.array([3, 4]), lease=5, now=0)
    assert ls.release("r", item.gen, now=1) is item
    assert not ls.active


def test_free_list():
    fl = FreeList(8, reserved=[0])
    a = fl.allocate(3)
    assert 0 not in a and fl.num_free == 4
    assert fl.allocate(5) is None
    fl.free(a)
    assert fl.num_free == 7
