"""The control readers' spin (``spin=``) over real TCP sessions in two threads of one process: whatever the
setting every byte arrives, and an idle session burns no CPU (a spin that never ended would burn a core)."""

import time

import numpy as np
import pytest

from kvxfer import ConfigError, Consumer, KVLayout, Producer


def _caches(fill: int):
    return [np.full((16, 1, 16, 128), fill, np.float16)]


@pytest.mark.parametrize("spin", [0, 1e-6, 100e-6, 0.01])
def test_every_spin_setting_moves_every_byte_by_push_and_pull(spin):
    src, dst = _caches(3), _caches(0)
    with (
        Consumer(KVLayout.from_tensors(dst, dims="BHND"), transport="tcp", spin=spin) as c,
        Producer(KVLayout.from_tensors(src, dims="BHND"), transport="tcp", spin=spin) as p,
    ):
        for k in range(20):
            src[0][k % 16] = k
            t = p.push(c.address, f"push-{k}", [k % 16]) if k % 2 else p.offer(c.address, f"pull-{k}", [k % 16])
            t.wait(10)
            a = c.get(10)
            assert (dst[0][a.block_ids[0]] == k).all()
            c.release(a.req)


def test_an_idle_session_burns_no_cpu():
    with (
        Consumer(KVLayout.from_tensors(_caches(0), dims="BHND"), transport="tcp", spin=0.01) as c,
        Producer(KVLayout.from_tensors(_caches(1), dims="BHND"), transport="tcp", spin=0.01) as p,
    ):
        for k in range(12):  # both readers spin 10 ms after each of these messages, then learn the session is idle
            p.push(c.address, f"r{k}", [k]).wait(10)
            c.release(c.get(10).req)
            time.sleep(0.03)
        time.sleep(0.05)
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(1.0)
        used = time.process_time() - cpu
        assert used < 0.2 * (time.monotonic() - wall), f"{used:.3f}s of CPU in a second of an idle session"


@pytest.mark.parametrize("spin", [-1, 0.02, float("inf"), "fast", None])
def test_a_producer_spin_outside_0_to_10ms_is_a_config_error(spin):
    with pytest.raises(ConfigError, match="spin"):
        Producer(KVLayout.from_tensors(_caches(0), dims="BHND"), transport="tcp", spin=spin)
