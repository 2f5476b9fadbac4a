"""Transports by name: ``"tcp"``, ``"nixl"``, ``"ucx"``, and ``"auto"`` (nixl where it can run, else tcp; ``ucx``
only by name: a handle opened as ``auto`` opens every candidate, and ucx's UCX must not load before NIXL's)."""

from __future__ import annotations

import importlib
from functools import cache

from ..errors import TransportError
from .base import Host, Link, Peer, ReadHost, Transport, WriteHost

_REGISTRY = {
    "tcp": "kvxfer.transports.tcp:TcpTransport",
    "nixl": "kvxfer.transports.nixl:NixlTransport",
    "ucx": "kvxfer.transports.ucx:UcxTransport",
}

__all__ = ["Host", "Link", "Peer", "ReadHost", "Transport", "WriteHost", "available", "candidates", "get", "resolve"]


def get(name: str) -> type[Transport]:
    """The transport class registered under ``name``; ``TransportError`` if unknown or not installed."""
    if name not in _REGISTRY:
        raise TransportError(f"unknown transport {name!r}; choose from {sorted(_REGISTRY)} or 'auto'")
    module, _, cls = _REGISTRY[name].partition(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise TransportError(f"transport {name!r} is not available here: {e}") from None


@cache
def _usable(name: str) -> bool:
    try:
        cls = get(name)
    except TransportError:
        return False
    probe = getattr(cls, "usable", None)
    return bool(probe()) if probe else True


def available() -> list[str]:
    """Transports that can run on this machine, best first."""
    return [n for n in ("nixl", "tcp", "ucx") if _usable(n)]


AUTO = ("nixl", "tcp")  # what ``auto`` may speak, best first


def candidates(name: str) -> list[str]:
    """The transports a handle opened as ``name`` may speak, best first: every available one of ``AUTO`` for
    ``"auto"`` (the two sides then agree on the first both have), else just ``name``."""
    return [n for n in available() if n in AUTO] if name == "auto" else [name]


def resolve(name: str) -> str:
    """``"auto"`` -> the best available transport; any other name is returned as is."""
    return available()[0] if name == "auto" else name
