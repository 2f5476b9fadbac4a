import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer import BlockError, KVLayout
from kvxfer.plan import FEW_RANGES, byte_ranges, check_ids, extents, make_plan, pair


def _layout(kind, nb=32, L=3):
    if kind == "cross":
        return KVLayout.from_tensors(np.zeros((nb, L, 4, 2, 8), np.uint8), block_size=4, num_layers=L)
    if kind == "kv":
        return KVLayout.from_tensors(
            [(np.zeros((nb, 4, 2, 4), np.uint8), np.zeros((nb, 4, 2, 4), np.uint8)) for _ in range(L)], block_size=4
        )
    return KVLayout.from_tensors([np.zeros((nb, 4, 2, 8), np.uint8) for _ in range(L)], block_size=4)


def _naive(a, b, src, dst):
    """Byte-level reference: (src address, dst address) of every byte, in stream order."""
    pairs = []
    for s, d in zip(src, dst, strict=True):
        sa = np.concatenate(
            [
                np.arange(a.seg_bytes[k]) + a.regions[a.seg_region[k]].ptr + a.seg_offset[k] + s * a.seg_stride[k]
                for k in range(a.num_segments)
            ]
        )
        da = np.concatenate(
            [
                np.arange(b.seg_bytes[k]) + b.regions[b.seg_region[k]].ptr + b.seg_offset[k] + d * b.seg_stride[k]
                for k in range(b.num_segments)
            ]
        )
        pairs.append(np.stack([sa, da], 1))
    return pairs


def _expand(plan, a, b):
    rows = []
    for sr, so, dr, do, n in zip(
        plan.src.region, plan.src.offset, plan.dst.region, plan.dst.offset, plan.src.nbytes, strict=True
    ):
        rows.append(np.stack([np.arange(n) + a.regions[sr].ptr + so, np.arange(n) + b.regions[dr].ptr + do], 1))
    return np.concatenate(rows)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["per", "cross", "kv"]),
    st.sampled_from(["per", "cross", "kv"]),
    st.integers(1, 32),
    st.randoms(use_true_random=False),
)
def test_plan_moves_exactly_the_right_bytes(ka, kb, n, rnd):
    a, b = _layout(ka), _layout(kb)
    src = np.array(rnd.sample(range(32), n))
    dst = np.array(rnd.sample(range(32), n)) if rnd.random() < 0.5 else np.sort(src)
    plan = make_plan(pair(a, b), src, dst, 32, 32)
    got = _expand(plan, a, b)
    want = _naive(a, b, src, dst)
    # same set of (src byte, dst byte) mappings, each exactly once
    want = np.concatenate(want)
    assert len(got) == len(want)
    assert set(map(tuple, got)) == set(map(tuple, want))


def test_sequential_ids_coalesce():
    a = _layout("per")
    plan = make_plan(pair(a, a), np.arange(32), np.arange(32), 32, 32)
    assert len(plan) == 3  # one descriptor per layer
    assert plan.total == 32 * a.block_bytes


def test_window_splits_extents():
    a = _layout("per")
    ext = extents(pair(a, a).a, pair(a, a).nbytes, [5, 9, 2], 32)
    w = ext.window(10, 100)
    assert w.total == 100
    assert w.offset[0] == ext.offset[0] + 10


@pytest.mark.parametrize(
    "ids,msg", [([40], "out of range"), ([1, 1], "duplicates"), ([[1]], "1-D"), ([], "empty"), ([1.5], "integers")]
)
def test_bad_ids(ids, msg):
    with pytest.raises(BlockError, match=msg):
        check_ids(np.array(ids), 32)


def test_length_mismatch():
    a = _layout("per")
    with pytest.raises(BlockError, match="destination"):
        make_plan(pair(a, a), [1, 2], [3], 32, 32)


def test_pairing_restricted_to_layers():
    from conformance.kvspec import Spec
    from kvxfer.plan import layer_ranges

    a_spec, b_spec = Spec(kind="nhd", layers=4), Spec(kind="cross_layer", layers=4)
    a = a_spec.layout(*a_spec.build(seed=1)[:2])
    b = b_spec.layout(*b_spec.build(fill=0)[:2])
    lb = a.fingerprint.layer_bytes
    assert layer_ranges(a, [3, 0, 1]).tolist() == [[0, 2 * lb], [3 * lb, 4 * lb]]
    full, half = pair(a, b), pair(a, b, layer_ranges(a, [1, 2]))
    assert half.block_bytes == 2 * lb and full.block_bytes == 4 * lb
    plan = make_plan(half, [1, 2, 3], [5, 6, 7], a.num_blocks, b.num_blocks)
    assert plan.total == 3 * 2 * lb
    with pytest.raises(BlockError):
        layer_ranges(a, [4])
    with pytest.raises(BlockError):
        pair(a, b, [[10, 5]])


def test_plan_without_coalescing_has_one_descriptor_per_piece_and_block():
    a = _layout("per")
    plan = make_plan(pair(a, a), np.arange(32), np.arange(32), 32, 32, coalesce=False)
    assert len(plan) == 3 * 32 and plan.total == 32 * a.block_bytes


@pytest.mark.parametrize("kind", ["cross", "per-layer"])
@pytest.mark.parametrize("pattern", ["permuted", "sequential"])
def test_a_big_plan_worked_on_both_sides_at_once_equals_one_worked_in_turn(monkeypatch, kind, pattern):
    """From ``PARALLEL_MIN`` ids a side, the destination side is checked and placed on a helper thread: the plan
    is the same, array for array, as one planned side after side."""
    from kvxfer import plan

    nb = 3 * plan.PARALLEL_MIN
    a, b = _layout(kind, nb=nb), _layout(kind, nb=nb)
    rng = np.random.default_rng(5)
    n = plan.PARALLEL_MIN + 17
    src = rng.permutation(nb)[:n] if pattern == "permuted" else np.arange(5, 5 + n)
    dst = rng.permutation(nb)[:n] if pattern == "permuted" else np.arange(9, 9 + n)
    at_once = make_plan(pair(a, b), src, dst, nb, nb)
    monkeypatch.setattr(plan, "PARALLEL_MIN", 10**9)
    in_turn = make_plan(pair(a, b), src, dst, nb, nb)
    for x, y in ((at_once.src, in_turn.src), (at_once.dst, in_turn.dst)):
        for f in ("region", "offset", "nbytes"):
            assert np.array_equal(getattr(x, f), getattr(y, f)), f


def _kv_leading(nb=32, L=3):
    """K then V of every layer in one tensor: the last block of a layer's K and the first of its V are back to
    back, so a request of every block merges across the piece boundary."""
    return KVLayout.from_tensors([np.zeros((2, nb, 4, 2, 4), np.uint8) for _ in range(L)], block_size=4, dims="KBNHD")


@pytest.mark.parametrize("ka", ["per", "cross", "kv", "kv_leading"])
@pytest.mark.parametrize("kb", ["per", "kv_leading"])
@pytest.mark.parametrize("pattern", ["all", "run", "runs", "permuted", "one"])
def test_packed_pieces_plan_as_the_general_scan_does(monkeypatch, ka, kb, pattern):
    """Packed pieces find their runs once for every piece; the plan is the general piece-by-piece scan's, array
    for array, merges across a piece boundary included (``kv_leading`` with every block). Three layers: every
    pairing has several pieces (one piece alone, unpacked, takes a shortcut that never merges)."""
    from kvxfer import plan

    a, b = (_kv_leading() if k == "kv_leading" else _layout(k) for k in (ka, kb))
    rng = np.random.default_rng(len(ka) * 7 + len(kb))
    src, dst = {
        "all": (np.arange(32), np.arange(32)),
        "run": (np.arange(3, 20), np.arange(10, 27)),
        "runs": (np.r_[0:5, 9:20, 25:30], np.r_[2:12, 14:20, 27:32]),
        "permuted": (rng.permutation(32), rng.permutation(32)),
        "one": (np.array([31]), np.array([0])),
    }[pattern]
    fast = make_plan(pair(a, b), src, dst, 32, 32)
    one_side = extents(pair(a, b).b, pair(a, b).nbytes, dst, 32)
    monkeypatch.setattr(plan, "_packed", lambda sides, nbytes: False)
    general = make_plan(pair(a, b), src, dst, 32, 32)
    for x, y in ((fast.src, general.src), (fast.dst, general.dst)):
        for f in ("region", "offset", "nbytes"):
            assert np.array_equal(getattr(x, f), getattr(y, f)), f
    if pattern == "all" and ka == kb == "kv_leading":
        assert len(fast) == 3  # K and V of each layer: one descriptor
    ref = extents(pair(a, b).b, pair(a, b).nbytes, dst, 32)
    for f in ("region", "offset", "nbytes"):
        assert np.array_equal(getattr(one_side, f), getattr(ref, f)), f


@pytest.mark.parametrize(
    "bad,msg",
    [
        ("src_range", "source block ids out of range"),
        ("dst_range", "destination block ids out of range"),
        ("dst_dup", "destination block ids contain duplicates"),
        ("both", "source block ids contain duplicates"),
    ],
)
def test_a_big_plan_checked_on_both_sides_at_once_names_the_bad_side(bad, msg):
    """The helper thread's verdict is not lost: a bad destination id fails the plan, and a bad source is reported
    first when both are bad."""
    from kvxfer import plan

    nb = 2 * plan.PARALLEL_MIN
    layout = _layout("cross", nb=nb, L=1)
    src, dst = np.arange(plan.PARALLEL_MIN), np.arange(1, plan.PARALLEL_MIN + 1)
    if bad == "src_range":
        src[-1] = nb
    if bad in ("dst_dup", "both"):
        dst[-1] = dst[0]
    if bad == "both":
        src[7] = src[3]
    if bad == "dst_range":
        dst[100] = nb + 4
    with pytest.raises(BlockError, match=msg):
        make_plan(pair(layout, layout), src, dst, nb, nb)


BAD_RANGES = {
    "empty range": [[8, 8]],
    "reversed": [[16, 8]],
    "negative": [[-1, 8]],
    "past the block": [[0, 4097]],
    "overlapping": [[0, 16], [8, 32]],
    "unsorted": [[64, 128], [0, 32]],
    "none at all": [],
}


@pytest.mark.parametrize("count", [1, FEW_RANGES + 7], ids=["few", "many"])
@pytest.mark.parametrize("bad", BAD_RANGES)
def test_byte_ranges_refuse_what_is_not_sorted_disjoint_and_within_a_block(bad, count):
    """Few ranges are checked as Python ints, many with numpy: the same ranges get the same verdict either way."""
    good = [[4096 + 16 * i, 4096 + 16 * i + 8] for i in range(count - 1)]  # after the bad ones, in a bigger block
    ranges = BAD_RANGES[bad] + good
    limit = 4096 if count == 1 else 4096 + 16 * count
    if bad == "past the block":
        ranges = [*good, [limit - 4, limit + 1]]
    if bad == "none at all":
        ranges = []
    with pytest.raises(BlockError, match="not sorted, disjoint and within a block"):
        byte_ranges(ranges, limit)
    if bad != "none at all":
        fixed = [[0, 8], *good]
        assert byte_ranges(fixed, limit).tolist() == fixed
