import numpy as np
import pytest
import torch

from kvxfer import KVLayout, LayoutError
from kvxfer.layout import check_compatible
from kvxfer.errors import IncompatibleError


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
