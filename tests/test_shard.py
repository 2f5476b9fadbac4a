"""Tensor-parallel shards: one monolithic KV cache, sharded as vLLM shards it for prefill TP p and decode TP d,
moved rank to rank through ``shard_pairing`` plans (every byte copied at the addresses the plan names), and
reassembled on the decode side: it equals the reference, head for head, and every other block is untouched."""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest

from kvxfer import BlockError, IncompatibleError, KVLayout
from kvxfer.paging import paging
from kvxfer.plan import dim_ranges, make_plan
from kvxfer.shard import check_shards, heads_of, shard_pairing, sources

NB, L, BS, D = 12, 2, 4, 3  # blocks, layers, tokens per block, head_dim (K and V: 2 * D values per token)
TPS = (1, 2, 4, 8)


def _rank_tensors(kind: str, ref: list[np.ndarray] | None, heads: tuple[int, int], bs: int = BS):
    """One rank's cache holding ``heads`` of every layer, in ``kind``'s memory order, filled from the logical
    reference ``ref`` (per layer ``[NB, H, bs, 2D]``) or zero; returns (tensors, from_tensors kwargs, logical)."""
    h = heads[1] - heads[0]
    tensors, logical = [], []
    for layer in range(L):
        src = None if ref is None else ref[layer][:, heads[0] : heads[1]]
        if kind == "hnd":
            t = np.zeros((NB, h, bs, 2 * D), np.uint8) if src is None else src.copy()
            view = lambda t=t: t  # noqa: E731
            dims = "BHND"
        elif kind == "nhd":
            t = (
                np.zeros((NB, bs, h, 2 * D), np.uint8)
                if src is None
                else np.ascontiguousarray(src.transpose(0, 2, 1, 3))
            )
            view = lambda t=t: t.transpose(0, 2, 1, 3)  # noqa: E731
            dims = "BNHD"
        else:  # kv_leading: [2, NB, BS, h, D], K then V
            t = np.zeros((2, NB, bs, h, D), np.uint8)
            if src is not None:
                t[0] = src[..., :D].transpose(0, 2, 1, 3)
                t[1] = src[..., D:].transpose(0, 2, 1, 3)
            view = lambda t=t: np.concatenate([t[0], t[1]], -1).transpose(0, 2, 1, 3)  # noqa: E731
            dims = "KBNHD"
        tensors.append(t)
        logical.append(view)
    return tensors, {"dims": dims}, logical


def _run(plan, a: KVLayout, b: KVLayout) -> None:
    """Copy every descriptor's bytes: what a transport does, with memmove."""
    for sr, so, dr, do, n in zip(
        plan.src.region, plan.src.offset, plan.dst.region, plan.dst.offset, plan.src.nbytes, strict=True
    ):
        ctypes.memmove(b.regions[dr].ptr + int(do), a.regions[sr].ptr + int(so), int(n))


@pytest.mark.parametrize("kind", ["hnd", "nhd", "kv_leading"])
@pytest.mark.parametrize("num_heads", [8, 2])
def test_every_tp_pair_reassembles_the_reference(kind, num_heads):
    rng = np.random.default_rng(7)
    ref = [rng.integers(1, 256, (NB, num_heads, BS, 2 * D), dtype=np.uint8) for _ in range(L)]
    src_ids = np.array([5, 0, 9, 3])
    dst_ids = np.array([2, 11, 4, 7])
    for p, d in itertools.product(TPS, TPS):
        prod = []
        for r in range(p):
            held = heads_of(r, p, num_heads)
            tensors, kw, _ = _rank_tensors(kind, ref, held)
            prod.append((KVLayout.from_tensors(tensors, block_size=BS, **kw), held, tensors))
        for q in range(d):
            held = heads_of(q, d, num_heads)
            tensors, kw, logical = _rank_tensors(kind, None, held)
            dst = KVLayout.from_tensors(tensors, block_size=BS, **kw)
            plans = sources(q, d, p, num_heads)
            covered = sorted(h for _, (lo, hi) in plans for h in range(lo, hi))
            assert covered == list(range(*held)), (p, d, q, plans)  # every head once
            for r, heads in plans:
                src, src_held, _ = prod[r]
                plan = make_plan(shard_pairing(src, src_held, dst, held, heads), src_ids, dst_ids, NB, NB)
                _run(plan, src, dst)
            for layer in range(L):
                got = logical[layer]()
                want = ref[layer][src_ids, held[0] : held[1]]
                np.testing.assert_array_equal(got[dst_ids], want, err_msg=f"TP {p} -> {d}, rank {q}, layer {layer}")
                others = np.setdiff1d(np.arange(NB), dst_ids)
                assert not got[others].any(), (p, d, q, layer)


def test_replicated_heads_ship_once_from_the_lowest_rank():
    assert [heads_of(r, 8, 2) for r in range(8)] == [(0, 1)] * 4 + [(1, 2)] * 4
    assert sources(0, 2, 8, 2) == [(0, (0, 1))]  # ranks 1-3 hold the same head: not asked again
    assert sources(0, 1, 8, 2) == [(0, (0, 1)), (4, (1, 2))]
    assert sources(3, 4, 2, 8) == [(1, (6, 8))]  # p < d: one producer rank feeds several consumer ranks


def test_head_ranges_follow_the_memory_order():
    hnd, _, _ = _rank_tensors("hnd", None, (0, 4))
    nhd, _, _ = _rank_tensors("nhd", None, (0, 4))
    a = KVLayout.from_tensors(hnd, block_size=BS, dims="BHND")
    b = KVLayout.from_tensors(nhd, block_size=BS, dims="BNHD")
    head = BS * 2 * D  # bytes of one head in one layer of one block
    assert dim_ranges(a.fingerprint, "H", 1, 3).tolist() == [[head, 3 * head], [5 * head, 7 * head]]
    assert len(dim_ranges(b.fingerprint, "H", 1, 3)) == L * BS  # NHD: one range per token
    assert dim_ranges(a.fingerprint, "H", 0, 4).tolist() == [[0, a.block_bytes]]


def test_shards_of_different_caches_do_not_pair():
    a = KVLayout.from_tensors(_rank_tensors("hnd", None, (0, 2))[0], block_size=BS, dims="BHND")
    b = KVLayout.from_tensors(_rank_tensors("nhd", None, (0, 2))[0], block_size=BS, dims="BNHD")
    with pytest.raises(IncompatibleError, match="different caches"):
        shard_pairing(a, (0, 2), b, (0, 2))
    with pytest.raises(IncompatibleError, match="does not hold"):
        check_shards(a.fingerprint, (0, 3), a.fingerprint, (0, 2))
    with pytest.raises(IncompatibleError, match="not held by both"):
        shard_pairing(a, (0, 2), a, (2, 4))
    with pytest.raises(IncompatibleError, match="do not split"):
        heads_of(0, 4, 6)
    with pytest.raises(IncompatibleError, match="rank 1 of tensor-parallel size 1"):
        sources(1, 1, 8, 2)


@pytest.mark.parametrize("kind", ["hnd", "nhd", "kv_leading"])
@pytest.mark.parametrize(("bs_a", "bs_b"), [(16, 64), (64, 16), (32, 64), (64, 32), (16, 32), (32, 32)])
@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 150])
def test_block_sizes_map_through_token_positions(kind, bs_a, bs_b, tokens):
    """A request of ``tokens`` tokens paged in blocks of ``bs_a`` lands token for token in blocks of ``bs_b``,
    partial last blocks included; blocks outside the request stay untouched."""
    rng = np.random.default_rng(tokens)
    heads = (0, 2)
    ref = [rng.integers(1, 256, (NB, 2, bs_a, 2 * D), dtype=np.uint8) for _ in range(L)]
    src_t, kw, src_logical = _rank_tensors(kind, ref, heads, bs_a)
    dst_t, _, dst_logical = _rank_tensors(kind, None, heads, bs_b)
    a = KVLayout.from_tensors(src_t, block_size=bs_a, **kw)
    b = KVLayout.from_tensors(dst_t, block_size=bs_b, **kw)
    src_ids = rng.permutation(NB)[: -(-tokens // bs_a)]
    dst_ids = rng.permutation(NB)[: -(-tokens // bs_b)]
    p = paging(a, b)
    _run(p.plan(src_ids, dst_ids, p.chunks(tokens), a.num_blocks, b.num_blocks), a, b)
    t = np.arange(tokens)
    for layer in range(L):
        got, want = dst_logical[layer](), src_logical[layer]()
        np.testing.assert_array_equal(
            got[dst_ids[t // bs_b], :, t % bs_b], want[src_ids[t // bs_a], :, t % bs_a], err_msg=f"layer {layer}"
        )
        assert not got[np.setdiff1d(np.arange(NB), dst_ids)].any()


def test_block_size_mapping_refuses_what_does_not_fit():
    kw = {"dims": "BHND"}
    a = KVLayout.from_tensors(_rank_tensors("hnd", None, (0, 2), 16)[0], block_size=16, **kw)
    b = KVLayout.from_tensors(_rank_tensors("hnd", None, (0, 2), 64)[0], block_size=64, **kw)
    c = KVLayout.from_tensors(_rank_tensors("hnd", None, (0, 2), 48)[0], block_size=48, **kw)
    p = paging(a, b)
    with pytest.raises(BlockError, match="need 2"):
        p.plan([0, 1, 2, 3, 4], [0], 5, a.num_blocks, b.num_blocks)  # 5 blocks of 16 need 2 of 64
    with pytest.raises(BlockError, match="need 1"):
        p.plan([0, 1], [0, 1], 2, a.num_blocks, b.num_blocks)
    with pytest.raises(BlockError, match="token count"):
        p.plan([0, 1], [0], None, a.num_blocks, b.num_blocks)
    with pytest.raises(BlockError, match="fill 2 destination blocks, not 1"):
        p.check(80, src_blocks=5, dst_blocks=1)
    with pytest.raises(IncompatibleError, match="do not map"):
        paging(c, b)
    nhd = KVLayout.from_tensors(_rank_tensors("nhd", None, (0, 2), 64)[0], block_size=64, dims="BNHD")
    with pytest.raises(IncompatibleError, match="do not map"):
        paging(a, nhd)
