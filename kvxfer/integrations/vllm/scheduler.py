"""The connector's scheduler half (engine-core process): follow each claimed request across chunked prefill,
order the worker to ship its prompt's blocks once the whole prompt is computed, and hold the blocks at finish only
while that transfer may still read them. It never touches the network; the worker reports back through
``KVXferWorkerMetadata`` and ``finished_sending``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .metadata import KVXferConnectorMetadata, KVXferWorkerMetadata, ShipOrder
from .settings import PARAMS_KEY, Claim, Settings, log, parse_claim

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _Tracked:
    claim: Claim
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    attempt: int = 0  # ship orders issued so far (0 or 1)
    inflight: bool = False  # ordered, end not heard from the worker yet
    outcome: tuple[str, str | None] | None = None  # (status, error) of the attempt once it ended
    num_blocks: int = 0


class KVXferScheduler:
    """Scheduler-side state and hooks; for a request without a claim every hook is a no-op."""

    def __init__(self, settings: Settings, block_size: int):
        self.settings = settings
        self.block_size = block_size
        self._tracked: dict[str, _Tracked] = {}
        self._delayed: set[str] = set()  # to tell the worker in the next metadata
        self._cancel_next: dict[str, tuple[int, str]] = {}
        self._awaiting: set[str] = set()  # delayed, finished_sending not seen yet

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer never loads; called repeatedly, so no side effects

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        rid = request.request_id
        st = self._tracked.get(rid)
        if st is None:
            claim = parse_claim(request.kv_transfer_params, rid, self.settings)
            if claim is None:
                return
            if claim.error:
                log.warning("kvxfer: request %s: %s; its KV will not be shipped", rid, claim.error)
            st = self._tracked[rid] = _Tracked(claim, int(request.num_prompt_tokens))
            st.num_blocks = math.ceil(st.prompt_len / self.block_size)
            sp = getattr(request, "sampling_params", None)
            if claim.digests and st.prompt_len % self.block_size and (getattr(sp, "max_tokens", 1) or 1) > 1:
                # The request decodes on while its KV ships: the next tokens land in the tail of the last prompt
                # block, under the transfer, so a whole-block digest would fail for no fault of the transport.
                claim.digests = False
                log.debug("kvxfer: request %s decodes after prefill into a partial last block: no digests", rid)
        ids = blocks.get_block_ids()
        st.block_ids = list(ids[0]) if ids else []  # first allocation or resume: the whole table

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVXferConnectorMetadata:
        meta = KVXferConnectorMetadata(cancel=self._cancel_next, delayed_free=self._delayed)
        self._cancel_next, self._delayed = {}, set()
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
                st.block_ids = list(new.block_ids[0]) if new.block_ids else []
                self._maybe_order(meta, new.req_id, st, new.num_computed_tokens, nst.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._tracked.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(nb[0]) if nb else []
            elif nb:
                st.block_ids.extend(nb[0])
            self._maybe_order(meta, rid, st, cached.num_computed_tokens[i], nst.get(rid, 0))
        return meta

    def _maybe_order(
        self, meta: KVXferConnectorMetadata, rid: str, st: _Tracked, computed: int, scheduled: int
    ) -> None:
        if st.claim.error or st.attempt:
            return  # malformed claim, or already ordered (one attempt per request)
        if computed + scheduled < st.prompt_len:
            return  # a chunk of the prompt; the rest comes in later steps
        if len(st.block_ids) < st.num_blocks:
            st.claim.error = (
                f"internal: {len(st.block_ids)} blocks tracked for a {st.prompt_len}-token prompt "
                f"({st.num_blocks} needed)"
            )
            log.error("kvxfer: request %s: %s", rid, st.claim.error)
            return
        c = st.claim
        st.attempt += 1
        st.inflight = True
        meta.ship.append(
            ShipOrder(
                req_id=rid,
                transfer_id=c.transfer_id,
                consumer=c.consumer,
                block_ids=st.block_ids[: st.num_blocks],
                num_tokens=st.prompt_len,
                attempt=st.attempt,
                deadline=c.deadline,
                digests=c.digests,
                meta={**c.meta, "num_tokens": st.prompt_len, "block_size": self.block_size, "vllm_request_id": rid},
            )
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for rid in connector_output.finished_sending or ():
            self._awaiting.discard(rid)
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVXferWorkerMetadata):
            for rid, (attempt, status, error) in wm.ended.items():
                st = self._tracked.get(rid)
                if st is not None and st.attempt == attempt and st.inflight:
                    st.inflight, st.outcome = False, (status, error)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._tracked.pop(rid, None)
        if st is None:
            return False, None
        c = st.claim
        info: dict[str, Any] = {
            "request_id": c.transfer_id,
            "consumer": c.consumer,
            "num_tokens": st.prompt_len,
            "num_blocks": st.num_blocks,
            "block_size": self.block_size,
            "digests": c.digests,
        }
        if st.inflight:
            # The transfer may still read these blocks: vLLM holds them until the worker reports the request
            # in finished_sending (on success, failure, cancel or deadline; never later than the deadline).
            self._delayed.add(rid)
            self._awaiting.add(rid)
            if request.is_finished() and request.status.name == "FINISHED_ABORTED":
                self._cancel_next[rid] = (st.attempt, "request aborted")
            info["status"] = "sending"
            return True, {PARAMS_KEY: info}
        if c.error:
            info.update(status="not_sent", error=c.error)
        elif st.outcome is not None:
            info["status"] = st.outcome[0]
            if st.outcome[1]:
                info["error"] = st.outcome[1]
        else:
            info.update(
                status="not_sent",
                error=f"request finished ({request.status.name.lower()}) before its prompt was computed",
            )
        return False, {PARAMS_KEY: info}

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting)  # keep an idle engine stepping until every held request is reported

    def pending(self) -> dict[str, str]:
        """Tracked requests: req -> ``"inflight"`` (ordered, end not heard yet) or ``"tracking"``."""
        return {rid: ("inflight" if st.inflight else "tracking") for rid, st in self._tracked.items()}
