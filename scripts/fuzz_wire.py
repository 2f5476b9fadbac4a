"""Fuzz the wire decoder: every input must decode or raise ``ProtocolError``, nothing else, and quickly.

Inputs: random bytes; mutations of valid encodings of every message type (flips, inserts, deletes,
truncations, splices, repeated slices); structure-aware variants (every integer replaced by a boundary value,
fields of the wrong type, unknown fields, the tag moved); deep nesting of arrays and maps anywhere; and frame
headers for ``frame_length``. Prints the inputs tried, the outcomes by class, the untyped exceptions (must be 0)
and the slowest decode; exits 1 if any input raised something other than ``ProtocolError``.

    python scripts/fuzz_wire.py --n 1000000 [--seed 1] [--max-seconds 900]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import heapq
import itertools
import random
import sys
import time

import msgspec

from kvxfer import wire
from kvxfer.errors import KVXferError

BOUNDARY = [-(2**63), -(2**32), -2, -1, 0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
SLOWEST = 50  # inputs kept for re-timing: one slow decode in a run may be the machine, not the input
CONTAINERS = [
    b"\x91",
    b"\x81\xa1k",
    b"\xdc\x00\x01",
    b"\xdd\x00\x00\x00\x01",
    b"\xde\x00\x01\xa1k",
    b"\xdf\x00\x00\x00\x01\xa1k",
    b"\x9f",
    b"\x8f",
]


def corpus() -> list[wire._Msg]:
    """Valid messages of every type, with meta, multi-sender fields and a layout."""
    fp = wire.Fingerprint(
        version=wire.VERSION,
        dtype="bfloat16",
        block_size=16,
        num_layers=2,
        layer_bytes=4096,
        block_bytes=8192,
        order="L2 N16 H2 D64",
    )
    lay = wire.LayoutDesc(
        num_blocks=64,
        regions=[wire.RegionDesc(1 << 40, 1 << 20, -1), wire.RegionDesc(0, 64, 0)],
        seg_region=[0, 0, 1],
        seg_offset=[0, 4096, 0],
        seg_stride=[8192, 8192, 1],
        seg_bytes=[4096, 4096, 1],
        fingerprint=fp,
    )
    ids = wire.ids_to_bytes([3, 1, 4, 1 << 20])
    meta = {
        "num_tokens": 4096,
        "first_token": 7,
        "sampling": {"temperature": 0.7, "stop": ["</s>"], "seed": None},
        "trace": "abc",
        "nested": [[1, 2], {"a": [True, 1.5]}],
    }
    return [
        wire.Hello(version=wire.VERSION, peer_id="prefill-0", nonce=b"\x02" * 32),
        wire.Challenge(version=wire.VERSION, peer_id="decode-0", nonce=b"\x03" * 32, proof=b"\x04" * 32),
        wire.Proof(proof=b"\x05" * 32, layout=lay, transports=[("nixl", b"\x01" * 40), ("tcp", b"")]),
        wire.Welcome(
            session=7, layout=lay, transport="nixl", transport_meta=b"\x01" * 40, mac=b"\x06" * 32, address="10.0.0.2:7"
        ),
        wire.Admit(
            req="req-1", num_blocks=4, deadline_ms=30000, meta=meta, senders=2, part=1, layers=[0, 1], attempt=3
        ),
        wire.Grant(req="req-1", gen=9, ids=ids, attempt=3),
        wire.Busy(req="req-1", retry_after_ms=250, reason="full", attempt=3),
        wire.Offer(req="req-2", gen=10, ids=ids, lease_ms=5000, meta=meta, digests=b"\x00" * 32),
        wire.Fetch(req="req-3", num_blocks=4, skip=2, attempt=5),
        wire.Done(req="req-1", gen=9, nbytes=32768, meta=meta, digests=b"\x11" * 32),
        wire.Released(req="req-2", gen=10, nbytes=32768),
        wire.Ack(req="req-1", gen=9),
        wire.Cancel(req="req-1", gen=9, reason="user"),
        wire.Error(req="req-1", code="blocks", message="out of range", gen=9, attempt=3),
        wire.DataHello(session=7, purpose="pull", nonce=b"\x07" * 32, mac=b"\x08" * 32),
        wire.WriteData(req="req-1", gen=9, ids=ids, offset=0, length=32768),
        wire.ReadData(req="req-2", gen=10, ids=ids, offset=4096, length=8192),
        wire.DataReply(req="req-2", ok=False, length=0, code="stale", message="gone"),
    ]


class Fuzzer:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.msgs = corpus()
        self.bodies = [wire.encode(m)[4:] for m in self.msgs]
        self.trees = [msgspec.to_builtins(m, builtin_types=(bytes,)) for m in self.msgs]

    # ---- generators: each returns one decode input ----------------------------------------------------------
    def random_bytes(self) -> bytes:
        r = self.rng
        head = r.choice([b"", b"\x85\xa1t", b"\x82\xa1t\xa3ack", b"\xde\x00\x05\xa1t"])
        return head + r.randbytes(r.choice([0, 1, 2, 8, 32, 128, 512]))

    def mutate(self) -> bytes:
        r = self.rng
        b = bytearray(r.choice(self.bodies))
        for _ in range(r.choice([1, 1, 2, 3, 8])):
            op = r.randrange(7)
            i = r.randrange(len(b) + 1)
            if op == 0 and b:
                b[min(i, len(b) - 1)] ^= 1 << r.randrange(8)
            elif op == 1 and b:
                b[min(i, len(b) - 1)] = r.randrange(256)
            elif op == 2:
                b[i:i] = r.randbytes(r.choice([1, 2, 4, 9]))
            elif op == 3:
                del b[i : i + r.choice([1, 2, 8])]
            elif op == 4:
                del b[i:]
            elif op == 5:
                j = r.randrange(len(b) + 1)
                b[i:i] = b[min(i, j) : max(i, j)][:256]
            else:
                b[i:i] = r.choice(self.bodies)[: r.randrange(64)]
        return bytes(b)

    def numbers(self) -> bytes:
        """A valid message with one integer (or other leaf) replaced by a boundary or wrong-typed value."""
        r = self.rng
        tree = copy.deepcopy(r.choice(self.trees))
        leaves = list(_leaves(tree))
        path = r.choice(leaves)
        node = tree
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = (
            r.choice(BOUNDARY)
            if r.random() < 0.8
            else r.choice([1.5, "x", b"y", None, True, [1], {"a": 1}, float("nan")])
        )
        return msgspec.msgpack.encode(tree)

    def structure(self) -> bytes:
        """Unknown fields, the tag moved or duplicated, fields missing."""
        r = self.rng
        tree = copy.deepcopy(r.choice(self.trees))
        op = r.randrange(4)
        if op == 0:
            tree["extra"] = r.choice([1, "x", [1, 2], {"a": None}])
        elif op == 1:
            tag = tree.pop("t")
            tree["t"] = tag  # tag last
        elif op == 2 and len(tree) > 1:
            tree.pop(r.choice([k for k in tree if k != "t"]))
        else:
            tree["t"] = r.choice(["hello", "ack", "admit", "nope", 1, None])
        return msgspec.msgpack.encode(tree)

    def deep(self) -> bytes:
        """Nesting from a few hundred to 200k containers, in meta, in an unknown field, before the tag, alone."""
        r = self.rng
        depth = r.choice([100, 950, 1000, 3000, 20000, 200000])
        nest = r.choice(CONTAINERS) * depth + b"\xc0"
        where = r.randrange(4)
        if where == 0:
            return (
                msgspec.msgpack.encode(
                    {"t": "admit", "req": "r", "num_blocks": 1, "deadline_ms": 1, "meta": {"k": None}}
                )[:-1]
                + nest
            )
        if where == 1:
            return b"\x83\xa1t\xa3ack\xa3req\xa1r\xa1x" + nest
        if where == 2:
            return b"\x83\xa1x" + nest + b"\xa1t\xa3ack\xa3req\xa1r"
        return nest


def _leaves(obj, path=()):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list) and obj:
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    elif path:
        yield path


def run(n: int, seed: int = 1, max_seconds: float | None = None, out=sys.stdout) -> dict:
    """Fuzz ``n`` inputs (or until ``max_seconds``); print and return the figures."""
    fz = Fuzzer(seed)
    gens = [(fz.random_bytes, 30), (fz.mutate, 40), (fz.numbers, 15), (fz.structure, 8), (fz.deep, 2)]
    pick = [g for g, w in gens for _ in range(w)]
    outcomes: collections.Counter = collections.Counter()
    by_gen: collections.Counter = collections.Counter()
    untyped: list[tuple[str, str, bytes]] = []
    slowest: list = []  # min-heap of the SLOWEST slowest inputs: (seconds, tie-break, kind, fn, arg)
    tie = itertools.count()
    t_start = time.monotonic()
    tried = 0
    rng = fz.rng
    while tried < n:
        if max_seconds is not None and tried % 1000 == 0 and time.monotonic() - t_start > max_seconds:
            break
        tried += 1
        if tried % 20 == 0:  # frame headers
            header = rng.randbytes(rng.choice([0, 3, 4, 4, 4, 5]))
            kind, fn, arg = "frame_length", wire.frame_length, header
        else:
            gen = rng.choice(pick)
            kind, fn, arg = gen.__name__, wire.decode, gen()
        by_gen[kind] += 1
        t0 = time.perf_counter()
        try:
            fn(arg)
            outcome = "ok"
        except KVXferError as e:
            outcome = type(e).__name__
        except BaseException as e:  # exactly what the fuzz is looking for
            outcome = "UNTYPED " + type(e).__name__
            if len(untyped) < 20:
                untyped.append((kind, f"{type(e).__name__}: {e}"[:200], bytes(arg[:64])))
        dt = time.perf_counter() - t0
        if len(slowest) < SLOWEST:
            heapq.heappush(slowest, (dt, next(tie), kind, fn, arg))
        elif dt > slowest[0][0]:
            heapq.heapreplace(slowest, (dt, next(tie), kind, fn, arg))
        outcomes[outcome] += 1
    elapsed = time.monotonic() - t_start
    n_untyped = sum(v for k, v in outcomes.items() if k.startswith("UNTYPED"))
    print(f"inputs tried: {tried} in {elapsed:.1f} s (seed {seed})", file=out)
    print("inputs by generator: " + ", ".join(f"{k} {v}" for k, v in sorted(by_gen.items())), file=out)
    print(f"decoded ok: {outcomes['ok']}", file=out)
    print(
        "typed errors: "
        + (
            ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()) if k != "ok" and not k.startswith("UNTYPED"))
            or "none"
        ),
        file=out,
    )
    print(f"untyped exceptions: {n_untyped}", file=out)
    for kind, what, head in untyped:
        print(f"  {kind}: {what} input {head.hex()}", file=out)
    first = max(slowest, default=(0.0, 0, "", None, b""))
    retimed = max(((_best_of(fn, arg), kind, len(arg)) for _, _, kind, fn, arg in slowest), default=(0.0, "", 0))
    print(
        f"max decode time: {first[0] * 1e3:.3f} ms as measured in the run ({first[2]}, {len(first[4])} bytes); "
        f"the {len(slowest)} slowest inputs re-timed (best of 5): at most {retimed[0] * 1e3:.3f} ms "
        f"({retimed[1]}, {retimed[2]} bytes)",
        file=out,
    )
    return {
        "tried": tried,
        "untyped": n_untyped,
        "outcomes": dict(outcomes),
        "by_gen": dict(by_gen),
        "max_decode_s": retimed[0],
    }


def _best_of(fn, arg, k: int = 5) -> float:
    """The fastest of ``k`` timings of ``fn(arg)``: tells a slow input from a scheduling hiccup."""
    best = float("inf")
    for _ in range(k):
        t0 = time.perf_counter()
        with contextlib.suppress(BaseException):  # already counted
            fn(arg)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="inputs to try")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-seconds", type=float, help="stop after this long even if fewer than --n were tried")
    args = ap.parse_args(argv)
    result = run(args.n, args.seed, args.max_seconds)
    return 1 if result["untyped"] else 0


if __name__ == "__main__":
    sys.exit(main())
