"""The benchmark's own control channel between its two halves (not kvxfer's protocol).

Length-prefixed msgpack dicts over one TCP connection: the producer half (the driver) sends
``{"op": ..., ...}`` and the consumer half answers each with one dict (``{"error": ...}`` when an op failed).
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import time

import msgspec

_LEN = struct.Struct(">I")
MAX = 256 << 20
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class ControlError(RuntimeError):
    """The other half of the benchmark failed, refused an op or went away."""


class Control:
    def __init__(self, sock: socket.socket):
        self.sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @classmethod
    def connect(cls, address: str, timeout: float = 30.0) -> Control:
        host, _, port = address.rpartition(":")
        deadline = time.monotonic() + timeout
        while True:
            try:
                return cls(socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5))
            except OSError as e:
                if time.monotonic() > deadline:
                    raise ControlError(f"cannot reach the consumer half at {address}: {e}") from None
                time.sleep(0.1)

    def send(self, obj: dict) -> None:
        body = _enc.encode(obj)
        try:
            self.sock.sendall(_LEN.pack(len(body)) + body)
        except OSError as e:
            raise ControlError(f"control connection lost: {e}") from None

    def recv(self, timeout: float | None = None) -> dict:
        self.sock.settimeout(timeout)
        try:
            (n,) = _LEN.unpack(self._exact(4))
            if n > MAX:
                raise ControlError(f"control frame of {n} bytes")
            return _dec.decode(self._exact(n))
        except TimeoutError:
            raise ControlError(f"no answer from the other half within {timeout}s") from None
        except OSError as e:
            raise ControlError(f"control connection lost: {e}") from None

    def readable(self, timeout: float) -> bool:
        return bool(select.select([self.sock], [], [], timeout)[0])

    def _exact(self, n: int) -> bytes:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise ControlError("the other half closed the control connection")
            got += k
        return bytes(buf)

    def call(self, op: str, timeout: float | None = 120.0, **args) -> dict:
        """Send one op and return its answer; raise ``ControlError`` if the other half reports a failure."""
        self.send({"op": op, **args})
        reply = self.recv(timeout)
        if "error" in reply:
            raise ControlError(f"consumer half: {op} failed: {reply['error']}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
