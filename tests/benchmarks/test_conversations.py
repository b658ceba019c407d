"""The prefix-cache workloads of `pdserve bench serve`: the prefix oracle on hand-made sequences,
multi-turn conversations (each turn's prompt the history: ids, text or chat messages; think time),
the system-prompt workload, and the summary's prefix figures against a fake server that reports
cached tokens, lists its nodes and exports a KV-bytes counter (and against one that reports none)."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from aiohttp import web

from pdserve.bench.client import EndpointConfig, _StreamState, cached_tokens
from pdserve.bench.conversations import ConversationState, conversation_specs, run_conversations
from pdserve.bench.fleet_probe import FleetSnapshot, fleet_snapshot, kv_bytes_received, kv_received_in
from pdserve.bench.prefix_metrics import prefix_summary
from pdserve.bench.prefix_oracle import PrefixOracle, block_keys, oracle_hits
from pdserve.bench.request_record import RequestRecord
from pdserve.bench.runner import BenchmarkRun, LoadConfig
from pdserve.cli.serve import free_port
from tests.benchmarks.conftest import run
from tests.benchmarks.fake_openai import ServerThread

# ---- the oracle --------------------------------------------------------------------------------

def test_oracle_hits_whole_blocks_short_of_the_last_prompt_token():
    oracle = PrefixOracle(block_size=4)
    assert oracle.request(list(range(1, 10))) == 0  # cold; caches [1..4], [5..8]
    assert oracle.request(list(range(1, 10))) == 8  # both blocks: 8 of 9 tokens
    assert oracle.request(list(range(1, 9))) == 4  # 8 tokens: the last is computed, so only block 1 counts
    assert oracle.request([1, 2, 3, 4, 99, 6, 7, 8, 9]) == 4  # diverges in block 2
    assert oracle.request([2, 1, 3, 4, 5, 6, 7, 8, 9]) == 0  # a block's key chains its parent's
    assert oracle.request([1, 2, 3]) == 0  # shorter than a block


def test_oracle_caches_the_output_but_its_last_token():
    oracle = PrefixOracle(block_size=4)
    assert oracle.request([1, 2, 3, 4, 5], [6, 7, 8, 9]) == 0  # computed: 1..8 (9's KV never is)
    assert oracle.request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]) == 8
    # the second request computed 1..10 (two full blocks): the third misses [9..12]
    assert oracle.request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]) == 8
    assert oracle.request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]) == 12


def test_oracle_lru_capacity_and_deepest_blocks_go_first():
    a, b = [1, 2, 3, 4, 5], [7, 8, 9, 10, 11]
    assert oracle_hits([(a, ()), (b, ()), (a, ())], block_size=2, capacity_blocks=2) == [0, 0, 0]  # b evicted a
    assert oracle_hits([(a, ()), (b, ()), (a, ())], block_size=2, capacity_blocks=4) == [0, 0, 4]
    assert oracle_hits([(a, ()), (b, ()), (a, ())], block_size=2, capacity_blocks=None) == [0, 0, 4]
    assert oracle_hits([(a, ()), (a, ())], block_size=2, capacity_blocks=0) == [0, 0]
    # capacity 3: a = a1 a2; then [1,2,9,9,5] hits a1 and adds b2; then c1 c2 push out the two least
    # recently used, a2 and b2 (a request refreshes its root last), so a keeps its first block only.
    seqs = [(a, ()), ([1, 2, 9, 9, 5], ()), ([6, 6, 7, 7, 5], ()), (a, ())]
    assert oracle_hits(seqs, block_size=2, capacity_blocks=3) == [0, 2, 0, 2]


def test_block_keys_chain_like_the_engine():
    keys = block_keys(list(range(40)), 16)
    assert len(keys) == 2 and keys[0] == hash((0, tuple(range(16))))
    assert keys[1] == hash((keys[0], tuple(range(16, 32))))
    with pytest.raises(ValueError):
        PrefixOracle(block_size=0)


# ---- datasets ------------------------------------------------------------------------------------

def test_conversation_specs_are_seeded_and_sized():
    specs = conversation_specs(5, 3, 100, 10, 8, 0.0, vocab_size=300, seed=3)
    again = conversation_specs(5, 3, 100, 10, 8, 0.0, vocab_size=300, seed=3)
    other = conversation_specs(5, 3, 100, 10, 8, 0.0, vocab_size=300, seed=4)
    assert [(s.first, s.new, s.output_lens) for s in specs] == [(s.first, s.new, s.output_lens) for s in again]
    assert [s.first for s in specs] != [s.first for s in other]
    assert all(len(s.first) == 100 and [len(n) for n in s.new] == [10, 10] and s.output_lens == [8] * 3
               for s in specs)
    assert len({tuple(s.first[:16]) for s in specs}) == 5  # conversations share no prefix
    ranged = conversation_specs(50, 2, 100, 10, 8, 0.5, vocab_size=300, seed=1)
    assert {len(s.first) for s in ranged} <= set(range(50, 151)) and len({len(s.first) for s in ranged}) > 5


def _record(prompt_len: int, output_ids: list[int], text: str = "") -> RequestRecord:
    rec = RequestRecord(0, prompt_len, len(output_ids), success=True, output_len=len(output_ids), generated_text=text)
    rec.output_ids = output_ids
    return rec


def test_next_turn_is_prompt_plus_output_plus_new_message():
    (spec,) = conversation_specs(1, 3, 20, 4, 3, vocab_size=300, seed=0)
    state = ConversationState(spec, "ids")
    first = state.sample(0)
    assert first.prompt == spec.first and first.prompt_len == 20 and first.output_len == 3
    assert state.advance(_record(20, [500, 501, 502]), 0) is None
    second = state.sample(1)
    assert second.prompt == spec.first + [500, 501, 502] + spec.new[0] and second.prompt_len == 27
    assert state.advance(_record(27, [9, 9, 9]), 1) is None
    assert state.sample(2).prompt == second.prompt + [9, 9, 9] + spec.new[1]
    # no ids from the server and no tokenizer: the conversation cannot go on exactly
    no_ids = _record(20, [], "abc")
    no_ids.output_len = 3
    assert "no output token ids" in ConversationState(spec, "ids").advance(no_ids, 0)


def test_text_and_chat_histories():
    (spec,) = conversation_specs(1, 2, 6, 3, 2, vocab_size=300, seed=0, as_text=True)
    text = ConversationState(spec, "text")
    text.advance(_record(6, [], " reply"), 0)
    assert text.sample(1).prompt == f"{spec.first} reply {spec.new[0]}"
    chat = ConversationState(spec, "chat")
    assert chat.sample(0).messages == [{"role": "user", "content": spec.first}]
    chat.advance(_record(6, [], "reply"), 0)
    assert chat.sample(1).messages == [{"role": "user", "content": spec.first},
                                       {"role": "assistant", "content": "reply"},
                                       {"role": "user", "content": spec.new[0]}]


# ---- the conversation runner against the plain fake -----------------------------------------------

def _run(fake, specs, think_s=0.0, max_concurrency=None, endpoint="/v1/completions", **cfg):
    fake.ttft_s, fake.itl_s = 0.01, 0.002
    config = EndpointConfig(api_url=fake.url + endpoint, model="fake-model", **cfg)
    bench = BenchmarkRun()
    run(run_conversations(config, specs, LoadConfig(max_concurrency=max_concurrency, disable_tqdm=True), bench,
                          think_s))
    return bench


def test_each_turn_sends_the_history_and_its_reply(fake):
    specs = conversation_specs(3, 3, 24, 5, 4, vocab_size=300, seed=1)
    bench = _run(fake, specs, max_concurrency=2)
    assert len(bench.records) == 9 and all(r.success for r in bench.records)
    by_conv = {}
    for body in fake.bodies:
        by_conv.setdefault(tuple(body["prompt"][:24]), []).append(body["prompt"])
    assert sorted(by_conv) == sorted(tuple(s.first) for s in specs)
    for spec in specs:
        prompts = by_conv[tuple(spec.first)]
        assert [len(p) for p in prompts] == [24, 33, 42]
        for k in range(2):  # the fake's reply to max_tokens 4 is ids 0..3
            assert prompts[k + 1] == prompts[k] + [0, 1, 2, 3] + spec.new[k]
    recs = {(r.conversation, r.turn): r for r in bench.records}
    assert {r.request_id for r in bench.records} == set(range(9))
    assert all(recs[(c, t)].request_id == c * 3 + t for c in range(3) for t in range(3))


def test_think_time_is_honoured_and_concurrency_counts_conversations(fake):
    specs = conversation_specs(2, 3, 8, 2, 2, vocab_size=300, seed=2)
    bench = _run(fake, specs, think_s=0.25, max_concurrency=1)
    recs = sorted(bench.records, key=lambda r: r.start_s)
    assert [(r.conversation, r.turn) for r in recs] == [(recs[0].conversation, t) for t in range(3)] + \
        [(recs[3].conversation, t) for t in range(3)]  # one conversation at a time, turns in order
    for prev, nxt in zip(recs, recs[1:]):
        if prev.conversation == nxt.conversation:
            assert nxt.start_s - (prev.start_s + prev.e2el_s) >= 0.25
    assert bench.duration_s >= 4 * 0.25


def test_a_failed_turn_ends_its_conversation(fake):
    fake.send_token_ids = False  # asked for ids, got none, no tokenizer: turn 1 cannot be built
    specs = conversation_specs(2, 3, 8, 2, 2, vocab_size=300, seed=2)
    bench = _run(fake, specs)
    assert len(bench.records) == 6 and len(fake.bodies) == 2
    failed = [r for r in bench.records if not r.success]
    assert {r.turn for r in failed} == {1, 2} and all("no output token ids" in r.error for r in failed)


def test_text_mode_and_chat_mode_against_the_fake(fake):
    specs = conversation_specs(1, 2, 6, 3, 2, vocab_size=300, seed=0, as_text=True)
    _run(fake, specs, return_token_ids=False)
    first, second = (b["prompt"] for b in fake.bodies)
    assert second == f"{first}t0t1 {specs[0].new[0]}"
    fake.bodies.clear()
    _run(fake, specs, endpoint="/v1/chat/completions")
    assert [m["role"] for m in fake.bodies[1]["messages"]] == ["user", "assistant", "user"]
    assert fake.bodies[1]["messages"][1]["content"] == "t0t1"


# ---- usage, metrics text, summary ----------------------------------------------------------------

def test_cached_tokens_is_unknown_when_missing_not_zero():
    assert cached_tokens({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 3}}) == 3
    assert cached_tokens({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}) == 0
    assert cached_tokens({"prompt_tokens": 5}) is None
    assert cached_tokens({"prompt_tokens_details": None}) is None and cached_tokens(None) is None
    state = _StreamState(0.0)
    state.on_event({"choices": [{"text": "a", "token_ids": [4, 5]}]}, 0.1)
    assert state.ids == [4, 5]


def test_kv_bytes_from_prometheus_text():
    text = ('# HELP pdserve_kv_transfer_bytes_total KV bytes\n'
            'pdserve_kv_transfer_bytes_total{node_id="d0",role="decode",direction="sent"} 7.0\n'
            'pdserve_kv_transfer_bytes_total{node_id="d0",role="decode",direction="received"} 1.5e+03\n'
            'pdserve_kv_transfer_bytes_created{node_id="d0",role="decode",direction="received"} 1.7e9\n')
    assert kv_received_in(text) == 1500.0
    assert kv_received_in("other_total 3\n") is None
    before = FleetSnapshot([], {"d0": 100.0, "d1": 50.0})
    after = FleetSnapshot([{"num_total_blocks": 10}, {"num_total_blocks": 5}], {"d0": 400.0, "d1": 20.0, "d2": 5.0})
    assert kv_bytes_received(before, after) == 300 + 20 + 5  # d1 restarted; d2 is new
    assert kv_bytes_received(None, after) is None and after.cache_blocks == 15


def test_prefix_summary_without_cached_tokens_is_na():
    recs = [_record(40, [1, 2]), _record(40, [1, 2])]
    recs[0].prompt_ids, recs[1].prompt_ids = list(range(10, 50)), list(range(10, 50))
    recs[1].start_s, recs[0].turn, recs[1].turn = 1.0, 0, 1
    s = prefix_summary(recs, [50.0, 99.0], conversation=True)
    assert s["prefix_hit_rate"] is None and s["recomputed_tokens_per_request"] is None
    assert s["kv_bytes_per_request"] is None and s["num_cached_reported"] == 0
    assert s["oracle_hit_rate"] == pytest.approx(32 / 80) and s["oracle_hit_rate_followup"] == pytest.approx(32 / 40)
    recs[1].prompt_ids = None  # a text prompt: no oracle
    assert prefix_summary(recs, [50.0])["oracle_hit_rate"] is None


# ---- end to end: a fake that caches prefixes, lists nodes and counts KV bytes ---------------------

class PrefixFake:
    """Completions over token ids that reports `usage.prompt_tokens_details.cached_tokens` from its own
    unbounded prefix cache (16-token blocks, prompt + output but its last token cached), lists two
    nodes at GET /nodes and exports the received-KV counter, 10 bytes per prompt token not cached."""

    BLOCK, BYTES_PER_TOKEN = 16, 10

    def __init__(self, report_cached: bool = True) -> None:
        self.report_cached = report_cached
        self.prefixes: set[tuple[int, ...]] = set()
        self.received = 5000.0  # bytes before the run
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_get("/nodes", self._nodes)
        app.router.add_get("/d0/metrics", self._metrics)
        app.router.add_get("/p0/metrics", self._prefill_metrics)
        return app

    async def _models(self, request):
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def _prefill_metrics(self, request):
        return web.Response(text="pdserve_up 1\n")

    async def _nodes(self, request):
        return web.json_response({"nodes": [
            {"node_id": "p0", "role": "prefill", "status_url": self.url + "/p0", "num_total_blocks": 300},
            {"node_id": "d0", "role": "decode", "status_url": self.url + "/d0", "num_total_blocks": 500}]})

    async def _metrics(self, request):
        return web.Response(text='pdserve_kv_transfer_bytes_total{node_id="d0",role="decode",direction="received"} '
                                 f"{self.received}\n")

    async def _generate(self, request):
        body = await request.json()
        prompt, n = body["prompt"], body["max_tokens"]
        cached = 0
        for m in range(self.BLOCK, len(prompt), self.BLOCK):  # whole blocks within all but the last token
            if tuple(prompt[:m]) not in self.prefixes:
                break
            cached = m
        self.received += self.BYTES_PER_TOKEN * (len(prompt) - cached)
        output = [1000 + len(prompt) % 7 + i for i in range(n)]
        computed = prompt + output[:-1]
        self.prefixes.update(tuple(computed[:m]) for m in range(self.BLOCK, len(computed) + 1, self.BLOCK))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, tok in enumerate(output):
            await asyncio.sleep(0.002)
            choice = {"index": 0, "text": f"w{tok}", "token_ids": [tok], "finish_reason": "length" if i == n - 1 else None}
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n}
        if self.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.fixture
def prefix_fake():
    server = ServerThread(PrefixFake())
    yield server.fake
    server.stop()


def _bench(url: str, out, *flags: str) -> dict:
    from pdserve.bench.cli import main

    assert main(["serve", "--base-url", url, "--disable-tqdm", "--save-json", str(out), *flags]) == 0
    return json.loads(out.read_text())["runs"][0]


CONVERSATION = ("--dataset-name", "conversation", "--num-conversations", "4", "--conversation-turns", "3",
                "--conversation-history-tokens", "40", "--conversation-new-tokens", "6", "--random-output-len", "5",
                "--max-concurrency", "2", "--num-warmups", "1")


def test_conversation_summary_matches_the_fake_server(prefix_fake, tmp_path, capsys):
    run_ = _bench(prefix_fake.url, tmp_path / "c.json", *CONVERSATION)
    s, reqs = run_["summary"], run_["requests"]
    assert s["completed"] == 12 and s["num_first_turns"] == 4 and s["num_followup_turns"] == 8
    assert all(r["cached_tokens"] is not None and r["turn"] in (0, 1, 2) for r in reqs)
    assert all(r["cached_tokens"] == 0 for r in reqs if r["turn"] == 0)  # warm-ups left nothing behind
    prompt = sum(r["prompt_len"] for r in reqs)
    cached = sum(r["cached_tokens"] for r in reqs)
    assert s["prefix_hit_rate"] == pytest.approx(cached / prompt) and cached > 0
    assert s["recomputed_tokens_per_request"] == pytest.approx((prompt - cached) / 12)
    # the fake's cache is unbounded and the oracle's (800 blocks) never fills: they agree exactly
    assert s["oracle_cache_blocks"] == 800 and s["oracle_hit_rate"] == pytest.approx(s["prefix_hit_rate"])
    assert s["prefix_hit_rate_followup"] == pytest.approx(s["oracle_hit_rate_followup"]) and s["prefix_hit_rate_followup"] > 0.5
    # 10 bytes per recomputed token; the warm-up's bytes went before the first snapshot
    assert s["kv_bytes_per_request"] == pytest.approx(10 * (prompt - cached) / 12)
    for key in ("median_ttft_first_turn_ms", "p99_ttft_first_turn_ms", "median_ttft_followup_ms", "p99_ttft_followup_ms"):
        assert s[key] > 0
    text = capsys.readouterr().out
    assert "Prefix hit rate (cached/prompt):" in text and "Oracle hit rate (800 blocks):" in text
    assert "TTFT P50 / P99 (ms), follow-ups (8):" in text


def test_system_prompt_summary_and_oracle_override(prefix_fake, tmp_path):
    run_ = _bench(prefix_fake.url, tmp_path / "s.json", "--dataset-name", "system-prompt", "--num-prompts", "12",
                  "--num-system-prompts", "3", "--system-prompt-len", "64", "--system-prompt-dist", "round-robin",
                  "--random-input-len", "8", "--random-output-len", "2", "--max-concurrency", "1",
                  "--oracle-cache-blocks", "100")
    s = run_["summary"]
    # one at a time, round-robin over 3 prompts: the first 3 miss, the other 9 hit the 64-token system prompt
    assert s["prefix_hit_rate"] == pytest.approx(9 * 64 / (12 * 72))
    assert s["oracle_hit_rate"] == pytest.approx(s["prefix_hit_rate"]) and s["oracle_cache_blocks"] == 100
    assert "num_followup_turns" not in s and all(r["turn"] is None for r in run_["requests"])


def test_missing_cached_tokens_and_no_nodes_report_na(fake, tmp_path, capsys):
    run_ = _bench(fake.url, tmp_path / "n.json", *CONVERSATION)
    s = run_["summary"]
    assert s["prefix_hit_rate"] is None and s["recomputed_tokens_per_request"] is None
    assert s["kv_bytes_per_request"] is None and s["oracle_cache_blocks"] is None  # unbounded oracle
    assert s["oracle_hit_rate"] > 0 and all(r["cached_tokens"] is None for r in run_["requests"])
    text = capsys.readouterr().out
    assert "Prefix hit rate (cached/prompt):         n/a" in text
    assert "KV bytes received per request:           n/a" in text
    assert "Oracle hit rate (unbounded):" in text


def test_fleet_snapshot_of_a_server_without_nodes(fake):
    assert fleet_snapshot(fake.url) is None
    assert fleet_snapshot(f"http://127.0.0.1:{free_port()}", timeout=2) is None


@pytest.mark.e2e
@pytest.mark.slow
def test_conversations_against_a_real_stack(tmp_path):
    """A tiny-model router + prefill + decode: every turn succeeds, the follow-ups hit the prefill
    node's prefix cache, the fleet's pools size the oracle and the decode node's counter gives bytes."""
    from benchmarks.harness.stack import Stack
    from pdserve.bench.cli import main
    from tests.conftest import save_tiny_model, save_tiny_tokenizer

    model = tmp_path / "tiny"
    save_tiny_model(model, "llama")
    save_tiny_tokenizer(model)
    stack = Stack(model=str(model), extra=["--kv-cache-memory-gb", "0.1"])
    try:
        code = main(["serve", "--base-url", stack.url, "--dataset-name", "conversation", "--num-conversations", "4",
                     "--conversation-turns", "3", "--conversation-history-tokens", "64", "--conversation-new-tokens",
                     "8", "--random-output-len", "8", "--random-vocab-size", "256", "--max-concurrency", "2",
                     "--think-time", "0.05", "--num-warmups", "1", "--disable-tqdm", "--save-json", str(tmp_path / "c.json")])
        nodes = json.loads(urllib.request.urlopen(stack.url + "/nodes", timeout=10).read())["nodes"]
    finally:
        stack.close()
    assert code == 0
    run_ = json.loads((tmp_path / "c.json").read_text())["runs"][0]
    s = run_["summary"]
    assert s["completed"] == 12 and s["num_followup_turns"] == 8
    assert s["oracle_cache_blocks"] == sum(n["num_total_blocks"] for n in nodes)
    assert s["kv_bytes_per_request"] > 0 and 0 < s["oracle_hit_rate_followup"] <= 1
    if s["prefix_hit_rate"] is not None:  # the router reports usage.prompt_tokens_details.cached_tokens
        assert s["prefix_hit_rate_followup"] > 0.5 and s["prefix_hit_rate"] <= s["oracle_hit_rate"] + 1e-9


def test_each_rate_of_a_sweep_draws_fresh_conversations(prefix_fake, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    from pdserve.bench.cli import main

    assert main(["serve", "--base-url", prefix_fake.url, "--disable-tqdm", "--save-json", str(out), "--sweep", "50,inf",
                 "--plot", str(tmp_path), *CONVERSATION]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == ["50", "inf"]
    for run_ in runs:  # the second rate's first turns find nothing of the first rate's in the cache
        assert all(r["cached_tokens"] == 0 for r in run_["requests"] if r["turn"] == 0)
        assert run_["summary"]["oracle_hit_rate"] == pytest.approx(run_["summary"]["prefix_hit_rate"])
    capsys.readouterr()
