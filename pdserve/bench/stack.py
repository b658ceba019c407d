"""Start a real local stack (`pdserve serve`: router + node processes) for end-to-end tests, and
talk to it over HTTP the way a client would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.cli.serve import free_port

ROOT = Path(__file__).resolve().parents[2]


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
    def __init__(self, model: str, *, num_prefill: int = 1, num_decode: int = 1, colocated: bool = False,
                 num_nodes: int = 1, extra: list[str] = (), prefill_args: str = "", decode_args: str = "",
                 timeout: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli.main", "serve", "--model", model, "--port", str(self.port),
               "--dtype", "float32", "--num-threads", "1", "--log-level", "WARNING",
               "--prefill-args", prefill_args, "--decode-args", decode_args, *extra]
        cmd += ["--colocated", "--num-nodes", str(num_nodes)] if colocated else [
            "--num-prefill", str(num_prefill), "--num-decode", str(num_decode)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.log: list[str] = []
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line:
                self.log.append(line)
                if "pdserve is ready" in line:
                    return
            elif self.proc.poll() is not None:
                break
        self.close()
        raise RuntimeError("the stack did not start:\n" + "".join(self.log[-60:]))

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
