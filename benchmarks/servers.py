"""Real server processes for the tests and benchmarks: a free localhost port, and a command started in a process
group of its own (a server's workers die with it), waited for until its ``/v1/models`` answers, its log in a file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``cmd`` serving an OpenAI-compatible API at ``http://127.0.0.1:PORT/v1``; stdout and stderr go to ``log``."""

    def __init__(self, cmd: list[str], port: int, log: Path, env: dict | None = None, startup: float = 90.0):
        self.cmd, self.port, self.log, self.startup, self.proc = cmd, port, Path(log), startup, None
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))  # the log's lines in the order they happened
        self.url = f"http://127.0.0.1:{port}/v1"

    def start(self) -> "ServerProcess":
        with self.log.open("a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        deadline = time.time() + self.startup
        while time.time() < deadline:
            assert self.proc.poll() is None, f"{self.cmd[0]} exited: " + self.log.read_text()[-3000:]
            try:
                urllib.request.urlopen(self.url + "/models", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.5)
        self.kill()
        raise AssertionError(f"the server did not answer within {self.startup:.0f} s: " + self.log.read_text()[-3000:])

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
