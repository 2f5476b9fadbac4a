"""Child processes driven through a pipe: how tests put a producer or a consumer in a process of its own.

The child's main receives the pipe's end first; it sends ``("ready", value)`` once serving, then answers
every command tuple with ``("ok", value)`` or ``("err", exception type name, message)``, until ``("close",)``.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import traceback

_ctx = mp.get_context("spawn")


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
        os.kill(self.pid, signal.SIGSTOP)

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
