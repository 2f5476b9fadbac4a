"""Closing a ucx link while other threads post on it, or while its peer dies: a session lost (its peer killed)
closes the link under threads still sending and under UCX's own error callbacks. Each crashed a CI run
(SIGSEGV: in ``tag_send`` on a closed endpoint; in ``ep.close()`` on one UCX had just failed); a post must end
in ``PeerError`` instead, and a close must simply close."""

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conformance.kvspec import Spec
from kvxfer import PeerError
from kvxfer.transports.base import Peer
from kvxfer.transports.ucx import DATA, UcxTransport

pytestmark = pytest.mark.ucx


def test_posts_racing_a_link_close_end_in_peer_error_not_a_crash():
    spec = Spec()
    tensors, kw, _, _ = spec.build(seed=1)
    layout = spec.layout(tensors, kw)
    ours, theirs = UcxTransport(layout, None), UcxTransport(layout, None)
    data, rng = np.zeros(64, np.uint8), random.Random(7)
    ended: list[BaseException] = []
    try:
        for session in range(150):
            link = ours.connect(Peer(session, "-", layout, None, theirs.local_meta(), True, key=b"k%d" % session))

            def post(link=link) -> None:
                try:
                    while True:
                        link._send(data, link._tag(1, DATA))
                except PeerError as e:
                    ended.append(e)

            threads = [threading.Thread(target=post) for _ in range(3)]
            for t in threads:
                t.start()
            time.sleep(rng.random() * 0.003)
            ours.disconnect(session)
            for t in threads:
                t.join(10)
            assert not any(t.is_alive() for t in threads)
    finally:
        ours.close()
        theirs.close()
    assert len(ended) == 3 * 150


def test_links_closed_as_their_peer_dies_do_not_crash_the_process():
    """64 peers killed one by one, each with 20 links closed as UCX fails them (support/ucx_peer_death.py: in a
    process of its own, so that a crash is an exit status). The code before this test crashed in 5 runs of 5."""
    run = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "support.ucx_peer_death", "8", "8", "20"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "closed 1280 links" in run.stdout
