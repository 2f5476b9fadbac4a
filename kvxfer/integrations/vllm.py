"""vLLM V1 KV connector: ship a prefilled request's paged KV to a kvxfer ``Consumer`` (producer side).

Load it by module path, alone or as one child of vLLM's ``MultiConnector``::

    --kv-transfer-config '{"kv_connector": "KVXferConnector",
                           "kv_connector_module_path": "kvxfer.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"transport": "tcp", "deadline": 30}}'

A request is *claimed* only when its ``kv_transfer_params`` hold the key ``"kvxfer"`` (a dict with at least
``"consumer": "host:port"``); for every other request each hook is a no-op. Everything the connector returns in
``kv_transfer_params`` lives under that one key, so it composes with NixlConnector's top-level keys.

Scheduler side (engine-core process): track each claimed request across chunked prefill (prefix-cache hits
included: cached blocks are shipped too) until its whole prompt is computed, then order the worker to ship the
prompt's blocks (``build_connector_meta``). ``request_finished`` holds the blocks (``delay_free``) only while that
transfer may still read them. The worker reports every held request back exactly once (``get_finished``).

Worker side (model-runner process): ``register_kv_caches`` registers vLLM's own per-layer tensors with kvxfer
(geometry from shapes and strides), ``wait_for_save`` (after the forward pass) hands the orders to background
threads that call ``Producer.push`` (admission first, ``Busy`` retried with its ``retry_after`` until the deadline),
so the forward pass never waits for the network.

Supported: vLLM >=0.32,<0.34 (0.33 adds ``supports_sleep_mode`` / ``unregister_kv_caches`` /
``restore_kv_caches``), one KV-cache group, tensor- and pipeline-parallel size 1. See docs/vllm.md.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from ..channel import parse_address
from ..errors import BusyError, CancelledError, KVXferError, TimeoutError
from ..producer import Producer
from ..transfer import Transfer
from ..layout import KVLayout

if TYPE_CHECKING:
    import torch

    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVXferConnector", "KVXferConnectorMetadata", "KVXferWorkerMetadata", "ShipOrder", "Settings"]

# A child of vLLM's logger: vLLM's handlers and level apply to it.
log = logging.getLogger("vllm.kvxfer")

PARAMS_KEY = "kvxfer"


# ==========================================================================================================
# configuration and claims
# ==========================================================================================================
@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` of this connector (the child's own one under MultiConnector)."""

    transport: str = "auto"           # "tcp", "nixl" or "auto"; the consumer must use the same one
    deadline: float = 30.0            # seconds from the ship order to the end of the transfer, retries included
    auth: str = ""                    # shared token the consumer expects (or name an env var with auth_env)
    digests: bool = False             # per-block CRCs checked by the consumer (host memory; tests, debugging)
    retry_busy: bool = True           # a Busy consumer is asked again after its retry_after, until the deadline
    connect_timeout: float = 5.0      # cap on connecting + handshaking with a new consumer
    allowed_consumers: tuple[str, ...] | None = None  # "host:port" or "host"; None: any consumer
    transport_options: dict = field(default_factory=dict)
    ship_threads: int = 32            # concurrent shipments per worker (each waits on one transfer)
    producer_workers: int = 8         # kvxfer Producer data-mover threads

    KEYS = ("transport", "deadline", "auth", "auth_env", "digests", "retry_busy", "connect_timeout",
            "allowed_consumers", "transport_options", "ship_threads", "producer_workers")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "Settings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.KEYS))
        if unknown:
            log.warning("kvxfer: ignoring unknown kv_connector_extra_config keys %s (known: %s)",
                        unknown, ", ".join(cls.KEYS))
        auth = str(extra.get("auth", ""))
        if extra.get("auth_env"):
            auth = os.environ.get(str(extra["auth_env"]), auth)
        allowed = extra.get("allowed_consumers")
        if allowed is not None:
            if isinstance(allowed, str) or not all(isinstance(a, str) for a in allowed):
                raise ValueError("kvxfer: allowed_consumers must be a list of 'host:port' or 'host' strings")
            allowed = tuple(allowed)
        s = cls(transport=str(extra.get("transport", "auto")), deadline=float(extra.get("deadline", 30.0)),
                auth=auth, digests=bool(extra.get("digests", False)),
                retry_busy=bool(extra.get("retry_busy", True)),
                connect_timeout=float(extra.get("connect_timeout", 5.0)), allowed_consumers=allowed,
                transport_options=dict(extra.get("transport_options") or {}),
                ship_threads=int(extra.get("ship_threads", 32)),
                producer_workers=int(extra.get("producer_workers", 8)))
        if s.deadline <= 0 or s.connect_timeout <= 0 or s.ship_threads < 1 or s.producer_workers < 1:
            raise ValueError("kvxfer: deadline, connect_timeout, ship_threads and producer_workers must be > 0")
        return s

    def consumer_allowed(self, address: str) -> bool:
        if self.allowed_consumers is None:
            return True
        host, port = parse_address(address)
        return address in self.allowed_consumers or host in self.allowed_consumers \
            or f"{host}:{port}" in self.allowed_consumers


@dataclass
class Claim:
    """What the router asked for in ``kv_transfer_params["kvxfer"]``, checked."""

    consumer: str = ""
    transfer_id: str = ""
    meta: dict = field(default_factory=dict)
    deadline: float = 30.0
    digests: bool = False
    error: str | None = None  # a malformed claim: nothing is shipped, the error goes back in kv_transfer_params


def parse_claim(params: Any, req_id: str, settings: Settings) -> Claim | None:
    """``None`` when the request is not ours (no ``"kvxfer"`` key), else a ``Claim`` (maybe with an error)."""
    if not isinstance(params, dict) or PARAMS_KEY not in params:
        return None
    spec = params[PARAMS_KEY]
    claim = Claim(transfer_id=req_id, deadline=settings.deadline, digests=settings.digests)
    try:
        if not isinstance(spec, dict):
            raise ValueError(f'"{PARAMS_KEY}" must be an object, got {type(spec).__name__}')
        consumer = spec.get("consumer")
        if not isinstance(consumer, str) or not consumer:
            raise ValueError('"consumer" ("host:port" of a kvxfer Consumer) is required')
        try:
            parse_address(consumer)
        except Exception as e:  # noqa: BLE001 - any parse failure is the router's mistake
            raise ValueError(f"bad consumer address {consumer!r}: {e}") from None
        if not settings.consumer_allowed(consumer):
            raise ValueError(f"consumer {consumer!r} is not in allowed_consumers")
        claim.consumer = consumer
        tid = spec.get("request_id", req_id)
        if not isinstance(tid, str) or not tid:
            raise ValueError('"request_id" must be a non-empty string')
        claim.transfer_id = tid
        meta = spec.get("meta", {})
        if not isinstance(meta, dict):
            raise ValueError('"meta" must be an object')
        msgspec.msgpack.encode(meta)  # it travels in the Admit message
        claim.meta = meta
        if spec.get("deadline") is not None:
            d = float(spec["deadline"])
            if not d > 0:
                raise ValueError('"deadline" must be > 0 seconds')
            claim.deadline = min(d, settings.deadline)
        if spec.get("digests") is not None:
            claim.digests = bool(spec["digests"])
    except (ValueError, TypeError, msgspec.EncodeError) as e:
        claim.error = f"bad kv_transfer_params[{PARAMS_KEY!r}]: {e}"
    return claim


# ==========================================================================================================
# scheduler -> worker and worker -> scheduler metadata
# ==========================================================================================================
@dataclass
class ShipOrder:
    """Ship these blocks of one request to one consumer (the whole prompt is computed)."""

    req_id: str          # vLLM's request id
    transfer_id: str     # the id the consumer sees (router-chosen, default: vLLM's)
    consumer: str
    block_ids: list[int]
    num_tokens: int      # prompt tokens covered by the blocks
    attempt: int         # 1 (the field fences a late report against a future re-ship policy)
    deadline: float      # seconds from the order
    digests: bool
    meta: dict


@dataclass
class KVXferConnectorMetadata(KVConnectorMetadata):
    ship: list[ShipOrder] = field(default_factory=list)
    cancel: dict[str, tuple[int, str]] = field(default_factory=dict)  # req -> (attempt, reason)
    delayed_free: set[str] = field(default_factory=set)  # request_finished returned True for these


@dataclass
class KVXferWorkerMetadata(KVConnectorWorkerMetadata):
    """Transfers that ended on the worker: req -> (attempt, status, error)."""

    ended: dict[str, tuple[int, str, str | None]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVXferWorkerMetadata):
            merged = dict(self.ended)
            for req, (attempt, status, error) in other.ended.items():
                old = merged.get(req)
                if old is None or old[0] < attempt or (old[0] == attempt and status != "done"):
                    merged[req] = (attempt, status, error)
            return KVXferWorkerMetadata(merged)
        return self


# ==========================================================================================================
# scheduler-side state
# ==========================================================================================================
@dataclass
class _Tracked:
    claim: Claim
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    attempt: int = 0                  # ship orders issued so far (0 or 1)
    inflight: bool = False            # ordered, end not heard from the worker yet
    outcome: tuple[str, str | None] | None = None  # (status, error) of the attempt once it ended
    num_blocks: int = 0


# ==========================================================================================================
# worker-side state
# ==========================================================================================================
class _Job:
    """One ship order on the worker: pushed (and re-pushed on Busy) by a background thread."""

    def __init__(self, order: ShipOrder):
        self.order = order
        self.req_id = order.req_id
        self.attempt = order.attempt
        self.t0 = time.monotonic()
        self.transfer: Transfer | None = None
        self.cancel_event = threading.Event()
        self.cancel_reason = ""
        self.started = False
        self.done = False
        self.status = "queued"
        self.error: str | None = None
        self.retries = 0
        self.forget = False   # the request finished without holding its blocks: drop the job once done
        self.cuda_event = None
        self.lock = threading.Lock()

    def cancel(self, reason: str) -> None:
        with self.lock:
            if self.done or self.cancel_event.is_set():
                return
            self.cancel_reason = reason
            self.cancel_event.set()
            t = self.transfer
        if t is not None:
            t.cancel(reason)


class KVXferConnector(KVConnectorBase_V1, SupportsHMA):
    """kvxfer producer connector for vLLM V1 (``kv_role="kv_producer"``)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        if ktc.kv_role not in ("kv_producer", "kv_both"):
            raise ValueError(f"KVXferConnector is a producer: kv_role must be 'kv_producer', got {ktc.kv_role!r}")
        self.settings = Settings.from_extra(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        ranks = pc.tensor_parallel_size * pc.pipeline_parallel_size
        if ranks != 1:
            raise ValueError("KVXferConnector supports tensor_parallel_size=1 and pipeline_parallel_size=1 "
                             f"(got {pc.tensor_parallel_size} x {pc.pipeline_parallel_size})")
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        if len(groups) > 1:
            raise ValueError(f"KVXferConnector ships one KV-cache group; this model has {len(groups)} "
                             "(hybrid attention): not supported yet")
        spec = groups[0].kv_cache_spec if groups else None
        self.block_size = int(getattr(spec, "block_size", 0) or vllm_config.cache_config.block_size)

        # scheduler side
        self._tracked: dict[str, _Tracked] = {}
        self._delayed: set[str] = set()             # to tell the worker in the next metadata
        self._cancel_next: dict[str, tuple[int, str]] = {}
        self._awaiting: set[str] = set()            # delayed, finished_sending not seen yet

        # worker side
        self._wlock = threading.Lock()
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self._producer: Producer | None = None
        self._layout: KVLayout | None = None
        self._ratio = 1                             # kernel blocks per scheduler block
        self._jobs: dict[str, _Job] = {}
        self._queued: list[_Job] = []
        self._w_delayed: set[str] = set()
        self._w_awaiting: set[str] = set()
        self._ended: dict[str, tuple[int, str, str | None]] = {}
        self._pool: ThreadPoolExecutor | None = None
        if role == KVConnectorRole.WORKER:
            self._pool = ThreadPoolExecutor(self.settings.ship_threads, thread_name_prefix="kvxfer-ship")

    # ------------------------------------------------------------------------------------------------------
    # class-level hooks
    # ------------------------------------------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> str | None:
        return None  # any layout: kvxfer reads the geometry off the tensors' strides

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: "KVTransferConfig") -> bool:
        return True  # unregister_kv_caches / restore_kv_caches follow the remap

    # ======================================================================================================
    # scheduler side
    # ======================================================================================================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # a producer never loads; called repeatedly, so no side effects

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
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

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVXferConnectorMetadata:
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

    def _maybe_order(self, meta: KVXferConnectorMetadata, rid: str, st: _Tracked, computed: int,
                     scheduled: int) -> None:
        if st.claim.error or st.attempt:
            return  # malformed claim, or already ordered (one attempt per request)
        if computed + scheduled < st.prompt_len:
            return  # a chunk of the prompt; the rest comes in later steps
        if len(st.block_ids) < st.num_blocks:
            st.claim.error = (f"internal: {len(st.block_ids)} blocks tracked for a {st.prompt_len}-token prompt "
                              f"({st.num_blocks} needed)")
            log.error("kvxfer: request %s: %s", rid, st.claim.error)
            return
        c = st.claim
        st.attempt += 1
        st.inflight = True
        meta.ship.append(ShipOrder(
            req_id=rid, transfer_id=c.transfer_id, consumer=c.consumer, block_ids=st.block_ids[:st.num_blocks],
            num_tokens=st.prompt_len, attempt=st.attempt, deadline=c.deadline, digests=c.digests,
            meta={**c.meta, "num_tokens": st.prompt_len, "block_size": self.block_size, "vllm_request_id": rid}))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        for rid in connector_output.finished_sending or ():
            self._awaiting.discard(rid)
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(wm, KVXferWorkerMetadata):
            for rid, (attempt, status, error) in wm.ended.items():
                st = self._tracked.get(rid)
                if st is not None and st.attempt == attempt and st.inflight:
                    st.inflight, st.outcome = False, (status, error)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        st = self._tracked.pop(rid, None)
        if st is None:
            return False, None
        c = st.claim
        info: dict[str, Any] = {"request_id": c.transfer_id, "consumer": c.consumer, "num_tokens": st.prompt_len,
                                "num_blocks": st.num_blocks, "block_size": self.block_size, "digests": c.digests}
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
            info.update(status="not_sent", error=f"request finished ({request.status.name.lower()}) before its "
                                                  "prompt was computed")
        return False, {PARAMS_KEY: info}

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def has_pending_push_work(self) -> bool:
        return bool(self._awaiting)  # keep an idle engine stepping until every held request is reported

    # ======================================================================================================
    # worker side
    # ======================================================================================================
    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]):
        self._kv_caches = dict(kv_caches)
        self._open_producer()

    def _open_producer(self) -> None:
        assert self._kv_caches is not None
        seen, tensors = set(), {}
        for name, t in self._kv_caches.items():  # layers sharing one cache (KV sharing) are shipped once
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key not in seen:
                seen.add(key)
                tensors[name] = t
        layout = KVLayout.from_tensors(tensors)
        sched_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        ratio = 1
        if sched_blocks and layout.num_blocks != sched_blocks:
            if layout.num_blocks % sched_blocks:
                raise ValueError(f"kvxfer: {layout.num_blocks} kernel blocks do not split {sched_blocks} blocks")
            ratio = layout.num_blocks // sched_blocks
        s = self.settings
        producer = Producer(layout, transport=s.transport, auth=s.auth, deadline=s.deadline,
                            connect_timeout=s.connect_timeout, transport_options=s.transport_options,
                            workers=s.producer_workers)
        with self._wlock:
            self._layout, self._ratio, self._producer = layout, ratio, producer
        log.info("kvxfer: registered %d KV tensors as %r (transport %s, %d kernel block(s) per block)",
                 len(tensors), layout, producer.transport_name, ratio)

    def unregister_kv_caches(self) -> None:
        """Sleep mode: the KV memory goes away; stop every shipment and drop the registration."""
        self._close_producer("KV cache unregistered (sleep)")

    def restore_kv_caches(self) -> None:
        """Wake-up: the KV tensors are back at the same addresses; register them again."""
        if self._kv_caches is not None and self._producer is None:
            self._open_producer()

    def _close_producer(self, reason: str) -> None:
        with self._wlock:
            jobs = list(self._jobs.values())
            producer, self._producer = self._producer, None
        for job in jobs:
            job.cancel(reason)
        if producer is not None:
            producer.close()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVXferConnectorMetadata):
            self._apply_cancels(kv_connector_metadata)  # before the next forward pass reuses the blocks

    def _apply_cancels(self, meta: KVXferConnectorMetadata) -> None:
        for rid, (attempt, reason) in meta.cancel.items():
            with self._wlock:
                job = self._jobs.get(rid)
            if job is not None and job.attempt == attempt:
                job.cancel(reason)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        meta = connector_metadata
        if not isinstance(meta, KVXferConnectorMetadata):
            return
        self._apply_cancels(meta)
        with self._wlock:
            self._w_delayed |= meta.delayed_free
            for order in meta.ship:
                old = self._jobs.get(order.req_id)
                if old is not None and not old.done:
                    old.cancel("superseded by a new attempt")
                job = _Job(order)
                self._jobs[order.req_id] = job
                self._queued.append(job)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        pass  # a producer loads nothing

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: Any, **kwargs: Any) -> None:
        pass  # whole requests are shipped after the forward pass, from the registered cache itself

    def wait_for_save(self) -> None:
        """After the forward pass: the prompts ordered this step are in the cache; start shipping them."""
        with self._wlock:
            queued, self._queued = self._queued, []
        if not queued:
            return
        event = None
        if self._layout is not None and self._layout.device >= 0:
            import torch
            event = torch.cuda.Event()
            event.record()  # the ship threads wait for the forward pass's KV writes on the GPU stream
        for job in queued:
            job.cuda_event = event
            job.started = True
            try:
                self._pool.submit(self._ship, job)
            except RuntimeError:  # pool shut down
                self._end_job(job, "failed", "connector shut down")

    def _ship(self, job: _Job) -> None:
        o = job.order
        end = job.t0 + o.deadline
        t: Transfer | None = None
        job.status = "shipping"
        try:
            if job.cuda_event is not None:
                job.cuda_event.synchronize()
            producer = self._producer
            if producer is None:
                raise KVXferError("no KV cache registered (sleeping or shut down)")
            ids = np.asarray(o.block_ids, dtype=np.int64)
            if self._ratio > 1:
                ids = (ids[:, None] * self._ratio + np.arange(self._ratio)).ravel()
            while True:
                if job.cancel_event.is_set():
                    raise CancelledError(job.cancel_reason)
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"deadline of {o.deadline:g}s passed before the consumer admitted it")
                t = producer.push(o.consumer, o.transfer_id, ids, meta=o.meta, deadline=remaining,
                                  digests=o.digests)
                with job.lock:
                    job.transfer = t
                    cancelled = job.cancel_event.is_set()
                if cancelled:
                    t.cancel(job.cancel_reason)
                try:
                    t.wait(timeout=remaining + 2.0)
                    self._end_job(job, "done", None)
                    return
                except BusyError as e:
                    if not self.settings.retry_busy:
                        raise
                    pause = max(e.retry_after, 0.001)
                    if time.monotonic() + pause >= end:
                        raise TimeoutError(f"consumer still busy at the deadline ({e})") from None
                    job.retries += 1
                    job.cancel_event.wait(pause)
        except KVXferError as e:
            if isinstance(e, CancelledError) or job.cancel_event.is_set():
                self._end_job(job, "cancelled", job.cancel_reason or str(e))
            else:
                self._end_job(job, "failed", f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - whatever happens, the request must be reported
            self._end_job(job, "failed", repr(e))
        finally:
            if t is not None and not t.done():
                t.cancel("shipment ended")

    def _end_job(self, job: _Job, status: str, error: str | None) -> None:
        o = job.order
        with job.lock:
            if job.done:
                return
            job.status, job.error, job.done = status, error, True
        dt = time.monotonic() - job.t0
        if status == "done":
            t = job.transfer
            log.debug("kvxfer: request %s: %d blocks (%d bytes) shipped to %s as %r in %.3fs",
                      o.req_id, len(o.block_ids), t.nbytes if t else 0, o.consumer, o.transfer_id, dt)
        elif status == "cancelled":
            log.info("kvxfer: request %s: shipment to %s cancelled after %.3fs: %s", o.req_id, o.consumer, dt, error)
        else:
            log.warning("kvxfer: request %s: shipment to %s (as %r) failed after %.3fs%s: %s", o.req_id,
                        o.consumer, o.transfer_id, dt, f" and {job.retries} busy retries" if job.retries else "",
                        error)
        with self._wlock:
            self._ended[o.req_id] = (job.attempt, status, error)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Report each held request once: after it finished in vLLM and its transfer ended (any outcome)."""
        sending: set[str] = set()
        with self._wlock:
            for rid in finished_req_ids:
                if rid in self._w_delayed:
                    self._w_delayed.discard(rid)
                    self._w_awaiting.add(rid)
                elif rid in self._jobs:
                    self._jobs[rid].forget = True
            for rid in list(self._w_awaiting):
                job = self._jobs.get(rid)
                if job is None or job.done:
                    sending.add(rid)
                    self._w_awaiting.discard(rid)
                    self._jobs.pop(rid, None)
            for rid, job in list(self._jobs.items()):
                if job.forget and job.done:
                    del self._jobs[rid]
        return (sending or None), None

    def build_connector_worker_meta(self) -> KVXferWorkerMetadata | None:
        with self._wlock:
            if not self._ended:
                return None
            ended, self._ended = self._ended, {}
        return KVXferWorkerMetadata(ended)

    def shutdown(self) -> None:
        self._close_producer("connector shut down")
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- introspection (tests, debugging) ----------------------------------------------------------------
    @property
    def producer(self) -> Producer | None:
        return self._producer

    def pending(self) -> dict[str, str]:
        """Worker: req -> job status of every shipment not yet forgotten; scheduler: tracked requests."""
        if self.role == KVConnectorRole.WORKER:
            with self._wlock:
                return {rid: j.status for rid, j in self._jobs.items()}
        return {rid: ("inflight" if st.inflight else "tracking") for rid, st in self._tracked.items()}
