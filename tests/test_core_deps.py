"""The transport core needs msgspec and numpy only: every module outside ``kvxfer.serving`` (and the vLLM
integration, which needs vLLM) imports in a process where the serving stack's packages cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import importlib, pkgutil, sys

    BLOCKED = {"starlette", "httpx", "uvicorn", "etcd3gw"}

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"{name} is not available to the core")
            return None

    sys.meta_path.insert(0, Block())
    import kvxfer
    skipped = ("kvxfer.serving", "kvxfer.integrations")
    names = [m.name for m in pkgutil.walk_packages(kvxfer.__path__, "kvxfer.") if not m.name.startswith(skipped)]
    for name in names:
        importlib.import_module(name)
    assert "kvxfer.runtime.service" in names and "kvxfer.transports.tcp" in names, names
    assert not BLOCKED & {m.split(".")[0] for m in sys.modules}
    print(len(names))
""")


def test_core_imports_without_the_serving_stack():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) > 10
