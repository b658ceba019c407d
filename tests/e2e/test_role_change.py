"""Role changes without restart, in real processes: two role-changing nodes (`pdserve prefill` n0,
`pdserve decode` n1) under a fake router. n0 flips prefill → decode → prefill and n1 decode →
prefill → decode, each the same process (pid) registering again with its new role (a decode
node advertises its KV socket, a prefill node none), the engine's blocks all free again after
each change; requests across the changes (hand-offs both ways, including shared memory from a
node that started as decode, and local prefill) give transformers' greedy outputs."""

from __future__ import annotations

import pytest

from pdserve.protocol.messages import Deregister, FirstToken, PrefillRequest, Register, SetRole
from tests.e2e.conftest import hf_greedy, prompts
from tests.e2e.test_local_prefill import FakeRouter, get_json, spawn_node, stop

pytestmark = pytest.mark.e2e

GREEDY = {"max_tokens": 10, "temperature": 0, "ignore_eos": True}


def metric(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError(name, labels)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_nodes_flip_roles_and_stay_exact(model_dir, tmp_path):
    import urllib.request

    from transformers import AutoModelForCausalLM

    path, _, _ = model_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    router = FakeRouter()
    procs = {"n0": spawn_node("prefill", router, "n0", str(path), tmp_path, "--role-change-timeout", "60"),
             "n1": spawn_node("decode", router, "n1", str(path), tmp_path)}
    ps = prompts(6, seed=11, lo=20, hi=120)
    counter = iter(range(100))

    def registered(node: str, role: str) -> Register:
        router.wait(lambda: router.of(node, Register) and router.of(node, Register)[-1].role == role,
                    what=f"{node} registered as {role}")
        reg = router.of(node, Register)[-1]
        assert reg.pid == procs[node].pid  # the same process
        assert (reg.kv_addr != "") == (role == "decode")
        return reg

    def serve(prefill: str, decode: str | None, prompt) -> None:
        """One request through `prefill` (handing off to `decode`, or prefilled locally when None)."""
        rid = f"q{next(counter)}"
        kv_addr = router.of(decode, Register)[-1].kv_addr if decode else ""
        router.send(prefill, PrefillRequest(rid, prompt, GREEDY, decode or "", kv_addr))
        router.wait(lambda: router.finished(rid), what=rid)
        assert router.tokens(rid) == hf_greedy(model, prompt, GREEDY["max_tokens"]), rid

    def set_role(node: str, role: str) -> Register:
        router.send(node, SetRole(role, "test"))
        reg = registered(node, role)
        status = get_json(reg.metrics_url + "/status")
        assert status["role"] == role and status["pid"] == procs[node].pid
        assert status["num_free_blocks"] == status["num_total_blocks"]  # every block back
        return reg

    try:
        n0 = registered("n0", "prefill")
        registered("n1", "decode")
        serve("n0", "n1", ps[0])  # prefill → decode, as started
        serve("n1", None, ps[1])  # n1 prefills locally
        # n0: prefill → decode; n1: decode → prefill; then the other way round for the KV.
        set_role("n0", "decode")
        set_role("n1", "prefill")
        serve("n1", "n0", ps[2])  # n1's pool was made shared at start, though it started as decode
        serve("n0", None, ps[3])
        with urllib.request.urlopen(n0.metrics_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert metric(text, "pdserve_kv_transfers_total", node_id="n0", role="decode", path="shm") == 1
        set_role("n0", "prefill")
        set_role("n1", "decode")
        serve("n0", "n1", ps[4])
        serve("n1", None, ps[5])
        assert len([m for m in router.of("n0", FirstToken)]) == 3  # n0 answered the first token of ps[0, 3, 4]
        with urllib.request.urlopen(n0.metrics_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        assert metric(text, "pdserve_node_role", node_id="n0", role="prefill") == 1
        assert metric(text, "pdserve_node_role", node_id="n0", role="decode") == 0
        for a, b in (("prefill", "decode"), ("decode", "prefill")):
            assert metric(text, "pdserve_node_role_changes_total", node_id="n0", from_role=a, to_role=b) == 1
    finally:
        codes = {name: stop(p) for name, p in procs.items()}
        router.pump(0.3)
        router.close()
    assert codes == {"n0": 0, "n1": 0}  # SIGTERM after role changes still drains and deregisters
    assert router.of("n0", Deregister) and router.of("n1", Deregister)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_router_flips_a_node_over_http_and_outputs_stay_exact(model_dir):
    """`pdserve serve` (real router, real nodes): POST /nodes/{id}/role turns the prefill node into
    a decode node and back; the same process each time, blocks all free, greedy outputs exact."""
    import time

    from transformers import AutoModelForCausalLM

    from benchmarks.harness.stack import Stack
    from tests.e2e.test_local_prefill import SMALL_POOL, completion_ids

    path, _, _ = model_dir
    model = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    stack = Stack(str(path), num_prefill=1, num_decode=1, extra=[*SMALL_POOL, "--disagg-policy", "auto"])
    ps = prompts(6, seed=13, lo=5, hi=120)

    def flip(node_id: str, role: str) -> None:
        status, body = stack.post(f"/nodes/{node_id}/role", {"role": role})
        assert status == 202, body
        deadline = time.monotonic() + 120
        while not any(n["node_id"] == node_id and n["role"] == role and n["ready"] for n in stack.nodes()):
            assert time.monotonic() < deadline, f"{node_id} never served {role}"
            time.sleep(0.2)

    try:
        (prefill,) = [n for n in stack.nodes() if n["role"] == "prefill"]
        pid = stack.get_url(prefill["status_url"] + "/status")["pid"]
        for p in ps[:2]:
            assert completion_ids(stack, p) == hf_greedy(model, p, 10)
        flip(prefill["node_id"], "decode")
        for p in ps[2:4]:
            assert completion_ids(stack, p) == hf_greedy(model, p, 10)
        flip(prefill["node_id"], "prefill")
        for p in ps[4:]:
            assert completion_ids(stack, p) == hf_greedy(model, p, 10)
        status = stack.get_url(prefill["status_url"] + "/status")
        assert status["pid"] == pid and status["role"] == "prefill" and status["role_changes"] == 2
        for s in stack.wait_idle():
            assert s["num_used_blocks"] == 0 and s.get("num_leases", 0) == 0, s
    finally:
        stack.close()
