"""The producer half: owns the source cache and a kvxfer ``Producer``, drives the consumer half, times.

For every (block size, transport, mode, pattern) it runs warm-up and timed transfers through kvxfer and, in
the same loop, interleaved with them, the raw baseline of that transport; after every transfer the consumer
half checks every byte that arrived (and poisons the blocks again), so a fast wrong answer cannot pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec
import numpy as np

from .. import tls, wire
from ..channel import SPIN
from ..errors import KVXferError
from ..layout import KVLayout
from ..plan import make_plan, pair
from ..producer import Producer
from . import baselines, certs, content, models
from .consumer import boot_id
from .control import Control, ControlError
from .patterns import pick, pick_at, spread
from .progress import Progress


@dataclass
class Settings:
    """Everything the driver needs to know about a run (the CLI fills it from its flags)."""

    geometry: models.Geometry
    block_sizes: list[int]
    tokens: int = 4096
    transports: list[str] = field(default_factory=lambda: ["tcp"])
    modes: list[str] = field(default_factory=lambda: ["push"])
    patterns: list[str] = field(default_factory=lambda: ["sequential"])
    repeats: int = 5
    warmup: int = 1
    latency: bool = False
    requests: int = 200
    concurrency: int = 8
    request_blocks: tuple[int, int] = (1, 16)
    tcp_streams: int | None = None  # None: the transport's default
    nixl_baseline: str = "same"
    spin: float = SPIN  # both handles' control readers (kvxfer.channel.Spin)
    deadline: float = 60.0
    seed: int = 0


class VerifyError(RuntimeError):
    pass


def _ids(a) -> bytes:
    return np.asarray(a).astype("<u4").tobytes()


def _pct_ms(xs, q) -> float:
    """Percentile ``q`` of the seconds ``xs`` (never empty: every row times at least one transfer), in ms."""
    return float(np.percentile(xs, q)) * 1e3


def _median(xs) -> float | None:
    return float(np.median(xs)) if len(xs) else None


class _SocketRef:
    """The tcp baseline: one plain socket between the two halves, the same byte count per transfer."""

    name = "socket"

    def __init__(self, drv: Driver, capacity: int, src: np.ndarray):
        port = drv.ctl.call("socket_open", capacity=capacity)["port"]
        self.drv = drv
        self.sender = baselines.SocketSender(drv.host, port, src)

    def once(self, mode: str, src_ids, dst_ids) -> float:
        return self.sender.send(len(src_ids) * self.drv.geom.block_bytes)

    def close(self) -> None:
        self.sender.close()
        err = self.drv.ctl.call("socket_close").get("error_text")
        if err:
            raise ControlError(f"socket baseline receiver failed: {err}")


class _UcxRef:
    """The ucx baseline: raw ucxx, one contiguous tag message of the same byte count per transfer and a one-byte
    acknowledgement, between the same two processes."""

    name = "ucxx-raw"

    def __init__(self, drv: Driver, capacity: int, src: np.ndarray):
        self.drv = drv
        self.raw = baselines.RawUcx()
        self.raw.connect(drv.ctl.call("ucx_open", capacity=capacity, address=self.raw.address())["address"])
        self.sender = baselines.UcxSender(self.raw, src)

    def once(self, mode: str, src_ids, dst_ids) -> float:
        return self.sender.send(len(src_ids) * self.drv.geom.block_bytes)

    def close(self) -> None:
        err = self.drv.ctl.call("ucx_close").get("error_text")
        self.raw.close()
        if err:
            raise ControlError(f"ucxx baseline receiver failed: {err}")


class _NixlRef:
    """The nixl baseline: NIXL called directly with the descriptors kvxfer's plan produces (WRITE for push,
    READ issued by the consumer for pull); every byte it moved is verified too."""

    name = "nixl-raw"

    def __init__(self, drv: Driver, per_block: bool = False):
        self.drv = drv
        self.agent = baselines.RawNixl(f"kvxfer-bench-producer-{time.monotonic_ns()}", drv.layout.regions)
        meta = drv.ctl.call("nixl_open")["meta"]
        self.peer = self.agent.add_peer(meta)
        self.me = drv.ctl.call("nixl_peer", meta=self.agent.metadata())["name"]
        self.count = 0
        self.coalesce = not per_block
        if per_block:
            self.name = "nixl-block"

    def once(self, mode: str, src_ids, dst_ids) -> float:
        drv = self.drv
        plan = make_plan(
            drv.pairing, src_ids, dst_ids, drv.layout.num_blocks, drv.remote.num_blocks, coalesce=self.coalesce
        )
        local = self.agent.descs(drv.layout.regions, plan.src)
        remote = self.agent.descs(drv.remote.regions, plan.dst)
        self.count += 1
        tag = f"bench-{self.count}".encode()
        t0 = time.perf_counter()
        if mode == "push":
            # the target polls for the notification while the WRITE runs (no progress threads anywhere)
            drv.ctl.send({"op": "nixl_wait", "tag": tag, "wait": drv.s.deadline})
            try:
                self.agent.xfer("WRITE", local, remote, self.peer, notif=tag, timeout=drv.s.deadline)
            finally:
                reply = drv.ctl.recv(drv.s.deadline + 30)  # keep the control channel in step either way
        else:
            drv.ctl.send({"op": "nixl_read", "local": remote.tobytes(), "remote": local.tobytes(), "peer": self.me})
            while not drv.ctl.readable(baselines.NOTIF_POLL):
                self.agent.poll()  # the passive side keeps UCX moving
            reply = drv.ctl.recv(drv.s.deadline + 30)
        dt = time.perf_counter() - t0
        if "error" in reply:
            raise ControlError(f"raw NIXL {'WRITE' if mode == 'push' else 'READ'} failed: {reply['error']}")
        check = drv.ctl.call("verify", dst=_ids(dst_ids), src=_ids(src_ids))
        if not check["ok"]:
            raise VerifyError(f"raw NIXL baseline delivered wrong bytes: {check['detail']}")
        return dt

    def close(self) -> None:
        try:
            self.drv.ctl.call("nixl_close")
        finally:
            self.agent.close()


class Driver:
    geom: models.Geometry  # the geometry being run, and its source cache: set by ``run_geometry``
    layout: KVLayout

    def __init__(self, settings: Settings, ctl: Control, host: str, progress: Progress | None = None):
        self.s = settings
        self.ctl = ctl
        self.host = host
        self.progress = progress or Progress(1, enabled=False)
        self.rows: list[dict] = []
        self.hello = ctl.call("hello", timeout=60, transports=settings.transports)
        if self.hello["missing"]:
            raise ControlError(
                "the consumer half cannot run " + "; ".join(f"{n}: {why}" for n, why in self.hello["missing"].items())
            )
        self.same_clock = self.hello.get("boot_id") == boot_id()

    # ---- bookkeeping ---------------------------------------------------------------------------------------
    def steps(self) -> int:
        """Progress units of the whole run: one per transfer (throughput) or per request (latency)."""
        s = self.s
        rows = len(s.block_sizes) * len(s.transports) * len(s.modes) * len(s.patterns)
        return rows * ((s.requests + s.warmup * s.concurrency) if s.latency else (s.warmup + s.repeats))

    @property
    def failed(self) -> bool:
        return any(r.get("error") or not r.get("verified", False) for r in self.rows)

    def _address(self, address: str) -> str:
        host, _, port = address.rpartition(":")
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"{host}:{port}"

    # ---- the run -------------------------------------------------------------------------------------------
    def run(self) -> list[dict]:
        """Every geometry for every transport, ucx's rows after all others: ucxx's UCX, once loaded in a process,
        slows every NIXL agent created after it (docs/transports.md)."""
        late = [n for n in self.s.transports if n == "ucx"]
        for names in ([n for n in self.s.transports if n not in late], late):
            for bs in self.s.block_sizes if names else ():
                self.run_geometry(dataclasses.replace(self.s.geometry, block_size=bs), names)
        return self.rows

    def run_geometry(self, geom: models.Geometry, names: list[str]) -> None:
        s = self.s
        self.geom = geom
        blocks = geom.blocks_for(s.tokens)
        widest = max(spread(p) for p in s.patterns)
        base = max(blocks, s.request_blocks[1] * s.concurrency) if s.latency else blocks
        nb = base * widest
        self.blocks, self.nb = blocks, nb
        self.progress.note(f"{geom.name} block {geom.block_size}: filling {nb} blocks x {geom.block_bytes} B")
        # the consumer half builds and poisons its cache while this half fills the source cache
        self.ctl.send({"op": "setup", "geometry": geom.to_dict(), "src_blocks": nb, "dst_blocks": nb, "seed": s.seed})
        arrays = models.allocate(geom, nb)
        try:
            content.Content(s.seed, geom.layers, nb, geom.layer_block_bytes).fill(arrays)
            self.layout = models.layout_of(geom, arrays)
            reply = self.ctl.recv(600)
            if "error" in reply:
                raise ControlError(f"consumer half: setup failed: {reply['error']}")
            self.remote = KVLayout.from_desc(msgspec.convert(reply["layout"], wire.LayoutDesc))
            self.pairing = pair(self.layout, self.remote)
            total = blocks * geom.block_bytes
            cap = max(total, s.request_blocks[1] * geom.block_bytes)
            contiguous = baselines.touched(cap, 7)
            self.progress.note(f"{geom.name} block {geom.block_size}: memcpy of {total} B")
            self.memcpy = _median(baselines.memcpy_gbps(total, s.repeats, contiguous))
            for name in names:
                self.run_transport(name, contiguous, cap)
        finally:
            del self.layout, arrays  # the source cache goes before the next geometry allocates its own

    def run_transport(self, name: str, contiguous: np.ndarray, cap: int) -> None:
        s = self.s
        base, with_tls = certs.split(name)
        opts = {"streams": s.tcp_streams} if base == "tcp" and s.tcp_streams is not None else {}
        cert_pem, key_pem = certs.self_signed() if with_tls else (None, None)
        opened = self.ctl.call(
            "open", transport=base, options=opts, deadline=s.deadline, cert=cert_pem, key=key_pem, spin=s.spin
        )
        address = self._address(opened["address"])
        client = None
        if cert_pem is not None:
            with certs.files(cert_pem) as d:
                client = tls.client_context(f"{d}/cert.pem", check_hostname=False)
        producer = Producer(
            self.layout,
            transport=base,
            deadline=s.deadline,
            lease=s.deadline,
            transport_options=opts,
            tls=client,
            spin=s.spin,
        )
        ref: _SocketRef | _NixlRef | _UcxRef | None = None
        ref_error = ""
        try:
            try:
                if base == "tcp":  # tcp+tls too: its ratio is the cost of TLS over a plain socket
                    ref = _SocketRef(self, cap, contiguous)
                elif name == "nixl":
                    if not (self.hello.get("nixl_raw") and baselines.nixl_importable()):
                        raise RuntimeError("nixl bindings are not importable on both halves")
                    ref = _NixlRef(self, per_block=s.nixl_baseline == "per-block")
                elif name == "ucx":
                    if not self.hello.get("ucx_raw"):
                        raise RuntimeError("ucxx is not importable on both halves")
                    ref = _UcxRef(self, cap, contiguous)
            except Exception as e:  # a missing baseline leaves the ratio empty, not the row
                ref_error = f"{type(e).__name__}: {e}"
            for mode in s.modes:
                for pattern in s.patterns:
                    self.ctl.call("pattern", pattern=pattern)
                    run = self.latency if s.latency else self.throughput
                    row = self._row(name, mode, pattern, ref, ref_error)
                    try:
                        run(producer, address, mode, pattern, ref, row)
                    except (KVXferError, ControlError, VerifyError, TimeoutError, OSError) as e:
                        row["error"] = f"{type(e).__name__}: {e}"
                    self._finish(row)
                    self.rows.append(row)
        finally:
            producer.close()
            if ref is not None:
                with contextlib.suppress(Exception):
                    ref.close()
            self.ctl.call("close")

    def _row(self, transport: str, mode: str, pattern: str, ref, ref_error: str) -> dict:
        g = self.geom
        return {
            "kind": "latency" if self.s.latency else "throughput",
            "model": g.name,
            "transport": transport,
            "mode": mode,
            "pattern": pattern,
            "layers": g.layers,
            "block_size": g.block_size,
            "block_bytes": g.layer_block_bytes,
            "bytes_per_block": g.block_bytes,
            "tokens": self.s.tokens,
            "blocks": self.blocks,
            "total_bytes": self.blocks * g.block_bytes,
            "descriptors": None,
            "gbps": None,
            "gbps_max": None,
            "p50_ms": None,
            "p99_ms": None,
            "baseline": ref.name if ref is not None else None,
            "baseline_gbps": None,
            "ratio": None,
            "ratio_paired": None,
            "ratio_best": None,
            "baseline_p50_ms": None,
            "baseline_p99_ms": None,
            "memcpy_gbps": self.memcpy,
            "memcpy_ratio": None,
            "repeats": self.s.repeats,
            "warmup": self.s.warmup,
            "spin": self.s.spin,
            "verified": False,
            "verified_bytes": 0,
            "error": None,
            "baseline_error": ref_error or None,
        }

    def _finish(self, row: dict) -> None:
        if row["gbps"] and row["baseline_gbps"]:
            row["ratio"] = row["gbps"] / row["baseline_gbps"]
        if row["gbps"] and row["memcpy_gbps"]:
            row["memcpy_ratio"] = row["gbps"] / row["memcpy_gbps"]

    # ---- one kvxfer transfer -------------------------------------------------------------------------------
    def _transfer(self, producer: Producer, address: str, mode: str, req: str, src: np.ndarray):
        if mode == "push":
            return producer.push(address, req, src)
        return producer.offer(address, req, src, lease=self.s.deadline)

    def _collect(self, items: list, row: dict) -> dict:
        rep = self.ctl.call("collect", timeout=self.s.deadline + 30, items=items, wait=self.s.deadline + 5)
        row["verified_bytes"] += rep["checked"]
        if not rep["ok"]:
            raise VerifyError(f"wrong bytes at the destination: {rep['detail']}")
        return rep["arrivals"]

    def _descriptors(self, t, src: np.ndarray, dst: np.ndarray) -> int:
        if t.descriptors:
            return t.descriptors  # what the producer's link issued (push)
        # pull: the consumer's link plans; count the two-sided coalesced plan instead
        return len(make_plan(self.pairing, src, dst, self.layout.num_blocks, self.remote.num_blocks))

    def _ref_once(self, ref, row: dict, mode: str, src, dst) -> float | None:
        """One baseline transfer; a failing baseline is reported in the row and dropped, it does not fail
        the kvxfer measurement it stands beside."""
        try:
            return ref.once(mode, src, dst)
        except (ControlError, VerifyError, TimeoutError, RuntimeError, OSError) as e:
            row["baseline_error"] = f"{type(e).__name__}: {e}"
            return None

    # ---- throughput ------------------------------------------------------------------------------------------
    def throughput(self, producer, address, mode, pattern, ref, row) -> None:
        s, g = self.s, self.geom
        rng = np.random.default_rng([s.seed, len(self.rows)])
        candidates = np.arange(self.nb, dtype=np.int64)
        nbytes = self.blocks * g.block_bytes
        times, ref_times, descs = [], [], []
        pending_ref: dict[int, float] = {}
        kvx_by_repeat: dict[int, float] = {}
        label = f"{row['transport']} {mode} {pattern} block {g.block_size}"
        for i in range(s.warmup + s.repeats):
            timed = i >= s.warmup
            self.progress.note(
                f"{label}: {'repeat' if timed else 'warm-up'} "
                f"{i - s.warmup + 1 if timed else i + 1}/{s.repeats if timed else s.warmup}"
            )
            src = pick(pattern, candidates, self.blocks, rng)
            ref_dst = pick(pattern, candidates, self.blocks, rng)
            steps = ["kvxfer", "ref"] if i % 2 == 0 else ["ref", "kvxfer"]
            for step in steps:
                if step == "ref":
                    if ref is not None and not row["baseline_error"]:
                        dt = self._ref_once(ref, row, mode, src, ref_dst)
                        if timed and dt is not None:
                            ref_times.append(dt)
                            pending_ref[i] = dt
                    continue
                req = f"{row['transport']}-{mode}-{pattern}-{g.block_size}-{i}"
                t0 = time.perf_counter()
                t = self._transfer(producer, address, mode, req, src)
                t.wait()
                dt = time.perf_counter() - t0
                arrivals = self._collect([[req, _ids(src)]], row)
                dst = np.frombuffer(arrivals[req]["dst"], dtype="<u4").astype(np.int64)
                if timed:
                    times.append(dt)
                    kvx_by_repeat[i] = dt
                    descs.append(self._descriptors(t, src, dst))
            self.progress.step()
        rates = [nbytes / t / 1e9 for t in times]
        row.update(
            descriptors=int(np.median(descs)),
            gbps=_median(rates),
            gbps_max=max(rates),
            p50_ms=_pct_ms(times, 50),
            p99_ms=_pct_ms(times, 99),
            verified=True,
            samples_gbps=[round(r, 4) for r in rates],
        )
        if ref_times:
            ref_rates = [nbytes / t / 1e9 for t in ref_times]
            # each kvxfer transfer ran right next to one baseline transfer: their ratio cancels slow drift
            # and bursts of load from other tenants that hit both
            paired = [pending_ref[i] / kvx_by_repeat[i] for i in kvx_by_repeat if i in pending_ref]
            row.update(
                baseline_gbps=_median(ref_rates),
                baseline_gbps_max=max(ref_rates),
                baseline_p50_ms=_pct_ms(ref_times, 50),
                baseline_p99_ms=_pct_ms(ref_times, 99),
                baseline_samples_gbps=[round(r, 4) for r in ref_rates],
                ratio_paired=_median(paired),
                ratio_best=max(rates) / max(ref_rates),
            )

    # ---- latency ---------------------------------------------------------------------------------------------
    def latency(self, producer, address, mode, pattern, ref, row) -> None:
        """Many small requests, ``concurrency`` in flight, in waves that fit the destination cache; each wave
        is verified between waves (untimed). Latency is producer submit -> consumer-visible arrival."""
        s, g = self.s, self.geom
        rng = np.random.default_rng([s.seed, len(self.rows), 1])
        lo, hi = s.request_blocks
        sizes = rng.integers(lo, hi + 1, size=s.requests + s.warmup * s.concurrency)
        reqs = [
            (f"{row['transport']}-{mode}-{pattern}-{g.block_size}-r{i}", pick_at(pattern, self.nb, int(n), rng))
            for i, n in enumerate(sizes)
        ]
        warm, timed = reqs[: s.warmup * s.concurrency], reqs[s.warmup * s.concurrency :]
        capacity = self.nb // spread(pattern)
        lat, walls, nbytes, descs = [], [], 0, []
        ref_lat, ref_bytes = [], 0
        candidates = np.arange(self.nb, dtype=np.int64)
        done = 0
        for is_warm, wave in [(True, w) for w in _waves(warm, capacity)] + [
            (False, w) for w in _waves(timed, capacity)
        ]:
            self.progress.note(f"{row['transport']} {mode} {pattern} latency: {done}/{len(timed)} requests")
            records, wall = self._wave(producer, address, mode, wave)
            arrivals = self._collect([[req, _ids(src)] for req, src in wave], row)
            self.progress.step(len(wave))
            if is_warm:
                continue
            walls.append(wall)
            for (req, src), (t0, t1, t) in zip(wave, records, strict=True):
                visible = arrivals[req]["t"] if self.same_clock else t1
                lat.append(visible - t0)
                nbytes += len(src) * g.block_bytes
                descs.append(self._descriptors(t, src, np.frombuffer(arrivals[req]["dst"], "<u4").astype(np.int64)))
            done += len(wave)
            if ref is not None:  # the same requests, one after the other, through the raw baseline
                for _, src in wave:
                    dst = pick(pattern, candidates, len(src), rng)
                    dt = None if row["baseline_error"] else self._ref_once(ref, row, mode, src, dst)
                    if dt is not None:
                        ref_lat.append(dt)
                        ref_bytes += len(src) * g.block_bytes
        total = sum(walls)
        row.update(
            kind="latency",
            requests=len(timed),
            concurrency=s.concurrency,
            request_blocks=f"{lo}-{hi}",
            total_bytes=nbytes,
            descriptors=int(np.median(descs)),
            gbps=nbytes / total / 1e9,
            req_s=len(timed) / total,
            p50_ms=_pct_ms(lat, 50),
            p99_ms=_pct_ms(lat, 99),
            latency_clock="consumer arrival" if self.same_clock else "producer completion",
            verified=True,
        )
        if ref_lat:
            row.update(
                baseline_gbps=ref_bytes / sum(ref_lat) / 1e9,
                baseline_req_s=len(ref_lat) / sum(ref_lat),
                baseline_p50_ms=_pct_ms(ref_lat, 50),
                baseline_p99_ms=_pct_ms(ref_lat, 99),
            )
            row.update(p50_rtt=row["p50_ms"] / row["baseline_p50_ms"], p99_rtt=row["p99_ms"] / row["baseline_p50_ms"])

    def _wave(self, producer: Producer, address: str, mode: str, wave: list) -> tuple[list, float]:
        """Submit ``wave`` with ``concurrency`` requests in flight; per request (submit, completion, transfer)."""
        queue = deque(enumerate(wave))
        records: list = [None] * len(wave)
        errors: list[BaseException] = []
        lock = threading.Lock()

        def worker() -> None:
            while not errors:
                with lock:
                    if not queue:
                        return
                    k, (req, src) = queue.popleft()
                t0 = time.monotonic()
                try:
                    t = self._transfer(producer, address, mode, req, src)
                    t.wait()
                except BaseException as e:  # re-raised in the driver thread
                    errors.append(e)
                    return
                records[k] = (t0, time.monotonic(), t)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(self.s.concurrency, len(wave)))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            raise errors[0]
        return records, max(r[1] for r in records) - min(r[0] for r in records)


def _waves(reqs: list, capacity: int) -> list[list]:
    """Consecutive groups of requests whose blocks fit ``capacity`` destination blocks at once."""
    waves: list[list] = []
    cur: list = []
    used = 0
    for req in reqs:
        n = len(req[1])
        if cur and used + n > capacity:
            waves.append(cur)
            cur, used = [], 0
        cur.append(req)
        used += n
    if cur:
        waves.append(cur)
    return waves
