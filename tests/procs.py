"""Child processes driven through a pipe: how tests put a producer or a consumer in a process of its own.

The child's main receives the pipe's end first; it sends ``("ready", value)`` once serving, then answers
every command tuple with ``("ok", value)`` or ``("err", exception type name, message)``, until ``("close",)``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback

_ctx = mp.get_context("spawn")
# Harness producers move bytes over the transport under test, not inline in the control messages (small requests
# would), so a test can pause, stop or kill one mid-transfer; tests of the inline path make their own producers.
TRANSPORT_ONLY = {"inline_max": 0}


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (or the process is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue  # the thread ended meanwhile
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def serve(conn, ready, commands: dict) -> None:
    """The child's side: announce ``ready``, then answer each command with ``commands[name](*args)``."""
    conn.send(("ready", ready))
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        if cmd == "close":
            return
        try:
            if cmd not in commands:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("ok", commands[cmd](*args)))
        except Exception as e:  # report to the parent, typed by name
            conn.send(("err", type(e).__name__, f"{e}\n{traceback.format_exc()}"))


def outcome(t, timeout: float = 15) -> dict:
    """How a child reports a transfer once it ended: its status and its error's type name."""
    t.wait_ended(timeout)
    return {"status": t.status.value, "error": type(t.error).__name__ if t.error else None}


class RemoteError(Exception):
    """An exception raised in the child, typed by name in ``kind``."""

    def __init__(self, kind: str, message: str):
        super().__init__(f"{kind}: {message}")
        self.kind = kind


class PipedProcess:
    what = "peer process"

    def __init__(self, target, *args, start_timeout: float = 60):
        self.conn, child = _ctx.Pipe()
        self.proc = _ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        self.pid = self.proc.pid
        if not self.conn.poll(start_timeout):
            raise TimeoutError(f"{self.what} did not start")
        status, self.ready = self.conn.recv()
        assert status == "ready", status

    def call(self, *cmd, timeout: float = 60):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.what} did not answer {cmd[0]}")
        reply = self.conn.recv()
        if reply[0] == "err":
            raise RemoteError(reply[1], reply[2])
        return reply[1]

    def stop(self) -> None:
        """SIGSTOP, and wait until every thread of the child is stopped: the signal is asynchronous, and on a
        loaded machine a thread ran on for milliseconds after ``kill`` returned, long enough to answer a
        message the test meant to reach a stopped process."""
        os.kill(self.pid, signal.SIGSTOP)
        end = time.monotonic() + 5.0
        while not _all_stopped(self.pid) and time.monotonic() < end:
            time.sleep(0.0005)

    def cont(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.cont()
        if self.proc.is_alive():
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(("close",))
            self.proc.join(10)
        self.kill()
