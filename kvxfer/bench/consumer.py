"""The consumer half: a kvxfer ``Consumer`` over a destination cache, driven by the producer half.

It owns everything that lives on the decode side: the destination cache (poisoned before each transfer), the
allocator that grants blocks in the requested pattern, the receiving end of the socket baseline and of the raw
NIXL baseline, and the byte-exact verification of every arrival against the seed-derived source contents.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import traceback
from typing import TypeVar

import msgspec
import numpy as np

from .. import tls, transports
from ..channel import SPIN
from ..consumer import Consumer
from ..layout import KVLayout
from ..transfer import Arrival
from ..wire import ids_from_bytes
from . import baselines, certs, content, models
from .control import Control
from .patterns import PatternAllocator


def usable(name: str) -> str:
    """ "" when transport ``name`` can run in this process, else why not."""
    try:
        cls = transports.get(name)
        probe = getattr(cls, "usable", None)
        if probe is not None and not probe():
            hint = ""
            if name == "nixl" and not baselines.nixl_importable():
                hint = ": no NIXL Python package (pip install 'kvxfer[nixl]')"
            return f"transport {name!r} cannot run here{hint}"
    except Exception as e:
        return str(e)
    return ""


T = TypeVar("T")


def _made(value: T | None, what: str) -> T:
    """``value`` once the op that makes it has run; an op sent out of order gets a clear error back."""
    if value is None:
        raise RuntimeError(f"no {what} yet: the driver sends the op that makes it first")
    return value


def boot_id() -> str:
    """Identifies this machine's boot: two processes with the same one share ``time.monotonic``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"{socket.gethostname()}-unknown"


class ConsumerHalf:
    def __init__(self, ctl: Control, host: str, *, corrupt: bool = False):
        self.ctl = ctl
        self.host = host
        self.corrupt = corrupt
        self.geom: models.Geometry | None = None
        self.arrays: list[np.ndarray] = []
        self.layout: KVLayout | None = None
        self.content: content.Content | None = None
        self.alloc: PatternAllocator | None = None
        self.consumer: Consumer | None = None
        self.arrived: dict = {}
        self.sock_rx: baselines.SocketReceiver | None = None
        self.ucx_rx: baselines.UcxReceiver | None = None
        self.nixl: baselines.RawNixl | None = None

    # ---- loop ----------------------------------------------------------------------------------------------
    def serve(self) -> None:
        while True:
            try:
                msg = self.ctl.recv(None)
            except Exception:  # the driver went away: nothing left to serve
                break
            op = msg.pop("op", "")
            if op == "quit":
                self.ctl.send({"ok": True})
                break
            handler = getattr(self, "op_" + op, None)
            try:
                if handler is None:
                    raise ValueError(f"unknown op {op!r}")
                reply = handler(**msg) or {}
            except Exception as e:  # every failure goes back to the driver
                reply = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            try:
                self.ctl.send(reply)
            except Exception:
                break
        self.shutdown()

    def shutdown(self) -> None:
        for close in (self.op_close, self.op_socket_close, self.op_nixl_close, self.op_ucx_close):
            with contextlib.suppress(Exception):
                close()
        self.ctl.close()

    # ---- ops -----------------------------------------------------------------------------------------------
    def op_hello(self, transports: list) -> dict:
        """Who we are, and which of the driver's ``transports`` can run here (nixl is imported only if asked)."""
        return {
            "pid": os.getpid(),
            "boot_id": boot_id(),
            "python": sys.version.split()[0],
            "missing": {n: why for n in transports if (why := usable(certs.split(n)[0]))},
            "nixl_raw": baselines.nixl_importable() if "nixl" in transports else False,
            "ucx_raw": baselines.ucx_importable() if "ucx" in transports else False,
        }

    def op_setup(self, geometry: dict, src_blocks: int, dst_blocks: int, seed: int) -> dict:
        self.op_close()
        self.op_nixl_close()
        self.arrays, self.layout = [], None
        self.geom = models.Geometry.from_dict(geometry)
        self.arrays = models.allocate(self.geom, dst_blocks)
        content.poison(self.arrays)
        self.layout = models.layout_of(self.geom, self.arrays)
        self.content = content.Content(seed, self.geom.layers, src_blocks, self.geom.layer_block_bytes)
        self.alloc = PatternAllocator(dst_blocks, seed=seed + 1)
        return {"layout": msgspec.to_builtins(self.layout.desc())}

    def op_open(
        self,
        transport: str,
        options: dict,
        deadline: float,
        cert: str | None = None,
        key: str | None = None,
        spin: float = SPIN,
    ) -> dict:
        """A Consumer over the set-up cache; with ``cert`` / ``key`` (PEM) its connections are TLS."""
        self.op_close()
        listen = f"{self.host}:0" if ":" not in self.host else f"[{self.host}]:0"
        server = None
        if cert is not None:
            with certs.files(cert, key) as d:
                server = tls.server_context(f"{d}/cert.pem", f"{d}/key.pem")
        self.consumer = Consumer(
            _made(self.layout, "layout (setup)"),
            transport=transport,
            listen=listen,
            allocator=self.alloc,
            transport_options=options,
            deadline=deadline,
            max_inflight=4096,
            tls=server,
            spin=spin,
        )
        self.arrived = {}
        return {"address": self.consumer.address, "transport": self.consumer.transport_name}

    def op_close(self) -> dict:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        return {}

    def op_pattern(self, pattern: str) -> dict:
        _made(self.alloc, "allocator (setup)").set_pattern(pattern)
        return {}

    def op_collect(self, items: list, wait: float) -> dict:
        """Wait for the arrivals of ``items`` ([req, source ids]), verify every byte, poison, release."""
        deadline = time.monotonic() + wait
        consumer = _made(self.consumer, "consumer (open)")
        expected = _made(self.content, "content (setup)")
        want = {req: src for req, src in items}
        got: dict[str, Arrival] = {}
        while len(got) < len(want):
            for req in [r for r in want if r in self.arrived and r not in got]:
                got[req] = self.arrived.pop(req)
            if len(got) == len(want):
                break
            arrival = consumer.get(timeout=max(0.001, deadline - time.monotonic()))
            self.arrived[arrival.req] = arrival
        rep = content.Report()
        out = {}
        for req, arrival in got.items():
            src = ids_from_bytes(want[req])
            if self.corrupt:
                self.corrupt = False
                content._rows(self.arrays[-1])[arrival.block_ids[-1], -1] ^= 0x5A
            rep.merge(expected.verify(self.arrays, arrival.block_ids, src))
            content.poison(self.arrays, arrival.block_ids)
            consumer.release(req)
            out[req] = {
                "t": arrival.timings.get("completed", 0.0),
                "dst": arrival.block_ids.astype("<u4").tobytes(),
                "nbytes": arrival.nbytes,
            }
        return {
            "ok": rep.ok,
            "checked": rep.checked_bytes,
            "bad": rep.bad_blocks,
            "detail": rep.describe(),
            "arrivals": out,
        }

    def op_verify(self, dst: bytes, src: bytes) -> dict:
        """Check bytes a baseline wrote into the destination cache, then poison them again."""
        d, s = ids_from_bytes(dst), ids_from_bytes(src)
        rep = _made(self.content, "content (setup)").verify(self.arrays, d, s)
        content.poison(self.arrays, d)
        return {"ok": rep.ok, "checked": rep.checked_bytes, "bad": rep.bad_blocks, "detail": rep.describe()}

    def op_stats(self) -> dict:
        return self.consumer.stats() if self.consumer else {}

    # ---- socket baseline -------------------------------------------------------------------------------
    def op_socket_open(self, capacity: int) -> dict:
        self.op_socket_close()
        self.sock_rx = baselines.SocketReceiver(self.host, capacity)
        return {"port": self.sock_rx.port}

    def op_socket_close(self) -> dict:
        err = None
        if self.sock_rx is not None:
            self.sock_rx.close()
            err = self.sock_rx.error
            self.sock_rx = None
        return {"error_text": repr(err) if err else ""}

    # ---- raw ucxx baseline -----------------------------------------------------------------------------
    def op_ucx_open(self, capacity: int, address: bytes) -> dict:
        self.op_ucx_close()
        self.ucx_rx = baselines.UcxReceiver(capacity, address)
        return {"address": self.ucx_rx.raw.address()}

    def op_ucx_close(self) -> dict:
        err = None
        if self.ucx_rx is not None:
            self.ucx_rx.close()
            err = self.ucx_rx.error
            self.ucx_rx = None
        return {"error_text": repr(err) if err else ""}

    # ---- raw NIXL baseline -----------------------------------------------------------------------------
    def op_nixl_open(self) -> dict:
        self.op_nixl_close()
        regions = _made(self.layout, "layout (setup)").regions
        self.nixl = baselines.RawNixl(f"kvxfer-bench-consumer-{os.getpid()}-{time.monotonic_ns()}", regions)
        return {"meta": self.nixl.metadata()}

    def op_nixl_peer(self, meta: bytes) -> dict:
        return {"name": _made(self.nixl, "raw NIXL agent (nixl_open)").add_peer(meta)}

    def op_nixl_wait(self, tag: bytes, wait: float = 60.0) -> dict:
        _made(self.nixl, "raw NIXL agent (nixl_open)").wait_notif(tag, wait)
        return {}

    def op_nixl_read(self, local: bytes, remote: bytes, peer: str) -> dict:
        loc = np.frombuffer(local, dtype=np.uint64).reshape(-1, 3)
        rem = np.frombuffer(remote, dtype=np.uint64).reshape(-1, 3)
        return {"seconds": _made(self.nixl, "raw NIXL agent (nixl_open)").xfer("READ", loc, rem, peer)}

    def op_nixl_close(self) -> dict:
        if self.nixl is not None:
            self.nixl.close()
            self.nixl = None
        return {}


def listen_and_serve(listen: str, *, corrupt: bool = False, forever: bool = False, announce=print) -> None:
    """Serve one driver session on ``listen`` (host:port, port 0 picks one), then return; with ``forever``,
    serve one session after another until interrupted."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    server = socket.create_server((host, int(port)))
    shown = host if host not in ("0.0.0.0", "::") else socket.gethostname()
    announce(f"kvxfer-bench consumer listening on {shown}:{server.getsockname()[1]}")
    try:
        while True:
            server.settimeout(None if forever else 300)
            sock, peer = server.accept()
            if forever:
                announce(f"kvxfer-bench consumer: serving {peer[0]}")
            ConsumerHalf(Control(sock), host, corrupt=corrupt).serve()
            if not forever:
                return
    finally:
        server.close()
