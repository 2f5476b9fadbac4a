"""``KVXferConnector``: the class vLLM loads. It checks the configuration, then hands each hook to the half of its
role, as vLLM's own NixlConnector does: ``KVXferScheduler`` in the engine-core process, ``KVXferWorker`` in the
model-runner process. ``kv_producer`` pushes and holds, ``kv_consumer`` fetches, ``kv_both`` does all three."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1 import base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from ...consumer import Consumer
from ...producer import Producer
from .groups import of_config
from .metadata import KVXferConnectorMetadata, KVXferWorkerMetadata
from .ranks import Stages, ports_fit, rank_address
from .scheduler import KVXferScheduler
from .settings import Settings
from .stats import KVXferPromMetrics, KVXferStats
from .worker import KVXferWorker

if TYPE_CHECKING:
    import torch
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


def _ranks(pc) -> tuple[int, int]:
    """This worker's (tensor-parallel, pipeline-parallel) ranks: from vLLM's groups where ones of these sizes are
    initialised (in a worker process), else from the worker's global rank in the parallel config (vLLM numbers
    ranks TP-fastest: ``rank = pp_rank * tp + tp_rank``)."""
    tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        t, p = get_tp_group(), get_pp_group()
        if t.world_size == tp and p.world_size == pp:
            return int(t.rank_in_group), int(p.rank_in_group)
    except (AssertionError, ImportError, AttributeError):
        pass
    return int(pc.rank) % tp, int(pc.rank) // tp % pp


def _stage_layers(vllm_config) -> Stages:
    """The model's layers each pipeline stage holds, as vLLM splits them (the same split on both instances)."""
    from vllm.distributed.utils import get_pp_indices

    total = int(vllm_config.model_config.get_total_num_hidden_layers())
    return lambda stage, stages: tuple(get_pp_indices(total, stage, stages))  # type: ignore[return-value]


def _packed_by_kernel(vllm_config) -> bool:
    """Whether this worker's attention kernel lays out each block its own way: vLLM's CPU attention keeps a head's
    K and V as ``[2, block_size, head_size]`` in kernel order, not the ``[block_size, 2 * head_size]`` its tensor
    shape says, so its blocks move whole (and by heads or layers) but cannot be split by tokens."""
    try:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

        layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase)  # type: ignore[type-abstract]
        return any(layer.get_attn_backend().get_name() == "CPU_ATTN" for layer in layers.values())
    except Exception:  # no model layers here (a harness), or another vLLM: nothing says the blocks are packed
        return False


class KVXferConnector(KVConnectorBase_V1, SupportsHMA):
    """kvxfer connector for vLLM V1: ``kv_role`` ``"kv_producer"``, ``"kv_consumer"`` or ``"kv_both"``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        if ktc.kv_role not in ("kv_producer", "kv_consumer", "kv_both"):
            raise ValueError(
                f"KVXferConnector: kv_role must be 'kv_producer', 'kv_consumer' or 'kv_both', got {ktc.kv_role!r}"
            )
        produce, fetch = ktc.kv_role != "kv_consumer", ktc.kv_role != "kv_producer"
        self.settings = Settings.from_extra(ktc.kv_connector_extra_config)
        pc = vllm_config.parallel_config
        tp, pp = int(pc.tensor_parallel_size), int(pc.pipeline_parallel_size)
        mla = bool(getattr(vllm_config.model_config, "use_mla", False))  # one latent cache, whole on every rank
        tp_rank, pp_rank = _ranks(pc)
        kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        shard = (tp_rank, tp, kv_heads) if tp > 1 else None
        stage = (pp_rank, pp) if pp > 1 else None
        self.settings = dataclasses.replace(self.settings, parallel=(tp, pp))
        listen = self.settings.listen  # under TP/PP each rank listens on its own port: the configured one + its rank
        if listen and tp * pp > 1 and not ports_fit(listen, tp * pp):
            raise ValueError(f"KVXferConnector: listen {listen!r} leaves no port for each of its {tp * pp} ranks")
        self.groups = of_config(kv_cache_config)  # the KV-cache groups that ship (``groups``)
        if len(self.groups) > 1 and pp > 1:
            raise ValueError(
                f"KVXferConnector: {len(self.groups)} KV-cache groups under pipeline parallelism "
                f"(pipeline_parallel_size={pp}): not supported"
            )
        specs = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        spec = specs[self.groups[0].index].kv_cache_spec if specs else None
        self.block_size = int(getattr(spec, "block_size", 0) or vllm_config.cache_config.block_size)
        self.connector_scheduler: KVXferScheduler | None = None
        self.connector_worker: KVXferWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVXferScheduler(
                self.settings, self.block_size, produce=produce, fetch=fetch, groups=self.groups
            )
        else:
            own = self.settings
            if listen and tp * pp > 1:
                own = dataclasses.replace(own, listen=rank_address(listen, pp_rank * tp + tp_rank))
            self.connector_worker = KVXferWorker(
                own,
                kv_cache_config,
                produce=produce,
                fetch=fetch,
                block_size=self.block_size,
                shard=shard,
                replicated=mla,
                stage=stage,
                layers=_stage_layers(vllm_config),
                kv_heads=kv_heads,
            )
            # vLLM 0.33 maps a failed load of a model of several groups by its request, not its block ids
            self.connector_worker.fail_by_request = len(self.groups) > 1 and hasattr(base, "KVConnectorTransferResults")

    # ---- class-level hooks -------------------------------------------------------------------------------
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # any layout: kvxfer reads the geometry off the tensors' strides

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        return True  # unregister_kv_caches / restore_kv_caches follow the remap

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVXferStats | None:
        return KVXferStats(data=data) if data is not None else KVXferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVXferPromMetrics:
        return KVXferPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ---- scheduler side ----------------------------------------------------------------------------------
    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(g.index for g in self.groups)  # a fetch restores the request's blocks of every group that ships

    def on_new_request(self, request: Request) -> None:
        if self.connector_scheduler is not None:
            self.connector_scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVXferConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # the blocks each group ships were tracked from the scheduler's outputs; the delay holds every group's
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def has_pending_push_work(self) -> bool:
        return self.connector_scheduler is not None and self.connector_scheduler.has_pending_push_work()

    # ---- worker side -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        assert self.connector_worker is not None
        self.connector_worker.packed = _packed_by_kernel(self._vllm_config)
        self.connector_worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.restore_kv_caches()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVXferConnectorMetadata):
            assert self.connector_worker is not None
            self.connector_worker.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVXferConnectorMetadata):
            assert self.connector_worker is not None
            self.connector_worker.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv()  # starts the step's fetches; never waits for one

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass  # loads are asynchronous: the request is scheduled only after finished_recving

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        pass  # whole requests are shipped after the forward pass, from the registered cache itself

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        return self.connector_worker.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.33: the finished transfers and, for a model of several KV-cache groups, the failed loads by
        request (their block ids, unique only within a group, cannot name them)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        assert self.connector_worker is not None
        sending, recving, failed = self.connector_worker.transfer_results(finished_req_ids)
        return KVConnectorTransferResults(set(sending or ()), set(recving or ()), failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.connector_worker is not None
        return self.connector_worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVXferWorkerMetadata | None:
        assert self.connector_worker is not None
        return self.connector_worker.build_connector_worker_meta()

    def get_kv_connector_stats(self) -> KVXferStats | None:
        if self.connector_worker is None:
            return None  # the scheduler half moves nothing
        return self.connector_worker.get_kv_connector_stats()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    # ---- introspection (tests, debugging) ----------------------------------------------------------------
    @property
    def producer(self) -> Producer | None:
        return self.connector_worker.producer if self.connector_worker is not None else None

    @property
    def consumer(self) -> Consumer | None:
        return self.connector_worker.consumer if self.connector_worker is not None else None

    def pending(self) -> dict[str, str]:
        """Worker: req -> shipment state of every shipment not yet forgotten; scheduler: tracked requests."""
        if self.connector_worker is not None:
            return self.connector_worker.pending()
        assert self.connector_scheduler is not None
        return self.connector_scheduler.pending()
