"""Links closed while their ucx peer dies, in a process of its own (a crash is an exit status, not a lost test
run): ``python -m support.ucx_peer_death ROUNDS PEERS LINKS`` from tests/. Each round starts ``PEERS`` bare UCX
workers (the raw ucxx baseline's ``RawUcx``) in child processes and opens ``LINKS`` links to each; then, peer by
peer, it kills the peer and closes its links while UCX runs the error callbacks for the dead endpoints. Prints
``closed N links`` and exits 0 when nothing crashed."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np

from conformance.kvspec import Spec
from kvxfer.transports.base import Peer
from kvxfer.transports.ucx import DATA, UcxTransport

PEER = """
import sys
from kvxfer.bench.baselines import RawUcx
raw = RawUcx()
sys.stdout.write(raw.address().hex() + "\\n")
sys.stdout.flush()
sys.stdin.read()  # until the parent is gone
"""


def _close_as_it_dies(ours: UcxTransport, child: subprocess.Popen, sessions: list[int]) -> None:
    """Kill ``child`` and close its links. UCX hears of the death some 26 ms later and fails the endpoints one
    after another: once one end of the list has failed, close from the other, so that the closes meet the error
    callbacks midway."""
    first, last = ours.links[sessions[0]].ep, ours.links[sessions[-1]].ep
    child.kill()
    end = time.monotonic() + 10
    while first.alive and last.alive and time.monotonic() < end:
        pass
    for s in sessions if last.alive else reversed(sessions):
        ours.disconnect(s)
    child.wait()


def main(rounds: int, peers: int, links: int) -> None:
    spec = Spec()
    tensors, kw, _, _ = spec.build(seed=1)
    layout = spec.layout(tensors, kw)
    ours = UcxTransport(layout, None)
    data, closed, session = np.zeros(64, np.uint8), 0, 0
    try:
        for _ in range(rounds):
            children = [
                subprocess.Popen(
                    [sys.executable, "-c", PEER],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
                for _ in range(peers)
            ]
            for child in children:
                assert child.stdout is not None
                meta = bytes.fromhex(child.stdout.readline().decode())
                sessions = []
                for _ in range(links):
                    session += 1
                    link = ours.connect(Peer(session, "-", layout, None, meta, True, key=b"k%d" % session))
                    link._leave([link._send(data, link._tag(1, DATA))])  # wired up: the peer's death reaches it
                    sessions.append(session)
                _close_as_it_dies(ours, child, sessions)
                closed += len(sessions)
    finally:
        ours.close()
    print(f"closed {closed} links", flush=True)


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
