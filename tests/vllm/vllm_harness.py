"""Drive a REAL vLLM V1 ``Scheduler`` (real ``Request``s, the connector loaded by module path) and the worker side
of the connector the way vLLM's model runner does (``KVConnectorModelRunnerMixin``), on CPU, with fabricated
``ModelRunnerOutput``s and a fake attention that writes known values into vLLM's own paged KV tensors.

Imported only after the session fixture checked that vLLM imports (it imports vLLM at module level).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer import kv_transfer_state
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.forward_context import set_forward_context
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin
from vllm.v1.worker.utils import allocate_kv_cache

from kvxfer.integrations.vllm import KVXferConnector, KVXferConnectorMetadata, ShipOrder
from support.ports import free_port as free_port  # the tests call it as vh.free_port
from vllm import SamplingParams
from vllm_consumer import block_stream

MODEL_DIR = str(Path(__file__).parent / "tiny-llama")  # config.json only: a 2-layer Llama, no weights, no hub
MODULE = "kvxfer.integrations.vllm"
EOS = 2
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
KV_HEADS, HEAD = 2, 64
DTYPE = torch.bfloat16

_hash_ready = False


# ------------------------------------------------------------------------------------------------------------
# configs
# ------------------------------------------------------------------------------------------------------------
def kvxfer_ktc(*, role: str = "kv_producer", policy: str | None = None, **extra) -> KVTransferConfig:
    ktc = KVTransferConfig(
        kv_connector="KVXferConnector",
        kv_connector_module_path=MODULE,
        kv_role=role,  # type: ignore[arg-type]
        kv_connector_extra_config=extra,
    )
    if policy:
        ktc.kv_load_failure_policy = policy  # type: ignore[assignment]
    return ktc


def multi_ktc(
    extra: dict, *, nixl: bool = True, nixl_extra: dict | None = None, role: str = "kv_producer"
) -> KVTransferConfig:
    children = [
        {
            "kv_connector": "KVXferConnector",
            "kv_connector_module_path": MODULE,
            "kv_role": role,
            "kv_connector_extra_config": extra,
        }
    ]
    if nixl:
        children.append(
            {
                "kv_connector": "NixlConnector",
                "kv_role": role,
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": dict(nixl_extra or {}),
            }
        )
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role=role,  # type: ignore[arg-type]
        kv_connector_extra_config={"connectors": children},
    )


def make_vllm_config(
    ktc: KVTransferConfig | None,
    *,
    max_batched: int = 64,
    max_seqs: int = 8,
    block: int = 16,
    max_model_len: int = 1024,
    layout: str = "LBHNC",
) -> VllmConfig:
    model_config = ModelConfig(
        model=MODEL_DIR, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len, seed=0
    )
    sched = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_batched,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=block, enable_prefix_caching=True)
    cache.kv_cache_layout = layout  # the engine core resolves it from the backends; CPU_ATTN -> LBHNC
    return VllmConfig(
        model_config=model_config,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=ktc,
        device_config=DeviceConfig("cpu"),
    )


def make_kv_cache_config(vc: VllmConfig, num_blocks: int, window: int = 0) -> KVCacheConfig:
    """One full-attention group of both layers; with ``window``, a hybrid model: layer 0 full attention (group 0)
    and layer 1 sliding-window attention over ``window`` tokens (group 1), the two groups' tensors aliasing one
    allocation as vLLM lays them out."""
    geometry = {"block_size": vc.cache_config.block_size, "num_kv_heads": KV_HEADS, "head_size": HEAD, "dtype": DTYPE}
    spec = FullAttentionSpec(**geometry)
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    if window:
        groups = [
            KVCacheGroupSpec([LAYERS[0]], spec),
            KVCacheGroupSpec([LAYERS[1]], SlidingWindowSpec(**geometry, sliding_window=window)),
        ]
    cfg = get_kv_cache_config_from_groups(vc, groups, spec.page_size_bytes * len(groups[0].layer_names) * num_blocks)
    vc.cache_config.num_gpu_blocks = cfg.num_blocks
    return cfg


def prompt_tokens(prompt_len: int, seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % 1000 + 3 for i in range(prompt_len)]


def make_request(
    rid: str, prompt_len: int, max_tokens: int, kv_params: dict | None, seed: int = 1, block: int = 16
) -> Request:
    """A Request exactly as the engine builds it: kv_transfer_params travel in SamplingParams.extra_args."""
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    extra = {"kv_transfer_params": kv_params} if kv_params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    sp.update_from_generation_config({}, EOS)
    return Request(
        request_id=rid,
        prompt_token_ids=prompt_tokens(prompt_len, seed),
        sampling_params=sp,
        pooling_params=None,
        block_hasher=get_request_block_hasher(block, sha256),
    )


def slot_value(token: int, pos: int, layer: int) -> float:
    """What the fake attention writes for one token of one layer (exact in bf16)."""
    return float((token * 7 + pos * 13 + layer * 101) % 251 - 125)


# ------------------------------------------------------------------------------------------------------------
# worker: vLLM's KV tensors + the worker-role connector, driven by vLLM's own KVConnectorModelRunnerMixin
# ------------------------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, vc: VllmConfig, kvc: KVCacheConfig, *, layout: str = "LBHNC", connector: bool = True):
        self.vc = vc
        self.block = vc.cache_config.block_size
        self.kv_caches = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[layout])
        g = torch.Generator().manual_seed(0)
        for t in {id(t): t for t in self.kv_caches.values()}.values():  # unwritten slots hold random bytes
            t.view(torch.int16).copy_(torch.randint(-3000, 3000, t.shape, generator=g, dtype=torch.int16))
        # the KV-cache group of each layer; req -> its block table in each group
        self.group_of = {name: g for g, grp in enumerate(kvc.kv_cache_groups) for name in grp.layer_names}
        self.block_tables: dict[str, list[list[int]]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.orders: list[ShipOrder] = []
        # req -> its shipped blocks' bytes after the forward pass of the step that ordered them (held since, so
        # what the push sends): once it ends vLLM frees them, and a partial last block (no hash) goes out first
        self.shipped: dict[str, list[bytes]] = {}
        self.fetch_orders: list = []
        self.tables_seen: dict[str, list[int]] = {}  # req -> its group-0 block table (kept after finish)
        self.group_tables_seen: dict[str, list[list[int]]] = {}  # req -> its table in every group
        self.connector = None
        if connector:
            # NixlConnector's worker pins the calling thread to the last core of each NUMA node on CPU (see
            # tests/e2e/nixl_site); here that thread is pytest's, and every test and peer process after it
            # would run on that one core
            cpus = os.sched_getaffinity(0)
            self.connector = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
            os.sched_setaffinity(0, cpus)
            self.connector.register_kv_caches(self.kv_caches)
            kv_transfer_state._KV_CONNECTOR_AGENT = self.connector

    @property
    def kvxfer(self) -> KVXferConnector:
        c = self.connector
        if isinstance(c, KVXferConnector):
            return c
        return next(x for x in c._connectors if isinstance(x, KVXferConnector))

    def close(self) -> None:
        if kv_transfer_state._KV_CONNECTOR_AGENT is self.connector:
            kv_transfer_state._KV_CONNECTOR_AGENT = None
        if self.connector is not None:
            self.connector.shutdown()

    def _our_meta(self, meta) -> KVXferConnectorMetadata | None:
        if isinstance(meta, KVXferConnectorMetadata):
            return meta
        for m in getattr(meta, "metadata", ()) or ():
            if isinstance(m, KVXferConnectorMetadata):
                return m
        return None

    def execute(self, so, prompt_len: dict[str, int], eos_for: set[str]) -> ModelRunnerOutput:
        if self.connector is not None:  # two engines in one process (P/D tests): the model runner's agent is ours
            kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        for r in so.scheduled_new_reqs:
            self.block_tables[r.req_id] = [list(ids) for ids in r.block_ids]
            self.tokens[r.req_id] = list(r.prompt_token_ids)
            self.tables_seen[r.req_id] = self.block_tables[r.req_id][0]
            self.group_tables_seen[r.req_id] = self.block_tables[r.req_id]
        c = so.scheduled_cached_reqs
        groups = len(set(self.group_of.values()))
        for i, rid in enumerate(c.req_ids):
            nb = c.new_block_ids[i]
            if rid in c.resumed_req_ids:
                self.block_tables[rid] = [list(ids) for ids in nb] if nb else [[] for _ in range(groups)]
            elif nb:
                tables = self.block_tables.setdefault(rid, [[] for _ in range(groups)])
                for table, ids in zip(tables, nb, strict=True):
                    table.extend(ids)
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        starts.update(zip(c.req_ids, c.num_computed_tokens, strict=True))
        for rid in so.finished_req_ids:
            self.block_tables.pop(rid, None)
        ours = self._our_meta(so.kv_connector_metadata)
        if ours is not None:
            self.orders.extend(ours.ship)
            self.fetch_orders.extend(ours.fetch)

        kv_out = None
        if self.connector is not None:
            # exactly the model runner's sequence: handle_preemptions, then the connector context around forward
            self.connector.handle_preemptions(so.kv_connector_metadata)
            if so.total_num_scheduled_tokens == 0:
                kv_out = KVConnectorModelRunnerMixin.kv_connector_no_forward(so, self.vc).kv_connector_output
            else:
                with (
                    set_forward_context(None, self.vc),
                    KVConnectorModelRunnerMixin._get_kv_connector_output(so) as out,
                ):
                    for li, name in enumerate(LAYERS):
                        self.connector.wait_for_layer_load(name)
                        self._attention(li, name, so, starts)
                        self.connector.save_kv_layer(name, self.kv_caches[name], None)
                kv_out = out
        else:
            for li, name in enumerate(LAYERS):
                self._attention(li, name, so, starts)

        # ordered to ship once this step's forward wrote them (no producer while asleep: nothing ships)
        if ours is not None and (producer := self.kvxfer.producer) is not None:
            for o in ours.ship:
                self.shipped[o.req_id] = [block_stream(producer.layout, b) for b in o.block_ids]

        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            done = starts[rid] + so.num_scheduled_tokens[rid] >= prompt_len[rid]
            sampled.append([EOS if rid in eos_for else 7] if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_out,
        )

    def _attention(self, li: int, name: str, so, starts: dict[str, int]) -> None:
        kv = self.kv_caches[name]  # [num_blocks, H, N, C] logical
        for rid, n in so.num_scheduled_tokens.items():
            bt, toks = self.block_tables[rid][self.group_of[name]], self.tokens[rid]
            for pos in range(starts[rid], starts[rid] + n):
                tok = toks[pos] if pos < len(toks) else 7
                if bt[pos // self.block]:  # the null block (a sliding window's past) holds nothing
                    kv[bt[pos // self.block], :, pos % self.block, :] = slot_value(tok, pos, li)


# ------------------------------------------------------------------------------------------------------------
# engine: schedule -> execute -> update_from_output, like EngineCore.step
# ------------------------------------------------------------------------------------------------------------
class Engine:
    def __init__(
        self,
        ktc: KVTransferConfig | None,
        *,
        num_blocks: int = 64,
        max_batched: int = 64,
        block: int = 16,
        worker_connector: bool = True,
        layout: str = "LBHNC",
        setup: Callable[[VllmConfig], None] | None = None,
        window: int = 0,
        max_model_len: int = 1024,
    ):
        self.vc = make_vllm_config(
            ktc, max_batched=max_batched, block=block, layout=layout, max_model_len=max_model_len
        )
        self.kvc = make_kv_cache_config(self.vc, num_blocks, window)
        if setup is not None:
            setup(self.vc)
        self.sched = Scheduler(
            vllm_config=self.vc,
            kv_cache_config=self.kvc,
            structured_output_manager=StructuredOutputManager(self.vc),
            block_size=block,
            log_stats=True,
        )
        self.worker = Worker(self.vc, self.kvc, layout=layout, connector=worker_connector and ktc is not None)
        self.prompt_len: dict[str, int] = {}
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, dict[str, Any]] = {}
        self.eos_for: set[str] = set()
        self.steps = 0
        self.preempted: set[str] = set()
        self.finished_sending: dict[str, int] = {}
        self.first_computed: dict[str, int] = {}  # req -> num_computed_tokens when first scheduled (prefix hit)
        self.finished_recving: dict[str, int] = {}
        self.load_errors: set[int] = set()
        self.failed_recving: set[str] = set()  # loads reported failed by request (models of several groups)
        self.stats: Any = None  # the connector's KVConnectorStats, aggregated over every step's output

    @property
    def kvxfer(self) -> KVXferConnector:
        c = self.sched.connector
        return c if isinstance(c, KVXferConnector) else next(x for x in c._connectors if isinstance(x, KVXferConnector))

    def add(self, req: Request) -> None:
        self.sched.add_request(req)  # a connector may shorten the prompt here (``on_new_request``)
        self.prompt_len[req.request_id] = req.num_prompt_tokens
        self.prompts[req.request_id] = list(req.prompt_token_ids)

    def abort(self, rid: str) -> None:
        self.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    def step(self) -> None:
        self.steps += 1
        so = self.sched.schedule()
        self.preempted |= set(so.preempted_req_ids or ())
        for r in so.scheduled_new_reqs:
            self.first_computed.setdefault(r.req_id, r.num_computed_tokens)
        mro = self.worker.execute(so, self.prompt_len, self.eos_for)
        kvo = mro.kv_connector_output
        for rid in (kvo.finished_sending or ()) if kvo else ():
            self.finished_sending[rid] = self.finished_sending.get(rid, 0) + 1
        for rid in (kvo.finished_recving or ()) if kvo else ():
            self.finished_recving[rid] = self.finished_recving.get(rid, 0) + 1
        if kvo is not None:
            self.load_errors |= set(kvo.invalid_block_ids or ())
            self.failed_recving |= set(kvo.failed_recving or ())
            if kvo.kv_connector_stats is not None:
                self.stats = (
                    kvo.kv_connector_stats if self.stats is None else self.stats.aggregate(kvo.kv_connector_stats)
                )
        eco = self.sched.update_from_output(so, mro)
        for outs in eco.values():
            for o in outs.outputs:
                d = self.outputs.setdefault(o.request_id, {"tokens": 0})
                d["tokens"] += len(o.new_token_ids)
                if o.finish_reason is not None:
                    d["finish"] = o.finish_reason.name
                    d["kv_transfer_params"] = o.kv_transfer_params
        if so.total_num_scheduled_tokens == 0:
            time.sleep(0.002)  # an idle engine kept stepping by has_pending_push_work: let transfers progress

    def busy(self) -> bool:
        return bool(self.sched.requests) or self.sched.has_requests()

    def run(
        self,
        timeout: float = 30.0,
        until: Callable[[Engine], bool] | None = None,
        on_step: Callable[[Engine], None] | None = None,
    ) -> float:
        t0 = time.monotonic()
        while (until(self) is False) if until is not None else self.busy():
            if time.monotonic() - t0 > timeout:
                raise AssertionError(
                    f"engine still busy after {timeout}s: requests={list(self.sched.requests)} "
                    f"connector={self.kvxfer.pending()} worker={self.worker.kvxfer.pending()}"
                )
            if on_step is not None:
                on_step(self)
            self.step()
        return time.monotonic() - t0

    def prefill(self, rid: str, n: int, seed: int, claim: dict | None = None, max_tokens: int = 1) -> dict:
        """Run a prefill of ``n`` tokens with a kvxfer claim (default: a hold) to its finish; its response's
        kv_transfer_params."""
        self.add(make_request(rid, n, max_tokens, {"kvxfer": claim if claim is not None else {}}, seed=seed))
        self.run(until=lambda e: "kv_transfer_params" in e.outputs.get(rid, {}))
        return self.outputs[rid]["kv_transfer_params"]

    def assert_no_leaks(self) -> None:
        s = self.sched
        bp = s.kv_cache_manager.block_pool
        assert not s.requests and not s.running and len(s.waiting) == 0, list(s.requests)
        assert bp.get_num_free_blocks() == bp.num_gpu_blocks - 1, (bp.get_num_free_blocks(), bp.num_gpu_blocks)
        assert all(b.ref_cnt == 0 for b in bp.blocks[1:])
        assert not self.kvxfer.pending() and not self.kvxfer.has_pending_push_work()
        if self.worker.connector is not None:
            assert not self.worker.kvxfer.pending(), self.worker.kvxfer.pending()
        for rid, n in self.finished_sending.items():
            assert n == 1, f"{rid} reported finished_sending {n} times"
        for rid, n in self.finished_recving.items():
            assert n == 1, f"{rid} reported finished_recving {n} times"

    def close(self) -> None:
        self.worker.close()


def run_both(p: Engine, d: Engine, timeout: float = 30.0) -> None:
    """Step a prefill and a decode engine in turn until both are idle."""
    t0 = time.monotonic()
    while p.busy() or d.busy():
        assert time.monotonic() - t0 < timeout, (p.kvxfer.pending(), d.kvxfer.pending(), d.worker.kvxfer.pending())
        for e in (p, d):
            if e.busy():
                e.step()


def expected_tokens_ok(arrival: dict, prompt: list[int], block: int) -> int:
    """Check every prompt token slot of an arrival holds what the fake attention wrote; returns slots checked."""
    n = 0
    for i, raw in enumerate(arrival["blocks"]):
        page = torch.frombuffer(bytearray(raw), dtype=DTYPE).view(len(LAYERS), KV_HEADS, block, 2 * HEAD)
        for off in range(block):
            pos = i * block + off
            if pos >= len(prompt):
                break
            for li in range(len(LAYERS)):
                want = slot_value(prompt[pos], pos, li)
                got = page[li, :, off, :]
                assert torch.all(got == want), (arrival["req"], i, off, li, got.flatten()[:4], want)
            n += 1
    return n


def physical_block_bytes(t: torch.Tensor, b: int) -> bytes:
    """One block of one layer, in memory order (for any stride permutation)."""
    page = t[b]
    order = sorted(range(page.dim()), key=lambda d: -page.stride(d))
    return page.permute(*order).contiguous().view(torch.uint8).numpy().tobytes()


def nixl_alias() -> bool:
    """Let vLLM's ``import nixl._api`` find the nixl-cu13 wheel kvxfer installs (the test process only)."""
    if "nixl._api" in sys.modules:
        return True
    try:
        import importlib

        pkg = importlib.import_module("nixl_cu13")
        api = importlib.import_module("nixl_cu13._api")
    except ImportError:
        return False
    sys.modules.setdefault("nixl", pkg)
    sys.modules.setdefault("nixl._api", api)
    return True


_dist_ready = False


def init_single_process_world(vc: VllmConfig) -> None:
    """NixlConnector's worker reads TP/PP ranks: a 1-process gloo world, once per process."""
    global _dist_ready
    if _dist_ready:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    port = free_port()  # not one the kernel hands out: CI's gloo store once found its port taken by then
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
        )
        ensure_model_parallel_initialized(1, 1)
    _dist_ready = True
