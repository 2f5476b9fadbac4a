import numpy as np

from kvxfer import KVLayout
from kvxfer.digest import block_digests, mismatches


def test_digests_catch_a_flipped_byte_in_any_segment():
    k = np.random.default_rng(0).integers(0, 255, (8, 4, 2, 4), dtype=np.uint8)
    v = np.random.default_rng(1).integers(0, 255, (8, 4, 2, 4), dtype=np.uint8)
    lay = KVLayout.from_tensors([(k, v)], block_size=4)
    ids = [6, 2, 5]
    d = block_digests(lay, ids)
    assert mismatches(lay, ids, d) == []
    v[5, 3, 1, 2] ^= 1
    assert mismatches(lay, ids, d) == [2]
    assert mismatches(lay, ids, b"") == [0, 1, 2]
