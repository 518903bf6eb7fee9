"""Start a real `trt-spec serve` process on 127.0.0.1 for a test module."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    model: str

    def metric(self, name: str, **labels) -> float:
        """The value of one sample on /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        for line in text.splitlines():
            m = re.match(r"([^{\s]+)(?:\{(.*)\})? (\S+)$", line)
            if not m or m.group(1) != name:
                continue
            got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(m.group(3))
        return 0.0

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


def start_server(engine, *args: str, model: str = "tiny", timeout: float = 60,
                 cli: list[str] | None = None, env: dict | None = None, stderr=None,
                 port: int | None = None) -> Server:
    """cli: the command that runs trt-spec [default: this interpreter's module]; stderr: a
    file for the server's log [default: the test's]; port: where it listens [default: a free
    one] (a restart on the same port: a browser page sees the same server come back)."""
    port = port or free_port()
    cli = cli or [sys.executable, "-m", "trt_spec.cli"]
    proc = subprocess.Popen([*cli, "serve", "--engine", str(engine), "--port", str(port),
                             "--served-model-name", model, "--threads", "1", *args], env=env,
                            stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"trt-spec serve exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Server(proc, url, model)
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"trt-spec serve was not healthy after {timeout} s")
