"""A peer that opens connections until the consumer's process runs out of descriptors: the consumer must go on
accepting once they are gone (an accept loop that ended at EMFILE left it deaf for good), and one session may
not hold more than a bounded number of data connections. The consumer runs in a child process of its own with
a small descriptor limit, as a serving process's default soft limit is."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conformance.rawpeer import RawPeer
from kvxfer import KVLayout, Producer, handshake
from kvxfer.transports.tcp.pool import MAX_OPEN

CHILD = """
import resource, sys
import numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from kvxfer import Consumer, KVLayout
c = Consumer(KVLayout.from_tensors([np.zeros((16, 2, 4, 8), np.float16)], block_size=4), transport="tcp")
print(c.address, flush=True)
while (line := sys.stdin.readline().strip()):
    a = c.get(10)
    c.release(a.req)
    print("got", a.req, flush=True)
c.close()
"""


def _layout():
    return KVLayout.from_tensors([np.ones((16, 2, 4, 8), np.float16)], block_size=4)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _push(child, address: str, req: str) -> None:
    with Producer(_layout(), transport="tcp") as p:
        p.push(address, req, [1, 2], deadline=10).wait()
    child.stdin.write("take\n")
    child.stdin.flush()
    assert child.stdout.readline().split() == ["got", req]


def _consumer(limit: int) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.replace("FD_LIMIT", str(limit))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    child.address = child.stdout.readline().strip()  # type: ignore[attr-defined]
    return child


def _flood(address: str, n: int) -> tuple[RawPeer, list[RawPeer]]:
    """One authenticated session and ``n`` data connections of it (each a valid DataHello)."""
    peer = RawPeer(address, timeout=10)
    welcome = peer.hello(_layout(), "tcp")
    data = []
    for _ in range(n):
        try:
            d = RawPeer(address, timeout=10)
            d.send(handshake.data_hello(welcome.session, "pull", peer.key))
        except OSError:  # the consumer is out of descriptors: its backlog fills up
            break
        data.append(d)
    return peer, data


def _end(peer: RawPeer, data: list[RawPeer]) -> None:
    for d in data:
        d.sock.close()
    peer.close()


def _stop(child: subprocess.Popen) -> None:
    if child.poll() is None:
        child.stdin.write("\n")
        child.stdin.flush()
        try:
            assert child.wait(20) == 0
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.mark.timeout(120)
def test_a_consumer_that_ran_out_of_descriptors_accepts_again():
    limit = MAX_OPEN - 64  # the data connections of one session use them all up
    child = _consumer(limit)
    try:
        peer, data = _flood(child.address, limit + 64)
        # out of descriptors: accept() fails with EMFILE (a loaded machine takes its time to accept them all)
        end = time.monotonic() + 10
        while _fds(child.pid) < limit - 4 and time.monotonic() < end:
            time.sleep(0.05)
        assert _fds(child.pid) >= limit - 4
        _end(peer, data)
        time.sleep(0.5)
        _push(child, child.address, "after-the-flood")
    finally:
        _stop(child)


@pytest.mark.timeout(120)
def test_one_session_holds_a_bounded_number_of_data_connections():
    child = _consumer(4 * MAX_OPEN)
    try:
        peer, data = _flood(child.address, MAX_OPEN + 128)
        assert len(data) == MAX_OPEN + 128
        time.sleep(0.5)
        assert _fds(child.pid) < MAX_OPEN + 64  # those past the bound were closed
        _end(peer, data)
        _push(child, child.address, "after-the-data-flood")
    finally:
        _stop(child)
