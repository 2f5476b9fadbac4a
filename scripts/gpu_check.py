"""GPU check: kvxfer's CUDA paths on a real GPU, every byte checked, speed beside same-run baselines.

Run on a GPU machine (one H200 here) with torch (CUDA), and nixl-cu12/cu13 and cupy where present:

    python scripts/gpu_check.py --json gpu.json

1. **pack**: the staging copy engine (``kvxfer.staging.cuda``) gathers random extents of device memory into
   pinned host memory and scatters them back, through the ``native/pack.cu`` kernel and through torch's indexed
   copies: every byte compared with a reference, then GB/s of packing fragmented pages beside a contiguous
   device-to-device copy of the same bytes.
2. **transfers**: producer and consumer are separate processes on one GPU, each with a Llama-3-8B-shaped cache
   (32 layers, 8 KV heads, head_dim 128, 16-token blocks, bf16; 256 blocks = 4k tokens = 512 MiB) in CUDA
   memory, as vLLM lays it out (``KBNHD``: [2, num_blocks, 16, 8, 128] per layer) and as HND views. NIXL
   (VRAM registration, CUDA IPC / cuda_copy through UCX) and TCP (through pinned staging) push and pull
   sequential and permuted blocks. The consumer checks its blocks with a position-weighted 64-bit digest per
   block (any changed word changes it) against the producer's, and that every other block still holds its
   sentinel. GB/s sit beside a torch device-to-device copy of the same bytes (NIXL) and beside TCP from pinned
   host memory of the same layout (TCP).

Without a GPU only the host-memory rows run (a dry run of the plumbing). Exit status 1 on any wrong byte or
failed section.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

LAYERS, HEADS, BS, HD = 32, 8, 16, 128
SENTINEL = 0x5A
SHAPES = {"kv_nhd": "KBNHD", "hnd": "BHND"}


def _shape(kind: str, num_blocks: int) -> tuple[int, ...]:
    return (2, num_blocks, BS, HEADS, HD) if kind == "kv_nhd" else (num_blocks, HEADS, BS, 2 * HD)


def _bdim(kind: str) -> int:
    return SHAPES[kind].index("B")


def _caches(kind: str, num_blocks: int, where: str, seed: int | None) -> list:
    """Per-layer bf16 tensors on ``where`` ("cuda" or "host", pinned when CUDA is there): seeded random, or
    the sentinel byte when ``seed`` is None."""
    import torch

    cuda = where == "cuda"
    out = []
    for i in range(LAYERS):
        if cuda:
            t = torch.empty(_shape(kind, num_blocks), dtype=torch.bfloat16, device="cuda")
        else:
            t = torch.empty(_shape(kind, num_blocks), dtype=torch.bfloat16, pin_memory=torch.cuda.is_available())
        if seed is None:
            t.view(torch.uint8).fill_(SENTINEL)
        else:
            g = torch.Generator(device=t.device)
            g.manual_seed(seed + i)
            t.view(torch.int16).random_(-32768, 32767, generator=g)
        out.append(t)
    return out


def _weights(n: int, device):
    import torch

    g = torch.Generator().manual_seed(1234)
    w = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, generator=g) * 2 + 1  # odd: no word cancels
    return w.to(device)


def digests(caches: list, kind: str, ids) -> list[list[int]]:
    """Per layer, per block in ``ids`` order: the position-weighted int64 sum of the block's bytes."""
    import torch

    b = _bdim(kind)
    idx = torch.as_tensor(list(ids), device=caches[0].device)
    out = []
    w = None
    for t in caches:
        blocks = t.index_select(b, idx).movedim(b, 0).contiguous().view(len(ids), -1).view(torch.int64)
        if w is None:
            w = _weights(blocks.shape[1], t.device)
        out.append((blocks * w).sum(1).tolist())
    return out


def stray(caches: list, kind: str, ids) -> int:
    """Blocks outside ``ids`` that no longer hold only the sentinel."""
    import torch

    b = _bdim(kind)
    bad = None
    for t in caches:
        per = (t.view(torch.uint8) != SENTINEL).movedim(b, 0).reshape(t.shape[b], -1).any(1)
        bad = per if bad is None else bad | per
    assert bad is not None
    bad[torch.as_tensor(list(ids), device=bad.device)] = False
    return int(bad.sum())


def _layout(caches: list, kind: str):
    from kvxfer import KVLayout

    return KVLayout.from_tensors(caches, dims=SHAPES[kind])


def _consumer(conn, transport: str, kind: str, num_blocks: int, where: str, options: dict) -> None:
    import torch

    from kvxfer import Consumer

    caches = _caches(kind, num_blocks, where, None)
    c = Consumer(_layout(caches, kind), transport=transport, deadline=60, transport_options=options)
    conn.send(c.address)
    while conn.recv() == "get":
        a = c.get(60)
        if where == "cuda":
            torch.cuda.synchronize()
        ids = a.block_ids.tolist()
        conn.send((a.req, ids, digests(caches, kind, ids), stray(caches, kind, ids)))
        b = _bdim(kind)
        idx = torch.as_tensor(ids, device=caches[0].device)
        for t in caches:
            t.view(torch.uint8).index_fill_(b, idx, SENTINEL)
        c.release(a.req)
    c.close()
    conn.send("closed")


def transfers(transport, kind, where, blocks, repeats, options, label, modes, patterns) -> list[dict]:
    """Push and pull, sequential and permuted, into a consumer process; every block's digest compared."""
    import numpy as np
    import torch

    from kvxfer import Producer

    num_blocks = 2 * blocks
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child, transport, kind, num_blocks, where, options), daemon=True)
    proc.start()
    rows = []
    p = None
    try:
        address = _first(parent, proc, "consumer")
        caches = _caches(kind, num_blocks, where, seed=7)
        layout = _layout(caches, kind)
        if where == "cuda":
            assert layout.device >= 0 and all(r.mem_type == "VRAM" for r in layout.regions)
        p = Producer(layout, transport=transport, deadline=60, transport_options=options)
        nbytes = blocks * layout.block_bytes
        rng = np.random.default_rng(0)
        for mode in modes:
            for pattern in patterns:
                times, ok, strays = [], True, 0
                for r in range(repeats + 1):
                    ids = np.arange(blocks) if pattern == "sequential" else rng.permutation(num_blocks)[:blocks]
                    if where == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    getattr(p, "push" if mode == "push" else "offer")(address, f"{mode}-{pattern}-{r}", ids).wait(60)
                    elapsed = time.perf_counter() - start
                    parent.send("get")
                    _, dst_ids, got, n_stray = parent.recv()
                    ok &= got == digests(caches, kind, ids.tolist()) and len(dst_ids) == blocks
                    strays += n_stray
                    if r:
                        times.append(elapsed)
                gbps = nbytes / float(np.median(times)) / 1e9
                row = {
                    "case": label,
                    "transport": transport,
                    "memory": where,
                    "layout": kind,
                    "mode": mode,
                    "pattern": pattern,
                    "bytes": nbytes,
                    "gbps": round(gbps, 2),
                    "bytes_ok": bool(ok and strays == 0),
                    "stray_blocks": strays,
                }
                rows.append(row)
                print(f"  {label:30} {mode:4} {pattern:10} {gbps:8.2f} GB/s  bytes ok: {row['bytes_ok']}", flush=True)
        parent.send("stop")
        parent.poll(30) and parent.recv()
    finally:
        if p is not None:
            p.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def _first(conn, proc, what: str, timeout: float = 120.0):
    """The first message of a child process; an error as soon as it died or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"{what} exited with status {proc.exitcode} before it was ready")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f} s")
    return conn.recv()


def _raw_target(conn, nbytes: int, where: str) -> None:
    """A bare NIXL agent over one buffer, progressing until told to stop (the raw baseline's other side)."""
    import torch

    from kvxfer.transports.nixl import nixl_api

    api = nixl_api()
    cuda = where == "cuda"
    buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    agent = api.nixl_agent(f"raw-target-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
    mem = "VRAM" if cuda else "DRAM"
    agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], mem)
    conn.send((agent.get_agent_metadata(), buf.data_ptr()))
    while not conn.poll(0.001):
        agent.get_new_notifs()
    conn.recv()
    conn.send("done")


def raw_nixl(where: str, nbytes: int, repeats: int) -> list[dict]:
    """NIXL called directly, no kvxfer: WRITE and READ between two processes' buffers, as 8 MiB descriptors in
    order and as 32 KiB descriptors in a random order (kvxfer's NIXL rows over the same bytes compare to it)."""
    import numpy as np
    import torch

    from kvxfer.transports.nixl import nixl_api

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_target, args=(child, 2 * nbytes, where), daemon=True)
    proc.start()
    rows = []
    try:
        meta, rptr = _first(parent, proc, "raw NIXL target")
        api = nixl_api()
        cuda = where == "cuda"
        buf = torch.empty(2 * nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
        agent = api.nixl_agent(f"raw-init-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
        mem = "VRAM" if cuda else "DRAM"
        agent.register_memory([(buf.data_ptr(), 2 * nbytes, 0, "")], mem)
        peer = agent.add_remote_agent(meta)
        rng = np.random.default_rng(5)
        for pattern, piece in (("sequential", 8 << 20), ("permuted", 32 << 10)):
            n = nbytes // piece
            local = np.arange(n, dtype=np.uint64) * np.uint64(piece) + np.uint64(buf.data_ptr())
            remote = rng.permutation(2 * n)[:n].astype(np.uint64) * np.uint64(piece) + np.uint64(rptr)
            if pattern == "sequential":
                remote = np.arange(n, dtype=np.uint64) * np.uint64(piece) + np.uint64(rptr)
            ones = np.full(n, piece, dtype=np.uint64)
            zeros = np.zeros(n, dtype=np.uint64)
            ldesc = agent.get_xfer_descs(np.stack([local, ones, zeros], 1), mem)
            rdesc = agent.get_xfer_descs(np.stack([remote, ones, zeros], 1), mem)
            for op in ("WRITE", "READ"):
                times = []
                for r in range(repeats + 1):
                    start = time.perf_counter()
                    handle = agent.initialize_xfer(op, ldesc, rdesc, peer, b"")
                    state = agent.transfer(handle)
                    while state == "PROC":
                        if time.perf_counter() - start > 30:
                            raise TimeoutError(f"raw NIXL {op} still running after 30 s")
                        state = agent.check_xfer_state(handle)
                    if state != "DONE":
                        raise RuntimeError(f"raw NIXL {op} ended {state}")
                    agent.release_xfer_handle(handle)
                    if r:
                        times.append(time.perf_counter() - start)
                gbps = nbytes / float(np.median(times)) / 1e9
                mode = "push" if op == "WRITE" else "pull"
                rows.append(
                    {"case": "nixl-raw", "memory": where, "mode": mode, "pattern": pattern, "gbps": round(gbps, 2)}
                )
                print(f"  raw NIXL {where} {op:5} {pattern:10} ({n} descriptors) {gbps:8.2f} GB/s", flush=True)
        parent.send("stop")
        parent.poll(30) and parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return rows


def _gbps(run, nbytes: int, repeats: int, stream=None) -> float:
    """GB/s of ``run`` moving ``nbytes``: once to warm up, then ``repeats`` times between two device
    synchronisations, each issued on ``stream`` (None: the current one)."""
    import torch

    with torch.cuda.stream(stream):
        run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        with torch.cuda.stream(stream):
            run()
    torch.cuda.synchronize()
    return nbytes * repeats / (time.perf_counter() - start) / 1e9


def d2d_gbps(nbytes: int, repeats: int = 20) -> float:
    """A torch device-to-device copy of ``nbytes`` (bytes copied per second, each byte counted once)."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _gbps(functools.partial(dst.copy_, src), nbytes, repeats)


def _slices(mem: list, ext):
    """The bytes of ``ext`` in order, cut from the tensors ``mem`` one slice per extent (the reference)."""
    import torch

    parts = zip(ext.region.tolist(), ext.offset.tolist(), ext.nbytes.tolist(), strict=True)
    return torch.cat([mem[r][o : o + k] for r, o, k in parts])


def pack_checks(repeats: int) -> list[dict]:
    """The staging engine, both packers: exact bytes on random extents, then packing speed for page sizes."""
    import numpy as np
    import torch

    from kvxfer.memory import Region
    from kvxfer.plan import Extents
    from kvxfer.staging.cuda import CudaEngine

    rows = []
    size = 1 << 30
    mem = [torch.randint(0, 256, (size,), dtype=torch.uint8, device="cuda") for _ in range(2)]
    regions = [Region(t.data_ptr(), size, 0) for t in mem]
    rng = np.random.default_rng(3)
    packers = ["kernel", "torch"]
    for packer in packers:
        try:
            engine = CudaEngine(regions, 0, packer=packer)
        except Exception as e:
            print(f"  pack {packer}: unavailable ({e})", flush=True)
            rows.append({"case": "pack", "packer": packer, "error": str(e)})
            continue
        for grain in (1, 2, 16, 4096):
            n = 300
            units = (size // 2) // grain
            starts = np.sort(rng.choice(units - 64, n, replace=False)) * grain
            lens = rng.integers(1, 64, n) * grain
            lens = np.minimum(lens, np.diff(np.append(starts, size // 2)))
            order = rng.permutation(n)
            ext = Extents(rng.integers(0, 2, n)[order], starts[order], lens[order])
            ref = _slices(mem, ext)
            slot = engine.slot(ext.total)
            engine.gather(ext, slot).wait()
            ok = bool(torch.equal(slot.extra["host"][: ext.total], ref.cpu()))
            fresh = torch.randint(0, 256, (ext.total,), dtype=torch.uint8)
            slot.extra["host"][: ext.total].copy_(fresh)
            engine.scatter(slot, ext).wait()
            back = _slices(mem, ext)
            ok &= bool(torch.equal(back.cpu(), fresh))
            rows.append({"case": "pack-bytes", "packer": packer, "grain": grain, "bytes_ok": ok})
            print(f"  pack {packer:6} grain {grain:5}: bytes ok: {ok}", flush=True)
        total = 256 << 20
        for page in (4096, 16384, 65536):
            n = total // page
            ids = rng.permutation(size // page)[:n]
            ext = Extents(np.zeros(n, dtype=np.int64), ids.astype(np.int64) * page, np.full(n, page))
            slot = engine.slot(total)
            stream = slot.extra["stream"]
            dev = slot.extra["dev"]
            steps = {
                "pack": functools.partial(engine._pack, ext, dev.data_ptr(), True, slot),
                "gather": functools.partial(engine.gather, ext, slot),
            }
            for step, run in steps.items():
                gbps = _gbps(run, total, repeats, stream)
                rows.append({"case": step, "packer": packer, "page": page, "bytes": total, "gbps": round(gbps, 1)})
                print(f"  {step:6} {packer:6} {page // 1024:3} KiB pages: {gbps:8.1f} GB/s", flush=True)
    d2d = d2d_gbps(256 << 20)
    rows.append({"case": "d2d", "bytes": 256 << 20, "gbps": round(d2d, 1)})
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    d2h = _gbps(functools.partial(host.copy_, dev, non_blocking=True), 256 << 20, repeats)
    rows.append({"case": "d2h-pinned", "bytes": 256 << 20, "gbps": round(d2h, 1)})
    print(f"  torch d2d {d2d:.1f} GB/s, d2h pinned {d2h:.1f} GB/s (256 MiB contiguous)", flush=True)
    del mem
    torch.cuda.empty_cache()
    return rows


def _ratios(rows: list[dict]) -> list[str]:
    """Each transfer row beside its baseline: NIXL over the d2d copy, TCP-from-CUDA over TCP-from-pinned."""
    lines = []

    def key(r):
        return r["transport"], r.get("streams"), r["layout"], r["mode"], r["pattern"]

    base = {key(r): r for r in rows if r.get("memory") == "host" and "transport" in r}
    d2d = next((r["gbps"] for r in rows if r.get("case") == "d2d-request"), None)
    gpu = any(r.get("memory") == "cuda" for r in rows)
    for r in rows:
        if "transport" not in r or r["memory"] != ("cuda" if gpu else "host"):
            continue
        raw = next(
            (x for x in rows if x.get("case") == "nixl-raw" and (x["mode"], x["pattern"]) == (r["mode"], r["pattern"])),
            None,
        )
        if r["transport"] == "nixl" and raw:
            r["ratio_vs_raw_nixl"] = round(r["gbps"] / raw["gbps"], 3)
            lines.append(f"{r['case']:30} {r['mode']:4} {r['pattern']:10} {r['ratio_vs_raw_nixl']:.3f}x raw NIXL")
        if r["transport"] == "nixl" and d2d:
            r["ratio_vs_d2d"] = round(r["gbps"] / d2d, 3)
            what = f"{r['case']:30} {r['mode']:4} {r['pattern']:10} {r['gbps']:8.2f} GB/s"
            lines.append(f"{what}  {r['ratio_vs_d2d']:.3f}x d2d")
        b = base.get(key(r))
        if r["transport"] == "tcp" and b and r["memory"] == "cuda":  # host rows are the baseline itself
            r["ratio_vs_pinned"] = round(r["gbps"] / b["gbps"], 3)
            lines.append(
                f"{r['case']:30} {r['mode']:4} {r['pattern']:10} {r['gbps']:8.2f} GB/s  "
                f"{r['ratio_vs_pinned']:.3f}x tcp from pinned ({b['gbps']:.2f})"
            )
    return lines


def _wanted(only: str, label: str) -> bool:
    return not only or any(label.startswith(w) for w in only.split(","))


def _cases(args, gpu: bool) -> list[tuple[str, str, str, str, dict]]:
    """(label, transport, layout, memory, transport options): CUDA rows first, then their host baselines."""
    out = []
    stages = [tuple(int(x) for x in st.split(":")) for st in args.stages.split(",")]
    for transport in [t for t in args.transports.split(",") if t]:
        for where in ("cuda", "host") if gpu else ("host",):
            if transport == "nixl" and where == "host" and gpu:
                continue  # the NIXL baseline is the d2d copy
            for kind in SHAPES:
                if transport == "tcp" and where == "host" and kind != "kv_nhd" and gpu:
                    continue
                for streams in (1, 4) if transport == "tcp" else (None,):
                    base = {} if streams is None else {"streams": streams}
                    staged = transport == "tcp" and where == "cuda"
                    for chunk, depth in stages if staged else [(0, 0)]:
                        opts = dict(base, stage_chunk=chunk << 20, stage_depth=depth) if staged else base
                        label = f"{transport}{'' if streams is None else f'x{streams}'} {where} {kind}"
                        label += f" {chunk}M:{depth}" if staged else ""
                        out.append((label, transport, kind, where, opts))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks per request (256 = 4k tokens, 512 MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--transports", default="nixl,tcp")
    ap.add_argument("--json", help="write every row here (rewritten after each section)")
    ap.add_argument("--only", default="", help="comma-separated section name prefixes (default: all)")
    ap.add_argument("--stages", default="16:2", help="TCP staging from CUDA, as chunk MiB:depth, comma-separated")
    ap.add_argument("--modes", default="push,pull")
    ap.add_argument("--patterns", default="sequential,permuted")
    args = ap.parse_args(argv)
    import torch

    from kvxfer import transports

    gpu = torch.cuda.is_available()
    have = transports.available()
    print(f"torch {torch.__version__}, GPU: {torch.cuda.get_device_name(0) if gpu else 'none'}, transports {have}")
    rows: list[dict] = []
    failed: list[str] = []

    def save():
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=2)

    def section(name, fn, *a):
        print(f"== {name}", flush=True)
        try:
            rows.extend(fn(*a))
        except Exception:
            traceback.print_exc()
            failed.append(name)
        save()

    nbytes = args.blocks * 2 * LAYERS * BS * HEADS * HD * 2
    if gpu and _wanted(args.only, "pack"):
        section("pack", pack_checks, args.repeats)
    if gpu:
        rows.append({"case": "d2d-request", "bytes": nbytes, "gbps": round(d2d_gbps(nbytes), 1)})
    if "nixl" in have and _wanted(args.only, "nixl raw"):
        where = "cuda" if gpu else "host"
        section(f"nixl raw {where}", raw_nixl, where, nbytes, args.repeats)
    for label, transport, kind, where, options in _cases(args, gpu):
        if not _wanted(args.only, label):
            continue
        if transport not in have:
            print(f"== {label}: {transport} not available here")
            failed.append(label)
            continue

        def run(t=transport, k=kind, w=where, o=options, lbl=label):
            out = transfers(t, k, w, args.blocks, args.repeats, o, lbl, args.modes.split(","), args.patterns.split(","))
            for r in out:
                r.update(streams=o.get("streams"), stage=o.get("stage_chunk", 0) >> 20, depth=o.get("stage_depth"))
            return out

        section(label, run)
    print("== summary")
    for line in _ratios(rows):
        print(line)
    save()
    bad = [r for r in rows if r.get("bytes_ok") is False]
    for r in bad:
        print("WRONG BYTES:", r)
    if failed:
        print("FAILED SECTIONS:", failed)
    print("ok" if not bad and not failed else "NOT OK", flush=True)
    return 0 if not bad and not failed else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # NIXL's native teardown can crash after a finished run (docs/transports.md)
