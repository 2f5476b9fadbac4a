"""Tensor-parallel prefill into another tensor-parallel decode, byte-exact against one monolithic cache.

One full KV cache (every kv head) is the reference. Each prefill rank of TP ``p`` is a producer process holding
its heads exactly as vLLM shards them (``shard.heads_of``: an even split, or replicas when there are fewer heads
than ranks), copied into a cache of its own whose layout declares those heads. Each decode rank of TP ``d`` is a
consumer (in the test process) holding its own heads. For every decode rank, the prefill ranks that
``shard.sources`` names push their share of the request's heads, each as one part of a multi-sender request; the
decode rank's blocks, read back, must equal the reference's heads for those blocks, and every other block must stay
untouched. A replicated head is shipped once. Over tcp and nixl, per-layer HND and NHD caches.

The same shapes by fetch: every prefill rank holds the request (under an id of its own), every decode rank fetches
its heads from the ranks ``shard.sources`` names into blocks it chose (``partial`` when a rank holds only some of
them), each hold counting the decode ranks that read it (``readers``); a hold no decode rank reads is declined.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.peers import wait_for
from kvxfer import BlockError, Consumer, IncompatibleError, KVLayout, KVXferError, Producer
from kvxfer.shard import heads_of, sources
from procs import PipedProcess, RemoteError, outcome, serve

LAYERS, NUM_BLOCKS, BLOCK, HEAD_DIM = 2, 24, 4, 8
SRC = np.array([5, 17, 2, 9, 11])  # the request's blocks on every prefill rank (same ids: one scheduler)


def reference(kind: str, heads: int) -> list[np.ndarray]:
    """The monolithic cache: per layer ``[blocks, heads, block, dim]`` (HND) or ``[blocks, block, heads, dim]``."""
    rng = np.random.default_rng(heads * 10 + len(kind))
    shape = (NUM_BLOCKS, heads, BLOCK, HEAD_DIM) if kind == "hnd" else (NUM_BLOCKS, BLOCK, heads, HEAD_DIM)
    return [rng.integers(0, 2**16, shape, dtype=np.uint16).view(np.float16) for _ in range(LAYERS)]


def shard(full: list[np.ndarray], kind: str, held: tuple[int, int], zero: bool = False) -> list[np.ndarray]:
    """A rank's own cache: its heads of every layer, contiguous (as a TP rank allocates it)."""
    axis = 1 if kind == "hnd" else 2
    out = [np.ascontiguousarray(np.take(t, range(*held), axis=axis)) for t in full]
    return [np.zeros_like(t) for t in out] if zero else out


def layout(tensors: list[np.ndarray], kind: str, held: tuple[int, int]) -> KVLayout:
    return KVLayout.from_tensors(tensors, dims="BHND" if kind == "hnd" else "BNHD", heads=held)


def _rank_main(conn, transport: str) -> None:
    """A prefill rank: ``setup`` builds its shard of a reference cache and a Producer; ``push`` ships a part."""
    state: dict = {}

    def setup(kind: str, heads: int, rank: int, tp: int) -> list[int]:
        if "producer" in state:
            state.pop("producer").close()
        held = heads_of(rank, tp, heads)
        state["tensors"] = shard(reference(kind, heads), kind, held)
        state["producer"] = Producer(
            layout(state["tensors"], kind, held), transport=transport, listen="127.0.0.1:0", inline_max=0
        )
        state["holds"] = {}
        return list(held)

    def push(address: str, req: str, senders: int, part: int, heads) -> dict:
        return outcome(state["producer"].push(address, req, SRC, senders=senders, part=part, heads=heads, deadline=10))

    def hold(req: str, lease: float, digests: bool = False) -> str:
        state["holds"][req] = state["producer"].hold(req, SRC, lease=lease, digests=digests)
        return state["producer"].address

    def held(req: str) -> dict:
        return outcome(state["holds"].pop(req))

    serve(conn, True, {"setup": setup, "push": push, "hold": hold, "held": held})


class Rank(PipedProcess):
    what = "prefill rank"


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def ranks(request):
    """Eight prefill-rank processes, reused by every case of one transport."""
    procs = [Rank(_rank_main, request.param) for _ in range(8)]
    yield request.param, procs
    for p in procs:
        p.close()


def _decode_rank(transport: str, kind: str, heads: int, c: int, d: int) -> tuple[Consumer, list[np.ndarray]]:
    """Decode rank ``c`` of ``d``: a consumer over a zeroed cache of its heads."""
    held = heads_of(c, d, heads)
    tensors = shard(reference(kind, heads), kind, held, zero=True)
    return Consumer(layout(tensors, kind, held), transport=transport, deadline=10), tensors


CASES = [(8, p, d) for p, d in [(1, 2), (2, 1), (2, 8), (8, 2), (8, 4), (4, 8), (4, 4)]]
CASES += [(2, p, d) for p, d in [(4, 1), (1, 4), (8, 2), (2, 8)]]  # fewer kv heads than ranks: replicas


@pytest.mark.parametrize("kind", ["hnd", "nhd"])
@pytest.mark.parametrize("heads,p,d", CASES, ids=[f"H{h}-tp{p}-into-tp{d}" for h, p, d in CASES])
def test_prefill_tp_into_decode_tp_is_byte_exact(ranks, kind, heads, p, d):
    transport, procs = ranks
    for r in range(p):
        assert tuple(procs[r].call("setup", kind, heads, r, p)) == heads_of(r, p, heads)
    full = reference(kind, heads)
    decode = [_decode_rank(transport, kind, heads, c, d) for c in range(d)]
    try:
        shipped: list[int] = []
        for c, (consumer, _) in enumerate(decode):
            parts = sources(c, d, p, heads)
            for i, (r, hs) in enumerate(parts):
                procs[r].conn.send(("push", consumer.address, f"req-{c}", len(parts), i, list(hs)))
                shipped += list(range(*hs))
            for r, _ in parts:
                assert procs[r].conn.poll(30), "a prefill rank did not answer"
                reply = procs[r].conn.recv()
                assert reply[0] == "ok" and reply[1] == {"status": "done", "error": None}, reply
        assert sorted(shipped) == sorted(h for c in range(d) for h in range(*heads_of(c, d, heads)))  # each once
        for c, (consumer, tensors) in enumerate(decode):
            a = consumer.get(10)
            assert a.req == f"req-{c}" and len(a.block_ids) == len(SRC)
            want = shard(full, kind, heads_of(c, d, heads))
            others = np.setdiff1d(np.arange(NUM_BLOCKS), a.block_ids)
            for got, ref in zip(tensors, want, strict=True):
                assert np.array_equal(got[a.block_ids].view(np.uint16), ref[SRC].view(np.uint16))
                assert not got[others].view(np.uint16).any(), "bytes landed outside the granted blocks"
            assert consumer.release(a.req)
    finally:
        for consumer, _ in decode:
            consumer.close()


def test_shards_that_share_no_heads_do_not_pair(ranks):
    """A prefill rank holding heads 0-3 cannot push to a decode rank holding heads 4-7: the handshake says so."""
    transport, procs = ranks
    procs[0].call("setup", "hnd", 8, 0, 2)
    consumer, _ = _decode_rank(transport, "hnd", 8, 1, 2)
    try:
        reply = procs[0].call("push", consumer.address, "far", 1, 0, None)
        assert reply == {"status": "failed", "error": "IncompatibleError"}
    finally:
        consumer.close()


def test_hostile_and_careless_parts_are_refused(ranks):
    """Overlapping heads, heads outside the consumer's, a partial single sender, heads and layers at once."""
    transport, procs = ranks
    procs[0].call("setup", "nhd", 8, 0, 1)  # holds every head
    consumer, _ = _decode_rank(transport, "nhd", 8, 0, 2)  # holds heads 0-3
    try:
        procs[3].call("setup", "nhd", 8, 0, 1)
        procs[3].conn.send(("push", consumer.address, "r", 2, 0, [0, 2]))  # done once its other part is
        wait_for(lambda: consumer.stats()["inflight"] == 1, 10)
        overlap = procs[0].call("push", consumer.address, "r", 2, 1, [1, 4])
        assert overlap == {"status": "failed", "error": "BlockError"}
        assert procs[0].call("push", consumer.address, "r", 2, 1, [2, 4]) == {"status": "done", "error": None}
        assert procs[3].conn.poll(20) and procs[3].conn.recv() == ("ok", {"status": "done", "error": None})
        outside = procs[0].call("push", consumer.address, "q", 2, 0, [3, 6])
        assert outside["error"] in ("BlockError", "IncompatibleError")
        procs[1].call("setup", "nhd", 8, 0, 2)  # holds heads 0-3, as the consumer
        assert procs[1].call("push", consumer.address, "whole", 1, 0, None) == {"status": "done", "error": None}
        procs[2].call("setup", "nhd", 8, 0, 4)  # holds heads 0-1 of the consumer's 0-3
        alone = procs[2].call("push", consumer.address, "partial", 1, 0, None)
        assert alone == {"status": "failed", "error": "BlockError"}
        some = procs[2].call("push", consumer.address, "some", 1, 0, [0, 1])  # alone, some heads are not enough
        assert some == {"status": "failed", "error": "BlockError"}
        with pytest.raises(RemoteError, match="BlockError"):
            procs[2].call("push", consumer.address, "theirs", 2, 0, [2, 4])  # heads this producer does not hold
        got = sorted(consumer.get(10).req for _ in range(2))
        assert got == ["r", "whole"]
        assert consumer.release("r") and consumer.release("whole")
        assert consumer.stats()["inflight"] == 0
    finally:
        consumer.close()


def test_a_layout_declaring_heads_it_does_not_hold_is_refused():
    t = shard(reference("hnd", 8), "hnd", (0, 4))
    with pytest.raises(Exception, match="heads"):
        layout(t, "hnd", (0, 3))
    with pytest.raises(Exception, match="heads"):
        layout(t, "hnd", (4, 4))
    assert layout(t, "hnd", (4, 8)).heads == (4, 8)
    with pytest.raises((BlockError, IncompatibleError)):
        sources(0, 3, 2, 8)


class _Declared:
    """A layout whose ``desc()`` claims other heads than it holds: what a hostile peer can put on the wire."""

    def __init__(self, real: KVLayout, heads: list[int]):
        self.real, self.heads = real, heads

    def desc(self):
        import msgspec

        return msgspec.structs.replace(self.real.desc(), heads=self.heads)

    def __getattr__(self, name):
        return getattr(self.real, name)


@pytest.mark.parametrize("transport", ["tcp"])
def test_hostile_admissions_between_shards_are_refused_and_leak_nothing(transport):
    """A raw peer (the documented protocol by hand) holding heads 0-3 of 8 talks to a consumer holding all 8: heads it
    does not hold, reversed or out-of-range heads, heads with layers, a partial single sender, an overlap; then a
    handshake whose declared heads do not match its layout. Each is refused with the right code, nothing leaks."""
    from conformance.rawpeer import RawPeer
    from kvxfer import wire

    full = shard(reference("hnd", 8), "hnd", (0, 8), zero=True)
    consumer = Consumer(layout(full, "hnd", (0, 8)), transport=transport, deadline=10)
    mine = layout(shard(reference("hnd", 8), "hnd", (0, 4)), "hnd", (0, 4))
    raw = RawPeer(consumer.address)
    try:
        assert isinstance(raw.hello(mine, transport), wire.Welcome)
        bad = [
            {"heads": [4, 8], "senders": 2},  # not held by the sender
            {"heads": [3, 2], "senders": 2},
            {"heads": [0, 9], "senders": 2},
            {"heads": [0, 1], "layers": [0, 5], "senders": 2},  # heads of layers the model does not have
            {"heads": [0, 1], "layers": [0, 0], "senders": 2},  # a layer twice
            {"heads": [0, 4]},  # alone, half the consumer's heads
            {},  # alone, a whole push of a sender holding half
        ]
        for i, fields in enumerate(bad):
            raw.send(wire.Admit(req=f"bad-{i}", num_blocks=2, deadline_ms=10_000, **fields))
            reply = raw.recv()
            assert isinstance(reply, wire.Error) and reply.code == "blocks", (fields, reply)
        raw.send(wire.Admit(req="ok", num_blocks=2, deadline_ms=10_000, heads=[0, 4], senders=2, part=0))
        assert isinstance(raw.recv(), wire.Grant)
        raw.send(wire.Admit(req="ok", num_blocks=2, deadline_ms=10_000, heads=[2, 4], senders=2, part=1))
        reply = raw.recv()
        assert isinstance(reply, wire.Error) and reply.code == "blocks", reply  # overlaps part 0
        raw.send(wire.Cancel(req="ok", gen=0, reason="done testing"))
        wait_for(lambda: consumer.stats()["inflight"] == 0 and consumer.stats()["free_blocks"] == NUM_BLOCKS, 10)
    finally:
        raw.close()
    liar = RawPeer(consumer.address)
    try:
        reply = liar.hello(_Declared(mine, [0, 3]), transport)  # a 4-head cache claiming 3 heads
        assert isinstance(reply, wire.Error) and reply.code == "protocol", reply
    finally:
        liar.close()
        consumer.close()


def _readers(p: int, d: int, heads: int) -> dict[int, int]:
    """Prefill rank -> how many decode ranks fetch from it."""
    n: dict[int, int] = {}
    for c in range(d):
        for r, _ in sources(c, d, p, heads):
            n[r] = n.get(r, 0) + 1
    return n


FETCH_CASES = [(8, 2, 1), (8, 1, 2), (8, 4, 2), (8, 2, 4), (2, 4, 1), (2, 1, 4)]


@pytest.mark.parametrize("kind", ["hnd", "nhd"])
@pytest.mark.parametrize("heads,p,d", FETCH_CASES, ids=[f"H{h}-tp{p}-into-tp{d}" for h, p, d in FETCH_CASES])
def test_decode_ranks_fetch_their_heads_from_prefill_rank_holds(ranks, kind, heads, p, d):
    transport, procs = ranks
    for r in range(p):
        procs[r].call("setup", kind, heads, r, p)
    full = reference(kind, heads)
    readers = _readers(p, d, heads)
    # digests cover a prefill rank's whole blocks: a decode rank holding other heads fetches without them
    addresses = [procs[r].call("hold", f"req@{r}", 20, True) for r in range(p)]
    decode = [_decode_rank(transport, kind, heads, c, d) for c in range(d)]
    dst = np.array([20, 3, 7, 0, 14])
    try:
        fetches = []
        for c, (consumer, _) in enumerate(decode):
            parts = sources(c, d, p, heads)
            for r, _ in parts:
                fetches.append(
                    consumer.fetch(
                        addresses[r], f"req@{r}", dst, readers=readers[r], partial=len(parts) > 1, deadline=10
                    )
                )
        for r in range(p):
            if r not in readers:  # a replica no decode rank reads: its prefill frees it now
                decode[0][0].decline(addresses[r], f"req@{r}", "a replica another rank holds")
        for f in fetches:
            f.wait(15)
        for r in range(p):
            want = "done" if r in readers else "cancelled"
            assert procs[r].call("held", f"req@{r}")["status"] == want, f"prefill rank {r}'s hold"
        others = np.setdiff1d(np.arange(NUM_BLOCKS), dst)
        for c, (_, tensors) in enumerate(decode):
            want = shard(full, kind, heads_of(c, d, heads))
            for got, ref in zip(tensors, want, strict=True):
                assert np.array_equal(got[dst].view(np.uint16), ref[SRC].view(np.uint16))
                assert not got[others].view(np.uint16).any(), "bytes landed outside the fetched blocks"
    finally:
        for consumer, _ in decode:
            consumer.close()


def test_a_fetch_from_a_rank_holding_some_of_our_heads_must_say_partial(ranks):
    """A decode rank holding every head fetching one prefill rank's half without ``partial`` would get blocks
    half filled: refused, and the hold is still there for a fetch that says it."""
    transport, procs = ranks
    procs[0].call("setup", "nhd", 8, 0, 2)
    address = procs[0].call("hold", "half", 20)
    consumer, tensors = _decode_rank(transport, "nhd", 8, 0, 1)
    try:
        with pytest.raises(IncompatibleError, match="partial=True"):
            consumer.fetch(address, "half", [1, 2, 3, 4, 5], deadline=10).wait(15)
        consumer.fetch(address, "half", [1, 2, 3, 4, 5], partial=True, deadline=10).wait(15)
        assert procs[0].call("held", "half")["status"] == "done"
        want = shard(reference("nhd", 8), "nhd", (0, 4))
        for got, ref in zip(tensors, want, strict=True):
            assert np.array_equal(got[1:6, :, :4].view(np.uint16), ref[SRC].view(np.uint16))
            assert not got[:, :, 4:].view(np.uint16).any(), "heads the rank does not hold were written"
    finally:
        consumer.close()


def test_a_hold_read_by_several_decode_ranks_ends_after_the_last_read(ranks):
    """One prefill rank, two decode ranks each reading their heads: the hold stays after the first read, a third
    fetch or one disagreeing on the number of readers is refused, and the hold ends done after the second."""
    transport, procs = ranks
    procs[0].call("setup", "hnd", 4, 0, 1)
    address = procs[0].call("hold", "two", 20)
    decode = [_decode_rank(transport, "hnd", 4, c, 2) for c in range(2)]
    third, _ = _decode_rank(transport, "hnd", 4, 0, 2)
    try:
        decode[0][0].fetch(address, "two", [0, 1, 2, 3, 4], readers=2, deadline=10).wait(15)
        with pytest.raises(BlockError, match="readers"):
            third.fetch(address, "two", [0, 1, 2, 3, 4], readers=3, deadline=10).wait(15)
        decode[1][0].fetch(address, "two", [5, 6, 7, 8, 9], readers=2, deadline=10).wait(15)
        assert procs[0].call("held", "two") == {"status": "done", "error": None}
        with pytest.raises(KVXferError):
            third.fetch(address, "two", [0, 1, 2, 3, 4], readers=2, deadline=10).wait(15)
        full = reference("hnd", 4)
        for c, ids in ((0, slice(0, 5)), (1, slice(5, 10))):
            want = shard(full, "hnd", heads_of(c, 2, 4))
            for got, ref in zip(decode[c][1], want, strict=True):
                assert np.array_equal(got[ids].view(np.uint16), ref[SRC].view(np.uint16))
    finally:
        third.close()
        for consumer, _ in decode:
            consumer.close()
