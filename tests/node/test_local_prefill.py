"""A decode node's local prefill: a PrefillRequest naming no decode node is prefilled in the
decode node's own engine, among its running decodes, then decoded there (FirstToken, then
TokenBatch), as a colocated prefill node does (node/local_requests.py). Aborts, queue-full and
other refusals leave nothing behind; n > 1 forks into choices; the heartbeat counts the prompt
tokens still to prefill; step samples show prefill chunks sharing steps with decodes."""

from __future__ import annotations

import time

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.request import child_id
from pdserve.kvtransfer.receiver import KVEvent, KVEventKind
from pdserve.node.requests import Stage
from pdserve.protocol.messages import Abort, Error, FirstToken, PrefillRequest, TokenBatch, decode
from tests.node.test_decode_node import FakeReceiver, ready, router  # noqa: F401 (fixture)

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


def make_node(tiny_llama, addr, *, max_num_batched_tokens: int = 2048, **kw):
    from pdserve.decode_node.node import DecodeNode
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.node.engine_wire import register_message
    from pdserve.node.router_link import RouterLink

    engine = LLMEngine(EngineConfig(model_path=tiny_llama, dtype="float32", num_kv_blocks=64, num_threads=1,
                                    max_num_batched_tokens=max_num_batched_tokens))
    receiver = FakeReceiver()
    node = DecodeNode(engine, RouterLink(addr, register_message("d0", "decode", engine, "tiny")), receiver, **kw)
    return node, receiver


class Sink:
    """What the node sent its router, by request id, in order."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.messages: list = []

    def drain(self, wait_ms: int = 0) -> list:
        """Everything received until the socket stays quiet for `wait_ms`."""
        while self.sock.poll(wait_ms):
            self.messages.append(decode(self.sock.recv_multipart()[1]))
        return self.messages

    def tokens(self, rid: str) -> list[int]:
        out: dict[int, int] = {}
        for m in self.messages:
            if isinstance(m, FirstToken) and m.request_id == rid:
                out[0] = m.token_id
            elif isinstance(m, TokenBatch):
                for t in m.tokens():
                    if t.request_id == rid:
                        out[t.index] = t.token_id
        return [out[i] for i in range(len(out))]

    def errors(self) -> list[Error]:
        return [m for m in self.messages if isinstance(m, Error)]


def run_until_idle(node, sink, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not node.is_idle():
        node.run_once()
        sink.drain()
        assert time.monotonic() < deadline, "the node did not finish"
    sink.drain(300)


def offline(tiny_llama, prompt, sampling) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", num_threads=1, kv_cache_memory_gb=0.01)
    outs = llm.generate([prompt], SamplingParams(**sampling), use_tqdm=False)
    return [o.token_ids for o in outs]


def test_local_prefill_among_running_decodes_equals_offline(tiny_llama, router, no_leak):  # noqa: F811
    node, receiver = make_node(tiny_llama, router[1], max_num_batched_tokens=32)
    sink = Sink(router[0])
    prompt = list(range(5, 85))  # 80 tokens: three chunks of the 32-token budget
    try:
        receiver.events = [ready("remote", 17)]  # a decode already running (its KV "received")
        node.run_once()
        receiver.events = [KVEvent(KVEventKind.DONE, "remote", num_bytes=1)]
        node.run_once()
        assert node.requests.stage("remote") is Stage.DECODING
        node.handle(PrefillRequest("local", prompt, {**GREEDY, "max_tokens": 10}))
        assert node.requests.stage("local") is Stage.PREFILLING
        hb = node.heartbeat()
        assert hb.num_outstanding_tokens == len(prompt) and hb.role == "decode"  # the router's cost model
        assert node.metrics_snapshot().num_outstanding_prompt_tokens == len(prompt)
        node.run_once()
        assert 0 < node.heartbeat().num_outstanding_tokens < len(prompt)  # one chunk done
        run_until_idle(node, sink)
        first = [m for m in sink.messages if isinstance(m, FirstToken)]
        assert [f.request_id for f in first] == ["local"]
        assert first[0].num_prompt_tokens == len(prompt) and first[0].prefill_s >= 0 and first[0].queued_s >= 0
        assert sink.tokens("local") == offline(tiny_llama, prompt, {**GREEDY, "max_tokens": 10})[0]
        # its first token came from a prefill node (KVReady): indices 1.. of max_tokens=3 here
        assert [t.index for m in sink.messages if isinstance(m, TokenBatch) for t in m.tokens()
                if t.request_id == "remote"] == [1, 2]
        assert not sink.errors()
        rows = node.steps.since(0)[0]
        assert any(p > 0 and d >= 1 for p, d, _, _ in rows), rows  # a prompt chunk in a decode step
        assert sum(p for p, _, _, _ in rows) == len(prompt)
    finally:
        node.link.close()
    no_leak(node.engine.block_manager)


def test_abort_mid_prefill_frees_its_blocks(tiny_llama, router, no_leak):  # noqa: F811
    node, _ = make_node(tiny_llama, router[1], max_num_batched_tokens=16)
    sink = Sink(router[0])
    try:
        node.handle(PrefillRequest("r1", list(range(5, 105)), GREEDY))
        node.run_once()
        bm = node.engine.block_manager
        assert bm.num_used_blocks > 0 and node.requests.stage("r1") is Stage.PREFILLING
        node.handle(Abort("r1"))
        assert node.is_idle() and not node.engine.has_unfinished() and bm.num_used_blocks == 0
        node.run_once()
        sink.drain(200)
        assert not [m for m in sink.messages if isinstance(m, (FirstToken, TokenBatch))]
    finally:
        node.link.close()
    no_leak(node.engine.block_manager)


def test_refusals_leave_nothing_behind(tiny_llama, router, no_leak):  # noqa: F811
    node, _ = make_node(tiny_llama, router[1], max_queue_len=1)
    sink = Sink(router[0])
    try:
        node.handle(PrefillRequest("r1", list(range(5, 40)), GREEDY))
        node.handle(PrefillRequest("r2", list(range(5, 40)), GREEDY))  # one waiting already: queue full
        node.handle(PrefillRequest("r3", list(range(5, 40)), GREEDY, "p-d1", "tcp://127.0.0.1:9"))  # not for us
        node.run_once()
        node.handle(PrefillRequest("r1", list(range(5, 40)), GREEDY))  # a duplicate
        node.handle(PrefillRequest("bad", [10_000], GREEDY))  # outside the vocabulary
        sink.drain(300)
        errors = {e.request_id: e for e in sink.errors()}
        assert sorted(errors) == ["bad", "r1", "r2", "r3"]
        assert errors["r2"].retryable and "queue full" in errors["r2"].message
        assert errors["r3"].retryable and "decode node" in errors["r3"].message
        assert not errors["r1"].retryable and "duplicate" in errors["r1"].message
        assert not errors["bad"].retryable
        assert node.requests.held_ids() == ["r1"] and list(node.engine.scheduler.requests) == ["r1"]
        run_until_idle(node, sink)
        assert len(sink.tokens("r1")) == GREEDY["max_tokens"]
    finally:
        node.link.close()
    no_leak(node.engine.block_manager)


@pytest.mark.parametrize("abort", [False, True])
def test_n_choices_fork_after_the_local_prefill(tiny_llama, router, no_leak, abort):  # noqa: F811
    node, _ = make_node(tiny_llama, router[1])
    sink = Sink(router[0])
    prompt = list(range(7, 44))
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 3, "ignore_eos": True}
    try:
        node.handle(PrefillRequest("s", prompt, sampling))
        node.run_once()  # the prompt and the choices' first tokens
        firsts = [m.request_id for m in sink.drain(300) if isinstance(m, FirstToken)]
        assert firsts == [child_id("s", i) for i in range(3)]
        assert node.requests.family("s") == firsts and all(node.requests.stage(c) is Stage.COLOCATED for c in firsts)
        if abort:
            node.handle(Abort("s"))  # the request id aborts every choice
            assert node.is_idle() and not node.engine.has_unfinished()
        run_until_idle(node, sink)
        if not abort:
            llm = LLM(str(tiny_llama), dtype="float32", num_threads=1, kv_cache_memory_gb=0.01)
            for i in range(3):
                alone = llm.generate([prompt], SamplingParams(**{**sampling, "n": 1, "seed": 5 + i}), use_tqdm=False)
                assert sink.tokens(child_id("s", i)) == alone[0].token_ids
    finally:
        node.link.close()
    no_leak(node.engine.block_manager)
