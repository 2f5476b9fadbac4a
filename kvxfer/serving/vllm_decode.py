"""The router's pool of vLLM decode instances: prefill on one vLLM, decode on another, the KV moved between them.

The flow is the one vLLM's own P/D proxy follows. The prefill gets the request with ``max_tokens=1`` and a claim
in ``kv_transfer_params`` that tells its connector to hold the prompt's KV for fetching (``{"kvxfer": {}}``: no
``"consumer"``; or NixlConnector's ``do_remote_decode``). Its answer's ``kv_transfer_params`` go unchanged, as the
decode request's ``kv_transfer_params``, to a vLLM decode instance with the client's original request; that
instance fetches the KV into blocks of its own, computes the rest and streams the answer, which the router passes
through as it comes (vLLM's own OpenAI format, streaming or not).

A request is answered at once, never after a timeout, when the KV will not be there to fetch: the prefill's error
reaches the client as it is; a prefill that did not hold the KV (no ticket in its answer, or a failed status) is a
502 ``kv_transfer_error`` or the regular pool (``--when-transfer-fails``). A decode instance that cannot be reached
is skipped for the next one, with the same ticket: nothing has fetched the KV yet. A fetch that fails on the decode
instance follows that instance's ``kv_load_failure_policy`` (recompute, or fail the request), inside vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

log = logging.getLogger("kvxfer.router")

# the connector's statuses under "kvxfer" that mean the KV is not held for fetching
NOT_HELD = ("not_sent", "not_held", "refused", "failed", "cancelled", "expired")
# NixlConnector's claim, as vLLM's P/D proxy sends it to a prefill instance
NIXL_CLAIM = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def claim(connector: str, digests: bool = False) -> dict:
    """The prefill request's ``kv_transfer_params``: hold the KV for a decode instance to fetch."""
    if connector == "nixl":
        return dict(NIXL_CLAIM)
    return {"kvxfer": {"digests": True} if digests else {}}


def not_held(connector: str, params: dict | None) -> str | None:
    """Why the prefill's answer carries no KV to fetch (``None`` when it does)."""
    params = params or {}
    if connector == "nixl":
        if params.get("do_remote_prefill") and params.get("remote_block_ids") is not None:
            return None
        return "the prefill's NixlConnector returned no blocks to read"
    ticket = params.get("kvxfer")
    if not isinstance(ticket, dict):
        return "the prefill did not claim the request (no kvxfer ticket in its answer)"
    status = ticket.get("status")
    if status in NOT_HELD or ticket.get("error") or not ticket.get("address"):
        return f"the prefill did not hold the KV (status {status!r}: {ticket.get('error') or 'no reason given'})"
    return None


@dataclass
class Instance:
    url: str
    alive: bool = False
    inflight: int = 0


PROBE_TIMEOUT = 5.0  # a loaded server's /health can take seconds; one slow answer must not drop it from the pool


class VLLMDecodePool:
    """vLLM decode instances (``kv_consumer`` with a connector that fetches), health-checked through ``/health``."""

    def __init__(self, urls: list[str], interval: float = 1.0):
        self.instances = {u.rstrip("/"): Instance(u.rstrip("/")) for u in urls}
        self.interval = interval

    async def refresh(self, client) -> None:
        await asyncio.gather(*(self._probe(client, i) for i in list(self.instances.values())))

    async def _probe(self, client, inst: Instance) -> None:
        try:
            inst.alive = (await client.get(f"{inst.url}/health", timeout=PROBE_TIMEOUT)).status_code == 200
        except Exception:  # unreachable: not a candidate until it answers again
            inst.alive = False

    def candidates(self) -> list[Instance]:
        return sorted((i for i in self.instances.values() if i.alive), key=lambda i: i.inflight)

    async def up(self, client) -> list[Instance]:
        """The live instances, least loaded first. When none is known live, every instance is probed once more
        before saying so: at start-up, or after one slow probe, an instance can be up that the last round missed."""
        if not self.candidates():
            await self.refresh(client)
        return self.candidates()

    async def run(self, client) -> None:
        while True:
            await self.refresh(client)
            await asyncio.sleep(self.interval)
