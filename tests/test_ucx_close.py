"""Closing a ucx link while other threads post on it: a session lost (its peer killed) closes the link under
threads still sending. A ucxx endpoint closed under a post crashed the process (SIGSEGV in ``tag_send``, seen
in CI); the post must end in ``PeerError`` instead."""

import random
import threading
import time

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
