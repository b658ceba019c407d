"""docker-compose.yml's router, prefill and decode commands, run as local processes (no Docker):
router + 2 prefill + 2 decode on a tiny model. Hostnames and fixed ports are rewritten (`router`
and 0.0.0.0 → 127.0.0.1, 5555/8000/9100/9200 → free ports), and the `keys` service's volume
(`/keys`) is a temporary directory holding keys made by `generate_keys`, so the stack runs with
CURVE as the file says; everything else is the compose command as written. Streaming requests go
through the router, then every role's /metrics must show the traffic."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.harness.compose import metric_sum, parse_metrics
from pdserve.cli.serve import free_port
from pdserve.protocol.curve import generate_keys
from tests.conftest import save_tiny_model, save_tiny_tokenizer
from tests.docker.compose import flag_value, services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
NUM_PREFILL, NUM_DECODE, NUM_REQUESTS, MAX_TOKENS = 2, 2, 8, 6
# Appended after the compose flags (argparse keeps the last): tiny pools and one thread per process.
TEST_NODE_FLAGS = ["--dtype", "float32", "--num-kv-blocks", "128", "--num-threads", "1", "--log-level", "WARNING"]


KEYS_MOUNT = "/keys"  # where the compose services mount the `curve-keys` volume


def local_argv(command: list[str], model: str, ports: dict[str, int], keys_dir: Path | None = None) -> list[str]:
    """A compose `command` (arguments to the `pdserve` entrypoint) as a local process's argv;
    paths under /keys point into `keys_dir`."""
    values = {"--host": "127.0.0.1", "--model": model, "--port": str(ports["http"]),
              "--control-addr": f"tcp://127.0.0.1:{ports['control']}",
              "--router": f"tcp://127.0.0.1:{ports['control']}"}
    if "--status-port" in command:
        values["--status-port"] = str(free_port())
    if "--kv-port" in command:
        values["--kv-port"] = str(free_port())
    argv = list(command)
    for flag, value in values.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
    if keys_dir is not None:
        argv = [str(keys_dir) + a[len(KEYS_MOUNT):] if a == KEYS_MOUNT or a.startswith(KEYS_MOUNT + "/") else a
                for a in argv]
    return [sys.executable, "-m", "pdserve.cli.main", *argv]


def local_env(service: dict, cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ, **{k: str(v) for k, v in (service.get("environment") or {}).items()})  # interpolated
    env.update(PYTHONPATH=str(ROOT), PDSERVE_CACHE_DIR=str(cache_dir), OMP_NUM_THREADS="1")
    return env


def check_compose_wiring(svc: dict) -> None:
    """The addresses the rewrite maps onto each other must agree in the compose file itself."""
    control = flag_value(svc["router"]["command"], "--control-addr")
    for name in ("prefill", "decode"):
        router_addr = flag_value(svc[name]["command"], "--router")
        assert router_addr.rsplit(":", 1)[1] == control.rsplit(":", 1)[1], name
        assert router_addr.split("//")[1].split(":")[0] == "router", name


def get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return 0, b""


def scrape(url: str) -> dict[tuple, float]:
    code, body = get(url + "/metrics")
    assert code == 200, url
    return parse_metrics(body.decode())


class LocalCompose:
    def __init__(self, tmp: Path) -> None:
        model = tmp / "model"
        save_tiny_model(model, "llama")
        save_tiny_tokenizer(model)
        svc = services()
        check_compose_wiring(svc)
        self.keys = generate_keys(tmp / "keys")  # what the `keys` service writes into its volume
        for name in ("router", "prefill", "decode"):
            assert flag_value(svc[name]["command"], "--zmq-curve-keys") == KEYS_MOUNT, name
        ports = {"http": free_port(), "control": free_port()}
        self.url = f"http://127.0.0.1:{ports['http']}"
        self.procs: list[subprocess.Popen] = []
        self.log = tmp / "stack.log"
        with open(self.log, "w") as log:
            self._start(svc["router"], ["--log-level", "WARNING"], model, ports, tmp, log)
            for name, count in (("prefill", NUM_PREFILL), ("decode", NUM_DECODE)):
                for _ in range(count):
                    self._start(svc[name], TEST_NODE_FLAGS, model, ports, tmp, log)

    def _start(self, service: dict, extra: list[str], model: Path, ports: dict, tmp: Path, log) -> None:
        argv = local_argv(service["command"], str(model), ports, self.keys) + extra
        self.procs.append(subprocess.Popen(argv, cwd=ROOT, env=local_env(service, tmp / "cache"), stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def wait_ready(self, timeout: float = 300.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in self.procs), "a process exited:\n" + self.log.read_text()[-4000:]
            code, body = get(self.url + "/nodes")
            nodes = json.loads(body)["nodes"] if code == 200 else []
            if len([n for n in nodes if n["ready"]]) == NUM_PREFILL + NUM_DECODE:
                return nodes
            time.sleep(1.0)
        raise AssertionError("the stack did not become ready:\n" + self.log.read_text()[-4000:])

    def stream(self, prompt: list[int]) -> tuple[list[int], str | None]:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "return_token_ids": True}
        req = urllib.request.Request(self.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        ids, reason = [], None
        with urllib.request.urlopen(req, timeout=300) as r:
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    ids += choice.get("token_ids", [])
                    reason = choice.get("finish_reason") or reason
        return ids, reason

    def close(self) -> None:
        """Nodes first (SIGTERM drains them), then the router."""
        for group in (self.procs[1:], self.procs[:1]):
            for p in group:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in group:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = LocalCompose(tmp_path_factory.mktemp("compose-local"))
    try:
        yield s
    finally:
        s.close()


def test_compose_commands_serve_and_export_metrics(stack):
    nodes = stack.wait_ready()
    assert {n["role"] for n in nodes} == {"prefill", "decode"}
    for node in nodes:
        assert node["status_url"].startswith("http://127.0.0.1:"), node  # the advertised address
        assert get(node["status_url"] + "/health")[0] == 200, node
    prompts = [[3 + (7 * i + j) % 250 for j in range(20 + 9 * i)] for i in range(NUM_REQUESTS)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(stack.stream, prompts))
    for ids, reason in results:
        assert len(ids) == MAX_TOKENS and reason == "length"

    router = scrape(stack.url)
    assert metric_sum(router, "pdserve_request_success_total", finished_reason="length") == NUM_REQUESTS
    assert metric_sum(router, "pdserve_time_to_first_token_seconds_count") == NUM_REQUESTS
    assert metric_sum(router, "pdserve_generation_tokens_total") == NUM_REQUESTS * MAX_TOKENS
    assert metric_sum(router, "pdserve_nodes", role="prefill") == NUM_PREFILL
    assert metric_sum(router, "pdserve_nodes", role="decode") == NUM_DECODE

    by_role: dict[str, list[dict]] = {"prefill": [], "decode": []}
    for node in nodes:
        metrics = scrape(node["status_url"])
        for name in ("pdserve_kv_blocks_total", "pdserve_kv_cache_usage_perc", "pdserve_prefix_cache_queries_total",
                     "pdserve_kv_transfer_bytes_total", "pdserve_num_requests_running"):
            assert any(n == name for n, _ in metrics), (node["node_id"], name)
        by_role[node["role"]].append(metrics)
    assert sum(metric_sum(m, "pdserve_prefix_cache_queries_total") for m in by_role["prefill"]) > 0
    assert any(metric_sum(m, "pdserve_kv_transfer_bytes_total", direction="received") > 0 for m in by_role["decode"])
    assert sum(metric_sum(m, "pdserve_kv_transfer_seconds_count") for m in by_role["decode"]) == NUM_REQUESTS
