"""``transport="auto"`` on one side and a single transport on the other agree on one both have."""

import numpy as np
import pytest

from kvxfer import Consumer, IncompatibleError, KVLayout, Producer, available_transports


def _layout(fill: int):
    caches = [np.full((16, 2, 4, 8), fill, np.float16) for _ in range(2)]
    return caches, KVLayout.from_tensors(caches)


@pytest.mark.parametrize("producer_t, consumer_t", [("auto", "tcp"), ("tcp", "auto"), ("auto", "auto")])
def test_auto_agrees_with_the_other_side(producer_t, consumer_t):
    if "nixl" not in available_transports():
        pytest.skip("needs nixl beside tcp to have a choice")
    _, src_layout = _layout(7)
    dst, dst_layout = _layout(0)
    with Consumer(dst_layout, transport=consumer_t) as c, Producer(src_layout, transport=producer_t) as p:
        assert p.push(c.address, "r", [1, 2]).wait(10).status.value == "done"
        a = c.get(10)
        assert all((d[a.block_ids] == 7).all() for d in dst)
        assert c.transport_name == ("nixl" if consumer_t == "auto" else "tcp")


def test_no_common_transport_is_incompatible():
    if "nixl" not in available_transports():
        pytest.skip("needs nixl beside tcp")
    _, src_layout = _layout(7)
    _, dst_layout = _layout(0)
    with (
        Consumer(dst_layout, transport="tcp") as c,
        Producer(src_layout, transport="nixl") as p,
        pytest.raises(IncompatibleError),
    ):
        p.push(c.address, "r", [1]).wait(10)


def test_auto_never_opens_ucx_and_listing_transports_loads_no_ucx():
    """A handle opened as auto opens every candidate: ucx is not one (its UCX, loaded before NIXL's in a process,
    slows NIXL several times), and listing or probing transports does not load ucxx either."""
    import subprocess
    import sys

    code = (
        "import sys, numpy as np\n"
        "from kvxfer import Consumer, KVLayout, transports\n"
        "assert 'ucx' not in transports.candidates('auto'), transports.candidates('auto')\n"
        "names = transports.available()\n"
        "with Consumer(KVLayout.from_tensors([np.zeros((16, 2, 4, 8), np.float16)]), transport='auto') as c:\n"
        "    assert 'ucx' not in c.transports, list(c.transports)\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'ucxx')\n"
        "assert not loaded, loaded\n"
        "print(names)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
