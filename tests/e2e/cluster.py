"""A local cluster whose processes a test starts, kills (-9), stops (SIGSTOP) and restarts one by
one: the router on fixed ports (so a restarted router is found again) and nodes by name.
`Stack` (benchmarks/harness/stack.py) starts everything through `pdserve serve` instead; both talk HTTP the same way."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.harness.stack import HttpClient, child_env
from pdserve.cli.serve import free_port

ROOT = Path(__file__).resolve().parents[2]

NODE_MODULES = {"prefill": "pdserve.prefill_node", "decode": "pdserve.decode_node", "both": "pdserve.prefill_node"}


class Cluster(HttpClient):
    def __init__(self, model: str, *, router_args: list[str] = (), node_args: list[str] = (),
                 heartbeat_timeout_s: float = 1.5, api_key: str | None = None, api_server_count: int = 1) -> None:
        self.model = model
        self.api_key = api_key
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # With --api-server-count N: N router processes on the port, nodes given all N control addresses.
        self.controls = [f"tcp://127.0.0.1:{free_port()}" for _ in range(api_server_count)]
        self.control = ",".join(self.controls)
        self.router_args = ["--heartbeat-timeout", str(heartbeat_timeout_s), *router_args,
                            *(["--api-key", api_key] if api_key else []),
                            *(["--api-server-count", str(api_server_count)] if api_server_count > 1 else [])]
        self.node_args = list(node_args)
        self.procs: dict[str, subprocess.Popen] = {}
        self.node_argv: dict[str, list[str]] = {}
        self.env = child_env(OMP_NUM_THREADS="1")
        self.logs = ROOT / ".pytest_cache" / f"cluster-{self.port}"
        self.logs.mkdir(parents=True, exist_ok=True)

    # ---- processes -----------------------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "a")
        proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.procs[name] = proc
        return proc

    def start_router(self) -> None:
        self._spawn("router", ["pdserve.router", "--model", self.model, "--port", str(self.port), "--control-addr",
                               self.control, "--log-level", "INFO", *self.router_args])
        self.wait(self._router_answers, 60, "the router")

    def start_node(self, name: str, role: str, *extra: str) -> None:
        argv = [NODE_MODULES[role], "--router", self.control, "--node-id", name, "--model", self.model,
                "--dtype", "float32", "--num-threads", "1", "--log-level", "INFO", *self.node_args, *extra]
        if role == "both":
            argv += ["--role", "both"]
        self.node_argv[name] = argv
        self._spawn(name, argv)

    def restart_node(self, name: str) -> None:
        self._spawn(name, self.node_argv[name])

    def wait_nodes(self, names, timeout: float = 120.0) -> None:
        """Until every named node is registered and ready, as the process this cluster last started
        under that name (not an entry a killed one left behind)."""
        def ready() -> bool:
            nodes = {n["node_id"]: n for n in self._nodes_or_empty()}
            try:
                return all(name in nodes and nodes[name]["ready"]
                           and self.get_url(nodes[name]["status_url"] + "/status")["pid"] == self.pid(name)
                           for name in names)
            except OSError:
                return False
        self.wait(ready, timeout, f"nodes {sorted(names)} ready")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.procs[name].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(10)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def api_server_pids(self) -> dict[int, int]:
        """--api-server-count: API server index → pid of its latest process (from the router's log)."""
        pids = {}
        for line in self.log("router").splitlines():
            if line.startswith("pdserve router: API server ") and " started (pid " in line:
                index, pid = line.split()[4], line.rsplit("pid ", 1)[1].rstrip(")")
                pids[int(index)] = int(pid)
        return pids

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
        for proc in self.procs.values():
            proc.wait(30)

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    # ---- helpers -------------------------------------------------------------------------------
    @staticmethod
    def wait(predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def _router_answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5):
                return True
        except urllib.error.HTTPError:  # 503 until nodes are ready: it answers all the same
            return True
        except OSError:
            return False

    def _nodes_or_empty(self) -> list[dict]:
        try:
            return self.nodes()
        except OSError:
            return []

    def status_of(self, name: str) -> dict:
        node = next(n for n in self.nodes() if n["node_id"] == name)
        return self.get_url(node["status_url"] + "/status")
