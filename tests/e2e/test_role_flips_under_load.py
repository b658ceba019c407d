"""Role changes under load, end to end: `pdserve serve` (router + 2 role-changing node processes,
--disagg-policy auto), 16 greedy streams running while the nodes change role 10 times in a row
through POST /nodes/{id}/role. Every request succeeds with transformers' tokens, each node keeps
its pid (the model stays loaded), and at the end no block or lease is held."""

from __future__ import annotations

import threading
import time
import urllib.error

import pytest

from benchmarks.harness.stack import Stack
from tests.e2e.conftest import hf_greedy, prompts

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]
MAX_TOKENS = 24
NUM_STREAMS = 16
NUM_FLIPS = 10


def roles(stack) -> dict[str, tuple[str, str | None, bool]]:
    return {n["node_id"]: (n["role"], n["changing_to"], n["ready"]) for n in stack.get("/nodes")["nodes"]}


def wait_settled(stack, node_id: str, role: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = roles(stack).get(node_id)
        if now == (role, None, True):
            return
        time.sleep(0.1)
    raise AssertionError(f"{node_id} did not settle as {role}: {roles(stack)}")


def test_sixteen_streams_survive_ten_role_flips_exactly(model_dir):
    path, model, _ = model_dir
    cases = [(p, hf_greedy(model, p, MAX_TOKENS)) for p in prompts(NUM_STREAMS, seed=7, lo=4, hi=120)]
    stack = Stack(str(path), extra=["--kv-cache-memory-gb", "0.1", "--disagg-policy", "auto"])
    try:
        pids = {s["node_id"]: s["pid"] for s in stack.node_status()}
        stop = threading.Event()
        results: list[tuple[bool, str]] = []
        lock = threading.Lock()

        def stream(i: int) -> None:
            prompt, want = cases[i]
            while not stop.is_set():
                ids = []
                try:
                    for _, event in stack.stream("/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                                    "temperature": 0, "return_token_ids": True}):
                        for choice in event["choices"]:
                            ids += choice.get("token_ids", [])
                    ok, why = ids == want, f"stream {i}: {ids} != {want}"
                except urllib.error.HTTPError as e:
                    ok, why = False, f"stream {i}: HTTP {e.code} {e.read()[:300]!r} at {time.time():.3f}"
                except Exception as e:  # noqa: BLE001 - a failed request is what the test counts
                    ok, why = False, f"stream {i}: {e!r}"
                with lock:
                    results.append((ok, why))

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(NUM_STREAMS)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        flips = []
        for _ in range(NUM_FLIPS):
            now = roles(stack)
            prefill = [n for n, (role, _, _) in now.items() if role == "prefill"]
            node, role = (prefill[0], "decode") if prefill else (sorted(now)[0], "prefill")
            status, body = stack.post(f"/nodes/{node}/role", {"role": role})
            assert status == 202, body
            wait_settled(stack, node, role)
            flips.append((node, role))
            time.sleep(0.5)  # requests flow in the new arrangement before the next flip
        stop.set()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        failures = [why for ok, why in results if not ok]
        assert len(results) >= NUM_STREAMS and not failures, (failures[:5], list(stack.log)[-60:])
        assert len(flips) == NUM_FLIPS
        after = stack.wait_idle()
        assert {s["node_id"]: s["pid"] for s in after} == pids  # the same processes: no restart
        for s in after:
            assert s["num_used_blocks"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0, s
            assert s.get("num_leases", 0) == 0 and s.get("num_receiving", 0) == 0, s
    finally:
        stack.close()
