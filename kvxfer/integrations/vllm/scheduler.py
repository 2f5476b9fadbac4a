"""The connector's scheduler half (engine-core process). Producer role: follow each claimed request across chunked
prefill, order the worker to ship (push) or hold its prompt's blocks once the whole prompt is computed, and keep
the blocks at finish only while that transfer may still read them. Consumer role: for a request carrying a
prefill's ticket, report the held prompt tokens as loaded asynchronously, and order the worker to fetch them into
the blocks vLLM allocated. It never touches the network; the worker reports back through ``KVXferWorkerMetadata``,
``finished_sending`` and ``finished_recving``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .groups import NULL_BLOCK, ONE, Group, spans, tables, windowed
from .metadata import FetchOrder, KVXferConnectorMetadata, KVXferWorkerMetadata, ShipOrder
from .ranks import holds_of
from .settings import FETCH, HOLD, NONE, PARAMS_KEY, PUSH, Claim, Settings, log, parse_claim

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


IDLE_PACE = 0.005  # seconds an engine stepping only for this connector's holds or fetches waits per step


@dataclass
class _Tracked:
    claim: Claim
    prompt_len: int
    block_ids: list[list[int]] = field(default_factory=list)  # the request's table in each shipping group
    attempt: int = 0  # ship orders issued so far (0 or 1)
    inflight: bool = False  # ordered, end not heard from the worker yet
    outcome: tuple[str, str | None] | None = None  # (status, error) of the attempt once it ended
    num_blocks: int = 0
    lease_expires: float = 0.0  # a hold: when its lease ends (time.time())


@dataclass
class _Fetch:
    """A decode request carrying a prefill's ticket, from its first allocation to its finish."""

    claim: Claim
    held_tokens: int = 0  # prompt tokens the hold covers (capped at this prompt)
    skip: int = 0  # held blocks already here (local prefix-cache hit)
    block_ids: list[int] = field(default_factory=list)  # ours, each group's blocks to load, one group after another
    spans: list[tuple[int, int]] = field(default_factory=list)  # per group: (first block of its hold to read, count)
    to_order: bool = False
    ordered: bool = False
    error: str = ""  # the blocks could not be mapped: the worker fails the order at once
    outcome: tuple[str, str | None] | None = None  # (status, error) once the fetch ended, or why none ran
    info: dict = field(default_factory=dict)  # nbytes, seconds of the fetch


class KVXferScheduler:
    """Scheduler-side state and hooks; for a request without a claim every hook is a no-op.

    ``produce``: push and hold claims are served (``kv_producer``, ``kv_both``); ``fetch``: tickets are loaded
    (``kv_consumer``, ``kv_both``); ``groups``: the KV-cache groups that ship (``groups.of_config``)."""

    def __init__(
        self,
        settings: Settings,
        block_size: int,
        *,
        produce: bool = True,
        fetch: bool = False,
        groups: tuple[Group, ...] = ONE,
    ):
        self.settings = settings
        self.block_size = block_size
        self.groups = groups
        self.produce, self.fetch = produce, fetch
        self.fingerprint = ""  # the worker's layout id, once it reported it (put in hold tickets)
        self._tracked: dict[str, _Tracked] = {}
        self._fetches: dict[str, _Fetch] = {}
        self._draining: set[str] = set()  # finished while their fetch ran: finished_recving not seen yet
        self._misaligned: set[str] = set()  # the last answer for these: a local hit inside a prefill block
        self._delayed: set[str] = set()  # to tell the worker in the next metadata
        self._cancel_next: dict[str, tuple[int, str]] = {}
        self._awaiting: set[str] = set()  # delayed, finished_sending not seen yet
        self._decline_next: list[tuple[str, str, str]] = []  # tickets this instance will not fetch: tell the prefill

    # ---- consumer role: loading a held prompt ------------------------------------------------------------
    def _held_tokens(self, request: Request, claim: Claim) -> int:
        assert claim.ticket is not None
        return min(claim.ticket.num_tokens, int(request.num_prompt_tokens))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Prompt tokens a ticket brings, past the local prefix-cache hit, loaded asynchronously; once per
        request (after the allocation, a resumed or recomputing request loads nothing). No side effects: vLLM
        asks again whenever the allocation did not fit."""
        if not self.fetch or request.request_id in self._fetches:
            return 0, False
        claim = parse_claim(request.kv_transfer_params, request.request_id, self.settings)
        if claim is None or claim.kind != FETCH or claim.error or claim.ticket is None:
            return 0, False
        count = self._held_tokens(request, claim) - num_computed_tokens
        if num_computed_tokens % claim.ticket.block_size:  # a local hit ending inside a prefill block: computed here
            self._misaligned.add(request.request_id)
            return 0, False
        self._misaligned.discard(request.request_id)
        return (count, True) if count > 0 else (0, False)

    def _alloc_fetch(self, request: Request, claim: Claim, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        f = self._fetches[rid] = _Fetch(claim)
        if claim.kind == NONE or claim.error:
            f.outcome = ("not_fetched", claim.error)
            log.warning("kvxfer: request %s: %s; its prompt is computed here", rid, claim.error)
            return
        if not self.fetch:
            f.outcome = ("not_fetched", "this instance's kv_role does not fetch (kv_consumer or kv_both does)")
            return
        if num_external_tokens <= 0:
            if rid in self._misaligned:
                self._misaligned.discard(rid)
                why = "the local prefix-cache hit ends inside one of the prefill's blocks: the rest is computed here"
            else:
                why = "nothing to load: the local prefix-cache hit covers the held prompt"
            f.outcome = ("not_fetched", why)
            self._decline(claim, why)
            return
        f.held_tokens = self._held_tokens(request, claim)
        local = f.held_tokens - num_external_tokens
        f.skip = max(0, local) // self.block_size
        f.to_order = True  # vLLM now waits for this request's finished_recving, whatever happens
        log.debug("kvxfer: request %s: %d held tokens to load, blocks allocated", rid, f.held_tokens)
        tabs = tables(self.groups, blocks.get_block_ids())
        if local < 0 or local % self.block_size:
            f.error = f"internal: {local} local tokens for {f.held_tokens} held tokens"
        else:
            f.error = self._map_groups(f, claim, tabs)
        if f.error:  # the fetch fails at once: every block it would have filled is a load error
            n = math.ceil(f.held_tokens / self.block_size)
            f.block_ids = [b for table in tabs for b in table[f.skip : n] if b != NULL_BLOCK]
            f.spans = []
            log.error("kvxfer: request %s: %s", rid, f.error)

    def _map_groups(self, f: _Fetch, claim: Claim, tabs: list[list[int]]) -> str:
        """Our blocks to load in each KV-cache group, and where they start in the group's hold: a full-attention
        group from the local hit on, a sliding-window group from the first block its window keeps (the prefill
        held the same span, ``groups``). Returns why they cannot be mapped, or ""."""
        t = claim.ticket
        assert t is not None
        held = t.groups or ((0, t.num_blocks),)
        if len(held) != len(self.groups):
            return f"the prefill ships {len(held)} KV-cache group(s), this instance has {len(self.groups)}"
        n = math.ceil(f.held_tokens / self.block_size)
        if t.block_size != self.block_size:  # one group, mapped through token positions by the fetch itself
            if len(held) > 1 or windowed(self.groups):
                return (
                    f"the prefill has {t.block_size} tokens per block, this instance {self.block_size}: blocks of "
                    "several KV-cache groups or of a sliding window map only block for block"
                )
            f.block_ids = tabs[0][f.skip : n]
            return "" if len(f.block_ids) == n - f.skip else f"internal: blocks {tabs[0]} for held blocks [0, {n})"
        for i, (g, table, (first, count)) in enumerate(zip(self.groups, tabs, held, strict=True)):
            start = max(f.skip, g.first_block(f.held_tokens, self.block_size))
            ids = table[start:n]
            if start < first or first + count < n:
                return f"group {i}: the prefill holds blocks [{first}, {first + count}), we need [{start}, {n})"
            if len(ids) < n - start or NULL_BLOCK in ids:
                return f"internal: group {i} has blocks {table} for held blocks [{start}, {n})"
            f.block_ids += ids
            f.spans.append((start - first, n - start))
        return ""

    # ---- producer role -----------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        """A hold of a model with a sliding window leaves the last prompt token to the decode instance
        (``groups``): drop it here, before anything is scheduled, and stop after the prefill."""
        if not self.produce or not windowed(self.groups) or request.num_prompt_tokens < 2:
            return
        claim = parse_claim(request.kv_transfer_params, request.request_id, self.settings)
        if claim is None or claim.kind != HOLD or claim.error or request.prompt_token_ids is None:
            return
        del request.prompt_token_ids[-1:]
        del request._all_token_ids[-1:]
        request.num_prompt_tokens -= 1
        del request.block_hashes[request.num_prompt_tokens // self.block_size :]
        request.max_tokens = 1
        log.debug("kvxfer: request %s: held without its last prompt token (a sliding window)", request.request_id)

    # ---- both roles --------------------------------------------------------------------------------------
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        rid = request.request_id
        if rid in self._fetches:
            return  # resumed after its load or a preemption: nothing more to load
        st = self._tracked.get(rid)
        if st is None:
            claim = parse_claim(request.kv_transfer_params, rid, self.settings)
            if claim is None:
                return
            if claim.kind in (FETCH, NONE):
                self._alloc_fetch(request, claim, blocks, num_external_tokens)
                return
            if not self.produce:
                claim.error = "this instance's kv_role does not produce (kv_producer or kv_both does)"
            if claim.error:
                log.warning("kvxfer: request %s: %s; its KV will not be shipped", rid, claim.error)
            st = self._tracked[rid] = _Tracked(claim, int(request.num_prompt_tokens))
            st.num_blocks = math.ceil(st.prompt_len / self.block_size)
            sp = getattr(request, "sampling_params", None)
            if claim.kind == PUSH and windowed(self.groups) and (getattr(sp, "max_tokens", 1) or 1) > 1:
                claim.error = (
                    "a sliding-window group's blocks are freed while the request decodes on: push only from a "
                    "request that ends with its prefill (max_tokens=1)"
                )
                log.warning("kvxfer: request %s: %s; its KV will not be shipped", rid, claim.error)
            if claim.digests and st.prompt_len % self.block_size and (getattr(sp, "max_tokens", 1) or 1) > 1:
                # The request decodes on while its KV ships: the next tokens land in the tail of the last prompt
                # block, under the transfer, so a whole-block digest would fail for no fault of the transport.
                claim.digests = False
                log.debug("kvxfer: request %s decodes after prefill into a partial last block: no digests", rid)
        st.block_ids = tables(self.groups, blocks.get_block_ids())  # first allocation or resume: the whole table

    def _decline(self, claim: Claim, why: str) -> None:
        """The worker tells the prefill that this ticket will not be fetched: it frees the blocks now, not at
        the end of the lease."""
        t = claim.ticket
        if t is not None and t.address:
            every = range(t.ranks[0] * t.ranks[1])  # every prefill rank holds a share, one hold per group
            holds = holds_of(t.address, claim.transfer_id, t.ranks, every, len(t.groups) or 1)
            self._decline_next += [(address, hold, why) for address, hold in holds]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVXferConnectorMetadata:
        ordering = any(f.to_order for f in self._fetches.values())
        if not scheduler_output.total_num_scheduled_tokens and (self._awaiting or self._fetches) and not ordering:
            # The engine steps only so that held prompts get reported (has_pending_push_work), or because its only
            # requests wait for their KV: a step with nothing to compute or order is a poll. Pace it, or an idle
            # prefill spins its engine core (and a decode its workers too) for as long as the transfers take,
            # starving the very processes that move the bytes (two servers on few cores).
            time.sleep(IDLE_PACE)
        meta = KVXferConnectorMetadata(cancel=self._cancel_next, delayed_free=self._delayed, decline=self._decline_next)
        self._cancel_next, self._delayed, self._decline_next = {}, set(), []
        for rid, f in self._fetches.items():
            if f.to_order:
                f.to_order, f.ordered = False, True
                meta.fetch.append(self._fetch_order(rid, f))
        if not self._tracked:
            return meta
        for rid in scheduler_output.preempted_req_ids or ():
            st = self._tracked.get(rid)
            if st is not None and st.inflight:
                # vLLM freed the blocks already: stop reading them before the next forward pass reuses them.
                # The request is not shipped again after it resumes (see docs/vllm.md); a request preempted
                # *before* its prompt was computed is simply tracked on and shipped once, later.
                meta.cancel[rid] = (st.attempt, "request preempted while its KV was shipping")
                st.inflight = False
                st.outcome = ("cancelled", "request preempted while its KV was shipping")
        nst = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            st = self._tracked.get(new.req_id)
            if st is not None:
                st.block_ids = tables(self.groups, new.block_ids)
                self._maybe_order(meta, new.req_id, st, new.num_computed_tokens, nst.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._tracked.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = tables(self.groups, nb)
            elif nb:
                for table, ids in zip(st.block_ids, tables(self.groups, nb), strict=True):
                    table.extend(ids)
            self._maybe_order(meta, rid, st, cached.num_computed_tokens[i], nst.get(rid, 0))
        return meta

    def _fetch_order(self, rid: str, f: _Fetch) -> FetchOrder:
        t = f.claim.ticket
        assert t is not None
        return FetchOrder(
            req_id=rid,
            transfer_id=t.request_id,
            address=t.address,
            block_ids=f.block_ids,
            skip=f.skip,
            num_tokens=f.held_tokens,
            block_size=t.block_size,
            fingerprint=t.fingerprint,
            lease_expires=t.lease_expires,
            deadline=f.claim.deadline,
            ranks=t.ranks,
            spans=f.spans,
            groups=len(t.groups) or 1,
            error=f.error,
            ordered_at=time.time(),
        )

    def _maybe_order(
        self, meta: KVXferConnectorMetadata, rid: str, st: _Tracked, computed: int, scheduled: int
    ) -> None:
        if st.claim.error or st.attempt:
            return  # malformed claim, or already ordered (one attempt per request)
        if computed + scheduled < st.prompt_len:
            return  # a chunk of the prompt; the rest comes in later steps
        sp = spans(self.groups, st.prompt_len, self.block_size)
        ids: list[int] = []
        for i, ((first, count), table) in enumerate(zip(sp, st.block_ids, strict=True)):
            part = table[first : first + count]
            if len(part) < count or NULL_BLOCK in part:
                st.claim.error = (
                    f"internal: group {i} tracks blocks {table} for a {st.prompt_len}-token prompt "
                    f"(blocks [{first}, {first + count}) needed)"
                )
                log.error("kvxfer: request %s: %s", rid, st.claim.error)
                return
            ids += part
        c = st.claim
        st.attempt += 1
        st.inflight = True
        if c.kind == HOLD:
            st.lease_expires = time.time() + c.lease
        meta.ship.append(
            ShipOrder(
                req_id=rid,
                transfer_id=c.transfer_id,
                consumer=c.consumer,
                block_ids=ids,
                num_tokens=st.prompt_len,
                attempt=st.attempt,
                deadline=c.deadline,
                digests=c.digests,
                meta={**c.meta, **self._groups_info(st.prompt_len), "vllm_request_id": rid},
                lease_expires=st.lease_expires,
                spans=sp,
            )
        )

    def _groups_info(self, tokens: int) -> dict[str, Any]:
        """What a consumer needs to place the blocks: tokens, tokens per block, and with several KV-cache groups or
        a sliding window each group's ``[first block, number of blocks]`` (its blocks follow one another)."""
        info: dict[str, Any] = {"num_tokens": tokens, "block_size": self.block_size}
        if self.groups != ONE:
            info["groups"] = [list(span) for span in spans(self.groups, tokens, self.block_size)]
        return info

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_sending or ():
            self._awaiting.discard(rid)
        for rid in connector_output.finished_recving or ():
            self._draining.discard(rid)
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVXferWorkerMetadata):
            if wm.fingerprint:
                self.fingerprint = wm.fingerprint
            for rid, (attempt, status, error) in wm.ended.items():
                st = self._tracked.get(rid)
                if st is not None and st.attempt == attempt and st.inflight:
                    st.inflight, st.outcome = False, (status, error)
                f = self._fetches.get(rid)
                if f is not None and f.ordered and f.outcome is None:
                    f.outcome = ("fetched" if status == "done" else status, error)
                    f.info = wm.fetched.get(rid, {})

    def _fetch_finished(self, request: Request, f: _Fetch) -> dict[str, Any]:
        rid = request.request_id
        t = f.claim.ticket
        info: dict[str, Any] = {"request_id": f.claim.transfer_id}
        if t is not None:
            info.update(address=t.address, num_tokens=f.held_tokens, skip_blocks=f.skip, num_blocks=len(f.block_ids))
        if f.ordered and f.outcome is None:
            # finished (aborted) while loading: vLLM frees its blocks once the worker reports finished_recving,
            # which it does after the cancelled fetch ended
            self._draining.add(rid)
            if request.status.name == "FINISHED_ERROR":  # kv_load_failure_policy "fail": the fetch failed
                info.update(status="failed", error="KV load failed (kv_load_failure_policy=fail)")
            else:
                info["status"] = "cancelled"
            return info
        status, error = f.outcome or ("not_fetched", "request finished before its blocks were allocated")
        info["status"] = status
        if error:
            info["error"] = error
        info.update(f.info)
        return info

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._misaligned.discard(rid)
        f = self._fetches.pop(rid, None)
        if f is not None:
            return False, {PARAMS_KEY: self._fetch_finished(request, f)}
        st = self._tracked.pop(rid, None)
        if st is None:
            if self.fetch:  # a ticket whose request ended before vLLM allocated its blocks (aborted, say)
                claim = parse_claim(request.kv_transfer_params, rid, self.settings)
                if claim is not None and claim.kind == FETCH and not claim.error:
                    self._decline(claim, f"request finished ({request.status.name.lower()}) before its load began")
            return False, None
        c = st.claim
        info: dict[str, Any] = {
            "request_id": c.transfer_id,
            **self._groups_info(st.prompt_len),
            "num_blocks": st.num_blocks,
            "digests": c.digests,
        }
        if c.kind == HOLD and st.attempt:
            info.update(address=self.settings.listen, lease_expires=st.lease_expires, transport=self.settings.transport)
            if self.settings.parallel != (1, 1):  # each rank holds its share, at the listen port + its rank
                info["ranks"] = list(self.settings.parallel)
            if self.fingerprint:
                info["fingerprint"] = self.fingerprint
        elif c.kind != HOLD:
            info["consumer"] = c.consumer
        if st.inflight:
            # The transfer may still read these blocks: vLLM holds them until the worker reports the request
            # in finished_sending (on success, failure, cancel or deadline; never later than the deadline).
            self._delayed.add(rid)
            self._awaiting.add(rid)
            if request.is_finished() and request.status.name == "FINISHED_ABORTED":
                self._cancel_next[rid] = (st.attempt, "request aborted")
            info["status"] = "held" if c.kind == HOLD else "sending"
            return True, {PARAMS_KEY: info}
        not_done = "not_held" if c.kind == HOLD else "not_sent"
        if c.error:
            info.update(status=not_done, error=c.error)
        elif st.outcome is not None:
            info["status"] = st.outcome[0]
            if st.outcome[1]:
                info["error"] = st.outcome[1]
        else:
            info.update(
                status=not_done,
                error=f"request finished ({request.status.name.lower()}) before its prompt was computed",
            )
        return False, {PARAMS_KEY: info}

    def has_pending_push_work(self) -> bool:
        # keep an idle engine stepping until every held request and every abandoned fetch is reported
        return bool(self._awaiting or self._draining or self._decline_next)

    def pending(self) -> dict[str, str]:
        """Tracked requests: req -> ``"inflight"`` (ordered, end not heard yet), ``"tracking"``, or for a
        fetching request ``"fetch:<status>"``."""
        out = {rid: ("inflight" if st.inflight else "tracking") for rid, st in self._tracked.items()}
        for rid, f in self._fetches.items():
            out[rid] = "fetch:" + (f.outcome[0] if f.outcome else "ordered" if f.ordered else "allocated")
        out.update({rid: "fetch:draining" for rid in self._draining})
        return out
