"""What the operator configures (``kv_connector_extra_config``) and what the router asks for per request (a claim
under ``kv_transfer_params["kvxfer"]``), both checked before anything is tracked or shipped."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from ... import inline, wire
from ...channel import SPIN, Spin, parse_address
from ...errors import ConfigError
from .ranks import ports_fit

# A child of vLLM's logger: vLLM's handlers and level apply to it.
log = logging.getLogger("vllm.kvxfer")

PARAMS_KEY = "kvxfer"
MAX_RANKS = 1024  # a ticket's tensor- or pipeline-parallel size, at most
MAX_GROUPS = 64  # a ticket's KV-cache groups, at most


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` of this connector (the child's own one under MultiConnector)."""

    transport: str = "auto"  # "tcp", "nixl" or "auto"; the consumer must use the same one
    deadline: float = 30.0  # seconds from the ship order to the end of the transfer, retries included
    auth: str = ""  # shared token the consumer expects (or name an env var with auth_env)
    digests: bool = False  # per-block CRCs checked by the consumer (host memory; tests, debugging)
    retry_busy: bool = True  # a Busy consumer is asked again after its retry_after, until the deadline
    connect_timeout: float = 5.0  # cap on connecting + handshaking with a new consumer
    allowed_consumers: tuple[str, ...] | None = None  # "host:port" or "host"; None: any consumer
    transport_options: dict = field(default_factory=dict)
    ship_threads: int = 4  # threads that start shipments (CUDA event, connecting); none waits on one
    producer_workers: int = 8  # kvxfer Producer data-mover threads
    listen: str = ""  # prefill: "host:port" the worker's Producer listens on for fetches (needed for holds)
    lease: float = 30.0  # prefill: seconds a held prompt waits to be fetched
    consumer_listen: str = "127.0.0.1:0"  # decode: the fetching Consumer's listen address
    inline_max: int = inline.DEFAULT  # prefill: a push or hold of at most this many bytes travels inline (0: never)
    spin: float = SPIN  # seconds the control readers busy-wait for a message before they block (0: never)
    parallel: tuple[int, int] = (1, 1)  # not a config key: this instance's (TP, PP) sizes, from vLLM's config

    KEYS = (
        "transport",
        "deadline",
        "auth",
        "auth_env",
        "digests",
        "retry_busy",
        "connect_timeout",
        "allowed_consumers",
        "transport_options",
        "ship_threads",
        "producer_workers",
        "listen",
        "lease",
        "consumer_listen",
        "inline_max",
        "spin",
    )

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            log.warning(
                "kvxfer: ignoring unknown kv_connector_extra_config keys %s (known: %s)", unknown, ", ".join(cls.KEYS)
            )
        auth = str(extra.get("auth", ""))
        if extra.get("auth_env"):
            auth = os.environ.get(str(extra["auth_env"]), auth)
        allowed = extra.get("allowed_consumers")
        if allowed is not None:
            if isinstance(allowed, str) or not all(isinstance(a, str) for a in allowed):
                raise ValueError("kvxfer: allowed_consumers must be a list of 'host:port' or 'host' strings")
            allowed = tuple(allowed)
        s = cls(
            transport=str(extra.get("transport", "auto")),
            deadline=float(extra.get("deadline", 30.0)),
            auth=auth,
            digests=bool(extra.get("digests", False)),
            retry_busy=bool(extra.get("retry_busy", True)),
            connect_timeout=float(extra.get("connect_timeout", 5.0)),
            allowed_consumers=allowed,
            transport_options=dict(extra.get("transport_options") or {}),
            ship_threads=int(extra.get("ship_threads", cls.ship_threads)),
            producer_workers=int(extra.get("producer_workers", 8)),
            listen=str(extra.get("listen") or ""),
            lease=float(extra.get("lease", 30.0)),
            consumer_listen=str(extra.get("consumer_listen") or "127.0.0.1:0"),
            inline_max=int(extra.get("inline_max", inline.DEFAULT)),
            spin=float(extra.get("spin", SPIN)),
        )
        try:
            Spin(s.spin)
        except ConfigError as e:
            raise ValueError(f"kvxfer: {e}") from None
        if not 0 <= s.inline_max <= inline.LIMIT:
            raise ValueError(f"kvxfer: inline_max must be within [0, {inline.LIMIT}], got {s.inline_max}")
        if s.deadline <= 0 or s.connect_timeout <= 0 or s.ship_threads < 1 or s.producer_workers < 1 or s.lease <= 0:
            raise ValueError("kvxfer: deadline, connect_timeout, lease, ship_threads and producer_workers must be > 0")
        for key in ("listen", "consumer_listen"):
            value = getattr(s, key)
            if value:
                try:
                    _, port = parse_address(value)
                except ConfigError as e:
                    raise ValueError(f"kvxfer: bad {key} address {value!r}: {e}") from None
                if key == "listen" and port == 0:
                    # the scheduler half writes this address into the response before the worker listens
                    raise ValueError("kvxfer: listen needs a concrete port (not 0): decode instances fetch from it")
        return s

    def consumer_allowed(self, address: str) -> bool:
        if self.allowed_consumers is None:
            return True
        host, port = parse_address(address)
        return (
            address in self.allowed_consumers
            or host in self.allowed_consumers
            or f"{host}:{port}" in self.allowed_consumers
        )


PUSH, HOLD, FETCH, NONE = "push", "hold", "fetch", "none"


@dataclass
class Ticket:
    """A prefill's held prompt, as its response put it under ``"kvxfer"`` (what a decode instance fetches)."""

    address: str
    request_id: str
    num_tokens: int
    num_blocks: int
    block_size: int
    lease_expires: float  # time.time() epoch
    fingerprint: str = ""  # the prefill layout's ``fingerprint_id`` ("" when the prefill did not know it yet)
    ranks: tuple[int, int] = (1, 1)  # the prefill's (TP, PP) sizes: each of its ranks holds a share (``ranks``)
    # each KV-cache group's held (first block, number of blocks), one hold per group (``groups``); () for one group
    # holding every block
    groups: tuple[tuple[int, int], ...] = ()


@dataclass
class Claim:
    """What the router asked for in ``kv_transfer_params["kvxfer"]``, checked.

    ``kind``: ``push`` (a ``consumer`` is named: ship to it), ``hold`` (no consumer: keep the blocks for a fetch),
    ``fetch`` (a prefill's response with ``status: held``: load its blocks), ``none`` (some other response passed
    on: nothing to do but say so)."""

    kind: str = PUSH
    consumer: str = ""
    transfer_id: str = ""
    meta: dict = field(default_factory=dict)
    deadline: float = 30.0
    lease: float = 30.0  # a hold: seconds its blocks wait to be fetched
    digests: bool = False
    ticket: Ticket | None = None
    error: str | None = None  # a malformed claim: nothing is moved, the error goes back in kv_transfer_params


def _ticket(spec: dict) -> Ticket:
    def num(key: str, typ: type, positive: bool = True):
        v = spec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (typ is int and v != int(v)):
            raise ValueError(f'ticket field "{key}" must be a{"n integer" if typ is int else " number"}')
        if positive and not v > 0:
            raise ValueError(f'ticket field "{key}" must be > 0')
        return typ(v)

    address = spec.get("address")
    if not isinstance(address, str) or not address:
        raise ValueError('ticket field "address" is required')
    try:
        parse_address(address)
    except ConfigError as e:
        raise ValueError(f"bad ticket address {address!r}: {e}") from None
    rid = spec.get("request_id")
    if not isinstance(rid, str) or not rid:
        raise ValueError('ticket field "request_id" must be a non-empty string')
    fp = spec.get("fingerprint", "")
    if not isinstance(fp, str):
        raise ValueError('ticket field "fingerprint" must be a string')
    ranks = spec.get("ranks", [1, 1])
    if (
        not isinstance(ranks, list)
        or len(ranks) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_RANKS for n in ranks)
    ):
        raise ValueError(f'ticket field "ranks" must be [tensor-parallel size, pipeline-parallel size], got {ranks!r}')
    if not ports_fit(address, ranks[0] * ranks[1]):
        raise ValueError(f"ticket address {address!r} leaves no port for each of its {ranks[0] * ranks[1]} ranks")
    groups = spec.get("groups", [])
    if (
        not isinstance(groups, list)
        or len(groups) > MAX_GROUPS
        or not all(
            isinstance(g, list)
            and len(g) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in g)
            and g[0] >= 0
            and g[1] >= 1
            for g in groups
        )
    ):
        raise ValueError(f'ticket field "groups" must be a list of [first block, number of blocks], got {groups!r}')
    return Ticket(
        ranks=(ranks[0], ranks[1]),
        groups=tuple((g[0], g[1]) for g in groups),
        address=address,
        request_id=rid,
        num_tokens=num("num_tokens", int),
        num_blocks=num("num_blocks", int),
        block_size=num("block_size", int),
        lease_expires=num("lease_expires", float),
        fingerprint=fp,
    )


def parse_claim(params: Any, req_id: str, settings: Settings) -> Claim | None:
    """``None`` when the request is not ours (no ``"kvxfer"`` key), else a ``Claim`` (maybe with an error)."""
    if not isinstance(params, dict) or PARAMS_KEY not in params:
        return None
    spec = params[PARAMS_KEY]
    claim = Claim(transfer_id=req_id, deadline=settings.deadline, lease=settings.lease, digests=settings.digests)
    try:
        if not isinstance(spec, dict):
            raise ValueError(f'"{PARAMS_KEY}" must be an object, got {type(spec).__name__}')
        if "status" in spec:  # a response passed on: a ticket to fetch, or an outcome to report
            if spec["status"] != "held":
                claim.kind = NONE
                claim.error = f"the prefill did not hold this prompt (status {spec['status']!r})"
                if spec.get("error"):
                    claim.error += f": {spec['error']}"
                return claim
            claim.kind = FETCH
            claim.ticket = _ticket(spec)
            claim.transfer_id = claim.ticket.request_id
            return claim
        consumer = spec.get("consumer")
        if consumer is None:
            claim.kind = HOLD
            if not settings.listen:
                raise ValueError('no "consumer" named (a hold), but this instance has no "listen" address configured')
        else:
            if not isinstance(consumer, str) or not consumer:
                raise ValueError('"consumer" ("host:port" of a kvxfer Consumer) must be a non-empty string')
            try:
                parse_address(consumer)
            except Exception as e:  # any parse failure is the router's mistake
                raise ValueError(f"bad consumer address {consumer!r}: {e}") from None
            if not settings.consumer_allowed(consumer):
                raise ValueError(f"consumer {consumer!r} is not in allowed_consumers")
            claim.consumer = consumer
        tid = spec.get("request_id", req_id)
        if not isinstance(tid, str) or not tid:
            raise ValueError('"request_id" must be a non-empty string')
        claim.transfer_id = wire.check_req(tid)
        meta = spec.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError('"meta" must be an object')
        claim.meta = wire.check_meta(meta)[0]  # it travels in the Admit / Offer message
        if spec.get("deadline") is not None:
            d = float(spec["deadline"])
            if not d > 0:
                raise ValueError('"deadline" must be > 0 seconds')
            claim.deadline = min(d, settings.deadline)
        if spec.get("lease") is not None:
            if consumer is not None:
                raise ValueError('"lease" is for a hold (no "consumer" named)')
            lease = float(spec["lease"])
            if not lease > 0:
                raise ValueError('"lease" must be > 0 seconds')
            claim.lease = min(lease, settings.lease)
        if spec.get("digests") is not None:
            claim.digests = bool(spec["digests"])
    except (ValueError, TypeError, ConfigError) as e:
        claim.error = f"bad kv_transfer_params[{PARAMS_KEY!r}]: {e}"
    return claim
