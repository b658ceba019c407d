"""The compose stack on a real Docker engine: docker/docker-compose.yml as written, the images that
`make image` builds, the default model (smollm2, float32) in its volume. One stack for the module,
driven through the published router port the way a user would:

1. `up --scale prefill=2 --scale decode=2` becomes healthy; streamed completions and chat equal
   transformers' greedy output; KV moves over the shared tmpfs (path="shm"); every node loaded the
   CPU's compiled ops that the image built.
2. Live scaling under 16 streams: each pool grows to 3 (the new replica registers and serves) and
   shrinks to 1 (the removed replicas drain); not one request fails or differs.
3. `docker kill` of a decode container mid-stream: every stream completes exactly. A node process
   that crashes is brought back by the restart policy and serves; `docker restart` of the router:
   nodes re-register and serve.
4. A rogue container on the stack's network (the project image, no keys, or keys of its own) is
   never listed, receives nothing, and is counted in pdserve_auth_refusals_total; users are served.
5. Prometheus reports up == 1 for the router and every replica, the latency histograms counted the
   traffic, and every Grafana panel's query returns a series.
6. `down` leaves no container or network; the next `up` reuses the model volume (no conversion)
   and, with the decode nodes on a /dev/shm of their own, KV moves over TCP (path="zmq") with the
   same outputs.

Skips, saying why, without a Docker engine (.ci/run starts one). Slow tier.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.harness.compose import (
    ComposeStack,
    EngineUnavailable,
    build_images,
    check_engine,
    docker,
    metric_sum,
    own_shm_override,
)
from tests.docker.compose import dashboard_exprs

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1800)]
MAX_TOKENS = 24
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are", "To make a cup of tea, first", "Water boils at"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine():
    try:
        check_engine()
    except EngineUnavailable as e:
        pytest.skip(f"no Docker engine: {e}")
    build_images(python=sys.executable)  # `make image`: seconds when the images are current


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy float32 output for every prompt (token ids), and the tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.engine.loader import resolve_model

    path = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)

    def greedy(ids):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=MAX_TOKENS, pad_token_id=tok.eos_token_id)
        return out[0, len(ids):].tolist()

    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)
    return {"texts": [greedy(tok.encode(t)) for t in TEXTS], "chat": greedy(chat_ids), "tokenizer": tok}


@pytest.fixture(scope="module")
def stack(engine, tmp_path_factory):
    s = ComposeStack(f"pdlive{os.getpid()}")
    s.tmp = tmp_path_factory.mktemp("compose-live")
    s.close()  # a leftover of a killed run with the same pid: start clean
    try:
        started = time.monotonic()
        s.up(prefill=2, decode=2)
        s.wait_pools(prefill=2, decode=2, timeout=900)
        s.up_to_healthy_s = time.monotonic() - started
        print(f"\n[compose-live] up to healthy (2 prefill + 2 decode): {s.up_to_healthy_s:.0f} s")
        yield s
    finally:
        s.close()
        assert s.containers(stopped=True) == [] and s.volumes() == [], "the stack left something behind"


def stream_ids(stack: ComposeStack, path: str, body: dict) -> list[int]:
    ids = []
    for _, event in stack.stream(path, {**body, "temperature": 0, "max_tokens": MAX_TOKENS,
                                        "return_token_ids": True}, timeout=300):
        assert "error" not in event, event
        for choice in event["choices"]:
            ids += choice.get("token_ids", [])
    return ids


def assert_serves_exactly(stack: ComposeStack, reference, texts: range = range(2)) -> None:
    for i in texts:
        assert stream_ids(stack, "/v1/completions", {"prompt": TEXTS[i]}) == reference["texts"][i], TEXTS[i]
    assert stream_ids(stack, "/v1/chat/completions", {"messages": CHAT}) == reference["chat"]


def kv_paths(stack: ComposeStack) -> dict[str, float]:
    metrics = stack.node_metrics("decode")
    return {path: sum(metric_sum(m, "pdserve_kv_transfers_total", path=path) for m in metrics.values())
            for path in ("shm", "zmq")}


class Load:
    """`n` client threads, each streaming completions back to back (prompts in turn) until stop();
    every result is kept: (prompt index, token ids or None, error or None)."""

    def __init__(self, stack: ComposeStack, n: int = 16) -> None:
        self.stack, self.results, self._stop = stack, [], threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(n)]
        for t in self.threads:
            t.start()

    def _run(self, k: int) -> None:
        i = k
        while not self._stop.is_set():
            prompt = i % len(TEXTS)
            try:
                result = (prompt, stream_ids(self.stack, "/v1/completions", {"prompt": TEXTS[prompt]}), None)
            except Exception as e:  # noqa: BLE001  (every failure is a result the test reports)
                result = (prompt, None, f"{type(e).__name__}: {e}")
            with self._lock:
                self.results.append(result)
            i += 1

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> list[tuple]:
        self._stop.set()
        for t in self.threads:
            t.join(360)
        assert not any(t.is_alive() for t in self.threads), "a client stream never ended"
        return self.results


def assert_all_exact(results: list[tuple], reference) -> None:
    errors = [e for _, _, e in results if e]
    assert not errors, f"{len(errors)} of {len(results)} requests failed, first: {errors[0]}"
    wrong = [TEXTS[p] for p, ids, _ in results if ids != reference["texts"][p]]
    assert not wrong, f"{len(wrong)} of {len(results)} outputs differ from transformers: {wrong[:3]}"


# --- 1 ---------------------------------------------------------------------------------------------
def test_up_serves_exactly_like_transformers_over_shared_memory(stack, reference):
    assert_serves_exactly(stack, reference, range(len(TEXTS)))
    paths = kv_paths(stack)
    assert paths["shm"] >= len(TEXTS) + 1 and paths["zmq"] == 0, paths
    # the image's build stage built the CPU's compiled ops for this machine: every node loaded them
    # from the (read-only) venv, none fell back to the torch code
    for service in ("prefill", "decode"):
        for container in stack.containers(service):
            logs = stack.logs(container)
            assert "CPU decode kernel loaded" in logs and "kernel unavailable" not in logs, (container, logs[-2000:])


# --- 2 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pool", ["decode", "prefill"])
def test_live_scaling_under_16_streams(stack, reference, pool):
    other = "prefill" if pool == "decode" else "decode"
    load = Load(stack)
    try:
        stack.wait(lambda: load.count() >= 16, 300, "16 requests done before scaling")
        old = {n["node_id"] for n in stack.ready_nodes(pool)}
        stack.up(**{pool: 3})
        stack.wait_pools(**{pool: 3, other: 2}, timeout=600)
        new = {n["node_id"] for n in stack.ready_nodes(pool)} - old
        assert len(new) == 1, new
        # The new replica serves: the router sends it work under load.
        def served() -> bool:  # a request's timings recorded on the new replica
            node = next(n for n in stack.ready_nodes(pool) if n["node_id"] in new)
            return bool(stack.get_url(node["status_url"] + "/status")["timings"])
        stack.wait(served, 300, f"the new {pool} replica to serve a request")
        done_before_shrink = load.count()
        stack.up(**{pool: 1})  # compose stops two replicas: SIGTERM, they drain
        stack.wait_pools(**{pool: 1, other: 2}, timeout=300)
        stack.wait(lambda: load.count() >= done_before_shrink + 16, 300, "16 more requests after shrinking")
    finally:
        results = load.stop()
    assert_all_exact(results, reference)
    stack.up(**{pool: 2})
    stack.wait_pools(prefill=2, decode=2, timeout=600)


# --- 3 ---------------------------------------------------------------------------------------------
def test_docker_kill_of_a_decode_container_mid_stream(stack, reference):
    victim = stack.containers("decode")[0]
    load = Load(stack)
    try:
        stack.wait(lambda: load.count() >= 8, 300, "8 requests done")
        time.sleep(1.0)  # streams in flight on both decode replicas
        docker("kill", victim)
        stack.wait_pools(decode=1, timeout=120)
        count = load.count()
        stack.wait(lambda: load.count() >= count + 16, 300, "16 more requests after the kill")
    finally:
        results = load.stop()
    assert_all_exact(results, reference)
    # Docker counts `docker kill` as a manual stop: the restart policy leaves it down; `up` starts it.
    assert stack.inspect(victim, "{{.State.Running}}") == "false"
    stack.up(decode=2)
    stack.wait_pools(prefill=2, decode=2, timeout=600)
    assert_serves_exactly(stack, reference)


def test_restart_policy_brings_back_a_crashed_node(stack, reference):
    victim = stack.containers("decode")[0]
    restarts = int(stack.inspect(victim, "{{.RestartCount}}"))
    before = {n["node_id"] for n in stack.nodes()}
    # The node process dies (kill -9 of every process but the container's init): a crash, which is
    # what the restart policy (`unless-stopped`) is for.
    docker("exec", victim, "sh", "-c", "kill -9 -1", check=False)
    stack.wait(lambda: int(stack.inspect(victim, "{{.RestartCount}}")) > restarts, 120, "the restart")
    # The new process registers under a new node id, and the dead one stays listed (as it last
    # reported) until its heartbeats time out: wait for both, not for two decode entries, which the
    # dead one and the other replica already make.
    stack.wait(lambda: len(ids := {n["node_id"] for n in stack.nodes()}) == 4 and len(ids - before) == 1
               and all(n["ready"] for n in stack.nodes()), 600, "the crashed node back under a new id, its old one gone")
    stack.wait_pools(prefill=2, decode=2, timeout=600)
    assert_serves_exactly(stack, reference)


def test_router_restart_nodes_reregister(stack, reference):
    # An earlier test's dead node stays listed (as it last reported) until its heartbeats time out
    # (5 s): settle on exactly the live pools before taking the snapshot.
    stack.wait(lambda: len(stack.nodes()) == 4 and all(n["ready"] for n in stack.nodes()), 120,
               "exactly the 2 + 2 live nodes listed")
    before = {n["node_id"] for n in stack.nodes()}
    docker("restart", stack.containers("router")[0], timeout=180)
    stack.wait_pools(prefill=2, decode=2, timeout=300)
    after = stack.nodes()
    assert {n["node_id"] for n in after} == before, (before, after)  # the same nodes, registered again
    assert_serves_exactly(stack, reference)


# --- 4 ---------------------------------------------------------------------------------------------
ROGUE_KV = """
import sys, time, zmq
ctx = zmq.Context()
got = 0
for host in sys.argv[1:]:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://{host}:9200")
    s.send_multipart([b"pull", b"x" * 64])
    if s.poll(3000):
        got += 1
    s.close()
print("replies", got)
"""


def test_rogue_container_is_refused(stack, reference):
    """A container on the stack's network with the project image, no keys (or keys of its
    own), tries to join as prefill and as decode and to pull KV from a decode node."""
    router_refusals = metric_sum(stack.router_metrics(), "pdserve_auth_refusals_total")
    decode_ips = [n["status_url"].split("//")[1].split(":")[0] for n in stack.ready_nodes("decode")]
    run = ["run", "-d", "--network", stack.network, "-v", f"{stack.project}_model-cache:/cache",
           "--label", f"com.docker.compose.project={stack.project}", "-e", "OMP_NUM_THREADS=1"]
    node = ["--router", "tcp://router:5555", "--host", "0.0.0.0", "--status-port", "9100", "--model", "smollm2",
            "--dtype", "float32", "--kv-cache-memory-gb", "0.1"]
    rogues = [
        docker(*run, "pdserve:cpu", "prefill", *node, "--node-id", "rogue-prefill", "--insecure").strip(),
        docker(*run, "pdserve:cpu", "decode", *node, "--kv-port", "9200", "--node-id", "rogue-decode",
               "--insecure").strip(),
        # Keys of its own: a CURVE handshake the router cannot complete.
        docker(*run, "--entrypoint", "sh", "pdserve:cpu", "-c",
               "pdserve keys /tmp/k >/dev/null && exec pdserve decode " + " ".join(node)
               + " --kv-port 9200 --node-id rogue-keyed --zmq-curve-keys /tmp/k").strip(),
    ]
    try:
        kv = docker("run", "--rm", "--network", stack.network, "--entrypoint", "python", "pdserve:cpu",
                    "-c", ROGUE_KV, *decode_ips, timeout=120)
        assert kv.strip() == "replies 0", kv
        # Each rogue node loads the model and tries to register (it retries, with heartbeats).
        def attempted() -> bool:
            return all("ready" in stack.logs(r) for r in rogues)
        stack.wait(attempted, 300, "the rogue nodes to start and try to register", every=2)
        load = Load(stack, n=4)
        time.sleep(15)
        results = load.stop()
        assert_all_exact(results, reference)
        listed = {n["node_id"] for n in stack.nodes()}
        assert not listed & {"rogue-prefill", "rogue-decode", "rogue-keyed"}, listed
        for rogue in rogues:  # received nothing
            ip = stack.inspect(rogue, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
            status = stack.get_url(f"http://{ip}:9100/status")
            assert status["timings"] == [] and status["num_used_blocks"] == 0, status
        assert metric_sum(stack.router_metrics(), "pdserve_auth_refusals_total") >= router_refusals + 3
        decode_refusals = sum(metric_sum(m, "pdserve_auth_refusals_total")
                              for m in stack.node_metrics("decode").values())
        assert decode_refusals >= len(decode_ips), decode_refusals
    finally:
        for rogue in rogues:
            docker("rm", "-f", rogue, check=False)


# --- 5 ---------------------------------------------------------------------------------------------
def test_prometheus_scrapes_every_replica_and_every_panel_has_data(stack, reference):
    assert_serves_exactly(stack, reference)
    instances = {role: {n["status_url"].split("//")[1] for n in stack.ready_nodes(role)}
                 for role in ("prefill", "decode")}

    def all_up() -> bool:
        up = {(r["metric"]["job"], r["metric"]["instance"]): r["value"][1] for r in stack.promql("up")}
        want = {("router", "router:8000"), *(("prefill", i) for i in instances["prefill"]),
                *(("decode", i) for i in instances["decode"])}
        return want <= {k for k, v in up.items() if v == "1"} and all(
            v == "1" for (job, i), v in up.items() if (job, i) in want)
    stack.wait(all_up, 120, "up == 1 for the router and every node replica", every=2)
    for name in ("pdserve_time_to_first_token_seconds_count", "pdserve_time_per_output_token_seconds_count"):
        stack.wait(lambda n=name: stack.promql(f"sum({n})") and float(stack.promql(f"sum({n})")[0]["value"][1]) > 0,
                   60, f"{name} > 0 in Prometheus", every=2)
    time.sleep(10)  # two scrapes after the last traffic: rates over [1m] see it
    empty = []
    for expr in dashboard_exprs():
        query = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "5m")
        if not stack.promql(query):
            empty.append(expr)
    assert not empty, f"Grafana panels whose query returns no series: {empty}"


# --- 6 ---------------------------------------------------------------------------------------------
def test_down_leaves_nothing_and_up_reuses_the_model_over_tcp(stack, reference):
    model_stamp = docker("run", "--rm", "-v", f"{stack.project}_model-cache:/cache", "--entrypoint", "sh",
                         "pdserve:cpu", "-c", "stat -c %Y /cache/models/*/config.json").strip()
    stack.down()
    assert stack.containers(stopped=True) == [] and stack.networks() == []
    # A /dev/shm of their own for the decode nodes: as if on another host, they pull KV over TCP.
    no_shm = own_shm_override(Path(stack.tmp) / "no-shm.yml")
    files = [*stack.files, no_shm]
    started = time.monotonic()
    stack.up(files=files)
    stack.wait_pools(prefill=2, decode=2, timeout=600)
    init = stack.containers("model-init", stopped=True)[0]
    assert "Using the GGUF" not in stack.logs(init), "the model was converted again"
    assert docker("run", "--rm", "-v", f"{stack.project}_model-cache:/cache", "--entrypoint", "sh", "pdserve:cpu",
                  "-c", "stat -c %Y /cache/models/*/config.json").strip() == model_stamp
    print(f"\n[compose-live] second up to healthy (model volume reused): {time.monotonic() - started:.0f} s")
    assert_serves_exactly(stack, reference, range(len(TEXTS)))
    paths = kv_paths(stack)
    assert paths["zmq"] >= len(TEXTS) + 1 and paths["shm"] == 0, paths
    stack.files = files  # the fixture's close() takes it all down, volumes included
