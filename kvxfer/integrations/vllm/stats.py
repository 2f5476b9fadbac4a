"""``KVXferStats``: the connector's transfers as vLLM's connector-stats hooks carry them (worker process ->
engine core -> vLLM's periodic "KV Transfer metrics" log line), counted per kind of transfer; ``KVXferPromMetrics``
turns the same figures into Prometheus counters on vLLM's ``/metrics``."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

KINDS = ("push", "hold", "fetch")  # shipped to a consumer, held and fetched from here, fetched into here
FIELDS = ("transfers", "failures", "bytes", "seconds")


@dataclass
class KVXferStats(KVConnectorStats):
    """``data``: kind -> {"transfers", "failures", "bytes", "seconds"}; sums, so aggregating adds them.
    ``bytes`` and ``seconds`` count transfers that succeeded (their GB/s), ``failures`` those that did not."""

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = {k: dict.fromkeys(FIELDS, 0) for k in KINDS}

    def record(self, kind: str, *, ok: bool, nbytes: int = 0, seconds: float = 0.0) -> None:
        d = self.data[kind]
        d["transfers"] += 1
        if ok:
            d["bytes"] += int(nbytes)
            d["seconds"] += float(seconds)
        else:
            d["failures"] += 1

    def clone_and_reset(self) -> KVXferStats:
        old = copy.deepcopy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data.get(k, {}).get("transfers") for k in KINDS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for kind, d in (other.data or {}).items():
            mine = self.data.setdefault(kind, dict.fromkeys(FIELDS, 0))
            for f in FIELDS:
                mine[f] = mine.get(f, 0) + d.get(f, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for kind in KINDS:
            d = self.data.get(kind) or {}
            if not d.get("transfers"):
                continue
            out[f"kvxfer_{kind}_transfers"] = d["transfers"]
            out[f"kvxfer_{kind}_failures"] = d["failures"]
            out[f"kvxfer_{kind}_MB"] = round(d["bytes"] / 1e6, 3)
            # three significant digits: small prompts on a loaded host move well under 1 MB/s, not "0.0"
            out[f"kvxfer_{kind}_GB/s"] = float(f"{d['bytes'] / d['seconds'] / 1e9:.3g}") if d["seconds"] > 0 else 0.0
        return out


class KVXferPromMetrics(KVConnectorPromMetrics):
    """Counters ``vllm:kvxfer_<kind>_{transfers,failures,bytes,seconds}_total`` per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[tuple[str, str], dict] = {}
        for kind in KINDS:
            for f in FIELDS:
                c = self._counter_cls(
                    name=f"vllm:kvxfer_{kind}_{f}",
                    documentation=f"kvxfer {kind} transfers: {f} (bytes and seconds of the successful ones)",
                    labelnames=labelnames,
                )
                self.counters[kind, f] = create_metric_per_engine(c, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for kind in KINDS:
            d = transfer_stats_data.get(kind) or {}
            for f in FIELDS:
                if d.get(f):
                    self.counters[kind, f][engine_idx].inc(d[f])
