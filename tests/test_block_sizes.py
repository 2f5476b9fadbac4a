"""Different tokens per block on each side, byte-exact through every way a request moves.

A request of ``T`` tokens (kv heads and head_dim per token, per layer) is the reference. A prefill process pages
it into blocks of ``bs_a`` tokens at shuffled block ids (the last block partial unless ``T`` divides evenly); a
consumer pages with ``bs_b``. The request crosses by push, by offer (the consumer pulls) and by hold (the
consumer fetches into blocks it chose); token ``t`` must land in slot ``t % bs_b`` of destination block
``t // bs_b``, and nothing else may change: not the other blocks, not the unused slots of a partial last block.
Over tcp and nixl, per-layer HND and NHD caches; and tensor-parallel shards with different block sizes at once.
"""

from __future__ import annotations

import numpy as np
import pytest

from conformance.peers import wait_for
from conformance.rawpeer import RawPeer
from kvxfer import BlockError, Consumer, IncompatibleError, KVLayout, Producer, wire
from kvxfer.shard import heads_of
from procs import PipedProcess

LAYERS, HEADS, DIM, NUM_BLOCKS = 2, 4, 8, 16


def reference(tokens: int, seed: int = 7) -> list[np.ndarray]:
    """Per layer ``[tokens, heads, dim]``: what the request's KV means, whatever the paging."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 2**16, (tokens, HEADS, DIM), dtype=np.uint16) for _ in range(LAYERS)]


def blank(kind: str, bs: int, held: tuple[int, int]) -> list[np.ndarray]:
    h = held[1] - held[0]
    shape = (NUM_BLOCKS, h, bs, DIM) if kind == "hnd" else (NUM_BLOCKS, bs, h, DIM)
    return [np.zeros(shape, dtype=np.uint16) for _ in range(LAYERS)]


def _view(t: np.ndarray, kind: str) -> np.ndarray:
    """A cache as ``[blocks, slot, heads, dim]``, whatever its memory order."""
    return t.transpose(0, 2, 1, 3) if kind == "hnd" else t


def paged(ref: list[np.ndarray], kind: str, bs: int, ids: np.ndarray, held: tuple[int, int]) -> list[np.ndarray]:
    """The reference's heads ``held`` paged into blocks ``ids`` of ``bs`` tokens."""
    out = blank(kind, bs, held)
    t = np.arange(len(ref[0]))
    for layer, r in zip(out, ref, strict=True):
        _view(layer, kind)[ids[t // bs], t % bs] = r[:, held[0] : held[1]]
    return out


def layout(tensors, kind: str, bs: int, held: tuple[int, int] | None = None) -> KVLayout:
    return KVLayout.from_tensors(tensors, block_size=bs, dims="BHND" if kind == "hnd" else "BNHD", heads=held)


def check(tensors, kind: str, bs: int, ids, ref: list[np.ndarray], held: tuple[int, int]) -> None:
    """Token for token into ``ids``; every other byte still zero (other blocks, a partial block's free slots)."""
    ids = np.asarray(ids)
    tokens = len(ref[0])
    assert len(ids) == -(-tokens // bs)
    t = np.arange(tokens)
    for layer, (got, r) in enumerate(zip(tensors, ref, strict=True)):
        v = _view(got, kind)
        np.testing.assert_array_equal(v[ids[t // bs], t % bs], r[:, held[0] : held[1]], err_msg=f"layer {layer}")
        mask = np.ones(v.shape[:2], dtype=bool)
        mask[ids[t // bs], t % bs] = False
        assert not v[mask].any(), "bytes landed outside the request's token slots"


def src_ids(tokens: int, bs: int) -> np.ndarray:
    return np.random.default_rng(tokens + bs).permutation(NUM_BLOCKS)[: -(-tokens // bs)]


def _prefill_main(conn, transport: str) -> None:
    """A prefill process: ``setup`` pages the reference into its own cache; ``push``/``offer``/``hold`` move it."""
    from procs import outcome, serve

    state: dict = {}

    def setup(kind: str, bs: int, tokens: int, held) -> list[int]:
        if "producer" in state:
            state.pop("producer").close()
        held = tuple(held) if held is not None else None
        ids = src_ids(tokens, bs)
        state["tensors"] = paged(reference(tokens), kind, bs, ids, held or (0, HEADS))
        lay = layout(state["tensors"], kind, bs, held)
        state["producer"] = Producer(lay, transport=transport, listen="127.0.0.1:0", deadline=10, lease=10)
        state["ids"], state["tokens"] = ids, tokens
        return ids.tolist()

    def push(address: str, req: str, senders: int = 1, part: int = 0, heads=None) -> dict:
        p = state["producer"]
        return outcome(
            p.push(address, req, state["ids"], tokens=state["tokens"], senders=senders, part=part, heads=heads)
        )

    def offer(address: str, req: str) -> dict:
        return outcome(state["producer"].offer(address, req, state["ids"], tokens=state["tokens"]))

    def hold(req: str) -> dict:
        state["hold"] = state["producer"].hold(req, state["ids"], tokens=state["tokens"])
        return state["hold"].ticket

    def held_end() -> dict:
        return outcome(state["hold"])

    serve(conn, True, {"setup": setup, "push": push, "offer": offer, "hold": hold, "held_end": held_end})


class Prefill(PipedProcess):
    what = "prefill process"


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def prefill(request):
    procs = [Prefill(_prefill_main, request.param) for _ in range(2)]
    yield request.param, procs
    for p in procs:
        p.close()


SIZES = [(a, b) for a in (16, 32, 64) for b in (16, 32, 64)]


@pytest.mark.parametrize("mode", ["push", "pull", "fetch"])
@pytest.mark.parametrize("kind", ["hnd", "nhd"])
@pytest.mark.parametrize(("bs_a", "bs_b"), SIZES, ids=[f"{a}-into-{b}" for a, b in SIZES])
def test_blocks_map_token_for_token(prefill, mode, kind, bs_a, bs_b):
    transport, (proc, _) = prefill
    tokens = 150 if mode != "push" or bs_a != bs_b else 128
    proc.call("setup", kind, bs_a, tokens, None)
    tensors = blank(kind, bs_b, (0, HEADS))
    consumer = Consumer(layout(tensors, kind, bs_b), transport=transport, deadline=10)
    try:
        if mode == "fetch":
            ticket = proc.call("hold", "r")
            assert ticket["tokens"] == tokens
            mine = np.random.default_rng(bs_b).permutation(NUM_BLOCKS)[: -(-tokens // bs_b)]
            f = consumer.fetch(ticket["address"], "r", mine, tokens=tokens)
            assert f.wait_ended(15) and f.error is None, f.error
            assert proc.call("held_end") == {"status": "done", "error": None}
            ids = mine
        else:
            reply = proc.call(mode if mode == "push" else "offer", consumer.address, "r", timeout=30)
            assert reply == {"status": "done", "error": None}
            a = consumer.get(10)
            ids = a.block_ids
        check(tensors, kind, bs_b, ids, reference(tokens), (0, HEADS))
        if mode != "fetch":
            assert consumer.release("r")
        assert wait_for(lambda: consumer.stats()["free_blocks"] == NUM_BLOCKS, 5)
    finally:
        consumer.close()


@pytest.mark.parametrize(("bs_a", "bs_b"), [(16, 64), (64, 16)])
def test_tensor_parallel_shards_with_other_block_sizes(prefill, bs_a, bs_b):
    """TP-2 prefill ranks (two processes, each half the heads) into one TP-1 decode rank paging differently:
    each rank's heads land token for token."""
    _, procs = prefill
    tokens = 150
    for r, p in enumerate(procs):
        p.call("setup", "nhd", bs_a, tokens, list(heads_of(r, 2, HEADS)))
    tensors = blank("nhd", bs_b, (0, HEADS))
    consumer = Consumer(layout(tensors, "nhd", bs_b, (0, HEADS)), transport=prefill[0], deadline=10)
    try:
        for r, p in enumerate(procs):
            p.conn.send(("push", consumer.address, "r", 2, r, list(heads_of(r, 2, HEADS))))
        for p in procs:
            assert p.conn.poll(30)
            assert p.conn.recv() == ("ok", {"status": "done", "error": None})
        a = consumer.get(10)
        check(tensors, "nhd", bs_b, a.block_ids, reference(tokens), (0, HEADS))
    finally:
        consumer.close()


def test_a_careless_producer_names_tokens_its_blocks_do_not_hold():
    tensors = blank("hnd", 16, (0, HEADS))
    with Producer(layout(tensors, "hnd", 16), transport="tcp") as p:
        with pytest.raises(BlockError, match="40 tokens do not fill 2 blocks of 16"):
            p.push("127.0.0.1:1", "r", [0, 1], tokens=40)
        with pytest.raises(BlockError, match="16 tokens do not fill 2 blocks"):
            p.offer("127.0.0.1:1", "r", [0, 1], tokens=16)


def test_per_block_digests_refuse_blocks_that_change_size():
    """Digests are per source block: into another block size the push ends with a clear error, no block leaks."""
    src = paged(reference(40), "hnd", 16, np.arange(3), (0, HEADS))
    tensors = blank("hnd", 32, (0, HEADS))
    with Consumer(layout(tensors, "hnd", 32), transport="tcp") as c, Producer(layout(src, "hnd", 16)) as p:
        t = p.push(c.address, "r", [0, 1, 2], tokens=40, digests=True)
        assert t.wait_ended(10) and isinstance(t.error, BlockError) and "digests" in str(t.error)
        assert c.stats()["free_blocks"] == NUM_BLOCKS and not tensors[0].any()


@pytest.mark.parametrize(
    ("num_blocks", "tokens"),
    [(3, 150), (11, 150), (4, 65), (1, 1 << 40)],
    ids=["too-few", "too-many", "one-token-over", "huge"],
)
def test_a_hostile_admission_with_tokens_its_blocks_cannot_hold_is_refused(num_blocks, tokens):
    """A raw peer, authenticated, admits ``num_blocks`` blocks of 16 said to hold ``tokens``: the consumer (64
    tokens per block) answers with a typed Error frame and grants nothing."""
    src = blank("hnd", 16, (0, HEADS))
    tensors = blank("hnd", 64, (0, HEADS))
    consumer = Consumer(layout(tensors, "hnd", 64), transport="tcp", deadline=5)
    try:
        raw = RawPeer(consumer.address)
        assert isinstance(raw.hello(layout(src, "hnd", 16), "tcp"), wire.Welcome)
        raw.send(wire.Admit(req="r", num_blocks=num_blocks, deadline_ms=5000, tokens=tokens))
        reply = raw.recv()
        assert isinstance(reply, wire.Error) and reply.code == BlockError.code, reply
        assert consumer.stats()["free_blocks"] == NUM_BLOCKS
        raw.send(wire.Admit(req="ok", num_blocks=10, deadline_ms=5000, tokens=150))
        granted = raw.recv()
        assert isinstance(granted, wire.Grant) and len(wire.ids_from_bytes(granted.ids, NUM_BLOCKS)) == 3
    finally:
        consumer.close()


@pytest.mark.parametrize("packed_side", ["consumer", "producer"])
def test_a_packed_cache_maps_no_tokens_but_moves_whole_blocks(packed_side):
    """A cache whose attention kernel packs each block (``packed``) refuses a peer paging differently in the
    handshake, whichever side it is on, and still takes whole blocks from a peer paging alike."""
    ref = reference(40)
    src = paged(ref, "hnd", 16, np.arange(3), (0, HEADS))
    for bs_b, ok in ((32, False), (16, True)):
        tensors = blank("hnd", bs_b, (0, HEADS))
        b = KVLayout.from_tensors(tensors, block_size=bs_b, dims="BHND", packed=packed_side == "consumer")
        a = KVLayout.from_tensors(src, block_size=16, dims="BHND", packed=packed_side == "producer")
        with Consumer(b, transport="tcp") as c, Producer(a, transport="tcp") as p:
            t = p.push(c.address, "r", [0, 1, 2], tokens=40)
            t.wait_ended(10)
            if ok:
                assert t.error is None
                check(tensors, "hnd", bs_b, c.get(5).block_ids, ref, (0, HEADS))
            else:
                assert isinstance(t.error, IncompatibleError) and "packed" in str(t.error), t.error
                assert not tensors[0].any()
