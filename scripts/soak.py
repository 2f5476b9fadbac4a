"""Soak run: several producer processes, hundreds of pushes and pulls into one Consumer, random faults on both
sides; prints what must be zero and exits non-zero if any of it is not.

Each producer is a real ``Producer`` in a child process (``tests/support/peer.py``); each request carries bytes
only it carries (``content(req)``), so every arrived request is compared byte for byte and a byte written
outside its grant shows up as a corrupted neighbour. The consumer (in this process) allocates through a
``GuardedAllocator``, which poisons freed blocks and catches double frees and writes after free.

Faults, at random, each aimed at a transfer in flight: SIGKILL a producer (restarted), SIGSTOP it for a while
(then SIGCONT), slow it down (stopped 98% of the time for a second or two), cancel a request on the producer's
side or on the consumer's; and close the consumer and open a new one. Figures:

- requests done, and failed by error type (every failure must be a typed ``KVXferError``);
- untyped: any other exception out of the API, an exception kvxfer only logged, a thread that died;
- hangs: a transfer not ended by its deadline + 2 s (counted from SIGCONT if its producer was stopped);
- leaks: consumer grants / hand-offs / dying slots left, blocks not back in the allocator, producer leases,
  live transfers or source blocks left, once everything settled;
- corruption: bytes landed after a free, bad frees, arrived requests whose bytes differ from the producer's,
  ``IntegrityError`` (a digest mismatch the consumer caught);
- the longest time from a fault to the error surfacing at the other side (consumer cancel or restart -> the
  producer's transfer ends), and the longest overshoot of a deadline.

    PYTHONPATH=. python3 scripts/soak.py --duration 60 --producers 3 --requests 400 --transport tcp --seed 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import numpy as np

from conformance.kvspec import Spec
from procs import RemoteError
from support import (
    BlockBytes,
    GuardedAllocator,
    ProducerChild,
    Throttle,
    content,
    watch_untyped,
)

SPEC = Spec(kind="nhd", num_blocks=512, layers=4, heads=4, block_size=16, head_dim=64)  # 64 KiB blocks
CONSUMER_BLOCKS = 1024
SIZES = [1, 2, 4, 16, 64, 128, 256]  # blocks per request (up to 16 MiB), or any size up to the largest
HANG_GRACE = 2.0
FAULTS = {
    "kill": 0.15,
    "stop": 0.2,
    "slow": 0.15,
    "producer_cancel": 0.2,
    "consumer_cancel": 0.2,
    "consumer_restart": 0.10,
}


class Slot:
    """One producer process and what the driver knows of it."""

    def __init__(self, index: int):
        self.index = index
        self.child: ProducerChild | None = None
        self.up = False  # started and not stopped: safe to call
        self.stopped_until = 0.0
        self.resumed_at = 0.0
        self.generation = 0
        self.live: set[str] = set()
        self.throttle: Throttle | None = None  # "slow": stopped 98% of the time, so transfers take long
        self.slow_until = 0.0

    def unthrottle(self) -> None:
        if self.throttle is not None:
            self.throttle.__exit__(None, None, None)
            self.throttle, self.slow_until = None, 0.0


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.untyped: list[str] = []
        watch_untyped(self.untyped)
        tensors, kw, _, _ = Spec(**{**SPEC.__dict__, "num_blocks": CONSUMER_BLOCKS}).build(fill=0)
        self.tensors = tensors
        self.layout = SPEC.layout(tensors, kw)
        self.blocks = BlockBytes(self.layout)
        self.guard = GuardedAllocator(self.layout)
        self.guards = [self.guard]
        self.lock = threading.Lock()
        self.consumer = self._new_consumer()
        self.slots = [Slot(i) for i in range(args.producers)]
        self.requests: dict[str, dict] = {}
        self.n_started = 0
        self.outcomes: Counter = Counter()
        self.faults: Counter = Counter()
        self.hangs: list[str] = []
        self.leaks: list[str] = []
        self.corrupt: list[str] = []
        self.fault_latency: list[tuple[float, str]] = []
        self.overshoot: list[tuple[float, str]] = []
        self.arrived = 0
        self.pending_cause: dict[str, tuple[float, str]] = {}  # req -> (fault time, fault kind)
        self.stop_drain = threading.Event()
        self.held: list[tuple[float, object, str]] = []  # arrivals the "runtime" still uses: (until, consumer, req)
        self.later: list[tuple[float, str, Slot, str]] = []  # scheduled cancels: (when, kind, producer, req)

    # ---- the consumer -------------------------------------------------------------------------------------
    def _new_consumer(self):
        from kvxfer import Consumer

        return Consumer(
            self.layout,
            transport=self.args.transport,
            allocator=self.guard,
            deadline=10.0,
            quarantine=self.args.quarantine,
            max_inflight=64,
            retry_after=0.02,
        )

    def _api(self, what: str, fn, *args):
        """Call the consumer's API; an exception outside the hierarchy is an untyped error."""
        from kvxfer import KVXferError

        try:
            return fn(*args)
        except KVXferError:
            return None
        except Exception as e:
            self.untyped.append(f"consumer.{what} raised {type(e).__name__}: {e}")
            return None

    def drain(self) -> None:
        """Take arrivals, check their bytes, hold them a little (blocks stay taken: Busy happens), release."""
        from kvxfer import DeadlineError, KVXferError

        held = self.held
        while True:
            stopping = self.stop_drain.is_set()  # read before the last get: an arrival handed before the stop is taken
            with self.lock:
                c = self.consumer
                try:
                    a = c.get(timeout=0.01)
                except DeadlineError:
                    a = None
                except KVXferError:
                    a = None
                except Exception as e:
                    self.untyped.append(f"consumer.get raised {type(e).__name__}: {e}")
                    a = None
                if a is not None:
                    self.check_arrival(a)
                    held.append((time.monotonic() + self.rng.uniform(0, 0.15), c, a.req))
                self.release_held(everything=stopping)
            if stopping and a is None and not held:
                return

    def check_arrival(self, a) -> None:
        self.arrived += 1
        got = self.blocks.read(a.block_ids)
        if len(a.block_ids) != self.requests.get(a.req, {}).get("n", -1) or not np.array_equal(
            got, content(a.req, len(a.block_ids), self.layout.block_bytes)
        ):
            self.corrupt.append(f"{a.req}: arrived bytes differ from the producer's")

    def take_arrivals(self, c) -> None:
        """Check and release every arrival still queued on ``c``."""
        from kvxfer import DeadlineError

        while True:
            try:
                a = c.get(timeout=0)
            except DeadlineError:
                return
            self.check_arrival(a)
            if not self._api("release", c.release, a.req):
                self.leaks.append(f"{a.req}: release() of an arrival returned False")

    def release_held(self, everything: bool = False) -> None:
        now = time.monotonic()
        for item in [h for h in self.held if everything or h[0] <= now]:
            self.held.remove(item)
            if not self._api("release", item[1].release, item[2]):
                self.leaks.append(f"{item[2]}: release() of an arrival returned False")

    def restart_consumer(self) -> None:
        """Close the consumer and open a new one on a new port; the old one must give every block back."""
        if "restart-under-load" in self.args.skip and self.args.transport == "nixl":
            self.quiesce()
        with self.lock:
            old, t = self.consumer, time.monotonic()
            for slot in self.slots:
                for req in slot.live:
                    self.pending_cause.setdefault(req, (t, "consumer_restart"))
            self.release_held(everything=True)  # the runtime gives back what it holds, then shuts the consumer
            if "restart-while-stopped" in self.args.skip:
                for slot in self.slots:
                    if slot.stopped_until:
                        slot.stopped_until = t
                self.wake(t)
            old.close()
            self.take_arrivals(old)  # handed off before the close: the runtime still gets them
            end = time.monotonic() + 5.0 + self.args.quarantine
            while time.monotonic() < end:
                s = old.stats()
                if s["inflight"] == s["dying"] == 0 and self.guard.full:
                    break
                time.sleep(0.01)
            s = old.stats()
            if s["inflight"] or s["dying"] or not self.guard.full:
                self.leaks.append(
                    f"closed consumer kept blocks: {s}, allocator {self.guard.num_free}/{self.guard.capacity} free"
                )
                self.guard = GuardedAllocator(self.layout)  # the old one's figures stay counted below
                self.guards.append(self.guard)
            self.consumer = self._new_consumer()

    def quiesce(self, timeout: float = 6.0) -> None:
        """Resume every producer and wait (at most ``timeout``) until no transfer is in flight."""
        now = time.monotonic()
        for s in self.slots:
            s.unthrottle()
            if s.stopped_until:
                s.stopped_until = now
        self.wake(now)
        end = now + timeout
        while time.monotonic() < end and any(s.live for s in self.slots if s.up):
            for s in self.slots:
                if s.up:
                    self.collect(s)
            time.sleep(0.01)

    # ---- producers ----------------------------------------------------------------------------------------
    def start_producer(self, slot: Slot) -> None:
        slot.generation += 1
        child = ProducerChild(SPEC, self.args.transport, seed=self.args.seed * 100 + slot.index * 10 + slot.generation)
        slot.child, slot.up, slot.resumed_at = child, True, time.monotonic()

    def restart_later(self, slot: Slot) -> None:
        def run():
            try:
                self.start_producer(slot)
            except Exception as e:
                self.untyped.append(f"producer restart failed: {type(e).__name__}: {e}")

        threading.Thread(target=run, daemon=True).start()

    def call(self, slot: Slot, *cmd):
        """A command to a running producer; ``None`` if it died meanwhile."""
        try:
            return slot.child.call(*cmd, timeout=30)
        except RemoteError as e:
            if e.kind == "RuntimeError" and "free source blocks" in str(e):
                return None
            self.untyped.append(f"producer {slot.index} {cmd[0]}: {e}"[:300])
        except (EOFError, BrokenPipeError, OSError, TimeoutError) as e:
            if slot.child.proc.is_alive():
                self.hangs.append(f"producer {slot.index} did not answer {cmd[0]}: {type(e).__name__}")
        return None

    def issue(self, slot: Slot | None = None, **extra) -> tuple[Slot, str, float] | None:
        ready = [s for s in self.slots if s.up and len(s.live) < 4]
        if slot is None:
            quick = [s for s in ready if s.throttle is None]  # a slowed producer answers in up to 50 ms
            slot = self.rng.choice(quick) if quick else None
        if slot is None or slot not in ready:
            return None
        req = f"r{self.n_started}-p{slot.index}g{slot.generation}"
        kind = self.rng.choice(["push", "offer"])
        n = self.rng.choice(SIZES) if self.rng.random() < 0.7 else self.rng.randint(1, SIZES[-1])
        seconds = self.rng.uniform(0.5, 4.0)
        kwargs = {"digests": self.rng.random() < 0.2, **extra}
        if kind == "push":
            kwargs.update(deadline=seconds, retry_busy=self.rng.random() < 0.5)
        else:
            kwargs.update(lease=seconds)
        with self.lock:
            address = self.consumer.address
        self.requests[req] = {"slot": slot.index, "kind": kind, "n": n, "started": time.monotonic()}
        started = self.call(slot, "start", kind, address, req, n, kwargs, True)
        self.n_started += 1
        if started is None:  # refused at once (its outcome still comes in), or no free source blocks
            return None
        slot.live.add(req)
        return slot, req, started["at"]

    def collect(self, slot: Slot) -> None:
        records = self.call(slot, "ended")
        for r in records or ():
            self.ended(slot, r)

    def ended(self, slot: Slot, r: dict) -> None:
        req = r["req"]
        slot.live.discard(req)
        info = self.requests.get(req)
        if info is None or "outcome" in info:
            return
        info["outcome"] = r["error"] or "done"
        self.outcomes[info["outcome"]] += 1
        if not r["typed"]:
            self.untyped.append(f"{req}: ended with untyped {r['error']}: {r['message']}")
        if r["error"] == "IntegrityError":
            self.corrupt.append(f"{req}: {r['message']}")
        late = r["ended"] - max(r["deadline"], slot.resumed_at) if r["deadline"] else 0.0
        if r["error"] is not None and r["deadline"]:
            self.overshoot.append((max(0.0, late), req))
        if late > HANG_GRACE:
            self.hangs.append(f"{req}: ended {late:.1f}s after its deadline")
        cause = self.pending_cause.pop(req, None)
        if cause and r["error"] is not None and r["ended"] >= cause[0]:
            since = max(cause[0], slot.resumed_at)  # a stopped producer learns nothing until it runs again
            self.fault_latency.append((max(0.0, r["ended"] - since), f"{cause[1]} -> {r['error']} ({req})"))

    def overdue(self, slot: Slot, now: float) -> None:
        """A transfer still live well past its deadline (its producer running) is a hang."""
        state = self.call(slot, "state")
        if state is None:
            return
        for req, status, deadline in state["live"]:
            late = state["now"] - max(deadline, slot.resumed_at)
            info = self.requests.get(req, {})
            if late > HANG_GRACE and not info.get("hung"):
                info["hung"] = True
                self.hangs.append(f"{req}: still {status} {late:.1f}s after its deadline")

    # ---- faults -------------------------------------------------------------------------------------------
    def fault(self) -> None:
        kind = self.rng.choices(list(FAULTS), weights=list(FAULTS.values()))[0]
        running = [s for s in self.slots if s.up]
        if kind == "consumer_restart":
            if time.monotonic() - getattr(self, "last_restart", 0) < 5.0:
                return
            self.last_restart = time.monotonic()
            self.faults[kind] += 1
            return self.restart_consumer()
        if not running:
            return
        # aimed at a transfer: one in flight on a slowed producer (they last), or one started now and hit
        # 0-4 ms into its life (most finish within a few ms)
        soon = self.rng.uniform(0, 0.004)
        slowed = [s for s in running if s.throttle is not None and s.live]
        if slowed and self.rng.random() < 0.5:
            slot = self.rng.choice(slowed)
            picked = slot, self.rng.choice(sorted(slot.live)), time.monotonic()
        elif kind == "producer_cancel":  # the producer cancels it itself, on time
            picked = self.issue(self.rng.choice(running), cancel_after=soon)
            if picked is not None:
                self.faults[kind] += 1
            return
        else:
            picked = self.issue(self.rng.choice(running))
        if picked is None:
            return
        slot, req, at = picked
        if kind == "consumer_cancel":  # from a timer: the loop is too slow to hit a few-ms transfer
            threading.Timer(max(0.0, at + soon - time.monotonic()), self.cancel, args=(kind, slot, req)).start()
        else:
            self.later.append((at + soon, kind, slot, req))

    def act(self, kind: str, slot: Slot, req: str) -> None:
        if not slot.up:
            return
        if kind == "kill":
            slot.up = False
            slot.unthrottle()
            self.collect(slot)
            slot.child.kill()
            for r in slot.live:  # gone with its process: neither done nor failed on this side
                self.requests[r]["outcome"] = "lost with producer"
                self.outcomes["lost with producer"] += 1
            slot.live.clear()
            self.restart_later(slot)
        elif kind == "slow":
            if slot.throttle is not None:
                return
            slot.throttle = Throttle(slot.child, run=0.001, stop=0.049).__enter__()
            slot.slow_until = time.monotonic() + self.rng.uniform(0.5, 2.0)
        elif kind == "stop":
            slot.unthrottle()
            slot.up = False
            slot.child.stop()
            longest = 3.0
            if "stop-past-quarantine" in self.args.skip and self.args.transport == "nixl":
                longest = 0.8 * self.args.quarantine
            slot.stopped_until = time.monotonic() + self.rng.uniform(0.1, longest)
        else:
            return self.cancel(kind, slot, req)
        self.faults[kind] += 1

    def cancel(self, kind: str, slot: Slot, req: str) -> None:
        self.faults[kind] += 1
        if kind == "producer_cancel":
            self.call(slot, "cancel", req)
            return
        t = time.monotonic()
        with self.lock:
            if self._api("cancel", self.consumer.cancel, req):
                self.pending_cause.setdefault(req, (t, "consumer_cancel"))

    def wake(self, now: float) -> None:
        for s in self.slots:
            if s.throttle is not None and now >= s.slow_until:
                s.unthrottle()
            if s.child is not None and not s.up and s.stopped_until and now >= s.stopped_until:
                s.child.cont()
                s.stopped_until, s.up, s.resumed_at = 0.0, True, time.monotonic()

    # ---- the run ------------------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        for s in self.slots:
            self.start_producer(s)
        drain = threading.Thread(target=self.drain, daemon=True)
        drain.start()
        start = time.monotonic()
        end = start + a.duration
        next_fault = start + self.rng.expovariate(1 / a.fault_every)
        next_check = start + 1.0
        interval = a.duration / max(1, a.requests)
        next_issue = next_collect = start
        while time.monotonic() < end and self.n_started < a.requests:
            now = time.monotonic()
            self.wake(now)
            if now >= next_issue:
                self.issue()
                next_issue = now + self.rng.uniform(0, 2 * interval)
            if now >= next_fault:
                self.fault()
                next_fault = now + self.rng.expovariate(1 / a.fault_every)
            for item in [x for x in self.later if x[0] <= now]:
                self.later.remove(item)
                self.act(*item[1:])
            if now >= next_collect:
                for s in self.slots:
                    if s.up and s.throttle is None:
                        self.collect(s)
                next_collect = now + 0.05
            if now >= next_check:
                for s in self.slots:
                    if s.up:
                        self.overdue(s, now)
                self.guard.check()
                next_check = now + 1.0
            time.sleep(0.005)
        return self.finish(start)

    def finish(self, start: float) -> dict:
        issuing = time.monotonic() - start
        while any(s.child is None or (not s.up and not s.stopped_until) for s in self.slots):
            time.sleep(0.05)  # restarts under way
        for s in self.slots:
            s.unthrottle()
            if s.stopped_until:
                s.stopped_until = time.monotonic()
        self.wake(time.monotonic())
        settle_end = time.monotonic() + 4.0 + HANG_GRACE + 1.0  # the longest deadline, the grace, a margin
        while time.monotonic() < settle_end and any(s.live for s in self.slots):
            for s in self.slots:
                self.collect(s)
            time.sleep(0.02)
        for s in self.slots:
            for req in sorted(s.live):
                self.hangs.append(f"{req}: never ended")
        self.stop_drain.set()
        time.sleep(0.3)
        with self.lock:
            end = time.monotonic() + 5.0 + self.args.quarantine
            while True:
                st = self.consumer.stats()
                if (st["inflight"] == st["handed"] == st["dying"] == 0 and self.guard.full) or time.monotonic() > end:
                    break
                time.sleep(0.02)
        time.sleep(0.3)  # a late writer would land now
        for key in ("inflight", "handed", "dying"):
            if st[key]:
                self.leaks.append(f"consumer {key} = {st[key]}")
        if st["free_blocks"] != self.guard.capacity:
            self.leaks.append(f"consumer free_blocks {st['free_blocks']} of {self.guard.capacity}")
        for g in self.guards:
            self.corrupt += [str(f) for f in g.check()] + [str(f) for f in g.bad_frees()]
        for s in self.slots:
            state = self.call(s, "state")
            if state is None:
                self.leaks.append(f"producer {s.index} did not report its state")
                continue
            if state["live"] or state["leases"] or state["free_src"] != state["capacity"]:
                self.leaks.append(
                    f"producer {s.index}: {len(state['live'])} live transfers, {state['leases']} "
                    f"leases, {state['capacity'] - state['free_src']} source blocks held"
                )
            self.untyped += [f"producer {s.index}: {u}" for u in state["untyped"]]
        for s in self.slots:
            s.child.close()
        self.consumer.close()
        lat = max(self.fault_latency, default=(0.0, ""))
        over = max(self.overshoot, default=(0.0, ""))
        return {
            "transport": self.args.transport,
            "producers": self.args.producers,
            "seconds": round(issuing, 1),
            "requests": self.n_started,
            "arrived": self.arrived,
            "outcomes": dict(sorted(self.outcomes.items(), key=lambda kv: -kv[1])),
            "faults": dict(self.faults),
            "untyped": len(self.untyped),
            "hangs": len(self.hangs),
            "leaks": len(self.leaks),
            "corruption": len(self.corrupt),
            "max_fault_to_error_s": round(lat[0], 3),
            "max_fault_to_error_case": lat[1],
            "max_deadline_overshoot_s": round(over[0], 3),
            "max_deadline_overshoot_case": over[1],
            "faults_timed": len(self.fault_latency),
            "details": {
                "untyped": self.untyped[:20],
                "hangs": self.hangs[:20],
                "leaks": self.leaks[:20],
                "corruption": self.corrupt[:20],
            },
        }


def report(fig: dict) -> None:
    print(
        f"soak: {fig['transport']}, {fig['producers']} producers, {fig['seconds']} s, "
        f"{fig['requests']} requests, {fig['arrived']} arrived at the consumer"
    )
    print("  outcomes at the producers: " + ", ".join(f"{k} {v}" for k, v in fig["outcomes"].items()))
    print("  faults injected:           " + ", ".join(f"{k} {v}" for k, v in sorted(fig["faults"].items())))
    for key in ("untyped", "hangs", "leaks", "corruption"):
        print(f"  {key + ':':27}{fig[key]}")
        for line in fig["details"][key]:
            print(f"      {line}")
    print(
        f"  longest fault -> error:    {fig['max_fault_to_error_s']} s  ({fig['max_fault_to_error_case']}; "
        f"{fig['faults_timed']} timed)"
    )
    print(f"  longest deadline overshoot:{fig['max_deadline_overshoot_s']} s  ({fig['max_deadline_overshoot_case']})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds to issue requests for")
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--requests", type=int, default=400, help="stop issuing after this many")
    p.add_argument("--transport", default="tcp", choices=["tcp", "nixl", "ucx"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fault-every", type=float, default=0.5, help="mean seconds between faults")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument(
        "--quarantine",
        type=float,
        default=2.0,
        help="the consumer's quarantine for failed one-sided grants (kvxfer's default)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["restart-while-stopped", "stop-past-quarantine", "restart-under-load"],
        help="leave out a fault combination that hits a known defect: restart-while-stopped resumes "
        "stopped producers before the consumer is restarted; stop-past-quarantine keeps nixl "
        "producers' stops shorter than the quarantine; restart-under-load restarts a nixl "
        "consumer only once no transfer is in flight",
    )
    args = p.parse_args(argv)
    fig = Soak(args).run()
    report(fig)
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2))
    bad = fig["untyped"] + fig["hangs"] + fig["leaks"] + fig["corruption"]
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    sys.exit(main())
