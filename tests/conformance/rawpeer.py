"""A hand-driven protocol peer: speaks kvxfer's wire format over a plain socket, to send what a correct
producer never would (bad versions, garbage, stale generations)."""

from __future__ import annotations

import socket
import struct

from kvxfer import AuthError, handshake, transports, wire
from kvxfer.channel import Channel, parse_address


class RawPeer:
    def __init__(self, address: str, timeout: float = 5.0):
        self.sock = socket.create_connection(parse_address(address), timeout=timeout)
        self.ch = Channel(self.sock)
        self.timeout = timeout

    def send(self, msg) -> None:
        self.ch.send(msg)

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_frame(self, body: bytes) -> None:
        self.sock.sendall(struct.pack(">I", len(body)) + body)

    def recv(self):
        return self.ch.recv(self.timeout)

    def closed_by_peer(self) -> bool:
        """Whether the other side closed the connection (EOF within the timeout)."""
        self.sock.settimeout(self.timeout)
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def hello(self, layout, transport: str, *, version: int = wire.VERSION, auth: str = ""):
        """The documented handshake, by hand, offering real metadata of a real ``transport`` instance; returns
        the consumer's last answer (``Welcome``, or the ``Error`` that ended it)."""
        self.transport = transports.get(transport)(layout, host=None)
        opening, nonce = handshake.hello("raw")
        opening.version = version
        self.send(opening)
        challenge = self.recv()
        if not isinstance(challenge, wire.Challenge):
            return challenge
        offers = [(transport, self.transport.local_meta())]
        try:
            proof, self.key = handshake.answer(challenge, "consumer", auth, nonce, layout, offers)
        except AuthError:  # we do not hold the consumer's token: answer with a made-up proof, as an attacker would
            proof = wire.Proof(proof=bytes(32), layout=layout.desc(), transports=offers)
        self.send(proof)
        return self.recv()

    def welcome(self, layout, address: str, transport: str = "tcp", session: int = 7) -> None:
        """A fetching consumer's half of the handshake, by hand, on a connection to a listening producer (which
        speaks first): its ``Welcome`` names ``address`` as where the producer's data connections go, and
        ``session`` as the session's number."""
        hello = handshake.check_hello(self.recv())
        challenge, nonce = handshake.challenge(hello, "raw", "")
        self.send(challenge)
        *_, self.key = handshake.check_proof(self.recv(), "", hello.nonce, nonce, layout, [transport])
        self.transport = transports.get(transport)(layout, host=None)
        self.send(handshake.welcome(session, layout, transport, self.transport.local_meta(), self.key, address))

    def close(self) -> None:
        self.ch.close()
        if getattr(self, "transport", None) is not None:
            self.transport.close()
