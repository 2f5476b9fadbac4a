"""Holds and fetches across parallel instances: which prefill ranks each decode rank fetches from.

A prefill under tensor parallelism ``p`` and pipeline parallelism ``q`` holds a request on each of its ``p * q``
worker ranks: rank ``g = pp_rank * p + tp_rank`` listens on the configured port plus ``g`` and holds its heads of
its layers as ``<request_id>@<g>``. The ticket says ``ranks: [p, q]``. A decode rank (of its own TP ``d`` and PP
``r``) fetches its heads (``shard.sources``: a replicated head from its lowest holder) of its layers from every
prefill rank that holds some, each fetch ``partial`` when it fills only part of the blocks, and each hold is told
how many decode ranks read it; a hold no decode rank reads (a replica) is declined by decode rank 0. A latent (MLA)
cache is whole on every rank: decode rank ``c`` reads it from prefill rank ``c % p``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...channel import parse_address
from ...shard import sources

Stages = Callable[[int, int], tuple[int, int]]  # (stage, stages) -> [first, last + 1) of the model's layers


@dataclass(frozen=True)
class Source:
    """One prefill rank a decode rank fetches from."""

    rank: int  # the prefill's worker rank: pp_rank * tp + tp_rank
    readers: int  # decode ranks that fetch from this rank's hold
    partial: bool  # other prefill ranks fill the rest of this decode rank's blocks


def hold_id(request_id: str, rank: int, ranks: int, group: int = 0) -> str:
    """The id prefill rank ``rank`` of ``ranks`` holds KV-cache group ``group`` of a request under: one id per rank
    and group, so a decode rank fetching several of them keeps their fetches apart."""
    rid = request_id if ranks == 1 else f"{request_id}@{rank}"
    return f"{rid}#{group}" if group else rid


def rank_address(address: str, rank: int) -> str:
    """Where prefill worker rank ``rank`` listens: the configured ``host:port`` plus ``rank``."""
    host, port = parse_address(address)
    return f"{host}:{port + rank}"


def ports_fit(address: str, ranks: int) -> bool:
    """Whether ``host:port`` leaves a port for each of ``ranks`` worker ranks (port + rank <= 65535)."""
    return parse_address(address)[1] + ranks - 1 <= 65535


def hold_of(address: str, request_id: str, ranks: tuple[int, int], rank: int, group: int = 0) -> tuple[str, str]:
    """Where rank ``rank`` of a prefill of ``ranks`` (TP, PP) listens, given its ticket's ``address``, and the id it
    holds KV-cache group ``group`` of ``request_id`` under."""
    n = ranks[0] * ranks[1]
    return (address if n == 1 else rank_address(address, rank)), hold_id(request_id, rank, n, group)


def holds_of(
    address: str, request_id: str, ranks: tuple[int, int], which: Iterable[int], groups: int
) -> list[tuple[str, str]]:
    """``hold_of`` for each prefill rank in ``which`` and each of ``groups`` KV-cache groups: every hold a decline
    names (a decode that fetches none of them tells each rank of each group)."""
    return [hold_of(address, request_id, ranks, g, group) for g in which for group in range(groups)]


def _reads(
    src: tuple[int, int], dst: tuple[int, int], dst_rank: tuple[int, int], heads: int, latent: bool, stages: Stages
) -> list[int]:
    (p, q), (d, r), (c, s) = src, dst, dst_rank
    lo, hi = stages(s, r)
    mine = [t for t in range(q) if max(lo, stages(t, q)[0]) < min(hi, stages(t, q)[1])]
    tps = [c % p] if latent else [rank for rank, _ in sources(c, d, p, heads)]
    return [t * p + rank for t in mine for rank in tps]


def plan(
    src: tuple[int, int],
    dst: tuple[int, int],
    dst_rank: tuple[int, int],
    heads: int,
    latent: bool,
    stages: Stages,
) -> tuple[list[Source], list[int]]:
    """For decode rank ``dst_rank`` (tp rank, pp rank) of a decode of ``dst`` (tp, pp), fetching from a prefill of
    ``src`` (tp, pp) with ``heads`` kv heads: the prefill ranks it fetches from, and the prefill ranks no decode
    rank fetches from (to decline). ``latent``: the cache is whole on every tensor-parallel rank (MLA)."""
    d, r = dst
    every = {(c, s): _reads(src, dst, (c, s), heads, latent, stages) for c in range(d) for s in range(r)}
    readers: dict[int, int] = {}
    for gs in every.values():
        for g in gs:
            readers[g] = readers.get(g, 0) + 1
    mine = every[dst_rank]
    unread = [g for g in range(src[0] * src[1]) if g not in readers]
    return [Source(g, readers[g], len(mine) > 1) for g in mine], unread
