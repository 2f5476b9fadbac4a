"""The raw references every kvxfer row is compared with, measured in the same run.

* ``socket``: one plain TCP connection, ``sendall`` of one contiguous buffer, ``recv_into`` another, a one-byte
  acknowledgement back: what a single socket moves between the same two processes.
* ``memcpy``: ``np.copyto`` of the same number of bytes inside one process: the machine's copy limit.
* ``nixl-raw``: NIXL called directly (no kvxfer) issuing the very descriptors kvxfer's plan produced.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import numpy as np

_HDR = struct.Struct(">Q")
NOTIF_POLL = 0.0001  # seconds between a passive NIXL side's notification polls
ACK = b"k"


def touched(nbytes: int, value: int = 1) -> np.ndarray:
    """A contiguous byte buffer whose pages are already faulted in."""
    buf = np.empty(max(1, nbytes), dtype=np.uint8)
    buf.fill(value)
    return buf


def memcpy_gbps(nbytes: int, repeats: int, src: np.ndarray | None = None) -> list[float]:
    """GB/s of ``np.copyto`` over ``nbytes`` for each repeat (one warm-up copy first)."""
    a = src[:nbytes] if src is not None and src.nbytes >= nbytes else touched(nbytes, 1)
    b = touched(nbytes, 2)
    np.copyto(b, a)
    out = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        np.copyto(b, a)
        out.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return out


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("baseline sender went away")
        got += k


class SocketReceiver:
    """Consumer half: accepts one plain connection and receives length-prefixed messages into one buffer."""

    def __init__(self, host: str, capacity: int):
        self.buf = touched(capacity, 3)
        self.server = socket.create_server((host, 0))
        self.port = self.server.getsockname()[1]
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-socket-baseline")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.server.settimeout(60)
            conn, _ = self.server.accept()
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            view = self.buf.data
            with conn:
                while True:
                    hdr = bytearray(_HDR.size)
                    _recv_exact_into(conn, memoryview(hdr))
                    (n,) = _HDR.unpack(hdr)
                    if n == 0:
                        return
                    if n > len(view):
                        raise ValueError(f"baseline message of {n} bytes exceeds {len(view)}")
                    _recv_exact_into(conn, view[:n])
                    conn.sendall(ACK)
        except BaseException as e:  # reported to the driver through ``close``
            self.error = e
        finally:
            self.server.close()

    def close(self) -> None:
        self.server.close()
        self.thread.join(5)


class SocketSender:
    """Producer half: one connection to a ``SocketReceiver``; ``send(n)`` times one message and its ack."""

    def __init__(self, host: str, port: int, src: np.ndarray):
        self.sock = socket.create_connection((host, port), timeout=60)
        self.sock.settimeout(None)  # plain blocking socket: no poll() before every send
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.view = src.data.cast("B")

    def send(self, nbytes: int, offset: int = 0) -> float:
        """Seconds from the first byte sent to the receiver's acknowledgement of the last."""
        t0 = time.perf_counter()
        self.sock.sendall(_HDR.pack(nbytes))
        self.sock.sendall(self.view[offset : offset + nbytes])
        if self.sock.recv(1) != ACK:
            raise ConnectionError("baseline receiver went away")
        return time.perf_counter() - t0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(_HDR.pack(0))
        self.sock.close()


# ---- raw NIXL --------------------------------------------------------------------------------------------
def nixl_importable() -> bool:
    try:
        from ..transports.nixl import nixl_api

        nixl_api()
    except Exception:  # any failure to load means "not here"
        return False
    return True


class RawNixl:
    """One NIXL agent (UCX backend, no progress thread: the caller polls) over a cache's host regions."""

    def __init__(self, name: str, regions):
        from ..transports.nixl import nixl_api

        api = nixl_api()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = api.nixl_agent(name, config)
        self.regions = list(regions)
        self.reg = self.agent.register_memory([(r.ptr, r.nbytes, 0, "") for r in self.regions], "DRAM")
        self.peers: dict[str, str] = {}

    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    def add_peer(self, meta: bytes) -> str:
        name = self.agent.add_remote_agent(meta)
        return name.decode() if isinstance(name, bytes) else name

    def descs(self, regions, ext) -> np.ndarray:
        """Nx3 (address, length, device) rows of ``ext`` (a kvxfer.plan.Extents over ``regions``)."""
        base = np.array([r.ptr for r in regions], dtype=np.uint64)
        out = np.empty((len(ext), 3), dtype=np.uint64)
        out[:, 0] = base[np.asarray(ext.region)] + np.asarray(ext.offset, dtype=np.uint64)
        out[:, 1] = np.asarray(ext.nbytes, dtype=np.uint64)
        out[:, 2] = 0
        return out

    def xfer(
        self, op: str, local: np.ndarray, remote: np.ndarray, peer: str, notif: bytes = b"", timeout: float = 60.0
    ) -> float:
        """Post one READ or WRITE of these descriptors and poll it to completion; returns seconds."""
        a = self.agent
        t0 = time.perf_counter()
        handle = a.initialize_xfer(op, a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM"), peer, notif)
        try:
            state = a.transfer(handle)
            while state == "PROC":
                if time.perf_counter() - t0 > timeout:
                    raise TimeoutError(f"raw NIXL {op} did not finish within {timeout}s")
                state = a.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"raw NIXL {op} failed ({state})")
            return time.perf_counter() - t0
        finally:
            handle.release()

    def poll(self) -> dict:
        return self.agent.get_new_notifs()

    def wait_notif(self, tag: bytes, timeout: float = 60.0) -> None:
        """Poll until a notification ``tag`` arrives (from any peer)."""
        deadline = time.monotonic() + timeout
        while True:
            for msgs in self.agent.get_new_notifs().values():
                if tag in msgs:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw NIXL notification {tag!r} did not arrive within {timeout}s")
            # a target spinning on get_new_notifs slows a cma WRITE into it about 4x on 2 cores: poll gently
            time.sleep(NOTIF_POLL)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort at teardown
            self.agent.deregister_memory(self.reg)
        self.agent = None


# ---- raw ucxx --------------------------------------------------------------------------------------------
_UCX_DATA, _UCX_ACK = 2, 3  # tags of the raw ucxx baseline's messages


def ucx_importable() -> bool:
    """Whether ucxx is installed (found, not loaded: its UCX must come after NIXL's in a process)."""
    from ..transports.ucx import UcxTransport

    return UcxTransport.usable()


class RawUcx:
    """One ucxx worker (progress thread, as the ucx transport runs it) and an endpoint to the other half's:
    one contiguous tag message each way per transfer, no kvxfer protocol, no bounce copies."""

    def __init__(self):
        from ..transports.ucx import ucxx

        self.u = ucx = ucxx()
        self.context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self.worker = ucx.UCXWorker(self.context)
        self.worker.start_progress_thread()
        self.ep = None

    def address(self) -> bytes:
        return self.worker.address.tobytes()

    def connect(self, address: bytes) -> None:
        u = self.u
        self.ep = u.UCXEndpoint.create_from_worker_address(self.worker, u.UCXAddress.create_from_buffer(address), True)

    def post(self, send: bool, buf: np.ndarray, tag: int):
        from ucxx._lib.arr import Array

        call = self.ep.tag_send if send else self.ep.tag_recv
        return call(Array(buf), self.u.UCXXTag(tag))

    @staticmethod
    def wait(*reqs, timeout: float = 60.0) -> None:
        """Poll as the ucx transport does (a pause doubling up to 1 ms), then raise what UCX reported."""
        end, pause = time.monotonic() + timeout, 0.00002
        for r in reqs:
            while not r.completed:
                if time.monotonic() > end:
                    raise TimeoutError("raw ucxx request did not complete")
                time.sleep(pause)
                pause = min(pause * 2, 0.001)
            r.check_error()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.worker.stop_progress_thread()


class UcxReceiver:
    """Consumer half: receives each message into one buffer, then acknowledges it with one byte."""

    def __init__(self, capacity: int, sender: bytes):
        self.raw = RawUcx()
        self.raw.connect(sender)
        self.buf = touched(capacity, 3)
        self.ack = np.ones(1, dtype=np.uint8)
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-ucx-baseline")
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                r = self.raw.post(False, self.buf, _UCX_DATA)
                while not r.completed:
                    if self.stop.wait(0.0005):
                        return
                r.check_error()
                self.raw.wait(self.raw.post(True, self.ack, _UCX_ACK))
        except BaseException as e:  # reported to the driver through ``close``
            self.error = e

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.raw.close()


class UcxSender:
    """Producer half: ``send(n)`` times one tag message of ``n`` contiguous bytes and its acknowledgement."""

    def __init__(self, raw: RawUcx, src: np.ndarray):
        self.raw = raw
        self.src = src
        self.ack = np.zeros(1, dtype=np.uint8)

    def send(self, nbytes: int) -> float:
        t0 = time.perf_counter()
        ack = self.raw.post(False, self.ack, _UCX_ACK)
        data = self.raw.post(True, self.src[:nbytes], _UCX_DATA)
        self.raw.wait(data, ack)
        return time.perf_counter() - t0
