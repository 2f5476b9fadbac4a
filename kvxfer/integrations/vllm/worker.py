"""The connector's worker half (model-runner process): register vLLM's KV tensors with one kvxfer ``Producer``
(producer role) and one fetching ``Consumer`` (consumer role); start a push or a hold for each ship order after
the forward pass, a fetch for each fetch order before it; report each held request in ``finished_sending`` and each
fetching request in ``finished_recving`` exactly once, after its transfer ended.

No thread waits for a transfer: each push is a future whose done callback (run by the producer's thread that ends
it) records the outcome, and ``Producer.push`` never waits for a connection (a new consumer's handshake runs on the
producer's pool). Host-memory caches start their pushes right in ``wait_for_save``; a CUDA cache hands them to a
few launcher threads, which wait for the forward pass's event (the KV writes must land before a byte is read).
Shipments go to the launchers grouped by consumer and step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...allocator import FreeList
from ...consumer import Consumer
from ...errors import CancelledError, ClosedError, DeadlineError, IncompatibleError, KVXferError, LeaseExpiredError
from ...layout import KVLayout
from ...producer import Producer
from ...shard import heads_of, sources, stripe
from ...transfer import Transfer
from .metadata import FetchOrder, KVXferConnectorMetadata, KVXferWorkerMetadata, ShipOrder
from .ranks import Source, Stages, hold_id, hold_of, holds_of, plan
from .settings import Settings, log
from .stats import KVXferStats

if TYPE_CHECKING:
    import torch
    from vllm.v1.kv_cache_interface import KVCacheConfig

QUEUED, LAUNCHING, SHIPPING = "queued", "launching", "shipping"
ENDED = ("done", "failed", "cancelled")
LATE = 1.0  # seconds between the scheduler's fetch order and the worker starting it past which the log says so


class _Shipment:
    """One ship order on the worker, from the order to the end of its transfer (state changes under ``lock``)."""

    def __init__(self, order: ShipOrder):
        self.order = order
        self.t0 = time.monotonic()
        # a push must end by its deadline; a hold waits for its fetch until its lease ends
        life = order.lease_expires - time.time() if order.lease_expires else order.deadline
        self.end_by = self.t0 + max(0.0, life)
        self.state = QUEUED
        self.transfers: list[Transfer] = []  # a push: one; a hold: one per KV-cache group
        self.cancel_reason: str | None = None
        self.error: str | None = None
        self.forget = False  # the request finished without holding its blocks: drop it once ended
        self.lock = threading.Lock()

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def _unpushed(o: ShipOrder) -> DeadlineError:
    if o.lease_expires:
        return LeaseExpiredError("the lease ended before the hold started")
    return DeadlineError(f"deadline of {o.deadline:g}s passed before the push started")


def _first_error(ts: list[Transfer]) -> BaseException | None:
    """What several transfers of one request ended with: the first real failure, not the cancels it caused."""
    errors = [t.error for t in ts if t.error is not None]
    return next((e for e in errors if not isinstance(e, CancelledError)), errors[0] if errors else None)


def _moving(t: Transfer) -> float:
    """Seconds the bytes of a transfer moved (a hold's wait for its fetch is not transfer time)."""
    end = t.timings.get("moved", t.timings.get("completed", t.timings["submitted"]))
    start = t.timings.get("admitted", t.timings["submitted"])
    return end - start if end > start else max(0.0, end - t.timings["submitted"])


class _Fetching:
    """One fetch order on the worker, from the order to its report in ``finished_recving``."""

    def __init__(self, order: FetchOrder):
        self.order = order
        self.t0 = time.monotonic()
        self.transfers: list[Transfer] = []  # one fetch per prefill rank holding some of our heads or layers
        self.started = False
        self.error: KVXferError | None = None  # set when it ended without a transfer (refused before the network)
        self.cancel_reason: str | None = None

    @property
    def ended(self) -> bool:
        """Refused, or every fetch started ended: only then can no byte land in the request's blocks."""
        return (self.error is not None or bool(self.transfers)) and all(t.done() for t in self.transfers)

    def cancel(self, reason: str) -> None:
        for t in self.transfers:
            t.cancel(reason)

    def _one_ended(self, t: Transfer) -> None:
        """A fetch from one prefill rank ended: if it failed, the request has failed; stop the others."""
        if t.error is not None:
            self.cancel(f"another rank's fetch failed: {t.error}")


class _Launchers:
    """A fixed set of threads running ``fn(*item)`` for each submitted item; their number never grows."""

    def __init__(self, n: int, fn: Callable[..., None]):
        self._fn = fn
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._threads = [threading.Thread(target=self._loop, daemon=True, name=f"kvxfer-launch-{i}") for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, *item: Any) -> None:
        if self._closed:
            raise ClosedError("connector shut down")
        self._items.put(item)

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._items.put(None)

    def _loop(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                self._fn(*item)
            except Exception:  # a launcher must survive anything
                log.exception("kvxfer launcher")


class KVXferWorker:
    """Worker-side state and hooks."""

    def __init__(
        self,
        settings: Settings,
        kv_cache_config: KVCacheConfig | None,
        *,
        produce: bool = True,
        fetch: bool = False,
        block_size: int = 0,
        shard: tuple[int, int, int] | None = None,
        replicated: bool = False,
        stage: tuple[int, int] | None = None,
        layers: Stages | None = None,
        kv_heads: int = 1,
    ):
        self.settings = settings
        self.shard = shard  # (tensor-parallel rank, size, the model's kv heads): this rank ships its heads
        self.replicated = replicated  # every rank holds the whole cache (MLA): this rank ships its stripe of layers
        self.stage = stage  # (pipeline-parallel rank, size): this rank's cache holds its stage's layers only
        self.stages = layers  # the model's layers of each pipeline stage, as vLLM splits them (fetch planning)
        self.kv_heads = kv_heads  # the model's kv heads (a prefill of another TP holds other shares of them)
        tp, _ = settings.parallel
        self.rank = (stage[0] if stage else 0) * tp + (shard[0] if shard else 0)  # this worker's rank in the instance
        self.packed = False  # the attention kernel packs each block (vLLM's CPU attention): no token mapping
        self.produce, self.fetch = produce, fetch
        self.block_size = block_size  # tokens per (scheduler) block: a ticket must say the same
        self._kv_cache_config = kv_cache_config
        self._lock = threading.Lock()
        self._kv_caches: dict[str, torch.Tensor] | None = None
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.stats = KVXferStats()
        self._fingerprint_told = False
        self._fetches: dict[str, _Fetching] = {}
        self._fetch_queue: list[_Fetching] = []
        self._load_errors: set[int] = set()
        # a model of several KV-cache groups (whose block ids vLLM cannot map back to requests) reports a failed
        # load by its request: ``failed_recving``
        self.fail_by_request = False
        self._failed_recving: set[str] = set()
        self._fetched: dict[str, dict] = {}
        self.layout: KVLayout | None = None
        self.ratio = 1  # kernel blocks per scheduler block
        self._shipments: dict[str, _Shipment] = {}
        self._queued: list[_Shipment] = []
        self._delayed: set[str] = set()  # vLLM holds their blocks; not finished in vLLM yet
        self._awaiting: set[str] = set()  # finished and held: reported once their shipment ended
        self._ended: dict[str, tuple[int, str, str | None]] = {}
        self._launchers = _Launchers(settings.ship_threads, self._launch)

    # ---- registration ------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
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
        layers = None
        if self.stage is not None:  # which of the model's layers this stage holds: read off vLLM's layer names
            from vllm.model_executor.models.utils import extract_layer_index

            index = {name: extract_layer_index(name) for name in tensors}
            tensors = dict(sorted(tensors.items(), key=lambda kv: index[kv[0]]))
            lo, hi = min(index.values()), max(index.values()) + 1
            if hi - lo != len(tensors):
                raise ValueError(
                    f"kvxfer: pipeline stage {self.stage[0]} holds KV for layers {sorted(index.values())}, not one "
                    "per layer of a contiguous range: not supported"
                )
            layers = (lo, hi)
        layout = KVLayout.from_tensors(
            tensors,
            heads=None if self.shard is None or self.replicated else heads_of(*self.shard),
            layers=layers,
            packed=self.packed,
        )
        sched_blocks = int(getattr(self._kv_cache_config, "num_blocks", 0) or 0)
        ratio = 1
        if sched_blocks and layout.num_blocks != sched_blocks:
            if layout.num_blocks % sched_blocks:
                raise ValueError(f"kvxfer: {layout.num_blocks} kernel blocks do not split {sched_blocks} blocks")
            ratio = layout.num_blocks // sched_blocks
        s = self.settings
        producer = consumer = None
        if self.produce:
            producer = Producer(
                layout,
                transport=s.transport,
                auth=s.auth,
                deadline=s.deadline,
                lease=s.lease,
                connect_timeout=s.connect_timeout,
                transport_options=s.transport_options,
                workers=s.producer_workers,
                listen=s.listen or None,
                inline_max=s.inline_max,
                spin=s.spin,
            )
        if self.fetch:
            # fetches land in blocks vLLM chose: the allocator grants nothing, so unsolicited pushes are Busy
            consumer = Consumer(
                layout,
                transport=s.transport,
                listen=s.consumer_listen,
                allocator=FreeList(0),
                auth=s.auth,
                deadline=s.deadline,
                transport_options=s.transport_options,
                queue_arrivals=False,
                spin=s.spin,
            )
        with self._lock:
            self.layout, self.ratio, self.producer, self.consumer = layout, ratio, producer, consumer
        roles = []
        if producer is not None:
            roles.append(f"producer over {producer.transport_name}" + (f" listening on {s.listen}" if s.listen else ""))
        if consumer is not None:
            roles.append(f"fetching consumer over {consumer.transport_name} on {consumer.address}")
        log.info(
            "kvxfer: registered %d KV tensors as %r (%s; %d kernel block(s) per block)",
            len(tensors),
            layout,
            ", ".join(roles),
            ratio,
        )

    def unregister_kv_caches(self) -> None:
        """Sleep mode: the KV memory goes away; stop every shipment and drop the registration."""
        self._close_producer("KV cache unregistered (sleep)")

    def restore_kv_caches(self) -> None:
        """Wake-up: the KV tensors are back at the same addresses; register them again."""
        if self._kv_caches is not None and self.producer is None:
            self._open_producer()

    def _close_producer(self, reason: str) -> None:
        with self._lock:
            shipments = list(self._shipments.values())
            fetches = list(self._fetches.values())
            producer, self.producer = self.producer, None
            consumer, self.consumer = self.consumer, None
        for sh in shipments:
            self._cancel(sh, reason)
        for fe in fetches:
            self._cancel_fetch(fe, reason)
        if producer is not None:
            producer.close()
        if consumer is not None:
            consumer.close()

    # ---- orders ------------------------------------------------------------------------------------------
    def handle_preemptions(self, meta: KVXferConnectorMetadata) -> None:
        self._apply_cancels(meta)  # before the next forward pass reuses the blocks

    def bind_connector_metadata(self, meta: KVXferConnectorMetadata) -> None:
        self._apply_cancels(meta)
        for address, hold, why in meta.decline if self.rank == 0 else ():  # one decode rank tells the prefill
            self._decline(address, hold, why)
        superseded = []
        with self._lock:
            for fo in meta.fetch:
                fe = self._fetches[fo.req_id] = _Fetching(fo)
                self._fetch_queue.append(fe)
            self._delayed |= meta.delayed_free
            for order in meta.ship:
                old = self._shipments.get(order.req_id)
                if old is not None:
                    superseded.append(old)
                sh = self._shipments[order.req_id] = _Shipment(order)
                self._queued.append(sh)
        for old in superseded:
            self._cancel(old, "superseded by a new attempt")

    def _apply_cancels(self, meta: KVXferConnectorMetadata) -> None:
        with self._lock:
            hit = [
                (sh, reason)
                for rid, (attempt, reason) in meta.cancel.items()
                if (sh := self._shipments.get(rid)) is not None and sh.order.attempt == attempt
            ]
        for sh, reason in hit:
            self._cancel(sh, reason)

    def _cancel(self, sh: _Shipment, reason: str) -> None:
        """Queued: ends now. Launching: the launcher cancels the transfer it gets. Shipping: cancel the transfer,
        whose done callback ends the shipment."""
        with sh.lock:
            if sh.ended or sh.cancel_reason is not None:
                return
            sh.cancel_reason = reason
            ts = list(sh.transfers)
        for t in ts:
            t.cancel(reason)
        if not ts:
            self._end(sh, "cancelled", reason, if_queued=True)

    # ---- fetching ----------------------------------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Start this step's fetches; none waits for a byte (the request decodes only after finished_recving)."""
        with self._lock:
            queued, self._fetch_queue = self._fetch_queue, []
        for fe in queued:
            self._start_fetch(fe)

    def _start_fetch(self, fe: _Fetching) -> None:
        o = fe.order
        if fe.cancel_reason is not None:
            return self._decline_all(o, fe.cancel_reason)
        fe.started = True
        try:
            consumer, layout = self.consumer, self.layout
            if consumer is None or layout is None:
                raise ClosedError("no KV cache registered (sleeping or shut down)")
            if o.error:  # no rank reads a byte of it: the prefill frees the holds now
                self._decline_all(o, f"the decode could not load it: {o.error}")
                raise KVXferError(o.error)
            # refusals that need no round trip: the hold cannot fit our blocks, or is gone already
            paged = o.block_size != self.block_size  # blocks map through token positions (the handshake checks)
            if paged and max(o.block_size, self.block_size) % min(o.block_size, self.block_size):
                raise IncompatibleError(
                    f"the prefill has {o.block_size} tokens per block, this instance {self.block_size}: "
                    "neither is a multiple of the other"
                )
            if paged and layout.packed:
                raise IncompatibleError(
                    f"the prefill has {o.block_size} tokens per block, this instance {self.block_size}, and this "
                    "instance's attention kernel packs its blocks (vLLM's CPU attention): they cannot be mapped "
                    "by tokens"
                )
            parallel = o.ranks != (1, 1) or self.settings.parallel != (1, 1)  # shares: the handshake pairs them
            if not paged and not parallel and o.fingerprint and o.fingerprint != layout.fingerprint_id:
                raise IncompatibleError(
                    f"layout mismatch: the prefill's KV layout {o.fingerprint} is not this instance's "
                    f"{layout.fingerprint_id}"
                )
            remaining = min(o.deadline - (time.monotonic() - fe.t0), o.lease_expires - time.time())
            late = time.time() - o.ordered_at if o.ordered_at else 0.0
            why = f" (the order reached this worker {late:.1f}s after vLLM allocated its blocks)" if late > LATE else ""
            if remaining <= 0:
                raise LeaseExpiredError(f"the lease of hold {o.transfer_id!r} ended before the fetch started{why}")
            # late: a stalled or busy worker, the lease ran meanwhile (docs/serving.md)
            log.log(
                logging.WARNING if why else logging.DEBUG,
                "kvxfer: request %s: fetching %r from %s%s, %.3fs left",
                o.req_id,
                o.transfer_id,
                o.address,
                why,
                remaining,
            )
            reads = self._reads(o, layout)
            sources, unread = self._sources(o)
            for src in sources:
                for group, (ids, at) in enumerate(reads):  # one hold per KV-cache group
                    address, hold = hold_of(o.address, o.transfer_id, o.ranks, src.rank, group)
                    t = consumer.fetch(
                        address, hold, ids, deadline=remaining, readers=src.readers, partial=src.partial, **at
                    )
                    fe.transfers.append(t)
                    t.add_done_callback(fe._one_ended)
            if self.rank == 0:  # replicas no decode rank reads: their prefill ranks free them now
                for address, hold in holds_of(o.address, o.transfer_id, o.ranks, unread, o.groups):
                    self._decline(address, hold, "a replica another prefill rank ships")
        except KVXferError as e:
            fe.error = e
        except Exception as e:  # whatever happens, the request must be reported
            fe.error = KVXferError(repr(e))
        if fe.error is not None:
            fe.cancel(f"fetch failed: {fe.error}")
        elif fe.cancel_reason is not None:
            fe.cancel(fe.cancel_reason)

    def _reads(self, o: FetchOrder, layout: KVLayout) -> list[tuple[np.ndarray, dict]]:
        """Each KV-cache group's read: our (kernel) blocks, and where in the group's hold they start."""
        ids = self._kernel_ids(o.block_ids)
        if o.block_size != self.block_size:  # one group: our blocks hold the held tokens from the first one not here
            start = o.skip * self.block_size
            tokens = o.num_tokens - start
            return [(ids[: -(-tokens // layout.fingerprint.block_size)], {"from_token": start, "tokens": tokens})]
        out, at = [], 0
        for skip, count in o.spans or [(o.skip, len(o.block_ids))]:
            out.append((ids[at * self.ratio : (at + count) * self.ratio], {"skip": skip * self.ratio}))
            at += count
        return out

    def _sources(self, o: FetchOrder):
        """The prefill ranks this rank fetches from (``ranks.plan``), and those no decode rank reads."""
        tp, pp = self.settings.parallel
        mine = (self.shard[0] if self.shard else 0, self.stage[0] if self.stage else 0)
        if o.ranks == (1, 1) and (tp, pp) == (1, 1):  # one rank on each side: it reads the whole hold
            return [Source(0, 1, False)], []
        if self.stages is None:
            raise IncompatibleError("parallel prefill or decode ranks, but no pipeline stage layers known")
        return plan(o.ranks, (tp, pp), mine, self.kv_heads, self.replicated, self.stages)

    def _decline_all(self, o: FetchOrder, why: str) -> None:
        """Tell every prefill rank to free its holds of every group of ``o`` (one decode rank tells them)."""
        if self.rank == 0:
            every = range(o.ranks[0] * o.ranks[1])
            for address, hold in holds_of(o.address, o.transfer_id, o.ranks, every, o.groups):
                self._decline(address, hold, why)

    def _decline(self, address: str, hold: str, why: str) -> None:
        consumer = self.consumer
        if consumer is not None:
            with contextlib.suppress(KVXferError):  # best effort: the lease frees the blocks anyway
                consumer.decline(address, hold, why)

    def _cancel_fetch(self, fe: _Fetching, reason: str) -> None:
        fe.cancel_reason = reason
        if fe.transfers:
            fe.cancel(reason)
        elif fe.error is None:
            fe.error = CancelledError(reason)

    def _fetch_ended(self, rid: str, fe: _Fetching) -> None:
        """Account one ended fetch (under ``_lock``): its outcome for the scheduler, its blocks if it failed."""
        o, ts = fe.order, fe.transfers
        error = fe.error or _first_error(ts)
        seconds = time.monotonic() - fe.t0
        if error is None:
            nbytes = sum(int(t.nbytes) for t in ts)
            self.stats.record("fetch", ok=True, nbytes=nbytes, seconds=max(_moving(t) for t in ts))
            self._ended[rid] = (1, "done", None)
            self._fetched[rid] = {"nbytes": nbytes, "seconds": round(seconds, 6)}
            log.debug(
                "kvxfer: request %s: fetched %d blocks (%d bytes) from %d rank(s) in %.3fs",
                rid,
                len(o.block_ids),
                nbytes,
                len(ts),
                seconds,
            )
            return
        self.stats.record("fetch", ok=False)
        status = "cancelled" if isinstance(error, CancelledError) else "failed"
        msg = f"{type(error).__name__}: {error}"
        self._ended[rid] = (1, status, msg)
        self._fetched[rid] = {"seconds": round(seconds, 6)}
        # vLLM recomputes these blocks or fails the request (kv_load_failure_policy)
        if self.fail_by_request:
            self._failed_recving.add(rid)
        else:
            self._load_errors.update(o.block_ids)
        log.warning(
            "kvxfer: request %s: fetch of %r from %s %s after %.3fs: %s",
            rid,
            o.transfer_id,
            o.address,
            status,
            seconds,
            msg,
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ---- shipping ----------------------------------------------------------------------------------------
    def wait_for_save(self) -> None:
        """After the forward pass: the prompts ordered this step are in the cache; hand them to the launchers."""
        with self._lock:
            queued, self._queued = self._queued, []
        if not queued:
            return
        event = None
        if self.layout is not None and self.layout.device >= 0:
            import torch

            event = torch.cuda.Event()
            event.record()  # the launcher waits for the forward pass's KV writes on the GPU stream
        groups: dict[str, list[_Shipment]] = {}
        for sh in queued:
            groups.setdefault(sh.order.consumer, []).append(sh)
        for group in groups.values():
            if event is None:  # host memory: the forward pass's writes are done, and a push never blocks
                self._launch(None, group)
                continue
            try:
                self._launchers.submit(event, group)
            except ClosedError:
                for sh in group:
                    self._end(sh, "failed", "connector shut down")

    def _launch(self, event: Any, group: list[_Shipment]) -> None:
        """On a launcher thread: wait for the KV writes, then start each push; nothing here waits for a transfer."""
        try:
            if event is not None:
                event.synchronize()
        except Exception as e:  # every shipment must still be reported
            for sh in group:
                self._end_with(sh, e, if_queued=True)
            return
        for sh in group:
            self._push(sh)

    def _push(self, sh: _Shipment) -> None:
        with sh.lock:
            if sh.state != QUEUED or sh.cancel_reason is not None:
                return  # cancelled or past its deadline while queued
            sh.state = LAUNCHING
        o = sh.order
        try:
            producer = self.producer
            if producer is None:
                raise ClosedError("no KV cache registered (sleeping or shut down)")
            remaining = sh.end_by - time.monotonic()
            if remaining <= 0:
                raise _unpushed(o)
            part = self._part() if o.kind != "hold" else {}
            if part is None:  # a replica another rank ships
                return self._end(sh, "done", None)
            ids = self._kernel_ids(o.block_ids)
            if o.kind == "hold":  # every rank holds its share of each group, under an id of its own (``ranks``)
                ts = self._hold(producer, o, ids, remaining)
            else:
                kernel = producer.layout.fingerprint.block_size
                t = producer.push(
                    o.consumer,
                    o.transfer_id,
                    ids,
                    # a consumer paging differently is granted the blocks that hold the prompt, no more
                    tokens=o.num_tokens if (len(ids) - 1) * kernel < o.num_tokens <= len(ids) * kernel else None,
                    meta=o.meta,
                    deadline=remaining,
                    digests=o.digests,
                    retry_busy=self.settings.retry_busy,
                    **part,
                )
                ts = [t]
        except Exception as e:  # whatever happens, the request must be reported
            self._end_with(sh, e)
            return
        with sh.lock:
            sh.transfers, sh.state = ts, SHIPPING
            reason = sh.cancel_reason
        for t in ts:
            if reason is not None:
                t.cancel(reason)
            t.add_done_callback(functools.partial(self._transfer_ended, sh))

    def _hold(self, producer: Producer, o: ShipOrder, ids: np.ndarray, lease: float) -> list[Transfer]:
        """One hold per KV-cache group (``o.spans``); if one cannot start, the others end at once."""
        tp, pp = self.settings.parallel
        ts: list[Transfer] = []
        at = 0
        try:
            for group, (_, count) in enumerate(o.spans or [(0, len(o.block_ids))]):
                held = hold_id(o.transfer_id, self.rank, tp * pp, group)
                part = ids[at * self.ratio : (at + count) * self.ratio]
                ts.append(producer.hold(held, part, lease=lease, meta=o.meta, digests=o.digests))
                at += count
        except BaseException:
            for t in ts:  # nobody fetched them yet: cancelling ends them now
                t.cancel("another KV-cache group of the request could not be held")
            raise
        return ts

    def _part(self) -> dict | None:
        """Push arguments of this rank's share of a request: ``{}`` unsharded; under tensor parallelism its heads
        as one part of a multi-sender push to a consumer holding every head (``shard.sources``), or for a cache
        every rank holds whole (MLA) its stripe of the layers (``shard.stripe``); under pipeline parallelism its
        stage's layers (of those heads), one part per stage and head share; None when this rank has nothing
        another rank does not ship."""
        if self.replicated and self.stage is not None:
            return self._latent_stage_part()
        part = self._tp_part()
        if self.stage is None or part is None:
            return part
        layout = self.layout
        if layout is None or layout.layers is None:
            raise ClosedError("no KV cache registered (sleeping or shut down)")
        pp_rank, pp = self.stage
        senders, i = part.get("senders", 1), part.get("part", 0)
        return {**part, "senders": pp * senders, "part": pp_rank * senders + i, "layers": range(*layout.layers)}

    def _latent_stage_part(self) -> dict | None:
        """MLA under TP and PP: each stage's ranks stripe the stage's layers (``shard.stripe``); the parts of every
        stage together are one request (stage ``s`` has ``min(tp, its layers)`` of them)."""
        layout = self.layout
        if layout is None or layout.layers is None or self.shard is None or self.stage is None:
            raise ClosedError("no KV cache registered (sleeping or shut down)")
        if self.stages is None:
            raise IncompatibleError("an MLA cache under pipeline parallelism, but no pipeline stage layers known")
        rank, tp, _ = self.shard
        pp_rank, pp = self.stage
        counts = [min(tp, hi - lo) for lo, hi in (self.stages(s, pp) for s in range(pp))]
        lo, hi = layout.layers
        mine = tuple(lo + k for k in stripe(rank, tp, hi - lo))
        return {"senders": sum(counts), "part": sum(counts[:pp_rank]) + rank, "layers": mine} if mine else None

    def _tp_part(self) -> dict | None:
        if self.shard is None:
            return {}
        rank, tp, heads = self.shard
        if self.replicated:
            layout = self.layout
            if layout is None:
                raise ClosedError("no KV cache registered (sleeping or shut down)")
            layers = layout.fingerprint.num_layers
            mine = stripe(rank, tp, layers)
            return {"senders": min(tp, layers), "part": rank, "layers": mine} if mine else None
        parts = sources(0, 1, tp, heads)
        i = next((i for i, (r, _) in enumerate(parts) if r == rank), None)
        return None if i is None else {"senders": len(parts), "part": i, "heads": parts[i][1]}

    def _kernel_ids(self, block_ids: list[int]) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64)
        if self.ratio > 1:
            ids = (ids[:, None] * self.ratio + np.arange(self.ratio)).ravel()
        return ids

    def _transfer_ended(self, sh: _Shipment, t: Transfer) -> None:
        """A transfer's done callback, in the thread that ended it (a producer thread, or the launcher): the
        shipment ends with its last transfer; one that failed stops the others (a hold of each group)."""
        with sh.lock:
            ts = list(sh.transfers)
        if t.error is not None and not isinstance(t.error, CancelledError):
            for other in ts:
                other.cancel(f"another KV-cache group's transfer failed: {t.error}")
        if not all(x.done() for x in ts):
            return
        error = _first_error(ts)
        if error is None:
            self._end(sh, "done", None)
        else:
            self._end_with(sh, error)

    def _end_with(self, sh: _Shipment, e: BaseException, *, if_queued: bool = False) -> None:
        if isinstance(e, CancelledError) or sh.cancel_reason is not None:
            self._end(sh, "cancelled", sh.cancel_reason or str(e), if_queued=if_queued)
        elif isinstance(e, KVXferError):
            self._end(sh, "failed", f"{type(e).__name__}: {e}", if_queued=if_queued)
        else:
            self._end(sh, "failed", repr(e), if_queued=if_queued)

    def _end(self, sh: _Shipment, status: str, error: str | None, *, if_queued: bool = False) -> None:
        o = sh.order
        with sh.lock:
            if sh.ended or (if_queued and sh.state != QUEUED):
                return
            sh.state, sh.error = status, error
        dt = time.monotonic() - sh.t0
        nbytes = sum(int(t.nbytes) for t in sh.transfers)
        where = o.consumer or "the consumer fetching its hold"
        if status == "done":
            log.debug(
                "kvxfer: request %s: %d blocks (%d bytes) shipped to %s as %r in %.3fs",
                o.req_id,
                len(o.block_ids),
                nbytes,
                where,
                o.transfer_id,
                dt,
            )
        elif status == "cancelled":
            log.info("kvxfer: request %s: shipment to %s cancelled after %.3fs: %s", o.req_id, where, dt, error)
        else:
            log.warning(
                "kvxfer: request %s: shipment to %s (as %r) failed after %.3fs: %s",
                o.req_id,
                where,
                o.transfer_id,
                dt,
                error,
            )
        with self._lock:
            self._ended[o.req_id] = (o.attempt, status, error)
            seconds = max((_moving(t) for t in sh.transfers), default=0.0)
            self.stats.record(o.kind, ok=status == "done", nbytes=nbytes, seconds=seconds)

    def _expire_queued(self) -> None:
        """A shipment still queued at its deadline (its launcher busy connecting elsewhere) fails now."""
        now = time.monotonic()
        with self._lock:
            late = [sh for sh in self._shipments.values() if sh.state == QUEUED and sh.end_by <= now]
        for sh in late:
            self._end_with(sh, _unpushed(sh.order), if_queued=True)

    # ---- reporting ---------------------------------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving, _ = self.transfer_results(finished_req_ids)
        return sending, recving

    def transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None, set[str]]:
        """Report each held request once: after it finished in vLLM and its transfer ended (any outcome); each
        fetching request once its fetch ended (any outcome: a failed one's blocks go to the load errors, or with
        several KV-cache groups the request to the failed receives, reported with it)."""
        self._expire_queued()
        sending: set[str] = set()
        recving: set[str] = set()
        with self._lock:
            abandoned = [fe for rid in finished_req_ids if (fe := self._fetches.get(rid)) is not None]
        for fe in abandoned:  # finished (aborted) while loading: stop, vLLM frees the blocks once reported
            if not fe.ended:
                self._cancel_fetch(fe, "request finished while its KV was loading")
        with self._lock:
            for rid, fe in list(self._fetches.items()):
                if fe.ended:
                    del self._fetches[rid]
                    self._fetch_ended(rid, fe)
                    recving.add(rid)
            for rid in finished_req_ids:
                if rid in self._delayed:
                    self._delayed.discard(rid)
                    self._awaiting.add(rid)
                elif rid in self._shipments:
                    self._shipments[rid].forget = True
            for rid in list(self._awaiting):
                sh = self._shipments.get(rid)
                if sh is None or sh.ended:
                    sending.add(rid)
                    self._awaiting.discard(rid)
                    self._shipments.pop(rid, None)
            for rid, sh in list(self._shipments.items()):
                if sh.forget and sh.ended:
                    del self._shipments[rid]
            failed, self._failed_recving = self._failed_recving, set()
        return (sending or None), (recving or None), failed

    def build_connector_worker_meta(self) -> KVXferWorkerMetadata | None:
        # The layout id goes to the scheduler here, not through get_handshake_metadata: MultiConnector forwards
        # only its first child's handshake metadata, which would hide NixlConnector's when this child comes first.
        fp = ""
        with self._lock:
            if not self._fingerprint_told and self.layout is not None and self.produce:
                fp, self._fingerprint_told = self.layout.fingerprint_id, True
            if not self._ended and not fp:
                return None
            ended, self._ended = self._ended, {}
            fetched, self._fetched = self._fetched, {}
        return KVXferWorkerMetadata(ended, fetched, fp)

    def get_kv_connector_stats(self) -> KVXferStats | None:
        with self._lock:
            return None if self.stats.is_empty() else self.stats.clone_and_reset()

    def shutdown(self) -> None:
        self._close_producer("connector shut down")
        self._launchers.close()

    def pending(self) -> dict[str, str]:
        """req -> state of every shipment not yet forgotten (queued, launching, shipping, done, failed, ...)."""
        with self._lock:
            out = {rid: sh.state for rid, sh in self._shipments.items()}
            out.update({rid: "fetching" for rid in self._fetches})
            return out
