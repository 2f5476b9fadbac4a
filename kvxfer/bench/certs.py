"""A throwaway self-signed certificate for the bench's ``tcp+tls`` rows (the openssl command line makes it)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

TLS_SUFFIX = "+tls"


def split(name: str) -> tuple[str, bool]:
    """``"tcp+tls"`` -> ("tcp", True): the transport and whether its connections are TLS."""
    return (name[: -len(TLS_SUFFIX)], True) if name.endswith(TLS_SUFFIX) else (name, False)


def self_signed(host: str = "127.0.0.1", name: str = "kvxfer-bench") -> tuple[str, str]:
    """(certificate PEM, key PEM) for ``host`` (and localhost), common name ``name``, valid a day."""
    if shutil.which("openssl") is None:
        raise RuntimeError("the tcp+tls rows need the openssl command to make a throwaway certificate")
    with tempfile.TemporaryDirectory() as d:
        cert, key = Path(d, "cert.pem"), Path(d, "key.pem")
        san = f"IP:{host}" if host.replace(".", "").isdigit() or ":" in host else f"DNS:{host}"
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                f"/CN={name}",
                "-addext",
                f"subjectAltName={san},DNS:localhost,IP:127.0.0.1",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
        )
        return cert.read_text(), key.read_text()


def files(cert_pem: str, key_pem: str | None = None) -> tempfile.TemporaryDirectory:
    """A temporary directory holding ``cert.pem`` (and ``key.pem``), for ``ssl``'s file-based loaders."""
    d = tempfile.TemporaryDirectory()
    Path(d.name, "cert.pem").write_text(cert_pem)
    if key_pem is not None:
        Path(d.name, "key.pem").write_text(key_pem)
    return d
