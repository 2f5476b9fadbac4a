"""A short soak run in CI: producers in child processes, pushes and pulls into one consumer, random SIGKILL /
SIGSTOP / cancels on both sides / consumer restarts. Nothing untyped, nothing hung, nothing leaked, no byte
where it must not be (scripts/soak.py prints the figures; docs/testing.md says how to run a long one)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# A consumer restarted while nixl pushes are granted to a live producer is left out: one-sided writes cannot be
# fenced by the receiver, and a producer that resumes after the consumer's quarantine can still post one
# (docs/testing.md, test_consumer_close_never_lets_a_granted_push_land_after_free).


@pytest.mark.timeout(150)
@pytest.mark.parametrize("transport", ["tcp", "nixl"])  # not ucx: its soak process took minutes to exit in CI
def test_short_soak_has_zero_faults(transport, tmp_path):
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "soak.py"),
            "--duration",
            "20",
            "--producers",
            "3",
            "--requests",
            "200",
            "--transport",
            transport,
            "--seed",
            "11",
            "--fault-every",
            "0.3",
            "--skip",
            "restart-under-load",
            "--json",
            str(out),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=140,
        env=env,
    )
    fig = json.loads(out.read_text()) if out.exists() else {}
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert fig["untyped"] == fig["hangs"] == fig["leaks"] == fig["corruption"] == 0, fig
    # enough requests that the faults hit live transfers (60 or more on an idle machine; 48 was seen beside two
    # vLLM servers on the same two cores), not a speed target
    assert fig["requests"] >= 30 and fig["arrived"] > 0, fig
    assert sum(fig["faults"].values()) >= 10, fig
