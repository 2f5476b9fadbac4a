"""Processes that load NIXL end with their own status: the bench CLI, a program using kvxfer's NIXL transport,
and a test run holding vLLM's NixlConnector agents. NIXL 1.5.1 with UCX has crashed such processes at exit
(SIGSEGV, 139) after their work was done; each case here runs in a real child process and checks its status."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvxfer import transports

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "--model",
    "custom",
    "--layers",
    "2",
    "--kv-heads",
    "2",
    "--head-dim",
    "32",
    "--block-size",
    "16",
    "--tokens",
    "256",
    "--repeats",
    "1",
    "--warmup",
    "0",
    "--quiet",
]


def _require(ok: bool, why: str) -> None:
    if not ok:
        if os.environ.get("CI"):
            pytest.fail(f"{why} in CI")
        pytest.skip(why)


@pytest.fixture
def nixl():
    _require("nixl" in transports.available(), "NIXL is not available here")


def _run(cmd, timeout: float, **env_vars: str):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.update(env_vars)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.parametrize("transport", ["nixl", "all"])
def test_bench_cli_exits_zero_after_printing_the_table(nixl, transport):
    proc = _run([sys.executable, "-m", "kvxfer.bench.cli", "--transport", transport, *TINY], timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert "transport  mode" in proc.stdout
    assert "nixl-raw" in proc.stdout  # the nixl row, next to its raw-NIXL baseline
    assert proc.stdout.rstrip().endswith("yes")  # the table is complete: the last row's "verified" column


# Native teardown that crashes, on demand: a C exit handler at an unmapped address, registered first.
# It stands in for NIXL 1.5.1 + UCX's crash after the interpreter is done, which does not happen on every
# machine; a process whose entry point ends it before native teardown never reaches the handler.
CRASH_AT_NATIVE_EXIT = "import ctypes; ctypes.CDLL(None).on_exit(ctypes.c_void_p(8), None)\n"


def test_the_crash_stand_in_crashes_a_plain_exit():
    proc = _run([sys.executable, "-c", CRASH_AT_NATIVE_EXIT + "print('done', flush=True)"], timeout=30)
    assert proc.returncode == -11 and proc.stdout == "done\n"


@pytest.mark.parametrize("extra, status", [([], 0), (["--inject-corruption"], 1)], ids=["ok", "failed-run"])
def test_bench_cli_status_survives_a_crashing_native_teardown(nixl, extra, status):
    run_cli = (
        "import runpy, sys\n"
        f"sys.argv = ['kvxfer-bench', '--transport', 'nixl', *{TINY + extra!r}]\n"
        "runpy.run_module('kvxfer.bench.cli', run_name='__main__', alter_sys=True)\n"
    )
    proc = _run([sys.executable, "-c", CRASH_AT_NATIVE_EXIT + run_cli], timeout=120)
    assert proc.returncode == status, (proc.returncode, proc.stderr[-2000:])
    assert "nixl-raw" in proc.stdout


def test_test_run_status_survives_a_crashing_native_teardown(nixl):
    run_pytest = (
        "import pytest, sys\n"
        "sys.exit(pytest.main(['tests/test_exit_status.py::test_program_using_the_nixl_transport_exits_zero',"
        " '-q', '-p', 'no:cacheprovider']))\n"
    )
    proc = _run([sys.executable, "-c", CRASH_AT_NATIVE_EXIT + run_pytest], timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert re.search(r"\b[1-9]\d* passed\b", proc.stdout) and " failed" not in proc.stdout, proc.stdout[-2000:]


PROGRAM = textwrap.dedent("""
    import numpy as np
    from kvxfer import Consumer, KVLayout, Producer

    src = [np.arange(8 * 2 * 16 * 64, dtype=np.float16).reshape(8, 2, 16, 64) for _ in range(2)]
    dst = [np.zeros_like(a) for a in src]
    consumer = Consumer(KVLayout.from_tensors(dst), transport="nixl")
    producer = Producer(KVLayout.from_tensors(src), transport="nixl")
    producer.push(consumer.address, "req-1", [1, 2, 3]).wait(timeout=30)
    arrival = consumer.get(timeout=10)
    assert all((d[b] == s[i]).all() for d, s in zip(dst, src) for b, i in zip(arrival.block_ids, [1, 2, 3]))
    print("pushed", len(arrival.block_ids), flush=True)
""")


def test_program_using_the_nixl_transport_exits_zero(nixl):
    proc = _run([sys.executable, "-c", PROGRAM], timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "pushed 3"


def test_ucx_log_lines_stay_out_of_the_programs_output(nixl):
    """UCX prints its log to stdout by default (seen: a connect error after a loaded run's "pushed 3"); a
    program's stdout is its own. At UCX's info level there are a dozen lines to misplace."""
    proc = _run([sys.executable, "-c", PROGRAM], timeout=60, UCX_LOG_LEVEL="info")
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "pushed 3"
    assert "UCX" in proc.stderr


@pytest.mark.vllm
@pytest.mark.timeout(360)  # a test run in a child: vLLM's import and engine set-up take most of a minute
def test_test_run_holding_vllm_nixl_agents_exits_zero(nixl):
    """One test that leaves two engines' NixlConnector agents (prefill and decode) in the run's process."""
    _require(importlib.util.find_spec("vllm") is not None, "vLLM is not installed")
    test = "tests/vllm/test_vllm_multi.py::test_pd_hold_and_fetch_under_multiconnector_beside_nixl"
    proc = _run([sys.executable, "-m", "pytest", test, "-q", "-p", "no:cacheprovider"], timeout=300)
    # the child's verdict lines: its captured vLLM log fills the tail of its output (CI, 2026-12-03)
    why = [ln for ln in proc.stdout.splitlines() if ln.startswith(("E ", "FAILED", "ERROR"))][:40]
    assert proc.returncode == 0, (proc.returncode, why, proc.stdout[-2000:], proc.stderr[-2000:])
    assert re.search(r"\b[1-9]\d* passed\b", proc.stdout) and " failed" not in proc.stdout, proc.stdout[-2000:]
