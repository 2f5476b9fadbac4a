"""Every command-line script of scripts/ and bench/ starts: ``--help`` exits 0, run from another directory.

They import the end-to-end harness (tests/e2e) and the tiny-model maker by path, which a move inside tests/ broke
once without any test noticing (``pd_latency.py`` and ``serving_ttft.py`` died on their imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for d in ("scripts", "bench") for p in (ROOT / d).glob("*.py") if "argparse" in p.read_text())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_script_answers_help(script: Path, tmp_path: Path):
    r = subprocess.run(
        [sys.executable, str(script), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout
