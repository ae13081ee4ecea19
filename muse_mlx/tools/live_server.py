"""`python -m muse_mlx.server` in a subprocess on a free port, for the tools that drive live servers
(live_handoff, load_test): started, waited for (GET /health), stopped, its output in a log file."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from ..errors import MuseError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server on `model` with `parallel` slots and `args`; ready when constructed."""

    def __init__(self, model: str, args: list[str], log: Path, start_timeout: float, parallel: int = 1):
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "muse_mlx.server", "--model", model, "--port",
                                          str(self.port), "--parallel", str(parallel), *args],
                                         stdout=out, stderr=subprocess.STDOUT, text=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MuseError(f"a server exited with {self.proc.returncode} before it was ready: "
                                f"{log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise MuseError(f"a server was not ready after {start_timeout:.0f} s (its log: {log})")

    def rss_bytes(self) -> int | None:
        """The server process's resident memory (Linux's /proc), None where that cannot be read."""
        try:
            with open(f"/proc/{self.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def add_flags(p, servers: str, workdir: str) -> None:
    """The flags every tool that starts servers takes: what else `servers` are given, how long they
    may take to start, where their files go (`workdir`), the synthetic label and the receipt."""
    p.add_argument("--server-arg", action="append", default=[], help=f"one more argument for {servers}")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    p.add_argument("--workdir", help=f"{workdir} (default: a temporary folder, removed)")
    p.add_argument("--synthetic", action="store_true", help="the model's weights are synthetic (so labelled)")
    p.add_argument("--receipt", help="write a receipt JSON here")
