"""The NIXL transport's background poller, on a real agent: callers of the agent go before it, and an idle
endpoint polls slowly. On a busy machine (vLLM workers spinning beside NixlConnector on 2 cores) a fast idle poll
behind a plain lock starved a fetch's handshake for 20 s and its offer for 10 s."""

import contextlib
import threading
import time

import numpy as np
import pytest

from kvxfer import KVLayout

pytest.importorskip("nixl_cu13")

from kvxfer.transports.nixl import FAST_WINDOW, NixlTransport, _AgentLock


class CountingAgent:
    """The real agent, with its polls counted."""

    def __init__(self, agent):
        self.agent, self.polls = agent, 0

    def get_new_notifs(self):
        self.polls += 1
        return self.agent.get_new_notifs()

    def __getattr__(self, name):
        return getattr(self.agent, name)


@pytest.fixture
def transport():
    t = NixlTransport(KVLayout.from_tensors([np.zeros((8, 2, 16, 8), dtype=np.float32)]), host=None)
    yield t
    t.close()


def _polls_in(t: NixlTransport, seconds: float) -> int:
    counting = t.main.agent = CountingAgent(t.main.agent)
    time.sleep(seconds)
    t.main.agent = counting.agent
    return counting.polls


def test_an_idle_endpoint_polls_at_its_idle_interval(transport):
    time.sleep(0.2)  # past the start-up's fast polls
    assert _polls_in(transport, 1.0) <= 1.0 / transport.poll_idle + 5  # 0.5 ms polls would be ~1000


def test_expecting_bytes_polls_fast_again(transport):
    time.sleep(0.2)
    transport.expect()
    fast = _polls_in(transport, 0.3)
    assert fast > 3 * 0.3 / transport.poll_idle, fast  # a push's arrival is noticed within about a millisecond


@pytest.mark.quiet  # counts wake-ups 0.1 ms apart: a loaded machine stretches them
def test_expecting_bytes_polls_every_fast_poll_for_a_moment_then_slower(transport):
    """A peer's WRITE completes only once this side progressed its notification: right after a Grant the poller
    runs at FAST_POLL (0.1 ms), more often than ``poll_interval`` allows, and only for FAST_WINDOW."""
    time.sleep(0.2)
    transport.expect()
    first = _polls_in(transport, FAST_WINDOW)
    assert first > FAST_WINDOW / transport.poll_interval, first  # 0.5 ms polls alone would be 40
    time.sleep(0.05)
    later = _polls_in(transport, 0.3)
    assert later <= 0.3 / transport.poll_interval + 5, later  # still busy, but no faster than poll_interval


def test_a_caller_waiting_for_the_agent_goes_before_the_poller():
    lock, got = _AgentLock(), threading.Event()
    lock.__enter__()  # a call in progress

    def caller():
        with lock:
            got.set()

    threading.Thread(target=caller, daemon=True).start()
    deadline = time.monotonic() + 5
    while not lock._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    lock.__exit__(None, None, None)
    assert got.wait(5)
    assert lock.acquire_if_free()  # free again, nobody waiting: the poller may take it
    lock.release()


def test_the_poller_never_takes_the_agent_from_a_waiting_caller():
    lock = _AgentLock()
    lock.__enter__()
    threading.Thread(target=lambda: lock.__enter__(), daemon=True).start()
    deadline = time.monotonic() + 5
    while not lock._waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    lock.__exit__(None, None, None)  # the caller takes it; the poller must not, even for an instant
    assert not lock.acquire_if_free()


class OverlapAgent:
    """The real agent, counting the polls made while one of its ``transfer()`` calls runs."""

    def __init__(self, agent):
        self.agent, self.posting, self.overlaps, self.transfers = agent, 0, 0, 0
        self.count = threading.Lock()

    def transfer(self, handle):
        with self.count:
            self.posting += 1
        try:
            return self.agent.transfer(handle)
        finally:
            with self.count:
                self.posting -= 1
                self.transfers += 1

    def get_new_notifs(self):
        self.overlaps += self.posting > 0
        return self.agent.get_new_notifs()

    def __getattr__(self, name):
        return getattr(self.agent, name)


@contextlib.contextmanager
def _spying(t: NixlTransport):
    """Every lane's agent of ``t`` wrapped in an ``OverlapAgent`` while the block runs."""
    spies = [OverlapAgent(a.agent) for a in t.agents]
    for a, spy in zip(t.agents, spies, strict=True):
        a.agent = spy
    try:
        yield spies
    finally:
        for a, spy in zip(t.agents, spies, strict=True):
            a.agent = spy.agent


def test_each_lane_posts_on_its_own_agent_and_no_poll_overlaps_a_copy():
    """Real pulls of 32 MiB between two NIXL endpoints in this process, the reader in two lanes: each lane's
    request goes through an agent of its own (one agent for both serialised their copies), and the poller never
    polls the endpoint's agent while its ``transfer()`` (the cma copy) runs."""
    from kvxfer import Consumer, Producer

    nb, layers = 64, 4
    tensors = [np.ones((nb, 16, 8, 512), dtype=np.float32) for _ in range(layers)]  # 256 KiB per layer-block
    dst = [np.zeros_like(x) for x in tensors]
    c = Consumer(KVLayout.from_tensors(dst), transport="nixl", transport_options={"lanes": 2})
    p = Producer(KVLayout.from_tensors(tensors), transport="nixl", transport_options={"lanes": 1})
    try:
        p.offer(c.address, "warm", [0]).wait(10)
        c.release(c.get(timeout=10).req)
        t = c.transports["nixl"]
        assert len(t.agents) == 2 and t.agents[0].agent is not t.agents[1].agent
        with _spying(t) as spies:
            for i in range(4):
                ids = np.random.default_rng(i).permutation(nb)[:32]  # 32 scattered blocks: two lanes of pieces
                p.offer(c.address, f"r{i}", ids).wait(20)
                arrival = c.get(timeout=10)
                assert all((x[arrival.block_ids] == 1).all() for x in dst)
                c.release(arrival.req)
        assert [spy.transfers for spy in spies] == [4, 4]
        assert spies[0].overlaps == 0
    finally:
        p.close()
        c.close()


def test_a_transfer_that_coalesced_into_one_descriptor_is_cut_across_lanes():
    """One layer, consecutive blocks on both sides: the plan is one 16 MiB descriptor, which two lanes share
    (cut inside it, both sides' addresses alike); every byte lands where it belongs."""
    from kvxfer import Consumer, Producer

    nb = 64
    src = [np.random.default_rng(0).integers(0, 1 << 30, (nb, 16, 8, 512), dtype=np.int32)]  # 256 KiB blocks
    dst = [np.zeros_like(src[0])]
    c = Consumer(KVLayout.from_tensors(dst), transport="nixl", transport_options={"lanes": 2})
    p = Producer(KVLayout.from_tensors(src), transport="nixl", transport_options={"lanes": 1})
    try:
        p.offer(c.address, "warm", [0]).wait(10)
        c.release(c.get(timeout=10).req)
        t = c.transports["nixl"]
        with _spying(t) as spies:
            offer = p.offer(c.address, "one", np.arange(nb)).wait(20)
            arrival = c.get(timeout=10)
        assert offer.done()
        assert next(iter(t.links.values())).descriptors(np.arange(nb), arrival.block_ids) == 1
        assert [spy.transfers for spy in spies] == [1, 1]
        assert np.array_equal(dst[0][arrival.block_ids], src[0])
        c.release(arrival.req)
    finally:
        p.close()
        c.close()
