"""Parallel sampling (n > 1) through a real in-process prefill → decode hand-off (ZMQ, tiny model):
one prefill, one KV transfer, each choice's first token from the prefill node under `{id}#{i}`,
the rest from the decode node under the same ids; greedy choices equal transformers, seeded
choices equal single requests with the derived seed; aborts free every block on both nodes."""

from __future__ import annotations

import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import child_id
from pdserve.protocol.messages import Abort, FirstToken, PrefillRequest, TokenBatch, decode
from tests.conftest import assert_no_leak
from tests.engine.test_generate_parity import hf_greedy, make_prompts
from tests.kvtransfer.test_node_metrics import NodePair, samples, value


class Pair(NodePair):
    """The node pair, and what the router would have received from it."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.outputs: dict[str, dict[int, int]] = {}  # wire id → output index → token
        self.finished: dict[str, str] = {}
        self.first_tokens: list[FirstToken] = []

    def submit(self, request_id, prompt, sampling, *, colocated=False):
        decode_id, kv_addr = ("", "") if colocated else ("d0", self.receiver.kv_addr)
        self.prefill.handle(PrefillRequest(request_id, prompt, sampling, decode_id, kv_addr))

    def run(self, until=None, timeout_s=60):
        deadline = time.monotonic() + timeout_s
        while True:
            self.prefill.run_once()
            self.decode.run_once()
            self._drain()
            if until is not None and until():
                return
            if until is None and self.prefill.is_idle() and self.decode.is_idle():
                while self.router.poll(200):  # what the nodes sent last may still be on its way
                    self._drain()
                return
            assert time.monotonic() < deadline, "the nodes did not finish"

    def _drain(self):
        while self.router.poll(0):
            msg = decode(self.router.recv_multipart()[1])
            if isinstance(msg, FirstToken):
                self.first_tokens.append(msg)
                self._add(msg.request_id, 0, msg.token_id, msg.finish_reason)
            elif isinstance(msg, TokenBatch):
                for t in msg.tokens():
                    self._add(t.request_id, t.index, t.token_id, t.finish_reason)

    def _add(self, rid, index, token_id, finish_reason):
        self.outputs.setdefault(rid, {})[index] = token_id
        if finish_reason is not None:
            self.finished[rid] = finish_reason

    def tokens(self, rid):
        got = self.outputs.get(rid, {})
        return [got[i] for i in range(len(got))]


@pytest.fixture
def pair(tiny_llama):
    p = Pair(tiny_llama)
    yield p
    p.close()


@pytest.mark.parametrize("colocated", [False, True])
def test_greedy_choices_equal_transformers_with_one_transfer(pair, tiny_llama, colocated):
    from transformers import AutoModelForCausalLM

    prompts = make_prompts(n=2, lengths=(45, 17), seed=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype="float32").eval()
    want = hf_greedy(model, prompts, max_tokens=8)
    for k, prompt in enumerate(prompts):
        pair.submit(f"r{k}", prompt, {"max_tokens": 8, "temperature": 0, "n": 3}, colocated=colocated)
    pair.run()
    for k, expected in enumerate(want):
        for i in range(3):
            assert pair.tokens(child_id(f"r{k}", i)) == expected, (k, i)
    assert {f.request_id for f in pair.first_tokens} == {child_id(f"r{k}", i) for k in range(2) for i in range(3)}
    d = samples(pair.decode.metrics.render())
    num_transfers = sum(v for (name, _), v in d.items() if name == "pdserve_kv_transfers_total")
    assert num_transfers == (0 if colocated else 2)  # one per request, not one per choice
    if not colocated:
        kv_bytes = sum(len(p) for p in prompts) * pair.prefill.engine.model_config.kv_elements_per_token * 4
        assert value(d, "pdserve_kv_transfer_bytes_total", node_id="d0", role="decode",
                     direction="received") == kv_bytes
    assert_no_leak(pair.prefill.engine.block_manager)
    assert_no_leak(pair.decode.engine.block_manager)
    assert len(pair.prefill.requests) == 0 and len(pair.decode.requests) == 0


def test_seeded_choices_equal_single_requests_with_the_derived_seed(pair, tiny_llama):
    prompt = make_prompts(n=1, lengths=(37,), seed=4)[0]
    sampling = {"max_tokens": 10, "temperature": 1.0, "seed": 21, "n": 3, "ignore_eos": True}
    pair.submit("s", prompt, sampling)
    pair.run()
    llm = LLM(str(tiny_llama), dtype="float32", num_threads=1, kv_cache_memory_gb=0.01)
    for i in range(3):
        alone = llm.generate([prompt], SamplingParams(**{**sampling, "n": 1, "seed": 21 + i}), use_tqdm=False)[0]
        assert pair.tokens(child_id("s", i)) == alone.token_ids
        assert pair.finished[child_id("s", i)] == "length"
    assert_no_leak(pair.decode.engine.block_manager)
    assert_no_leak(pair.prefill.engine.block_manager)


@pytest.mark.parametrize("when", ["decoding", "one_choice"])
def test_aborts_free_every_block_on_both_nodes(pair, when):
    pair.submit("a", make_prompts(n=1, lengths=(40,))[0], {"max_tokens": 200, "temperature": 1.0, "n": 4,
                                                           "ignore_eos": True})
    pair.run(until=lambda: all(len(pair.tokens(child_id("a", i))) >= 3 for i in range(4)))
    de = pair.decode.engine
    assert sorted(de.scheduler.requests) == [child_id("a", i) for i in range(4)]
    assert sorted(pair.decode.heartbeat().request_ids) == sorted(de.scheduler.requests)  # the table agrees
    assert pair.decode.requests.family("a") == [child_id("a", i) for i in range(4)]
    if when == "one_choice":  # the router found a stop string in choice 2 alone
        pair.decode.handle(Abort(child_id("a", 2)))
        assert sorted(de.scheduler.requests) == [child_id("a", i) for i in (0, 1, 3)]
    pair.decode.handle(Abort("a"))  # the client went away: the request id aborts every choice
    pair.prefill.handle(Abort("a"))
    pair.run()
    assert not de.scheduler.requests
    assert len(pair.decode.requests) == 0 and len(pair.prefill.requests) == 0  # forgotten on both nodes
    assert_no_leak(de.block_manager)
    assert_no_leak(pair.prefill.engine.block_manager)
