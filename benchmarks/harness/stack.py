"""Start a local stack (`pdserve serve`: router + node processes) in a child process, wait until it
is ready, and talk to it over HTTP the way a client would.

Used by the serving benchmarks (benchmarks/compare.py, benchmarks/serving.py) and the end-to-end
tests. The child runs the same `pdserve` as the caller: the folder holding the package goes first
on its PYTHONPATH, so a source checkout works without an install. Every HTTP call has a timeout.
"""

from __future__ import annotations

import collections
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pdserve
from pdserve.utils.processes import free_port

PACKAGE_PARENT = Path(pdserve.__file__).resolve().parent.parent  # the folder that holds pdserve/


def child_env(**overrides: str) -> dict[str, str]:
    """This process's environment for a child that must import this same pdserve."""
    path = os.pathsep.join(p for p in (str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **overrides)


class HttpClient:
    """Talk to a router over HTTP the way a client would (`self.url` is the router's)."""

    url: str
    api_key: str | None = None  # sent as a bearer token to the router

    def _headers(self) -> dict:
        return {"Content-Type": "application/json",
                **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})}

    def get(self, path: str) -> dict:
        return self.get_url(self.url + path, self._headers())

    @staticmethod
    def get_url(url: str, headers: dict | None = None) -> dict:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=30) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), self._headers())
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def stream(self, path: str, body: dict, timeout: float = 300):
        """Yields (time.time(), event dict) for each SSE event until [DONE]; ConnectionError if the
        stream ends without it (the server went away)."""
        req = urllib.request.Request(self.url + path, json.dumps({**body, "stream": True}).encode(), self._headers())
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return
                yield time.time(), json.loads(line[6:])
        raise ConnectionError("the stream ended without [DONE]")

    def nodes(self) -> list[dict]:
        return self.get("/nodes")["nodes"]

    def node_status(self) -> list[dict]:
        return [self.get_url(node["status_url"] + "/status") for node in self.nodes()]

    def wait_idle(self, timeout: float = 60.0) -> list[dict]:
        """Every node's status once none holds a block (or the last statuses at the timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.node_status()
            if all(s["num_used_blocks"] == 0 for s in status) or time.monotonic() > deadline:
                return status
            time.sleep(0.2)


class Stack(HttpClient):
    """`pdserve serve` with float32, one thread per node and WARNING logs unless `extra` says
    otherwise (later flags win); the constructor returns once the stack prints that it is ready, or
    raises with the last of its output after `timeout` seconds. `close()` stops it (SIGTERM, then
    SIGKILL after 60 s)."""

    def __init__(self, model: str, *, num_prefill: int = 1, num_decode: int = 1, colocated: bool = False,
                 num_nodes: int = 1, extra: list[str] = (), prefill_args: str | list[str] = "",
                 decode_args: str | list[str] = "", timeout: float = 240.0) -> None:
        """`prefill_args`/`decode_args`: one string for every node of the role, or one per node."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli.main", "serve", "--model", model, "--port", str(self.port),
               "--dtype", "float32", "--num-threads", "1", "--log-level", "WARNING"]
        for flag, values in (("--prefill-args", prefill_args), ("--decode-args", decode_args)):
            cmd += [f"{flag}={value}" for value in ([values] if isinstance(values, str) else values)]
        cmd += list(extra)
        cmd += ["--colocated", "--num-nodes", str(num_nodes)] if colocated else [
            "--num-prefill", str(num_prefill), "--num-decode", str(num_decode)]
        # Nodes set torch's threads from --num-threads; OMP_NUM_THREADS=1 keeps everything else in
        # the router and nodes from starting one thread per core each.
        self.proc = subprocess.Popen(cmd, env=child_env(OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.log: collections.deque[str] = collections.deque(maxlen=2000)  # the stack's output, last lines
        self._partial = b""
        self._wait_ready(timeout)
        # Keep reading after start-up: a pipe nobody drains fills up and blocks the stack's writes.
        threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout: float) -> None:
        start = time.monotonic()
        deadline = start + timeout
        fd = self.proc.stdout.fileno()
        exited = False
        while (left := deadline - time.monotonic()) > 0 and select.select([fd], [], [], left)[0]:
            if not self._read(fd):
                exited = True  # end of output: the stack exited
                break
            if any("pdserve is ready" in line for line in self.log):
                return
        self.close()
        why = (f"exited after {time.monotonic() - start:.0f} s without becoming ready" if exited
               else f"did not start within {timeout:.0f} s")
        raise RuntimeError(f"the stack {why}:\n" + "".join(list(self.log)[-60:]))

    def _read(self, fd: int) -> bool:
        """One read of whatever the stack printed into `log`, whole lines; False at end of output."""
        data = os.read(fd, 1 << 16)
        *lines, self._partial = (self._partial + data).split(b"\n")
        self.log.extend(line.decode(errors="replace") + "\n" for line in lines)
        return bool(data)

    def _drain(self) -> None:
        fd = self.proc.stdout.fileno()
        try:
            while self._read(fd):
                pass
        except (OSError, ValueError):  # closed under us
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
