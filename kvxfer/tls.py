"""Optional TLS (Python's ``ssl``) for the control channel and TCP data connections.

kvxfer's own handshake already authenticates both sides; TLS adds secrecy and integrity of the bytes on a
network that is not private. A consumer takes a server context, a producer a client context; with TLS on,
every control and TCP data connection is TLS. NIXL's one-sided data path is not covered (RDMA and
NVLink traffic never leaves the fabric).
"""

from __future__ import annotations

import socket
import ssl

from .sockets import mapped


def server_context(certfile: str, keyfile: str | None = None, cafile: str | None = None) -> ssl.SSLContext:
    """A consumer's context: its certificate; with ``cafile``, producers must present one it signed too."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    if cafile:
        ctx.load_verify_locations(cafile)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(
    cafile: str | None = None, certfile: str | None = None, keyfile: str | None = None, check_hostname: bool = True
) -> ssl.SSLContext:
    """A producer's context: the consumers' CA (the system's when ``None``), and its own certificate for mutual
    TLS. ``check_hostname=False`` accepts any name the CA signed (addresses given as IPs)."""
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = check_hostname
    if certfile:
        ctx.load_cert_chain(certfile, keyfile)
    return ctx


def accept(ctx: ssl.SSLContext, sock: socket.socket, timeout: float) -> ssl.SSLSocket:
    """The server side of a TLS handshake on an accepted connection, within ``timeout``."""
    with mapped("TLS handshake with a producer"):
        sock.settimeout(timeout)
        return ctx.wrap_socket(sock, server_side=True)
