"""Decode-pool discovery through etcd: endpoints register under a lease, so a dead node disappears.

Uses etcd's v3 gRPC gateway through ``etcd3gw`` (a maintained client, the ``router`` extra). An endpoint
writes ``<prefix><id> = {"url": ..., "kvxfer": ...}`` bound to a lease it keeps alive; when it dies, the
lease expires after ``ttl`` seconds and the key goes with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import uuid
from collections.abc import Callable

log = logging.getLogger("kvxfer.discovery")


def _client(address: str):
    import etcd3gw

    host, _, port = address.rpartition(":")
    return etcd3gw.client(host=host or "127.0.0.1", port=int(port))


def register_forever(address: str, prefix: str, url: str, info: Callable[[], dict], ttl: int = 5) -> threading.Event:
    """Keep ``url`` registered under ``prefix`` while this process lives; set the returned event to stop."""
    stop = threading.Event()
    key = f"{prefix}{uuid.uuid4().hex[:12]}"

    def loop():
        lease = None
        while not stop.is_set():
            try:
                if lease is None:
                    client = _client(address)
                    lease = client.lease(ttl)
                    client.put(key, json.dumps({"url": url, "kvxfer": info().get("kvxfer")}), lease=lease)
                lease.refresh()
            except Exception as e:  # etcd down: retry with a fresh lease
                log.warning("etcd registration of %s failed: %s", url, e)
                lease = None
            stop.wait(ttl / 3)
        if lease is not None:
            with contextlib.suppress(Exception):  # etcd gone too: the lease expires by its ttl
                lease.revoke()

    threading.Thread(target=loop, daemon=True, name="kvxfer-etcd-register").start()
    return stop


def list_endpoints(address: str, prefix: str) -> list[dict]:
    """Every endpoint currently registered under ``prefix``."""
    out = []
    for value, _meta in _client(address).get_prefix(prefix):
        try:
            out.append(json.loads(value))
        except (ValueError, TypeError):
            continue
    return out
