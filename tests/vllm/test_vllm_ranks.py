"""Which prefill ranks each decode rank fetches from (``kvxfer.integrations.vllm.ranks.plan``), against what it must
mean for every pair of parallel layouts: every byte of every decode rank comes from exactly one prefill rank that
holds it, each hold is told how many decode ranks read it, and every hold no decode rank reads is declined."""

from __future__ import annotations

import itertools

import pytest

pytestmark = pytest.mark.vllm

LAYERS = 8


def _stages(stage: int, stages: int) -> tuple[int, int]:
    from vllm.distributed.utils import get_pp_indices

    return tuple(get_pp_indices(LAYERS, stage, stages))  # type: ignore[return-value]


def _held(g: int, tp: int, pp: int, heads: int, latent: bool) -> set[tuple[int, int]]:
    """The (head, layer) cells prefill rank ``g`` holds, as vLLM shards them."""
    from kvxfer.shard import heads_of

    t, s = g % tp, g // tp
    h0, h1 = (0, heads) if latent else heads_of(t, tp, heads)
    lo, hi = _stages(s, pp)
    return {(h, layer) for h in range(h0, h1) for layer in range(lo, hi)}


CASES = [
    (p, q, d, r, heads, latent)
    for (p, q), (d, r) in itertools.product([(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (8, 1)], repeat=2)
    for heads, latent in [(8, False), (2, False), (1, True)]
]


@pytest.mark.parametrize("p,q,d,r,heads,latent", CASES)
def test_every_decode_cell_comes_from_one_prefill_rank_holding_it(vh, p, q, d, r, heads, latent):
    from kvxfer.integrations.vllm.ranks import plan

    readers: dict[int, int] = {}
    unread = None
    for c, s in itertools.product(range(d), range(r)):
        sources, not_read = plan((p, q), (d, r), (c, s), heads, latent, _stages)
        assert unread is None or not_read == unread, "decode ranks disagree on which holds nobody reads"
        unread = not_read
        want = _held(s * d + c, d, r, heads, latent)  # the decode rank's own cells
        got: list[tuple[int, int]] = []
        for src in sources:
            cells = _held(src.rank, p, q, heads, latent) & want
            assert cells, f"decode rank {(c, s)} fetches from prefill rank {src.rank}, which holds none of its cells"
            got += cells
            readers[src.rank] = readers.get(src.rank, 0) + 1
            assert src.partial == (len(sources) > 1)
        assert len(got) == len(set(got)), "a cell is read from two prefill ranks (a replica shipped twice)"
        assert set(got) == want, f"decode rank {(c, s)} misses {sorted(want - set(got))[:4]}"
    for src_rank, n in readers.items():
        told = {
            x.readers
            for c, s in itertools.product(range(d), range(r))
            for x in plan((p, q), (d, r), (c, s), heads, latent, _stages)[0]
            if x.rank == src_rank
        }
        assert told == {n}, f"prefill rank {src_rank} is read by {n} decode ranks but told {told}"
    assert set(unread or []) == set(range(p * q)) - set(readers)


def test_a_hold_id_and_address_per_rank(vh):
    from kvxfer.integrations.vllm.ranks import hold_id, rank_address

    assert hold_id("req", 0, 1) == "req"
    assert [hold_id("req", g, 4) for g in range(4)] == ["req@0", "req@1", "req@2", "req@3"]
    assert rank_address("10.0.0.5:5600", 3) == "10.0.0.5:5603"
