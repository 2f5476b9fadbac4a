"""Multi-sender requests: tensor-parallel prefill ranks (separate processes) each push a subset of layers of
one request into the same granted blocks; ready only when every sender is done; a missing sender is a
deadline error; no block leaks."""

import numpy as np
import pytest

from conformance.kvspec import Spec, as_bytes
from conformance.peers import wait_for
from kvxfer import DeadlineError
from kvxfer.runtime import handoff_meta
from local_service import SPEC
from procs import RemoteError

CROSS = Spec(kind="cross_layer", num_blocks=64, layers=4, heads=2, block_size=4, head_dim=8)


def layer_bytes(raw, spec: Spec, layer: int, ids) -> np.ndarray:
    """Memory-order bytes of one layer of blocks ``ids`` (independent of how a side splits segments)."""
    a = raw[0][:, layer] if spec.kind == "cross_layer" else raw[layer]
    return as_bytes(a)[np.asarray(ids)]


@pytest.mark.parametrize("dst", [SPEC, CROSS], ids=["per_layer", "cross_layer"])
def test_two_ranks_each_send_half_the_layers(service, senders, dst):
    svc = service(dst)
    r0, r1 = senders(1), senders(2)
    src = np.array([7, 8, 9, 30, 2])
    r1.call("hold")
    r0.push(
        svc.address,
        "tp",
        src,
        wait=False,
        senders=2,
        part=0,
        layers=[0, 2],
        meta=handoff_meta(num_tokens=19, first_token=42, sampling={"seed": 5}),
    )
    r1.push(svc.address, "tp", src, wait=False, senders=2, part=1, layers=[1, 3], meta={"rank": 1})
    wait_for(lambda: svc.stats()["inflight"] == 1, 5)
    with pytest.raises(DeadlineError):  # rank 0 moved its layers, rank 1 is held: not ready
        svc.next(0.3)
    r1.call("go")
    assert r1.call("wait", "tp", 10)["status"] == "done"
    assert r0.call("wait", "tp", 10)["status"] == "done"  # each rank is acknowledged once all are done
    h = svc.next(5)
    assert h.req == "tp" and h.num_tokens == 19 and h.first_token == 42 and h.sampling == {"seed": 5}
    assert h.meta["rank"] == 1 and h.nbytes == len(src) * svc.svc.layout.block_bytes
    for layer, seed in [(0, 1), (1, 2), (2, 1), (3, 2)]:
        want = layer_bytes(SPEC.build(seed=seed)[3], SPEC, layer, src)
        assert np.array_equal(layer_bytes(svc.raw, dst, layer, h.block_ids), want), layer
    assert svc.stats()["admitted"] == 1 and svc.stats()["completed"] == 1
    svc.release("tp")
    assert svc.settled()


def test_missing_sender_hits_the_deadline(service, senders):
    svc = service(deadline=1.0)
    r0 = senders(1)
    with pytest.raises(RemoteError) as e:  # rank 1 never comes: the request times out for rank 0 too
        r0.push(svc.address, "half", np.arange(12), senders=2, part=0, layers=[0, 1])
    assert e.value.kind == "DeadlineError"
    wait_for(svc.settled, 5)
    assert svc.stats()["failed"] == 1 and svc.stats()["pending"] == 0


def test_overlapping_layers_are_refused(service, senders):
    svc = service()
    r0, r1 = senders(1), senders(2)
    r0.call("hold")
    r0.push(svc.address, "ov", [1, 2], wait=False, senders=2, part=0, layers=[0, 1])
    wait_for(lambda: svc.stats()["inflight"] == 1, 5)
    with pytest.raises(RemoteError) as e:
        r1.push(svc.address, "ov", [1, 2], senders=2, part=1, layers=[1, 2, 3])
    assert e.value.kind == "BlockError"
    svc.cancel("ov")
    r0.call("go")
    with pytest.raises(RemoteError):
        r0.call("wait", "ov", 5)
    wait_for(svc.settled, 5)
