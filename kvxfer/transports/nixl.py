"""NIXL transport: one-sided READ / WRITE over NIXL's UCX backend (RDMA, NVLink / CUDA IPC, cma, shm, tcp).

One NIXL agent per endpoint registers the layout's regions once (DRAM for host tensors, VRAM for CUDA ones).
Agent metadata travels inside kvxfer's own handshake, so there is no second side channel. A transfer is one
NIXL request built from the plan's numpy descriptor arrays (Nx3 uint64: address, length, device), or one per
lane when it is large (lanes post from their own threads at once, each on an agent of its own). A push's WRITE carries a
notification naming (request, generation, bytes); the consumer polls notifications and tells its ledger the
bytes landed. No NIXL progress thread: on small machines its busy-poll halves throughput, so
the initiator drives progress by polling its request and one light poller thread per endpoint drains
notifications (which also progresses the passive side).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import itertools
import os
import sys
import threading
import time
import uuid
import weakref
from typing import cast

import msgspec
import numpy as np

from ..errors import CancelledError, DeadlineError, KVXferError, PeerError, TransportError
from ..memory import HOST
from ..plan import Extents
from . import parallel
from .base import Link, Peer, Transport, WriteHost, ucx_logs_to_stderr

_NOTIF = msgspec.msgpack.Encoder()
_NOTIF_DECODER = msgspec.msgpack.Decoder(tuple[str, int, int])


_LIVE: weakref.WeakSet[NixlTransport] = weakref.WeakSet()
DRAIN = 1.0  # how long a stopped request is still polled for its end (the consumer's quarantine is longer)
BUSY_WINDOW = 1.0  # seconds of fast polling after a peer was told to move bytes here, or bytes arrived
# A peer's WRITE completes only once this side progressed its notification: polled every 0.5 ms, a 1 MiB push
# over cma took 1.7 ms where raw NIXL, whose target busy-polls, took 0.47. So for a moment after a Grant, an
# Offer, a Done or an arrival the poller polls every FAST_POLL (a poll costs under 1 us; the wake-up is the cost).
FAST_WINDOW = 0.02
FAST_POLL = 0.0001
# A large transfer is cut into lanes posted from their own threads, each on an agent of its own (lane 0 on the
# endpoint's, the others on helpers that only initiate): over cma a copy runs in the posting thread, so two lanes
# use both cores. On 2 cores, 640 MiB of permuted pieces (bench/nixl_lanes.py) moved with two lanes against one
# in 119 against 233 ms (16 KiB pieces), 64 against 83 ms (256 KiB) and 38 against 78 ms (16 MiB). One agent with
# a UCX worker per lane and NIXL's strict locking (what lanes were before) gained on small pieces only.
LANE_MIN = 4 << 20  # bytes a lane moves at least: below that a thread start costs more than it saves
LANE_SEP = "#lane"  # a helper agent's name: its endpoint's agent's, then this and the lane number


class _AgentLock:
    """The lock every call into an agent takes, where callers go before the background poller: the poller
    takes it only when it is free and nobody waits (a plain lock let a busy poller starve a handshake)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count = threading.Lock()
        self._waiting = 0

    def __enter__(self) -> None:
        with self._count:
            self._waiting += 1
        self._lock.acquire()
        with self._count:
            self._waiting -= 1

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire_if_free(self) -> bool:
        return not self._waiting and self._lock.acquire(blocking=False)

    def release(self) -> None:
        self._lock.release()


class _Agent:
    """One NIXL agent over the endpoint's registered memory, and the lock its callers take."""

    def __init__(self, agent):
        self.agent = agent
        self.lock = _AgentLock()
        self.reg = None

    def register(self, regs: np.ndarray, mem_type: str) -> None:
        self.reg = self.agent.register_memory(regs, mem_type)

    def close(self, remotes) -> None:
        """Forget ``remotes``, deregister, and destroy the agent now (not at interpreter exit)."""
        with self.lock:
            agent, self.agent = self.agent, None
            if agent is None:
                return
            for name in remotes:
                with contextlib.suppress(Exception):
                    agent.remove_remote_agent(name)
            if self.reg is not None:
                with contextlib.suppress(Exception):
                    agent.deregister_memory(self.reg)
            del agent  # the last reference: the C++ agent is destroyed here, not at interpreter exit


def _name(agent_name) -> str:
    return agent_name.decode() if isinstance(agent_name, bytes) else agent_name


def _endpoint(agent_name) -> str:
    """The endpoint agent a notification came from: a helper lane's name maps to its endpoint's."""
    return _name(agent_name).partition(LANE_SEP)[0]


@atexit.register
def _close_all() -> None:
    """Destroy NIXL agents while the interpreter is whole: one torn down during finalisation aborts the
    process ("terminate called without an active exception")."""
    for t in list(_LIVE):
        t.close()


def native_loaded() -> bool:
    """Whether NIXL's native library is in this process, loaded by kvxfer or by anyone else (vLLM)."""
    return any(name.startswith("nixl") and name.endswith("._bindings") for name in sys.modules)


def exit_before_native_teardown(status: int) -> None:
    """End a process that loaded NIXL with ``status`` before native teardown runs; else return.

    With its UCX backend loaded, NIXL 1.5.1 has been seen to crash (SIGSEGV, exit 139) after every agent is
    gone and the interpreter is done, replacing a finished run's status. What runs then is native only: the
    plugin manager's static destructor unloading the UCX plugin, then UCX's library destructors, with libc's
    mmap/brk/madvise still patched to jump into UCX's memory hooks (docs/transports.md). A program's entry
    point calls this once, last: Python's exit handlers run (every kvxfer agent closed, logs flushed), stdio
    is flushed, and ``os._exit(status)`` skips that native teardown, which frees nothing the kernel does not.
    """
    if not native_loaded():
        return
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken pipe: nothing left to say
            stream.flush()
    os._exit(status)


def nixl_api():
    """NIXL's Python API: the ``nixl`` meta-package if installed (it picks the wheel matching the CUDA
    driver, which takes seconds), else the one CUDA-flavoured wheel that is (``kvxfer[nixl]`` on CPU)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    ucx_logs_to_stderr()
    names = ("nixl._api",) if importlib.util.find_spec("nixl") else ("nixl_cu13._api", "nixl_cu12._api")
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError("no NIXL Python package (install kvxfer[nixl])")


def _error(e: Exception, what: str) -> Exception:
    """NIXL's exceptions as kvxfer's: a gone peer is a ``PeerError``, anything else a ``TransportError``."""
    name = type(e).__name__
    if "Disconnect" in name or "Remote" in name:
        return PeerError(f"{what}: peer disconnected ({name}: {e})")
    return TransportError(f"{what}: {name}: {e}")


class NixlTransport(Transport):
    name = "nixl"
    one_sided = True

    @staticmethod
    def usable() -> bool:
        try:
            nixl_api()
            return True
        except ImportError:
            return False

    def __init__(
        self,
        layout,
        host,
        *,
        num_threads: int = 0,
        lanes: int | None = None,
        lane_min: int = LANE_MIN,
        backends=("UCX",),
        poll_interval: float = 0.0005,
        poll_idle: float = 0.02,
        **_,
    ):
        super().__init__(layout, host)
        api = nixl_api()
        self.mem_type = "DRAM" if layout.device == HOST else "VRAM"
        self.poll_interval, self.poll_idle = poll_interval, max(poll_interval, poll_idle)
        self._busy_until = self._fast_until = 0.0
        self._wake = threading.Event()
        self.lanes = parallel.per_core() if lanes is None else max(1, int(lanes))
        self.lane_min = max(1, int(lane_min))
        self.ptrs = np.array([r.ptr for r in layout.regions], dtype=np.uint64)
        self.devs = np.array([max(r.device, 0) for r in layout.regions], dtype=np.uint64)
        regs = np.stack([self.ptrs, np.array([r.nbytes for r in layout.regions], dtype=np.uint64), self.devs], 1)
        config = api.nixl_agent_config(enable_prog_thread=False, num_threads=num_threads, backends=list(backends))
        name = f"kvxfer-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # lane 0 is the endpoint's own agent (peers know it); the others only initiate, and their notifications
        # reach the peer's agent under a name it maps back to this one (``_endpoint``)
        self.agents: list[_Agent] = []
        try:
            for i in range(self.lanes):
                self.agents.append(_Agent(api.nixl_agent(f"{name}{LANE_SEP}{i}" if i else name, config)))
                self.agents[-1].register(regs, self.mem_type)
            self._meta = self.agents[0].agent.get_agent_metadata()  # fixed once the memory is registered
        except Exception as e:
            for a in self.agents:
                a.close(())
            raise _error(e, "registering KV memory with NIXL") from None
        self.main = self.agents[0]
        self.links: dict[int, NixlLink] = {}
        # a remote agent's links: one per session, and one agent can have several (one producer reaching this
        # consumer at two addresses, a session redialed before the old one's end was heard)
        self.by_agent: dict[str, list[NixlLink]] = {}
        self.closed = False
        self._poller = threading.Thread(target=self._poll_loop, daemon=True, name="kvxfer-nixl-poll")
        self._poller.start()
        _LIVE.add(self)

    def _live_agent(self):
        if self.main.agent is None:
            raise PeerError("NIXL transport closed")
        return self.main.agent

    def local_meta(self) -> bytes:
        self._live_agent()
        return self._meta

    def connect(self, peer: Peer) -> NixlLink:
        self.expect()  # the new peer's first request needs this side's progress to set up its UCX endpoint
        with self.main.lock:  # the main agent's lock, then a helper's: the one order that takes both
            try:
                name = self._live_agent().add_remote_agent(peer.meta)
                for helper in self.agents[1:]:  # every lane reaches the peer's own agent
                    with helper.lock:
                        helper.agent.add_remote_agent(peer.meta)
            except Exception as e:
                raise _error(e, "adding the peer's NIXL agent") from None
            name = _name(name)
            link = NixlLink(self, peer, name)
            self.links[peer.local] = link
            self.by_agent[name] = [*self.by_agent.get(name, ()), link]  # a new list: the poller reads it unlocked
        return link

    def expect(self) -> None:
        self._stay_fast(time.monotonic())
        self._wake.set()

    def _stay_fast(self, now: float) -> None:
        self._busy_until, self._fast_until = now + BUSY_WINDOW, now + FAST_WINDOW

    def disconnect(self, session: int) -> None:
        with self.main.lock:
            link = self.links.pop(session, None)
            if link is None:
                return
            link.closed = True
            others = [x for x in self.by_agent.pop(link.remote, []) if x is not link]
            if others:
                self.by_agent[link.remote] = others
                return
            with contextlib.suppress(Exception):  # a dead peer may already be gone
                self._live_agent().remove_remote_agent(link.remote)
            for helper in self.agents[1:]:  # as in connect: the main agent's lock, then a helper's
                with helper.lock, contextlib.suppress(Exception):
                    helper.agent.remove_remote_agent(link.remote)

    def _poll_loop(self) -> None:
        """Drain notifications (push arrivals) and progress this agent (a peer's request completes only while
        this side progresses too). Fast while something is expected or arriving (``BUSY_WINDOW``), backing off
        to ``poll_idle`` otherwise: every poll takes the GIL and the agent, and in a busy process (a vLLM worker
        spinning beside other servers on few cores) a fast idle poll starved handshakes and transfers for
        seconds. The poller takes the agent only when no caller waits for it (``_AgentLock``)."""
        idle = self.poll_interval
        while not self.closed:
            notifs: dict = {}
            main = self.main
            if main.lock.acquire_if_free():
                try:
                    if self.closed or main.agent is None:
                        return
                    notifs = main.agent.get_new_notifs()
                except Exception:  # keep polling; a broken peer shows up on its own transfers
                    notifs = {}
                finally:
                    main.lock.release()
            got = False
            for agent_name, msgs in notifs.items():
                links = self.by_agent.get(_name(agent_name)) or self.by_agent.get(_endpoint(agent_name)) or []
                for m in msgs:
                    got = True
                    try:
                        req, gen, nbytes = _NOTIF_DECODER.decode(m)
                    except msgspec.MsgspecError:
                        continue
                    for link in links:  # the session the request was granted on counts it; the others refuse it
                        if not link.peer.is_producer:  # only a consumer's blocks land
                            cast(WriteHost, self.host).landed(link.peer.local, req, gen, nbytes)
            now = time.monotonic()
            if got:  # more may follow: stay fast (no self-wake: this sleep is already the short one)
                self._stay_fast(now)
            busy = now < self._busy_until
            idle = self.poll_interval if got else min(idle * 2, 2 * self.poll_interval if busy else self.poll_idle)
            if now < self._fast_until:
                idle = min(idle, FAST_POLL)
            if self._wake.wait(idle):
                self._wake.clear()
                idle = self.poll_interval

    def close(self) -> None:
        """Release every NIXL resource now: remote agents, the registrations, and the agents themselves."""
        if self.closed:
            return
        self.closed = True
        self._wake.set()
        self._poller.join(1.0)
        with self.main.lock:
            remotes = {x.remote for x in self.links.values()}
            self.links.clear()
            self.by_agent.clear()
        for a in reversed(self.agents):  # the endpoint's own agent last: helpers' requests ran on its memory
            a.close(remotes)
        _LIVE.discard(self)


class NixlLink(Link[NixlTransport]):
    def __init__(self, transport: NixlTransport, peer: Peer, remote: str):
        self.t = transport
        self.peer = peer
        self.remote = remote
        self.closed = False
        r = peer.layout.regions
        self.rptrs = np.array([x.ptr for x in r], dtype=np.uint64)
        self.rdevs = np.array([max(x.device, 0) for x in r], dtype=np.uint64)
        self.rmem = "DRAM" if peer.layout.device == HOST else "VRAM"

    @staticmethod
    def _descs(ext: Extents, ptrs: np.ndarray, devs: np.ndarray) -> np.ndarray:
        region = np.asarray(ext.region)
        out = np.empty((len(ext), 3), dtype=np.uint64)
        out[:, 0] = ptrs[region] + np.asarray(ext.offset, dtype=np.uint64)
        out[:, 1] = ext.nbytes
        out[:, 2] = devs[region]
        return out

    def _plan(self, src_ids, dst_ids, part=None, chunks=None):
        a, b = (self.t.layout, self.peer.layout) if self.peer.is_producer else (self.peer.layout, self.t.layout)
        return self.paging(part).plan(src_ids, dst_ids, chunks, a.num_blocks, b.num_blocks)

    def descriptors(self, src_ids, dst_ids, chunks=None) -> int:
        return len(self._plan(src_ids, dst_ids, chunks=chunks))

    def _lanes(self, local: np.ndarray, remote: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, int]]:
        """The descriptor pairs cut into at most ``lanes`` runs of equal bytes (with their byte counts): several
        when the transfer is large, else one. A cut inside a descriptor splits it (both sides' addresses move
        alike), so a transfer that coalesced into one large descriptor still uses every lane."""
        sizes = local[:, 1].astype(np.int64)
        total = int(sizes.sum())
        k = min(self.t.lanes, total // self.t.lane_min)
        if k <= 1:
            return [(local, remote, total)]
        ends = np.cumsum(sizes)
        bounds = [0, *(total * np.arange(1, k) // k).tolist(), total]
        lanes = []
        for lo_byte, hi_byte in itertools.pairwise(bounds):
            first = int(np.searchsorted(ends, lo_byte, side="right"))  # the descriptor holding byte lo_byte
            last = int(np.searchsorted(ends, hi_byte, side="left"))  # the one holding byte hi_byte - 1
            lo, re = local[first : last + 1].copy(), remote[first : last + 1].copy()
            head = lo_byte - int(ends[first] - sizes[first])
            tail = int(ends[last]) - hi_byte
            for d in (lo, re):
                d[0, 0] += head
                d[0, 1] -= head
                d[-1, 1] -= tail
            lanes.append((lo, re, hi_byte - lo_byte))
        return lanes

    def _move(self, op: str, local, remote, notif, deadline: float, cancel: threading.Event) -> None:
        """One NIXL request per lane, lanes after the first in their own threads; all have ended on return.
        ``notif(nbytes)`` is a lane's notification: the consumer adds up what each says landed."""
        lanes = self._lanes(local, remote)  # at most one per agent
        pieces = [
            (a, op, lo, re, notif(n), deadline, cancel) for a, (lo, re, n) in zip(self.t.agents, lanes, strict=False)
        ]
        parallel.run_all(self._run, pieces, "kvxfer-nixl-lane")

    def _run(
        self,
        lane: _Agent,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        notif: bytes,
        deadline: float,
        cancel: threading.Event,
    ) -> None:
        agent, lock = lane.agent, lane.lock
        if agent is None:
            raise PeerError("NIXL transport closed")
        handle = None
        try:
            with lock:
                ldesc = agent.get_xfer_descs(local, self.t.mem_type)
                rdesc = agent.get_xfer_descs(remote, self.rmem)
                handle = agent.initialize_xfer(op, ldesc, rdesc, self.remote, notif)
                # the last moment to decide: a one-sided op posted after the deadline (a producer stopped and
                # resumed) could land in blocks the other side freed once its quarantine passed
                if cancel.is_set():
                    raise CancelledError("transfer cancelled")
                if time.monotonic() >= deadline:
                    raise DeadlineError(f"NIXL {op} not posted: the deadline passed")
                state = agent.transfer(handle)
            posted, drained_by = time.monotonic(), 0.0
            stop: KVXferError | None = None
            while state == "PROC":
                if stop is None:
                    if cancel.is_set():
                        stop = CancelledError("transfer cancelled")
                    elif self.closed or self.t.closed:
                        stop = PeerError("link closed")
                    elif time.monotonic() >= deadline:
                        stop = DeadlineError(f"NIXL {op} still in progress at the deadline")
                    # a posted request cannot be withdrawn: wait (a little) for it to end, so that once this
                    # returns nothing of it lands any more
                    drained_by = time.monotonic() + DRAIN
                elif time.monotonic() >= drained_by:
                    break
                # a pause of an eighth of the time it has taken so far: its end is seen at most ~12% late
                time.sleep(min(0.001, max(0.00002, (time.monotonic() - posted) / 8)))
                with lock:
                    state = agent.check_xfer_state(handle)
            if stop is not None:
                raise stop
            if state != "DONE":
                raise TransportError(f"NIXL {op} ended in state {state}")
        except (CancelledError, PeerError, DeadlineError, TransportError):
            raise
        except Exception as e:  # NIXL's own exception types
            raise _error(e, f"NIXL {op}") from None
        finally:
            if handle is not None:
                # a handle still in flight cannot always be released
                with lock, contextlib.suppress(Exception):
                    agent.release_xfer_handle(handle)

    def write(self, req, gen, src_ids, dst_ids, deadline, cancel, part=None, chunks=None) -> int:
        plan = self._plan(src_ids, dst_ids, part, chunks)
        local = self._descs(plan.src, self.t.ptrs, self.t.devs)
        remote = self._descs(plan.dst, self.rptrs, self.rdevs)
        self._move("WRITE", local, remote, lambda n: _NOTIF.encode((req, gen, n)), deadline, cancel)
        return plan.total

    def read(self, req, gen, src_ids, dst_ids, deadline, cancel, chunks=None) -> int:
        plan = self._plan(src_ids, dst_ids, chunks=chunks)
        local = self._descs(plan.dst, self.t.ptrs, self.t.devs)
        remote = self._descs(plan.src, self.rptrs, self.rdevs)
        self._move("READ", local, remote, lambda n: b"", deadline, cancel)
        return plan.total

    def close(self) -> None:
        self.closed = True
