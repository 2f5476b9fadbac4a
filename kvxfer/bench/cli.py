"""``kvxfer-bench``: how close to the wire does kvxfer move a paged KV cache?

With no flags: a Llama-3-8B-shaped cache (32 layers, 8 KV heads x 128, bf16, 16-token blocks), a 4096-token
request pushed over TCP on loopback between two processes, side by side with a plain single-socket
``sendall``/``recv_into`` of the same bytes and with ``memcpy``, every byte verified.

Two machines: ``kvxfer-bench --role consumer --listen 0.0.0.0:7450`` on the decode host, then
``kvxfer-bench --role producer --connect DECODE_HOST:7450 [flags]`` on the prefill host.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import select
import subprocess
import sys
import time

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
DEFAULT_CONSUMER_LISTEN = "0.0.0.0:7450"
PLOT_BLOCK_SIZES = [16, 32, 64, 128]


def _csv(kind, choices=None, all_value=None):
    def parse(text: str):
        items = [x.strip() for x in text.split(",") if x.strip()]
        if all_value is not None and items == ["all"]:
            return list(all_value)
        out = []
        for x in items:
            try:
                v = kind(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"bad value {x!r}") from None
            if choices is not None and v not in choices:
                raise argparse.ArgumentTypeError(f"{x!r}: choose from {', '.join(choices)}")
            out.append(v)
        if not out:
            raise argparse.ArgumentTypeError("empty list")
        return out

    return parse


def _range(text: str) -> tuple[int, int]:
    lo, sep, hi = text.partition("-")
    try:
        a, b = int(lo), int(hi if sep else lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or LO-HI") from None
    if not 0 < a <= b:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < LO <= HI")
    return a, b


def build_parser() -> argparse.ArgumentParser:
    from ..channel import SPIN
    from .models import DTYPES, PRESETS
    from .patterns import PATTERNS

    p = argparse.ArgumentParser(
        prog="kvxfer-bench",
        description="Move a model-shaped paged KV cache between two processes with kvxfer and compare it, in "
        "the same run, with the raw transport (plain socket for tcp, raw NIXL for nixl) and memcpy.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  kvxfer-bench                                   # llama-3-8b, 4k tokens, tcp push\n"
        "  kvxfer-bench --transport all --json out.json --plot out.png\n"
        "  kvxfer-bench --model deepseek-v3 --mode push,pull --pattern all\n"
        "  kvxfer-bench --latency --requests 400 --concurrency 16\n"
        "  kvxfer-bench --role consumer --listen 0.0.0.0:7450     # on the decode host\n"
        "  kvxfer-bench --role producer --connect decode-host:7450 # on the prefill host\n",
    )
    g = p.add_argument_group("cache geometry")
    g.add_argument(
        "--model",
        default="llama-3-8b",
        choices=[*sorted(PRESETS), "custom"],
        help="preset cache shape (default: llama-3-8b); the flags below override its fields",
    )
    g.add_argument("--layers", type=int, help="number of layers")
    g.add_argument("--kv-heads", type=int, help="KV heads (per tensor-parallel shard)")
    g.add_argument("--head-dim", type=int, help="head dimension (MLA: latent dimension)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="element type")
    g.add_argument(
        "--mla",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="MLA cache: one latent vector per token instead of K and V",
    )
    g.add_argument(
        "--block-size",
        type=_csv(int),
        metavar="N[,N...]",
        help=f"tokens per block, or a list to sweep (default: the preset's; with --plot: "
        f"{','.join(map(str, PLOT_BLOCK_SIZES))})",
    )
    g.add_argument("--tokens", type=int, default=4096, help="tokens per request (default: 4096)")

    r = p.add_argument_group("what to run")
    r.add_argument(
        "--transport",
        type=_csv(str),
        default=["tcp"],
        metavar="NAME[,NAME...]",
        help="tcp, nixl, auto, or all (every transport kvxfer.transports.available() lists), and tcp+tls (the tcp "
        "transport with TLS on every connection, to measure its cost); default: tcp",
    )
    r.add_argument(
        "--mode",
        type=_csv(str, ("push", "pull"), ("push", "pull")),
        default=["push"],
        metavar="push|pull|all",
        help="push: producer WRITEs; pull: consumer READs (default: push)",
    )
    r.add_argument(
        "--pattern",
        type=_csv(str, PATTERNS, PATTERNS),
        default=["sequential"],
        metavar="|".join(PATTERNS) + "|all",
        help="block-id pattern on both sides (default: sequential)",
    )
    r.add_argument("--repeats", type=int, default=5, help="timed transfers per row (default: 5)")
    r.add_argument("--warmup", type=int, default=1, help="untimed transfers first (default: 1)")
    r.add_argument(
        "--latency",
        action="store_true",
        help="latency mode: many small concurrent requests; p50/p99 from producer submit to "
        "consumer-visible arrival, and requests per second",
    )
    r.add_argument("--requests", type=int, default=200, help="latency mode: timed requests (default: 200)")
    r.add_argument("--concurrency", type=int, default=8, help="latency mode: requests in flight (default: 8)")
    r.add_argument(
        "--request-blocks",
        type=_range,
        default=(1, 16),
        metavar="LO-HI",
        help="latency mode: blocks per request, uniform (default: 1-16)",
    )
    r.add_argument(
        "--tcp-streams",
        type=int,
        help="tcp transport: parallel data connections (default: the transport's, one per core up to 4)",
    )
    r.add_argument(
        "--nixl-baseline",
        choices=["same", "per-block"],
        default="same",
        help="nixl rows: raw NIXL with kvxfer's coalesced descriptors (same), or one per layer-block "
        "(per-block: what coalescing saves)",
    )
    r.add_argument(
        "--spin",
        type=float,
        default=SPIN,
        metavar="SECONDS",
        help=f"how long both sides' control readers busy-wait for a message before they block (default: {SPIN:g}; "
        "0: never)",
    )
    r.add_argument("--deadline", type=float, default=60.0, help="seconds any one transfer may take (default: 60)")
    r.add_argument("--seed", type=int, default=0, help="seed of the cache contents and block ids")

    o = p.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the rows as a JSON list")
    o.add_argument("--plot", metavar="PATH", help="write a PNG of GB/s against block size (needs matplotlib)")
    o.add_argument("--quiet", action="store_true", help="no progress display on stderr")

    n = p.add_argument_group("placement")
    n.add_argument(
        "--role",
        choices=("both", "producer", "consumer"),
        default="both",
        help="both (default): producer here, consumer in a child process on loopback; producer: "
        "drive a consumer started elsewhere (--connect); consumer: serve one producer (--listen)",
    )
    n.add_argument("--connect", metavar="HOST:PORT", help="producer role: the consumer half's address")
    n.add_argument(
        "--listen",
        metavar="HOST:PORT",
        help=f"consumer role: where to listen (default: {DEFAULT_CONSUMER_LISTEN}); "
        f"both: the loopback address of the child (default: 127.0.0.1:0)",
    )
    n.add_argument(
        "--serve-forever",
        action="store_true",
        help="consumer role: serve one producer run after another instead of exiting after one",
    )
    p.add_argument("--inject-corruption", action="store_true", help=argparse.SUPPRESS)  # tests: flip a byte
    return p


def geometry_from(args):
    from .models import PRESETS, Geometry

    base = PRESETS.get(args.model) or Geometry("custom", layers=32, kv_heads=8, head_dim=128)
    changes = {
        k: v
        for k, v in (
            ("layers", args.layers),
            ("kv_heads", args.kv_heads),
            ("head_dim", args.head_dim),
            ("dtype", args.dtype),
            ("mla", args.mla),
        )
        if v is not None
    }
    if changes.get("mla") and "kv_heads" not in changes:
        changes["kv_heads"] = 1
    if changes and args.model != "custom":
        changes["name"] = f"{args.model}*"  # a preset with overridden fields
    return dataclasses.replace(base, **changes)


def resolve_transports(names: list[str]) -> list[str]:
    """Transport names to run: "all" is every available one, "auto" the best; each checked to run here.

    Named transports are probed one by one, so a plain ``tcp`` run never imports NIXL (seconds to load).
    """
    from .. import transports
    from . import certs
    from .consumer import usable

    out = []
    for n in names:
        base, with_tls = certs.split(n)
        for m in transports.available() if n == "all" else [transports.resolve(base) + (certs.TLS_SUFFIX * with_tls)]:
            if m not in out:
                out.append(m)
    for m in out:
        base, with_tls = certs.split(m)
        if with_tls and base != "tcp":
            raise ValueError(f"{m!r}: TLS covers the tcp transport only (NIXL data never leaves the fabric)")
        why = usable(base)
        if why:
            raise ValueError(why)
    return out


def _spawn_consumer(listen: str, corrupt: bool) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "kvxfer.bench.cli", "--role", "consumer", "--listen", listen]
    if corrupt:
        cmd.append("--inject-corruption")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    out = proc.stdout
    assert out is not None  # stdout=PIPE
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if select.select([out], [], [], 0.1)[0]:
            line = out.readline()
            if line.startswith("kvxfer-bench consumer listening on "):
                return proc, line.rsplit(" ", 1)[1].strip()
            if not line:
                break
        elif proc.poll() is not None:
            break
    proc.kill()
    proc.wait()
    raise RuntimeError(f"the consumer process did not start (exit code {proc.returncode})")


def main(argv=None) -> int:
    """Run as the program (``argv`` None: the console script, ``python -m``), it ends the process itself
    with the status once a run that loaded NIXL is over, before NIXL's native teardown can crash it."""
    status = _main(argv)
    if argv is None:
        from ..transports.nixl import exit_before_native_teardown

        exit_before_native_teardown(status)
    return status


def _main(argv) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.role == "consumer":
        from .consumer import listen_and_serve

        try:
            listen_and_serve(
                args.listen or DEFAULT_CONSUMER_LISTEN,
                corrupt=args.inject_corruption,
                forever=args.serve_forever,
                announce=lambda s: print(s, flush=True),
            )
        except KeyboardInterrupt:
            return EXIT_FAILED
        return EXIT_OK

    from ..channel import Spin
    from ..errors import ConfigError
    from . import report
    from .driver import Settings

    try:
        geom = geometry_from(args)
        transports_ = resolve_transports(args.transport)
    except Exception as e:  # bad geometry or transport: a usage error
        parser.exit(EXIT_USAGE, f"kvxfer-bench: error: {e}\n")
    if args.role == "producer" and not args.connect:
        parser.error("--role producer needs --connect HOST:PORT")
    for name in ("repeats", "tokens", "requests", "concurrency", "tcp_streams"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    try:
        Spin(args.spin)
    except ConfigError as e:
        parser.error(f"--spin: {e}")
    if args.plot and (why := report.plot_available()):
        parser.exit(EXIT_USAGE, f"kvxfer-bench: error: {why}\n")
    block_sizes = args.block_size or (PLOT_BLOCK_SIZES if args.plot else [geom.block_size])
    settings = Settings(
        geometry=geom,
        block_sizes=block_sizes,
        tokens=args.tokens,
        transports=transports_,
        modes=args.mode,
        patterns=args.pattern,
        repeats=args.repeats,
        warmup=args.warmup,
        latency=args.latency,
        requests=args.requests,
        concurrency=args.concurrency,
        request_blocks=args.request_blocks,
        tcp_streams=args.tcp_streams,
        nixl_baseline=args.nixl_baseline,
        spin=args.spin,
        deadline=args.deadline,
        seed=args.seed,
    )
    producer_bytes, consumer_bytes = memory_needed(settings)
    need = producer_bytes + (consumer_bytes if args.role == "both" else 0)
    have = memory_available()
    if have is not None and need > 0.85 * have:
        parser.exit(
            EXIT_USAGE,
            f"kvxfer-bench: error: this run needs about {need / 2**30:.1f} GiB of memory here "
            f"and {have / 2**30:.1f} GiB are available; use fewer --tokens, or put the "
            f"consumer half on another machine (--role)\n",
        )
    return run(settings, args, geom_text=geom.describe())


def run(settings, args, geom_text: str) -> int:
    from . import report
    from .control import Control, ControlError
    from .driver import Driver
    from .progress import Progress

    proc = None
    ctl = None
    driver = None
    error = None
    progress = Progress(1, enabled=not args.quiet)
    try:
        if args.role == "both":
            proc, address = _spawn_consumer(args.listen or "127.0.0.1:0", args.inject_corruption)
        else:
            address = args.connect
        host = address.rpartition(":")[0].strip("[]")
        ctl = Control.connect(address)
        driver = Driver(settings, ctl, host, progress)
        progress.total = driver.steps()
        driver.run()
    except (ControlError, RuntimeError, OSError, MemoryError) as e:
        error = f"{type(e).__name__}: {e}" if not isinstance(e, ControlError) else str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        progress.close()
        if ctl is not None:
            with contextlib.suppress(Exception):  # the other half may be gone already
                ctl.call("quit", timeout=10)
            ctl.close()
        if proc is not None:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    rows = driver.rows if driver is not None else []
    if rows:
        print(report.header(rows, geom_text))
        print(report.table(rows))
        if args.json:
            report.write_json(rows, args.json)
        if args.plot:
            report.plot(rows, args.plot, title=f"{geom_text.split(':')[0]}, {settings.tokens} tokens")
    if error is not None:
        print(f"kvxfer-bench: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    assert driver is not None  # no error: the driver ran
    if driver.failed:
        print("kvxfer-bench: FAILED: a transfer failed or delivered wrong bytes (see the table)", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def memory_needed(settings) -> tuple[int, int]:
    """Bytes the (producer, consumer) halves allocate for the largest geometry of a run."""
    import dataclasses as dc

    from .patterns import spread

    worst = (0, 0)
    for bs in settings.block_sizes:
        g = dc.replace(settings.geometry, block_size=bs)
        blocks = g.blocks_for(settings.tokens)
        base = max(blocks, settings.request_blocks[1] * settings.concurrency) if settings.latency else blocks
        cache = base * max(spread(p) for p in settings.patterns) * g.block_bytes
        total = max(blocks, settings.request_blocks[1]) * g.block_bytes
        # producer: source cache, contiguous baseline buffer, memcpy target; consumer: cache, socket buffer
        worst = max(worst, (cache + 2 * total, cache + total), key=sum)
    return worst


def memory_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    sys.exit(main())
