"""Planning speed: block ids -> coalesced descriptors for a million blocks (target: 10 ms or less, permuted)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import MILLION, fake_layout
from kvxfer.plan import check_ids, extents, make_plan, pair

PATTERNS = {
    "sequential": lambda rng, n: (np.arange(n), np.arange(n)),
    "permuted": lambda rng, n: (rng.permutation(n), rng.permutation(n)),
    "fragmented": lambda rng, n: (np.arange(0, n, 2), np.arange(0, n, 2)),
}


@pytest.fixture(scope="module")
def one_segment():
    layout = fake_layout(MILLION)
    return layout, pair(layout, layout)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_make_plan_1m_blocks(benchmark, one_segment, pattern):
    """One segment per block (a single layer, or a cross-layer cache): 1M blocks -> up to 1M descriptors."""
    layout, pairing = one_segment
    src, dst = PATTERNS[pattern](np.random.default_rng(0), MILLION)
    plan = benchmark(make_plan, pairing, src, dst, MILLION, MILLION)
    assert plan.total == len(src) * layout.block_bytes
    benchmark.extra_info["blocks"] = len(src)
    benchmark.extra_info["descriptors"] = len(plan)


@pytest.mark.parametrize("pattern", ["sequential", "permuted"])
def test_extents_1m_blocks(benchmark, one_segment, pattern):
    """One side only (what the TCP transport plans on each end)."""
    layout, pairing = one_segment
    src, _ = PATTERNS[pattern](np.random.default_rng(1), MILLION)
    ext = benchmark(extents, pairing.a, pairing.nbytes, src, MILLION)
    assert ext.total == MILLION * layout.block_bytes


def test_check_ids_1m_blocks(benchmark):
    ids = np.random.default_rng(2).permutation(MILLION)
    benchmark(check_ids, ids, MILLION)


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_make_plan_llama_8b_128k_tokens(benchmark, pattern):
    """A realistic big request: Llama-3-8B per-layer cache (32 segments), 128k tokens = 8192 blocks."""
    n = 8192
    layout = fake_layout(2 * n, layers=32)
    pairing = pair(layout, layout)
    src, dst = PATTERNS[pattern](np.random.default_rng(3), 2 * n)
    src, dst = src[:n], dst[:n]
    plan = benchmark(make_plan, pairing, src, dst, 2 * n, 2 * n)
    benchmark.extra_info["descriptors"] = len(plan)
