"""The GuardedAllocator catches what it exists to catch, and a clean transfer through a real Consumer trips
nothing."""

import numpy as np
import pytest

from conformance.kvspec import Spec
from kvxfer import Consumer, Producer
from support import POISON, BadFree, BlockBytes, GuardedAllocator, content

SPEC = Spec(num_blocks=16)


def _guard(reserved=()):
    tensors, kw, _, raw = SPEC.build(fill=0)
    layout = SPEC.layout(tensors, kw)
    return GuardedAllocator(layout, reserved=reserved), raw, layout


def test_double_free_is_caught():
    g, _, _ = _guard()
    ids = g.allocate(3)
    g.free(ids)
    with pytest.raises(BadFree):
        g.free(ids[:1])
    assert [f.kind for f in g.bad_frees()] == ["double_free"]
    assert g.full


def test_free_of_a_block_never_allocated_is_caught():
    g, _, _ = _guard(reserved=[0])
    with pytest.raises(BadFree):
        g.free(np.array([5]))
    with pytest.raises(BadFree):
        g.free(np.array([0]))  # reserved (vLLM's null block)
    with pytest.raises(BadFree):
        g.free(np.array([99]))
    assert [f.kind for f in g.bad_frees()] == ["foreign_free"] * 3
    assert g.num_free == g.capacity == 15


def test_free_poisons_and_a_write_after_free_is_caught():
    g, raw, layout = _guard()
    ids = g.allocate(4)
    raw[1][ids[2], 0, 0, 0] = 7.0  # the runtime writes while it owns the block: fine
    g.free(ids)
    assert not BlockBytes(layout).differs(ids, POISON).any(), "every byte of a freed block is poisoned"
    assert g.check() == []
    raw[2][ids[1], 3, 1, 5] = 1.0  # a byte lands in a freed block (layer 2)
    faults = g.check()
    assert [(f.kind, f.blocks) for f in faults] == [("write_after_free", (int(ids[1]),))]


def test_a_write_after_free_is_caught_when_the_block_is_handed_out_again():
    g, raw, _ = _guard()
    ids = g.allocate(2)
    g.free(ids)
    raw[0][ids[0], -1, -1, -1] = 3.0
    again = g.allocate(2)  # LIFO: the same blocks come back first
    assert sorted(again.tolist()) == sorted(ids.tolist())
    assert [(f.where, f.blocks) for f in g.faults] == [("allocate", (int(ids[0]),))]


def test_a_clean_push_through_a_real_consumer_trips_nothing():
    tensors, kw, _, _ = SPEC.build(fill=0)
    clayout = SPEC.layout(tensors, kw)
    g = GuardedAllocator(clayout)
    src_t, src_kw, _, _ = SPEC.build(seed=1)
    playout = SPEC.layout(src_t, src_kw)
    BlockBytes(playout).write([3, 4, 5], content("r1", 3, playout.block_bytes))
    with Consumer(clayout, transport="tcp", allocator=g) as c, Producer(playout, transport="tcp") as p:
        p.push(c.address, "r1", [3, 4, 5]).wait(10)
        a = c.get(5)
        assert (BlockBytes(clayout).read(a.block_ids) == content("r1", 3, clayout.block_bytes)).all()
        assert c.release("r1")
        assert c.stats()["free_blocks"] == g.capacity
    assert g.check() == [] and g.bad_frees() == []
