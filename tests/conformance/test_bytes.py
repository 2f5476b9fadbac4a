"""Every byte arrives where it belongs, and nowhere else: layouts, dtypes, patterns, sizes, both directions."""

import numpy as np
import pytest

from .conftest import PARALLEL, SENTINEL, pick, source_views
from .kvspec import KINDS, Spec, block_bytes, untouched


def _check(consumer, spec_src, seed, src_ids, arrival):
    src = block_bytes(source_views(spec_src, seed), src_ids)
    dst = block_bytes(consumer.views, arrival.block_ids)
    for a, b in zip(src, dst, strict=True):
        np.testing.assert_array_equal(a, b)
    assert untouched(consumer.views, arrival.block_ids, SENTINEL)


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_layout_both_directions(consumers, producers, kind, mode):
    spec = Spec(kind=kind)
    consumer = consumers(spec)
    producer = producers(spec, seed=11)
    rng = np.random.default_rng(KINDS.index(kind))
    ids = pick("permuted", 17, spec.num_blocks, rng)
    getattr(producer, mode)(consumer.address, f"{kind}-{mode}", ids)
    arrival = consumer.get(10)
    assert arrival.req == f"{kind}-{mode}" and arrival.kind == mode
    _check(consumer, spec, 11, ids, arrival)


@pytest.mark.parametrize("pattern", ["sequential", "fragmented", "permuted"])
@pytest.mark.parametrize("n", [1, 2, 33, 64])
def test_block_patterns(consumers, producers, pattern, n):
    spec = Spec(kind="nhd", num_blocks=64)
    consumer = consumers(spec)
    producer = producers(spec, seed=3)
    ids = pick(pattern, n, spec.num_blocks, np.random.default_rng(n))
    for mode in ("push", "pull"):
        getattr(producer, mode)(consumer.address, f"{pattern}-{n}-{mode}", ids)
        arrival = consumer.get(10)
        _check(consumer, spec, 3, ids, arrival)
        consumer.release(arrival.req)


@pytest.mark.parametrize(
    "dtype,lib",
    [("float16", "numpy"), ("float32", "numpy"), ("uint8", "numpy"), ("bfloat16", "torch"), ("float16", "torch")],
)
def test_dtypes_and_libraries(consumers, producers, dtype, lib):
    spec = Spec(kind="hnd", dtype=dtype, lib=lib)
    consumer = consumers(spec)
    producer = producers(spec, seed=5)
    ids = [5, 3, 60, 61, 62]
    producer.push(consumer.address, "r", ids)
    _check(consumer, spec, 5, ids, consumer.get(10))


def test_thousands_of_blocks(consumers, producers):
    spec = Spec(kind="nhd", num_blocks=4096, layers=2, heads=1, block_size=2, head_dim=4, dtype="uint8")
    consumer = consumers(spec)
    producer = producers(spec, seed=9)
    rng = np.random.default_rng(0)
    for mode, ids in (("push", rng.permutation(4096)[:3000]), ("pull", np.arange(4096))):
        getattr(producer, mode)(consumer.address, mode, ids)
        arrival = consumer.get(20)
        _check(consumer, spec, 9, ids, arrival)
        consumer.release(arrival.req)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_a_transfer_cut_into_parallel_pieces_lands_every_byte(consumers, producers, mode):
    """Scattered 1 KiB pieces, far past the inline size, moved as three pieces at once; several requests too."""
    spec = Spec(kind="nhd", num_blocks=128, layers=3, heads=2, block_size=8, head_dim=32, dtype="float16")
    consumer = consumers(spec, transport_options=PARALLEL)
    producer = producers(spec, seed=21, transport_options=PARALLEL)
    rng = np.random.default_rng(21)
    asks = [(f"{mode}-{i}", pick("permuted", n, spec.num_blocks, rng)) for i, n in enumerate((100, 13, 7))]
    for req, ids in asks:
        getattr(producer, mode)(consumer.address, req, ids, wait=False)
    arrivals = {a.req: a for a in (consumer.get(20) for _ in asks)}
    source = source_views(spec, 21)
    for req, ids in asks:
        for a, b in zip(block_bytes(source, ids), block_bytes(consumer.views, arrivals[req].block_ids), strict=True):
            np.testing.assert_array_equal(a, b)
    assert untouched(consumer.views, np.concatenate([a.block_ids for a in arrivals.values()]), SENTINEL)


def test_different_but_compatible_layouts(consumers, producers):
    """A cross-layer producer into a per-layer consumer: same block content, different segments."""
    src_spec = Spec(kind="cross_layer")
    dst_spec = Spec(kind="nhd")
    consumer = consumers(dst_spec)
    producer = producers(src_spec, seed=21)
    ids = [7, 1, 2, 3, 40]
    for mode in ("push", "pull"):
        getattr(producer, mode)(consumer.address, mode, ids)
        arrival = consumer.get(10)
        src_views = source_views(src_spec, 21)
        for layer in range(src_spec.layers):
            s = np.ascontiguousarray(src_views[layer][ids]).view(np.uint8).reshape(len(ids), -1)
            # nhd's logical view is [nb, H, bs, C] over [nb, bs, H, C] memory: compare memory order
            d = consumer.raw[layer][arrival.block_ids].view(np.uint8).reshape(len(ids), -1)
            np.testing.assert_array_equal(s, d)
        consumer.release(arrival.req)


def test_metadata_passes_through(consumers, producers):
    consumer = consumers()
    producer = producers()
    meta = {"first_token": 42, "sampling": {"temperature": 0.5}, "tokens": 17}
    producer.push(consumer.address, "m", [1, 2], meta=meta)
    assert consumer.get(10).meta == meta


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_integrity_digests_roundtrip(consumers, producers, mode):
    spec = Spec(kind="kv_separate")
    consumer = consumers(spec)
    producer = producers(spec, seed=4)
    ids = [9, 8, 7, 30]
    getattr(producer, mode)(consumer.address, "d", ids, digests=True)
    arrival = consumer.get(10)
    assert len(arrival.digests) == 4 * len(ids)
    _check(consumer, spec, 4, ids, arrival)
