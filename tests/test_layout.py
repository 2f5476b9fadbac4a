import numpy as np
import pytest
import torch

from kvxfer import KVLayout, LayoutError
from kvxfer.errors import IncompatibleError
from kvxfer.layout import check_compatible


def _vllm_view(nb, H, bs, C, order, dtype=torch.bfloat16):
    """vLLM 0.33's logical [nb, H, bs, C] over a memory order given as a permutation of the logical dims."""
    phys_shape = [(nb, H, bs, C)[d] for d in order]
    inv = np.argsort(order)
    return torch.zeros(phys_shape, dtype=dtype).permute(*inv)


@pytest.mark.parametrize("order,segments", [((0, 1, 2, 3), 1), ((0, 2, 1, 3), 1), ((1, 0, 2, 3), 4)])
def test_vllm_memory_orders(order, segments):
    caches = {f"l{i}": _vllm_view(10, 4, 16, 64, order) for i in range(3)}
    lay = KVLayout.from_tensors(caches)
    assert lay.num_blocks == 10
    assert lay.num_segments == 3 * segments
    assert lay.block_bytes == 3 * 4 * 16 * 64 * 2
    fp = lay.fingerprint
    assert (fp.dtype, fp.block_size, fp.num_layers, fp.layer_bytes) == ("bfloat16", 16, 3, 4 * 16 * 64 * 2)


def test_nhd_and_hnd_fingerprints_differ():
    nhd = KVLayout.from_tensors([_vllm_view(4, 2, 16, 8, (0, 2, 1, 3))])
    hnd = KVLayout.from_tensors([_vllm_view(4, 2, 16, 8, (0, 1, 2, 3))])
    with pytest.raises(IncompatibleError, match="order"):
        check_compatible(nhd.fingerprint, hnd.fingerprint)


def test_segment_addresses_match_the_tensor():
    t = _vllm_view(6, 2, 4, 8, (1, 0, 2, 3), torch.float32)  # heads outermost: 2 segments per block
    lay = KVLayout.from_tensors([t])
    for b in range(6):
        for h in range(2):
            s = h
            addr = lay.regions[lay.seg_region[s]].ptr + lay.seg_offset[s] + b * lay.seg_stride[s]
            assert addr == t[b, h].data_ptr()
            assert lay.seg_bytes[s] == t[b, h].numel() * 4


def test_views_of_one_allocation_share_a_region():
    base = torch.zeros(2, 8, 4, 16)  # like vLLM CPU: per-layer views of one tensor
    lay = KVLayout.from_tensors({"a": base[0], "b": base[1]}, block_size=4)
    assert len(lay.regions) == 1 and lay.num_segments == 2


def test_cross_layer_matches_per_layer_fingerprint():
    x = np.zeros((8, 3, 16, 2, 32), np.float16)
    cross = KVLayout.from_tensors(x, block_size=16, num_layers=3)
    per = KVLayout.from_tensors([np.zeros((8, 16, 2, 32), np.float16) for _ in range(3)], block_size=16)
    check_compatible(cross.fingerprint, per.fingerprint)


def test_non_affine_block_is_refused():
    t = torch.zeros(8, 2, 16, 128)[..., :64]  # a block with holes inside
    with pytest.raises(LayoutError, match="not an affine slice"):
        KVLayout.from_tensors([t])


def test_overlapping_blocks_are_refused():
    a = np.lib.stride_tricks.as_strided(np.zeros(1024, np.uint8), shape=(8, 4, 16, 4), strides=(16, 64, 4, 1))
    with pytest.raises(LayoutError):
        KVLayout.from_tensors([a])


def test_mixed_inputs_are_refused():
    with pytest.raises(LayoutError, match="dtypes"):
        KVLayout.from_tensors([np.zeros((4, 1, 2, 2), np.float16), np.zeros((4, 1, 2, 2), np.float32)])
    with pytest.raises(LayoutError, match="number of blocks"):
        KVLayout.from_tensors([np.zeros((4, 1, 2, 2), np.float16), np.zeros((5, 1, 2, 2), np.float16)])
    with pytest.raises(LayoutError, match="block_size"):
        KVLayout.from_tensors([np.zeros((4, 8), np.float16)])
    with pytest.raises(LayoutError):
        KVLayout.from_tensors(["not a tensor"])


def test_desc_roundtrip_and_validation():
    lay = KVLayout.from_tensors([np.zeros((4, 1, 2, 2), np.float16)])
    again = KVLayout.from_desc(lay.desc())
    assert again.block_bytes == lay.block_bytes and again.num_blocks == 4
    d = lay.desc()
    import msgspec

    bad = msgspec.structs.replace(d, num_blocks=10**6)
    with pytest.raises(LayoutError, match="past the end"):
        KVLayout.from_desc(bad)


# ---- the fingerprint names what every dim means: look-alike layouts are refused ------------------------------
def _fp(*args, **kw):
    return KVLayout.from_tensors(*args, **kw).fingerprint


def test_fingerprint_spells_the_meaning_of_every_dim():
    assert _fp([_vllm_view(4, 2, 16, 8, (0, 2, 1, 3))] * 3).order == "L3 N16 H2 D8"
    assert _fp([_vllm_view(4, 2, 16, 8, (0, 1, 2, 3))] * 3).order == "L3 H2 N16 D8"
    assert _fp([(np.zeros((4, 16, 2, 8)), np.zeros((4, 16, 2, 8)))] * 2, block_size=16).order == "L2 K2 N16 H2 D8"
    assert _fp(np.zeros((2, 4, 3, 16, 5, 8)), dims="KBLNHD").order == "K2 L3 N16 H5 D8"
    mixed = [np.zeros((4, 16, 8, 16))] * 2 + [np.zeros((4, 16, 4, 32))] * 2  # layers that differ are spelled out
    assert _fp(mixed, block_size=16).order == "L[2x(N16 H8 D16) | 2x(N16 H4 D32)]"
    assert _fp(mixed[::-1], block_size=16).order == "L[2x(N16 H4 D32) | 2x(N16 H8 D16)]"


def test_nhd_views_into_hnd_views_when_block_size_equals_kv_heads():
    nhd = _fp([_vllm_view(4, 4, 4, 8, (0, 2, 1, 3))])  # vLLM's logical view: dims known by position
    hnd = _fp([_vllm_view(4, 4, 4, 8, (0, 1, 2, 3))])
    with pytest.raises(IncompatibleError, match="order"):
        check_compatible(nhd, hnd)


def test_per_layer_nhd_into_hnd_when_tokens_equal_heads():
    nhd, hnd = [np.zeros((4, 4, 4, 8), np.float16)] * 2, [np.zeros((4, 4, 4, 8), np.float16)] * 2
    with pytest.raises(LayoutError, match="dims='BHND' or dims='BNHD'"):
        KVLayout.from_tensors(nhd, block_size=4)  # [nb, 4, 4, 8]: which 4 is the token?
    with pytest.raises(IncompatibleError, match="order"):
        check_compatible(_fp(nhd, dims="BNHD"), _fp(hnd, dims="BHND"))


def test_kv_leading_cross_layer_into_per_layer_kv_pairs():
    L, H = 3, 5
    kv_first = np.zeros((2, 4, L, 16, H, 8), np.float16)  # [2, nb, L, ...]: all layers' K, then all V
    pairs = [(np.zeros((4, 16, H, 8), np.float16), np.zeros((4, 16, H, 8), np.float16)) for _ in range(L)]
    with pytest.raises(IncompatibleError, match="order"):
        check_compatible(_fp(kv_first, block_dim=1, block_size=16, num_layers=L), _fp(pairs, block_size=16))
    with pytest.raises(LayoutError, match="dims"):  # with 2 kv heads, which size-2 dim is K?
        KVLayout.from_tensors(np.zeros((2, 4, L, 16, 2, 8), np.float16), block_dim=1, block_size=16, num_layers=L)


def test_kv_inside_the_block_before_layers_into_per_layer_tensors():
    L = 2
    kv_outer = np.zeros((4, 2, L, 16, 5, 8), np.float16)  # [nb, 2, L, ...]: K of every layer, then V
    per_layer = [np.zeros((4, 2, 16, 5, 8), np.float16) for _ in range(L)]  # [nb, 2, ...]: K, V of one layer
    with pytest.raises(LayoutError, match="dims='BKLNHD' or dims='BLKNHD'"):
        KVLayout.from_tensors(kv_outer, block_size=16, num_layers=L)  # is K or L first? sizes cannot tell
    with pytest.raises(IncompatibleError, match="order"):
        check_compatible(_fp(kv_outer, dims="BKLNHD"), _fp(per_layer, block_size=16))


def test_equal_meanings_still_pair_however_segmented():
    hnd = [np.zeros((4, 2, 16, 8), np.float16)] * 2
    heads_outer = [np.zeros((2, 4, 16, 8), np.float16).transpose(1, 0, 2, 3)] * 2  # one segment per head
    check_compatible(_fp(hnd, block_size=16), _fp(heads_outer, block_size=16))
    pairs = [(np.zeros((4, 16, 2, 8), np.float16), np.zeros((4, 16, 2, 8), np.float16))] * 3
    kv_leading = [np.zeros((2, 4, 16, 2, 8), np.float16)] * 3  # K and V planes: two segments per layer
    check_compatible(_fp(pairs, block_size=16), _fp(kv_leading, dims="KBNHD"))
    cross = np.zeros((4, 3, 2, 16, 2, 8), np.float16)  # [nb, L, K/V, ...]: per-layer pairs' bytes, one segment
    check_compatible(_fp(pairs, block_size=16), _fp(cross, dims="BLKNHD"))
    nhd_views = [_vllm_view(4, 2, 16, 8, (0, 2, 1, 3), torch.float16)] * 3
    check_compatible(_fp(nhd_views), _fp([np.zeros((4, 16, 2, 8), np.float16)] * 3, dims="BNHD"))


@pytest.mark.parametrize(
    "dims,match",
    [
        ("BHN", "one letter each"),
        ("BHNX", "unknown letters"),
        ("BHHD", "at most once"),
        ("HNDK", "B exactly once"),
        ("BKND", "K dim has size 4"),
        ("BHND", "N dim has size 4, but block_size"),
    ],
)
def test_bad_dims_are_refused(dims, match):
    with pytest.raises(LayoutError, match=match):
        KVLayout.from_tensors([np.zeros((4, 4, 4, 8))], dims=dims, block_size=2 if dims == "BHND" else None)


def test_dims_fix_block_dim_block_size_and_layers():
    lay = KVLayout.from_tensors(np.zeros((3, 2, 8, 16, 4)), dims="LKBND")
    fp = lay.fingerprint
    assert (lay.num_blocks, fp.block_size, fp.num_layers, fp.order) == (8, 16, 3, "L3 K2 N16 D4")
    with pytest.raises(LayoutError, match="block_dim 0 disagrees"):
        KVLayout.from_tensors(np.zeros((3, 2, 8, 16, 4)), dims="LKBND", block_dim=0)
    with pytest.raises(LayoutError, match="pair of tensors has no K dim"):
        KVLayout.from_tensors([(np.zeros((8, 2, 4)), np.zeros((8, 2, 4)))], dims="BKD", block_size=1)


def test_lookalike_layouts_are_refused_end_to_end_over_tcp():
    """A real producer and consumer whose views look alike (block_size == kv_heads) but whose memory orders
    differ: the handshake refuses them and no byte lands (it used to transpose every block)."""
    from kvxfer import Consumer, Producer

    src = _vllm_view(8, 4, 4, 8, (0, 2, 1, 3), torch.float16)  # NHD memory
    src.view(torch.int16).copy_(torch.arange(src.numel(), dtype=torch.int16).view(src.shape))
    dst = _vllm_view(8, 4, 4, 8, (0, 1, 2, 3), torch.float16)  # HND memory, same logical shape
    with (
        Consumer(KVLayout.from_tensors([dst]), transport="tcp") as c,
        Producer(KVLayout.from_tensors([src]), transport="tcp") as p,
        pytest.raises(IncompatibleError, match="order"),
    ):
        p.push(c.address, "r", [1, 2], deadline=10).wait()
    assert not dst.any()


# ---- a peer's layout description with hostile numbers ---------------------------------------------------------
def _desc(**changes):
    import msgspec

    d = KVLayout.from_tensors([np.zeros((4, 1, 2, 2), np.float16)]).desc()
    regions = changes.pop("regions", None)
    if regions is not None:
        changes["regions"] = [msgspec.structs.replace(d.regions[0], **regions)]
    return msgspec.structs.replace(d, **changes)


@pytest.mark.parametrize(
    "changes",
    [
        {"num_blocks": 2**64 - 1},  # raised OverflowError
        {"num_blocks": 0},
        {"num_blocks": 5, "seg_stride": [2**62]},  # (5 - 1) * 2**62 wraps int64 to 0: was welcomed
        {"seg_offset": [2**63 - 1]},  # offset + bytes wraps negative: was welcomed
        {"seg_offset": [2**64]},
        {"seg_bytes": [-8]},
        {"seg_region": [2**63]},
        {"regions": {"nbytes": 2**63}},
        {"regions": {"ptr": -1}},
        {"regions": {"ptr": 2**64 - 8}},
    ],
)
def test_out_of_range_numbers_in_a_peers_layout_are_layout_errors(changes):
    with pytest.raises(LayoutError):
        KVLayout.from_desc(_desc(**changes))


def test_segment_sums_that_would_wrap_are_refused():
    import msgspec

    from kvxfer import wire

    n = 4
    d = _desc()
    big = 2**62
    d = msgspec.structs.replace(
        d,
        num_blocks=1,
        regions=[wire.RegionDesc(i * big, big, -1) for i in range(n)],
        seg_region=list(range(n)),
        seg_offset=[0] * n,
        seg_stride=[big] * n,
        seg_bytes=[big] * n,
        fingerprint=msgspec.structs.replace(d.fingerprint, block_bytes=(n * big) % 2**64),
    )
    with pytest.raises(LayoutError):
        KVLayout.from_desc(d)


def test_layers_sharing_memory_are_named_in_a_warning(caplog):
    """``[t] * 2`` (one buffer, twice) or overlapping views would land one layer's bytes over another's."""
    base = np.zeros((16, 2, 4, 8), np.float16)
    for caches in ([base[:8]] * 2, [base[:8], base[4:12]], [(base[:8], base[:8])]):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvxfer"):
            KVLayout.from_tensors(caches, block_size=4, dims="BHND")
        assert "share bytes of memory" in caplog.text
    for caches in (
        [base[:8], base[8:]],
        [np.zeros((8, 2, 4, 8), np.float16) for _ in range(3)],
        [base[:, 0], base[:, 1]],
    ):
        caplog.clear()
        with caplog.at_level("WARNING", logger="kvxfer"):
            KVLayout.from_tensors(caches, block_size=4, dims="BHND" if caches[0].ndim == 4 else "BND")
        assert "share bytes" not in caplog.text  # back to back, apart, interleaved K and V: disjoint
