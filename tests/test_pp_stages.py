"""Pipeline-parallel prefill: each stage holds some of the model's layers, byte-exact against one monolithic cache.

One full cache (every layer, every kv head) is the reference. A prefill stage is a producer process whose cache
holds its layers only (and, under tensor parallelism too, its heads of them), declared with
``KVLayout.from_tensors(..., layers=(lo, hi), heads=...)``. A decode rank is a consumer in the test process holding
its own layers (all of them, or a stage's). Every prefill rank whose layers overlap the decode rank's pushes those
layers (of its heads) as one part of a multi-sender request; the decode rank's blocks must equal the reference's
and every other block must stay untouched. Over tcp and nixl.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.rawpeer import RawPeer
from kvxfer import BlockError, Consumer, IncompatibleError, KVLayout, Producer, wire
from kvxfer.shard import heads_of
from procs import PipedProcess

LAYERS, HEADS, NUM_BLOCKS, BLOCK, DIM = 4, 4, 16, 4, 8
SRC = np.array([9, 2, 14, 5])


def reference() -> list[np.ndarray]:
    rng = np.random.default_rng(11)
    return [rng.integers(1, 2**16, (NUM_BLOCKS, HEADS, BLOCK, DIM), dtype=np.uint16) for _ in range(LAYERS)]


def stages(pp: int) -> list[tuple[int, int]]:
    """vLLM's even split of the layers into ``pp`` stages."""
    n = LAYERS // pp
    return [(s * n, (s + 1) * n) for s in range(pp)]


def cache(layers: tuple[int, int], heads: tuple[int, int], zero: bool = False) -> list[np.ndarray]:
    out = [np.ascontiguousarray(t[:, heads[0] : heads[1]]) for t in reference()[layers[0] : layers[1]]]
    return [np.zeros_like(t) for t in out] if zero else out


def layout(tensors, layers: tuple[int, int] | None, heads: tuple[int, int] | None) -> KVLayout:
    return KVLayout.from_tensors(tensors, dims="BHND", layers=layers, heads=heads)


def _rank_main(conn, transport: str) -> None:
    from procs import outcome, serve

    state: dict = {}

    def setup(layers, heads) -> None:
        if "producer" in state:
            state.pop("producer").close()
        layers, heads = tuple(layers), tuple(heads)
        state["tensors"] = cache(layers, heads)
        lay = layout(state["tensors"], layers, heads if heads != (0, HEADS) else None)
        state["producer"] = Producer(lay, transport=transport, deadline=10)

    def push(address: str, req: str, senders: int, part: int, layers, heads) -> dict:
        p = state["producer"]
        return outcome(p.push(address, req, SRC, senders=senders, part=part, layers=layers, heads=heads))

    serve(conn, True, {"setup": setup, "push": push})


class Rank(PipedProcess):
    what = "prefill rank"


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def ranks(request):
    procs = [Rank(_rank_main, request.param) for _ in range(4)]
    yield request.param, procs
    for p in procs:
        p.close()


# (prefill pp, prefill tp, decode pp): decode ranks hold every head
CASES = [(2, 1, 1), (4, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 2), (4, 1, 2), (2, 1, 4)]


@pytest.mark.parametrize("pp,tp,dpp", CASES, ids=[f"pp{p}-tp{t}-into-pp{d}" for p, t, d in CASES])
def test_prefill_stages_into_decode_stages_are_byte_exact(ranks, pp, tp, dpp):
    transport, procs = ranks
    prefill = [(st, heads_of(r, tp, HEADS)) for st in stages(pp) for r in range(tp)]
    for proc, (st, hs) in zip(procs, prefill, strict=False):
        proc.call("setup", list(st), list(hs))
    decode = []
    for st in stages(dpp):
        tensors = cache(st, (0, HEADS), zero=True)
        decode.append((st, Consumer(layout(tensors, st if dpp > 1 else None, None), transport=transport), tensors))
    try:
        for c, (dst, consumer, _) in enumerate(decode):
            parts = [
                (i, (max(st[0], dst[0]), min(st[1], dst[1])), hs)
                for i, (st, hs) in enumerate(prefill)
                if max(st[0], dst[0]) < min(st[1], dst[1])
            ]
            for k, (i, (lo, hi), hs) in enumerate(parts):
                heads = list(hs) if tp > 1 else None
                procs[i].conn.send(("push", consumer.address, f"req-{c}", len(parts), k, list(range(lo, hi)), heads))
            for i, _, _ in parts:
                assert procs[i].conn.poll(30), "a prefill rank did not answer"
                assert procs[i].conn.recv() == ("ok", {"status": "done", "error": None})
        for c, (dst, consumer, tensors) in enumerate(decode):
            a = consumer.get(10)
            assert a.req == f"req-{c}"
            others = np.setdiff1d(np.arange(NUM_BLOCKS), a.block_ids)
            for got, want in zip(tensors, reference()[dst[0] : dst[1]], strict=True):
                np.testing.assert_array_equal(got[a.block_ids], want[SRC])
                assert not got[others].any(), "bytes landed outside the granted blocks"
    finally:
        for _, consumer, _ in decode:
            consumer.close()


def test_a_stage_declaring_layers_its_tensors_do_not_hold_is_refused():
    from kvxfer import LayoutError

    with pytest.raises(LayoutError, match="layers \\[0, 3\\) do not match the 2 layers"):
        layout(cache((0, 2), (0, HEADS)), (0, 3), None)


def test_hostile_stage_admissions_are_refused_and_leak_nothing():
    """A raw peer holding layers [0, 2) admits parts naming layers it does not hold, a single sender covering
    half the consumer's layers, and layers the model does not have: each ``Error(blocks)``, nothing granted."""
    consumer = Consumer(layout(cache((0, LAYERS), (0, HEADS), zero=True), None, None), transport="tcp")
    try:
        raw = RawPeer(consumer.address)
        assert isinstance(raw.hello(layout(cache((0, 2), (0, HEADS)), (0, 2), None), "tcp"), wire.Welcome)
        for i, fields in enumerate(
            [
                {"layers": [2, 3], "senders": 2},  # not held by the sender
                {"layers": [0, 7], "senders": 2},
                {},  # alone, half the consumer's layers
                {"layers": [0, 1]},  # likewise, named
            ]
        ):
            raw.send(wire.Admit(req=f"bad-{i}", num_blocks=2, deadline_ms=10_000, **fields))
            reply = raw.recv()
            assert isinstance(reply, wire.Error) and reply.code == BlockError.code, (fields, reply)
        assert consumer.stats()["free_blocks"] == NUM_BLOCKS
    finally:
        consumer.close()


def test_stages_sharing_no_layer_do_not_pair():
    a = layout(cache((0, 2), (0, HEADS)), (0, 2), None)
    b = layout(cache((2, 4), (0, HEADS), zero=True), (2, 4), None)
    with Consumer(b, transport="tcp") as c, Producer(a, transport="tcp") as p:
        t = p.push(c.address, "r", SRC[:2])
        assert t.wait_ended(10) and isinstance(t.error, IncompatibleError), t.error
