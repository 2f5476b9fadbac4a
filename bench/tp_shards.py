"""Tensor-parallel prefill into a tensor-parallel decode: aggregate GB/s of head-sharded multi-sender pushes.

    python bench/tp_shards.py [--transport tcp,nixl] [--prefill-tp 8] [--decode-tp 4] [--against 8]
                              [--consumers 2] [--tokens 4096] [--repeats 3]

The default shape is Llama-3-70B's KV cache (80 layers, 8 kv heads of 128, bf16, 16 tokens per block): each of
``prefill-tp`` producer processes holds its ranks' heads (one each at TP-8: 8 KiB per layer-block), and
``consumers`` of the ``decode-tp`` decode ranks (in this process; as many as the machine holds) each gather their
heads from the prefill ranks ``shard.sources`` names, all parts of all consumers at once. Every byte is checked
after the last repeat. GB/s counts the bytes that land in the consumers' blocks. ``--against`` runs the same
with another decode TP in the same run (default: the prefill's, the homogeneous case) and prints the ratio.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import numpy as np

from kvxfer import Consumer, KVLayout, Producer
from kvxfer.shard import heads_of, sources

LAYERS, HEADS, HEAD_DIM, BLOCK = 80, 8, 128, 16


def _cache(heads: tuple[int, int], blocks: int, fill: bool) -> list[np.ndarray]:
    """Per-layer ``[blocks, heads, BLOCK, K|V]`` bf16-sized caches; a head's bytes depend on (layer, head) only."""
    n = heads[1] - heads[0]
    out = []
    for layer in range(LAYERS):
        t = np.zeros((blocks, n, BLOCK, 2 * HEAD_DIM), np.uint16)
        if fill:
            for i, h in enumerate(range(*heads)):
                t[:, i] = (layer * 131 + h * 7 + np.arange(blocks)[:, None, None]) % 65521
        out.append(t)
    return out


def _layout(tensors, heads) -> KVLayout:
    return KVLayout.from_tensors(tensors, dims="BHND", heads=heads)


def _producer(conn, transport: str, rank: int, tp: int, blocks: int) -> None:
    held = heads_of(rank, tp, HEADS)
    tensors = _cache(held, blocks, fill=True)
    producer = Producer(_layout(tensors, held), transport=transport)
    conn.send("ready")
    while (cmd := conn.recv()) is not None:
        pushes = [
            producer.push(addr, req, np.arange(blocks), senders=senders, part=part, heads=hs, deadline=120)
            for addr, req, senders, part, hs in cmd
        ]
        for t in pushes:
            t.wait(150)
        conn.send("done")
    producer.close()


def run(transport: str, args, decode_tp: int) -> list[float]:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for r in range(args.prefill_tp):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_producer, args=(b, transport, r, args.prefill_tp, args.blocks), daemon=True)
        p.start()
        pipes.append(a)
        procs.append(p)
    for a in pipes:
        assert a.recv() == "ready"
    decode = []
    for c in range(min(args.consumers, decode_tp)):
        held = heads_of(c, decode_tp, HEADS)
        tensors = _cache(held, args.blocks, fill=False)
        decode.append((Consumer(_layout(tensors, held), transport=transport, deadline=120), tensors, held))
    rates = []
    try:
        for rep in range(args.repeats + 1):
            work: list[list] = [[] for _ in range(args.prefill_tp)]
            for c, (consumer, _, _) in enumerate(decode):
                parts = sources(c, decode_tp, args.prefill_tp, HEADS)
                for i, (r, hs) in enumerate(parts):
                    work[r].append((consumer.address, f"req-{rep}-{c}", len(parts), i, hs))
            start = time.perf_counter()
            for a, w in zip(pipes, work, strict=True):
                a.send(w)
            arrivals = [consumer.get(150) for consumer, _, _ in decode]
            elapsed = time.perf_counter() - start
            for a in pipes:
                assert a.recv() == "done"
            total = sum(len(x.block_ids) * c.layout.block_bytes for x, (c, _, _) in zip(arrivals, decode, strict=True))
            if rep:  # the first round opens the connections
                rates.append(total / elapsed / 1e9)
            if rep == args.repeats:
                for x, (_, tensors, held) in zip(arrivals, decode, strict=True):
                    want = _cache(held, args.blocks, fill=True)
                    assert all(np.array_equal(t[x.block_ids], w) for t, w in zip(tensors, want, strict=True))
            for x, (consumer, _, _) in zip(arrivals, decode, strict=True):
                consumer.release(x.req)
    finally:
        for a in pipes:
            a.send(None)
        for p in procs:
            p.join(30)
        for consumer, _, _ in decode:
            consumer.close()
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="tcp,nixl")
    ap.add_argument("--prefill-tp", type=int, default=8)
    ap.add_argument("--decode-tp", type=int, default=4)
    ap.add_argument("--against", type=int, default=None, help="decode TP to compare with (default: prefill TP)")
    ap.add_argument("--consumers", type=int, default=2, help="decode ranks to run (at most --decode-tp)")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    args.blocks = -(-args.tokens // BLOCK)
    args.consumers = min(args.consumers, args.decode_tp)
    per = LAYERS * BLOCK * 2 * HEAD_DIM * 2 * (HEADS // args.decode_tp) * args.blocks / 2**20
    print(
        f"Llama-3-70B KV, {args.tokens} tokens: prefill TP-{args.prefill_tp} ({args.prefill_tp} processes) into "
        f"{args.consumers} of {args.decode_tp} decode ranks, {per:.0f} MiB per decode rank"
    )
    against = args.prefill_tp if args.against is None else args.against
    for transport in args.transport.split(","):
        medians = []
        for d in dict.fromkeys([args.decode_tp, against]):
            rates = run(transport, args, d)
            medians.append(statistics.median(rates))
            print(
                f"{transport:5s} TP-{args.prefill_tp} -> TP-{d}: median {medians[-1]:.2f} GB/s  (each of "
                f"{len(rates)}: {', '.join(f'{r:.2f}' for r in rates)}), every byte checked"
            )
        if len(medians) == 2:
            print(f"{transport:5s} TP-{args.decode_tp} / TP-{against}: {medians[0] / medians[1]:.2f}x")


if __name__ == "__main__":
    main()
