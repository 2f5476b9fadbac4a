"""vLLM P/D through each connector on one shape: vLLM 0.33's own NixlConnector beside KVXferConnector.

    python bench/vllm_connectors.py [--tokens 32768] [--pattern shuffled,sequential] [--repeats 3]
                                    [--connectors nixl-connector,kvxfer-nixl,kvxfer-tcp] [--json PATH]

Two real vLLM 0.33 schedulers in this process, each with its connector's worker half driven by vLLM's own
``KVConnectorModelRunnerMixin`` over vLLM-allocated CPU KV tensors (the tests' harness,
``tests/vllm/vllm_harness.py``), shaped as one Llama-3-70B TP-8 shard: 80 layers, one kv head of 128, bf16, 32
tokens per block, so every block is 80 pages of 16 KiB (NixlConnector's CPU worker takes block sizes in multiples
of 32 only: the 8 KiB pages of 16-token blocks are a GPU shape it cannot run here). The prefill holds a prompt
(``max_tokens=1``), the decode instance loads it into the blocks its scheduler allocated, exactly as each connector
does in a server; a load is timed from the decode request's arrival to its ``finished_recving`` (both engines
stepping, as two servers would), after one small untimed load that makes each connector's connections. GB/s counts
the prompt's KV. ``shuffled``: both block pools' free lists are shuffled first, so a request's blocks
are scattered pages, as in a server that has run a while; ``sequential``: fresh pools, consecutive blocks.

The attention is a no-op (what is timed is the load), so the prefill's cache holds random bytes and the decode's
starts zeroed: after the first load of each connector and pattern every loaded block is compared with the
prefill's, and a mismatch is an error (exit 1). The ratio column is each connector's GB/s over NixlConnector's,
same pattern, same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS, KV_HEADS, HEAD, BLOCK = 80, 1, 128, 32
CONNECTORS = ("nixl-connector", "kvxfer-nixl", "kvxfer-tcp")


def _model_dir(tokens: int) -> str:
    """A config-only Llama of the shard's KV shape (no weights: nothing is computed)."""
    d = tempfile.mkdtemp(prefix="kvxfer-bench-model-")
    cfg = json.loads((ROOT / "tests/vllm/tiny-llama/config.json").read_text())
    cfg.update(
        num_hidden_layers=LAYERS,
        num_key_value_heads=KV_HEADS,
        num_attention_heads=8,
        head_dim=HEAD,
        hidden_size=8 * HEAD,
        max_position_embeddings=max(4096, tokens + 256),
    )
    (Path(d) / "config.json").write_text(json.dumps(cfg))
    return d


def _harness(tokens: int):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    sys.path[:0] = [str(ROOT / "tests/vllm"), str(ROOT / "tests")]
    import vllm_harness as vh

    vh.MODEL_DIR = _model_dir(tokens)
    vh.LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    vh.KV_HEADS, vh.HEAD = KV_HEADS, HEAD
    vh.Worker._attention = lambda self, li, name, so, starts: None  # the load is timed, not the model
    if not vh.nixl_alias():
        raise SystemExit("NIXL (nixl-cu13) is not importable: pip install -e '.[nixl]'")
    return vh


def _pair(vh, name: str, blocks: int, tokens: int):
    """A prefill and a decode engine with connector ``name``."""
    from vllm.config import KVTransferConfig

    kw = dict(block=BLOCK, num_blocks=blocks, max_batched=8192, max_model_len=tokens + 64)
    if name == "nixl-connector":

        def ktc(role: str) -> KVTransferConfig:
            return KVTransferConfig(kv_connector="NixlConnector", kv_role=role, kv_buffer_device="cpu")

        engines = []
        for role in ("kv_producer", "kv_consumer"):
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(vh.free_port())
            engines.append(vh.Engine(ktc(role), setup=vh.init_single_process_world, **kw))
        for e in engines:  # what vLLM's engine core does with the workers' handshake metadata
            md = e.worker.connector.get_handshake_metadata()
            e.sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): md})
        return engines
    transport = name.split("-", 1)[1]
    common = {"transport": transport, "deadline": 120, "lease": 120}
    p = vh.Engine(vh.kvxfer_ktc(role="kv_producer", listen=f"127.0.0.1:{vh.free_port()}", **common), **kw)
    d = vh.Engine(vh.kvxfer_ktc(role="kv_consumer", **common), **kw)
    return [p, d]


def _shuffle(e, rng: random.Random) -> None:
    q = e.sched.kv_cache_manager.block_pool.free_block_queue
    free = q.popleft_n(q.num_free_blocks)
    rng.shuffle(free)
    q.append_n(free)


def _load(vh, p, d, rid: str, tokens: int, seed: int, nixl: bool) -> float:
    """Prefill (held), then the decode request: seconds from its arrival to its finished_recving."""
    claim = {"do_remote_decode": True} if nixl else {"kvxfer": {}}
    p.add(vh.make_request(f"p-{rid}", tokens, 1, claim, seed=seed))
    p.run(timeout=300, until=lambda e: "kv_transfer_params" in e.outputs.get(f"p-{rid}", {}))
    params = p.outputs[f"p-{rid}"]["kv_transfer_params"]
    t0 = time.perf_counter()
    d.add(vh.make_request(f"d-{rid}", tokens, 1, params, seed=seed))
    while f"d-{rid}" not in d.finished_recving:
        if time.perf_counter() - t0 > 300:
            raise SystemExit(f"{rid}: not loaded after 300 s")
        for e in (d, p):
            e.step()
    seconds = time.perf_counter() - t0
    vh.run_both(p, d, timeout=300)
    if d.load_errors or d.failed_recving or d.first_computed.get(f"d-{rid}", 0) < tokens - BLOCK:
        raise SystemExit(f"{rid}: the load failed (decode computed from token {d.first_computed.get(f'd-{rid}')})")
    return seconds


def _check(vh, p, d, rid: str) -> int:
    """Every full loaded block of the decode equals the prefill's; the number of blocks compared."""
    import torch

    n = d.first_computed[f"d-{rid}"] // BLOCK
    src = torch.tensor(p.worker.tables_seen[f"p-{rid}"][:n])
    dst = torch.tensor(d.worker.tables_seen[f"d-{rid}"][:n])
    for name in vh.LAYERS:  # bit for bit (random bf16 bits hold NaNs, which equal nothing)
        a, b = p.worker.kv_caches[name][src], d.worker.kv_caches[name][dst]
        if not torch.equal(a.view(torch.int16), b.view(torch.int16)):
            raise SystemExit(f"{rid}: layer {name}: the decode's blocks differ from the prefill's")
    return n


def _isolated(name: str, pattern: str, args) -> dict:
    """One connector's row, measured by this script in a process of its own: in one process kvxfer over NIXL
    run after NixlConnector loaded in 550-595 ms, against 340-360 ms first (NixlConnector: 657-770 either way)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--connectors", name, "--pattern", pattern]
        cmd += ["--tokens", str(args.tokens), "--repeats", str(args.repeats), "--json", out.name, "--quiet"]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit(f"{name} {pattern}: its run failed")
        return json.loads(Path(out.name).read_text())[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--pattern", default="shuffled,sequential")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--json", default="")
    ap.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)  # a child of _isolated: no table
    args = ap.parse_args(argv)
    names = [c for c in args.connectors.split(",") if c]
    if unknown := set(names) - set(CONNECTORS):
        ap.error(f"unknown connectors {sorted(unknown)}; choose from {CONNECTORS}")
    isolate = len(names) > 1  # each connector in a fresh process, as in a server
    vh = None if isolate else _harness(args.tokens)
    nblocks = -(-args.tokens // BLOCK)
    nbytes = nblocks * LAYERS * KV_HEADS * BLOCK * 2 * HEAD * 2
    print(
        f"Llama-3-70B TP-8 shard: {LAYERS} layers x {KV_HEADS} kv head x {HEAD}, bf16, {BLOCK} tokens per block "
        f"({BLOCK * 2 * HEAD * 2 // 1024} KiB pages); {args.tokens} tokens = {nbytes / 2**20:.0f} MiB per request; "
        f"{args.repeats} repeats"
    )
    rows = []
    for pattern in args.pattern.split(","):
        for name in names:
            if isolate:
                rows.append(_isolated(name, pattern, args))
                continue
            p, d = _pair(vh, name, nblocks + 64, args.tokens)
            try:
                for e in (p, d):
                    if pattern == "shuffled":
                        _shuffle(e, random.Random(7))
                for t in {id(t): t for t in d.worker.kv_caches.values()}.values():
                    t.zero_()
                _load(vh, p, d, f"{name}-{pattern}-warmup", 4 * BLOCK, seed=1000, nixl=name == "nixl-connector")
                times = []  # connections and handshakes are made: each connector's steady state
                for r in range(args.repeats):
                    rid = f"{name}-{pattern}-{r}"
                    times.append(_load(vh, p, d, rid, args.tokens, seed=r + 1, nixl=name == "nixl-connector"))
                    if r == 0:
                        _check(vh, p, d, rid)
                    print(f"  {name:15} {pattern:10} load {times[-1] * 1e3:8.1f} ms", flush=True)
            finally:
                p.close()
                d.close()
            med = statistics.median(times)
            rows.append({"connector": name, "pattern": pattern, "ms": med * 1e3, "gbps": nbytes / med / 1e9})
    if args.quiet:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        return 0
    print("\n| pattern | connector | median load ms | GB/s | vs NixlConnector |\n|---|---|---|---|---|")
    for row in rows:
        base = next((b for b in rows if b["pattern"] == row["pattern"] and b["connector"] == "nixl-connector"), None)
        row["ratio"] = row["gbps"] / base["gbps"] if base else None
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] is not None else "-"
        print(f"| {row['pattern']} | {row['connector']} | {row['ms']:.1f} | {row['gbps']:.2f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
