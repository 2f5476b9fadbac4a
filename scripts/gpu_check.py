"""GPU check for the NIXL path: CUDA tensors register as VRAM and move between two processes on one GPU.

Run on a GPU machine (one H200 here) with torch (CUDA) and nixl-cu12/cu13 importable:

    python scripts/gpu_check.py --json gpu.json

Producer and consumer are separate processes, each with a Llama-3-8B-shaped per-layer cache in CUDA memory
(bf16, [num_blocks, 8, 16, 256] HND views). It pushes (NIXL WRITE) and pulls (NIXL READ) permuted and
sequential blocks, checks every byte on the GPU, and prints GB/s beside a torch device-to-device copy of
the same bytes. Exit status 1 on any wrong byte.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

LAYERS, HEADS, BS, C = 32, 8, 16, 256


def _caches(num_blocks: int, seed: int | None):
    import torch

    g = torch.Generator(device="cuda")
    out = {}
    for i in range(LAYERS):
        t = torch.empty((num_blocks, HEADS, BS, C), dtype=torch.bfloat16, device="cuda")
        if seed is None:
            t.zero_()
        else:
            g.manual_seed(seed + i)
            t.view(torch.int16).random_(-32768, 32767, generator=g)
        out[f"layer{i}"] = t
    return out


def _consumer(conn, num_blocks: int) -> None:
    import torch

    from kvxfer import Consumer, KVLayout

    caches = _caches(num_blocks, None)
    c = Consumer(KVLayout.from_tensors(caches), transport="nixl", deadline=60)
    conn.send(c.address)
    while True:
        cmd = conn.recv()
        if cmd == "stop":
            break
        a = c.get(60)
        torch.cuda.synchronize()
        # per-block checksums of every layer, in arrival order, for the producer to compare
        idx = torch.as_tensor(a.block_ids, device="cuda")
        sums = [caches[k][idx].view(torch.int16).long().sum(dim=(1, 2, 3)).tolist() for k in caches]
        conn.send((a.req, a.block_ids.tolist(), sums))
        c.release(a.req)
    c.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks per request (256 = 4k tokens, 512 MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    import numpy as np
    import torch

    from kvxfer import KVLayout, Producer

    num_blocks = 2 * args.blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, num_blocks), daemon=True)
    proc.start()
    address = parent.recv()
    caches = _caches(num_blocks, seed=1)
    layout = KVLayout.from_tensors(caches)
    assert layout.device >= 0 and all(r.mem_type == "VRAM" for r in layout.regions)
    p = Producer(layout, transport="nixl", deadline=60)
    nbytes = args.blocks * layout.block_bytes
    src_flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst_flat = torch.empty_like(src_flat)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.repeats):
        dst_flat.copy_(src_flat)
    torch.cuda.synchronize()
    d2d = nbytes * args.repeats / (time.perf_counter() - t0) / 1e9
    rows, ok = [], True
    rng = np.random.default_rng(0)
    for mode in ("push", "pull"):
        for pattern in ("sequential", "permuted"):
            times = []
            for r in range(args.repeats + 1):
                ids = np.arange(args.blocks) if pattern == "sequential" else rng.permutation(num_blocks)[: args.blocks]
                start = time.perf_counter()
                getattr(p, "push" if mode == "push" else "offer")(address, f"{mode}-{pattern}-{r}", ids).wait(60)
                elapsed = time.perf_counter() - start
                parent.send("next")
                _, _, sums = parent.recv()
                idx = torch.as_tensor(ids, device="cuda")
                want = [t[idx].view(torch.int16).long().sum(dim=(1, 2, 3)).tolist() for t in caches.values()]
                ok &= sums == want
                if r:
                    times.append(elapsed)
            gbps = nbytes / float(np.median(times)) / 1e9
            rows.append(
                {
                    "mode": mode,
                    "pattern": pattern,
                    "bytes": nbytes,
                    "gbps": round(gbps, 2),
                    "d2d_gbps": round(d2d, 2),
                    "ratio_vs_d2d": round(gbps / d2d, 3),
                    "bytes_ok": ok,
                }
            )
            print(f"{mode:5} {pattern:10} {gbps:8.2f} GB/s  (torch d2d {d2d:.1f} GB/s)  bytes ok: {ok}")
    parent.send("stop")
    proc.join(30)
    p.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
