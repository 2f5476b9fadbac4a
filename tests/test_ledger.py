"""The sans-IO ledgers, driven without a network or a clock."""

import numpy as np
import pytest

from kvxfer import BlockError, BusyError, CancelledError, ClosedError, DeadlineError, FreeList, StaleError
from kvxfer.ledger import VERDICT_WAIT, Grants, Leases


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


def test_a_closed_ledger_admits_nothing_and_keeps_what_it_holds():
    g = _grants()
    slot, _ = g.admit(1, "held", 2, 10, 0)
    g.close()
    for admit in (lambda: g.admit(1, "push", 2, 10, 0), lambda: g.admit_pull(1, "pull", 2, 10, 0, lease_gen=3)):
        with pytest.raises(ClosedError):
            admit()
    assert g.allocator.num_free == 14 and g.counts()["inflight"] == 1
    assert g.fail("held", CancelledError("closing"), 0) is slot and g.allocator.num_free == 16


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
    g.fail("r", DeadlineError("late"), now=1)
    assert g.allocator.num_free == 12  # a receive still writes into them
    g.end_receive(slot, 0, now=1)
    g.reap(now=1)
    assert g.allocator.num_free == 16


def test_one_sided_quarantine():
    g = _grants(quarantine=2.0)
    g.admit(1, "r", 4, 10, 0)
    g.fail("r", DeadlineError("late"), now=1, one_sided=True)
    assert g.allocator.num_free == 12
    g.reap(now=2.5)
    assert g.allocator.num_free == 12
    g.reap(now=3.0)
    assert g.allocator.num_free == 16


def test_peer_lost_frees_at_once():
    g = _grants(quarantine=60)
    g.admit(7, "a", 3, 10, 0)
    g.admit(8, "b", 3, 10, 0)
    lost = g.peer_lost(7, DeadlineError("gone"), now=1)
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


def test_a_lease_frees_its_blocks_only_after_its_last_read_stopped():
    ls = Leases()
    item = ls.offer(1, "r", np.array([3, 4]), lease=5, now=0)
    ls.check_read(1, "r", item.gen, np.array([3, 4]), now=1)
    ls.check_read(1, "r", item.gen, np.array([3, 4]), now=1)  # two streams read it
    freed = []
    ls.drop(item, StaleError("expired"))
    assert item.error is not None  # what stops the reads being served
    with pytest.raises(StaleError):  # and no read starts
        ls.check_read(1, "r", item.gen, np.array([3, 4]), now=1)
    ls.when_unread(item, lambda: freed.append("r"))
    ls.end_read(item)
    assert freed == []  # one stream still sends from the blocks
    ls.end_read(item)
    assert freed == ["r"]
    done = ls.offer(1, "d", np.array([1]), lease=5, now=0)
    ls.release("d", done.gen, now=1)
    ls.when_unread(done, lambda: freed.append("d"))  # nothing reads: at once
    assert freed == ["r", "d"]


def test_a_stream_byte_is_received_once():
    from kvxfer import ProtocolError

    g = _grants()
    slot, _ = g.admit(1, "a", 2, deadline=5, now=0)
    half = slot.nbytes // 2
    t = g.begin_write(1, "a", slot.gen, slot.ids, (0, half))
    g.end_receive(t, half, now=1)
    for dup in [(0, half), (half - 1, half + 1), (0, 1)]:  # again, overlapping, inside
        with pytest.raises(ProtocolError):
            g.begin_write(1, "a", slot.gen, slot.ids, dup)
    assert slot.landed == half and slot.moving == 0  # a refused window counts nothing, holds nothing
    t = g.begin_write(1, "a", slot.gen, slot.ids, (half, slot.nbytes))
    assert g.end_receive(t, slot.nbytes - half, now=1) is None  # complete only once the Done comes
    assert g.done(1, "a", slot.gen, slot.nbytes, {}, b"") is slot


def test_free_list():
    fl = FreeList(8, reserved=[0])
    a = fl.allocate(3)
    assert 0 not in a and fl.num_free == 4
    assert fl.allocate(5) is None
    fl.free(a)
    assert fl.num_free == 7


def lay(*layers: int) -> dict:
    """A part carrying ``layers`` of 4 layers of 10 bytes: what the consumer passes the ledger for it."""
    return {"selection": layers, "ranges": np.array([[10 * x, 10 * x + 10] for x in layers])}


def _multi(**kw):
    return Grants(FreeList(16), block_bytes=40, **kw)


def test_parts_share_one_grant_each_with_its_generation():
    g = _multi()
    slot, _ = g.admit(1, "r", 3, deadline=10, now=0, senders=2, part=0, **lay(0, 1))
    again, superseded = g.admit(2, "r", 3, deadline=99, now=0, senders=2, part=1, **lay(2, 3))
    assert again is slot and not superseded and g.allocator.num_free == 13 and slot.deadline == 10
    p0, p1 = slot.parts[0], slot.parts[1]
    assert p0.gen != p1.gen and p0.nbytes == p1.nbytes == 60 and slot.nbytes == 120
    assert g.check_write(2, "r", p1.gen, slot.ids) is p1
    with pytest.raises(StaleError):
        g.check_write(1, "r", p1.gen, slot.ids)  # part 1's generation from part 0's session
    assert g.landed(1, "r", p0.gen, 60) is None
    assert g.done(1, "r", p0.gen, 60, {"first_token": 3}, b"") is None  # part 1 still missing
    assert g.landed(2, "r", p1.gen, 60) is None
    assert g.done(2, "r", p1.gen, 60, {"first_token": 9, "x": 1}, b"") is slot
    assert slot.meta == {"first_token": 3, "x": 1}  # part 0's meta wins
    with pytest.raises(StaleError):  # a duplicate done after the hand-off changes nothing
        g.done(2, "r", p1.gen, 60, {}, b"")
    with pytest.raises(StaleError):  # nor may the id be admitted again while the runtime holds it
        g.admit(1, "r", 3, 10, 1)
    assert g.release("r") and g.allocator.num_free == 16


def test_parts_must_agree_and_cover_every_layer():
    g = _multi()
    g.admit(1, "r", 3, 10, 0, senders=3, part=0, **lay(0))
    with pytest.raises(BlockError):
        g.admit(2, "r", 4, 10, 0, senders=3, part=1, **lay(1))  # another block count
    with pytest.raises(BlockError):
        g.admit(2, "r", 3, 10, 0, senders=3, part=1, **lay(0))  # overlapping layers
    g.admit(2, "r", 3, 10, 0, senders=3, part=1, **lay(1))
    with pytest.raises(BlockError):
        g.admit(3, "r", 3, 10, 0, senders=3, part=2, **lay(2))  # layer 3 would be missing
    with pytest.raises(BlockError):
        g.admit(3, "x", 3, 10, 0, senders=2, part=2, **lay(0))  # no such part
    with pytest.raises(BlockError):
        g.admit(3, "y", 3, 10, 0, **lay(0))  # a single sender carries every layer


def test_missing_part_expires_and_a_lost_part_fails_the_request():
    g = _multi(quarantine=5)
    slot, _ = g.admit(1, "r", 2, deadline=5, now=0, senders=2, part=0, **lay(0, 1))
    assert g.expired(now=5) == [slot]
    g.fail("r", DeadlineError("1 of 2 senders never came"), now=5, one_sided=True)
    assert g.allocator.num_free == 14  # quarantined: part 0 may still be writing
    g.peer_lost(1, DeadlineError("gone"), now=6)
    assert g.allocator.num_free == 16
    s2, _ = g.admit(1, "q", 2, 10, 0, senders=2, part=0, **lay(0, 1))
    g.admit(2, "q", 2, 10, 0, senders=2, part=1, **lay(2, 3))
    assert [s.req for s in g.peer_lost(2, DeadlineError("rank 1 died"), now=1)] == ["q"]
    assert g.allocator.num_free == 16 and s2.error is not None


def test_part_re_admission_supersedes_the_request():
    g = _multi()
    old, _ = g.admit(1, "r", 2, 10, 0, senders=2, part=0, **lay(0, 1))
    new, superseded = g.admit(3, "r", 2, 10, 0, senders=2, part=0, **lay(0, 1))
    assert superseded == [old] and new is not old and isinstance(old.error, StaleError)


# ---- the slot's explicit state and the rules that are ledger operations ------------------------------------
def test_slot_states_follow_the_transition_table():
    from kvxfer import ProtocolError
    from kvxfer.ledger import State

    g = _grants()
    slot, _ = g.admit(1, "r", 2, 10, 0)
    assert slot.state is State.GRANTED
    g.begin_receive(slot)
    assert slot.state is State.RECEIVING
    g.begin_receive(slot)  # a second window of the same request
    assert g.end_receive(slot, 10, now=1) is None and slot.state is State.RECEIVING
    assert g.end_receive(slot, 10, now=1) is None and slot.state is State.GRANTED
    assert g.done(1, "r", slot.gen, 20, {}, b"") is slot and slot.state is State.HANDED
    with pytest.raises(ProtocolError):  # a handed slot cannot start receiving again
        slot.to(State.RECEIVING)
    assert slot.state is State.HANDED  # an illegal transition changes nothing
    assert g.release("r") and slot.state is State.FREED
    with pytest.raises(ProtocolError):
        slot.to(State.GRANTED)


def test_done_while_receiving_waits_for_the_last_byte():
    g = _grants()
    slot, _ = g.admit(1, "r", 2, 10, 0)
    g.begin_receive(slot)
    assert g.done(1, "r", slot.gen, 20, {"k": 1}, b"") is None  # bytes still landing: not handed yet
    assert g.end_receive(slot, 20, now=1) is slot and slot.meta == {"k": 1}


def test_cancel_matches_only_the_sessions_own_generations():
    g = _grants()
    slot, _ = g.admit(1, "r", 2, 10, 0)
    assert g.cancel(2, "r", slot.gen, CancelledError("x"), now=1) is None  # another session
    assert g.cancel(1, "r", slot.gen + 99, CancelledError("x"), now=1) is None  # a generation it never had
    assert g.get("r") is slot
    assert g.cancel(1, "r", 0, CancelledError("x"), now=1) is slot  # gen 0: before the grant reached it
    assert g.phase("r") == "failed" and g.allocator.num_free == 16


def test_a_pull_is_cancelled_by_its_session_whatever_lease_it_names():
    g = _grants()
    slot = g.admit_pull(3, "p", 2, 10, 0, lease_gen=77)
    assert slot.members() == [(3, 77)]
    with pytest.raises(StaleError):  # nobody may write into blocks a pull reads into
        g.check_write(3, "p", slot.gen, slot.ids)
    assert g.cancel(3, "p", 5, CancelledError("x"), now=1) is slot


def test_revoke_takes_back_a_handed_slot_and_frees_it():
    g = _grants()
    slot, _ = g.admit(1, "r", 2, 10, 0)
    g.landed(1, "r", slot.gen, 20)
    assert g.done(1, "r", slot.gen, 20, {}, b"") is slot and g.phase("r") == "ready"
    assert g.revoke(slot, CancelledError("digests differ"), now=1)
    assert not g.revoke(slot, CancelledError("again"), now=1)
    assert g.phase("r") == "failed" and g.allocator.num_free == 16 and not g.release("r")


def test_meta_of_parts_merges_with_part_zero_winning_in_either_order():
    g = _multi()
    g.admit(2, "r", 1, 10, 0, senders=2, part=1, **lay(2, 3), meta={"first_token": 9, "rank": 1})
    slot, _ = g.admit(1, "r", 1, 10, 0, senders=2, part=0, **lay(0, 1), meta={"first_token": 3})
    assert slot.meta == {"first_token": 3, "rank": 1}


def test_one_producer_cannot_take_every_grant():
    g = _grants(max_inflight_per_peer=2)
    g.admit(1, "a", 1, 10, 0)
    g.admit(1, "b", 1, 10, 0)
    with pytest.raises(BusyError):
        g.admit(1, "c", 1, 10, 0)
    g.admit(2, "d", 1, 10, 0)  # another session still gets room


def test_a_grant_under_a_per_producer_bound_expects_every_byte_of_its_blocks():
    """The per-producer bound counts requests; the grant still expects its blocks' bytes, not that count."""
    g = _grants(max_inflight_per_peer=2)
    g.admit(1, "a", 1, 10, 0)
    slot, _ = g.admit(1, "b", 3, 10, 0)
    assert slot.nbytes == 3 * 10


def test_a_failed_pull_keeps_its_blocks_until_the_reader_stops():
    g = _grants()
    slot = g.admit_pull(1, "p", 4, 10, 0, lease_gen=5)
    g.begin_receive(slot)
    g.fail("p", CancelledError("producer cancelled"), now=1)
    assert g.allocator.num_free == 12  # the reader may still land bytes
    g.end_receive(slot, 0, now=1)
    assert g.allocator.num_free == 16


def test_a_fetch_reads_into_the_callers_blocks_and_gives_them_back_to_the_caller():
    g = _grants(quarantine=1.0)
    mine = np.array([15, 3, 9])
    slot = g.admit_pull(1, "f", 3, 10, 0, lease_gen=7, ids=mine)
    assert slot.external and np.array_equal(slot.ids, mine) and g.allocator.num_free == 16
    g.begin_receive(slot)
    assert g.end_receive(slot, 30, 0.1) is None and g.confirm(slot) is slot
    assert g.release("f") and g.allocator.num_free == 16  # not the allocator's blocks: never freed to it
    assert [s.req for s in g.take_freed()] == ["f"] and g.take_freed() == []


def test_a_failed_fetch_gives_its_blocks_back_only_once_no_byte_can_land():
    g = _grants(quarantine=1.0)
    slot = g.admit_pull(1, "f", 2, 10, 0, lease_gen=7, one_sided=True, ids=np.array([4, 5]))
    g.begin_receive(slot)
    g.fail("f", DeadlineError("late"), now=0.5)
    assert g.take_freed() == []  # the reader still runs
    g.end_receive(slot, 0, now=0.6)
    assert g.take_freed() == []  # one-sided: the quarantine holds
    g.reap(now=1.6)
    assert [s.req for s in g.take_freed()] == ["f"] and g.allocator.num_free == 16
    with pytest.raises(BlockError):
        g.admit_pull(1, "g", 2, 10, 0, lease_gen=8, ids=np.array([4, 5, 6]))


def test_ranges_are_rechecked_unless_they_cannot_have_changed():
    """A session's coverage (read-only, owning its bytes) is checked once; ranges an admission could have
    changed since (writable, or a read-only view of writable memory) are checked every time."""
    g = _grants(max_inflight=8)
    covered = np.array([[0, 10]], np.int64)
    covered.setflags(write=False)
    for i in range(2):
        assert g.admit(1, f"ro{i}", 1, 10, 0, ranges=covered)[0].nbytes == 10
    mine = np.array([[0, 10]], np.int64)
    g.admit(1, "rw", 1, 10, 0, ranges=mine)
    mine[0, 1] = 11  # past the block
    with pytest.raises(BlockError, match="within a block"):
        g.admit(1, "rw2", 1, 10, 0, ranges=mine)
    base = np.array([[0, 10]], np.int64)
    view = base.view()
    view.setflags(write=False)
    g.admit(1, "view", 1, 10, 0, ranges=view)
    base[0, 0] = 5  # a single sender no longer fills its blocks
    with pytest.raises(BlockError, match="every byte"):
        g.admit(1, "view2", 1, 10, 0, ranges=view)


def test_a_released_pull_waits_for_its_verdict_past_the_deadline():
    g = _grants()
    waiting = g.admit_pull(1, "released", 1, 5, 0, lease_gen=3)
    g.admit_pull(1, "reading", 1, 5, 0, lease_gen=4)
    g.begin_receive(waiting)
    g.end_receive(waiting, waiting.nbytes, now=1)
    assert g.releasing(waiting) is None
    assert [s.req for s in g.expired(now=5)] == ["reading"]  # the other has its Released out: the producer decides
    failed = g.expire(5, lambda s: DeadlineError(f"{s.req} late"))
    assert [s.req for s in failed] == ["reading"] and g.allocator.num_free == 15
    assert g.expire(5 + VERDICT_WAIT - 0.01, lambda s: DeadlineError("late")) == []
    assert g.confirm(waiting) is waiting  # an Ack in time hands it off
    late = g.admit_pull(1, "unanswered", 1, 5, 0, lease_gen=5)
    g.begin_receive(late)
    g.end_receive(late, late.nbytes, now=1)
    assert g.releasing(late) is None
    assert [s.req for s in g.expire(5 + VERDICT_WAIT, lambda s: DeadlineError("no verdict"))] == ["unanswered"]
    assert isinstance(g.releasing(late), DeadlineError)  # failed first: no Released may go out for it
