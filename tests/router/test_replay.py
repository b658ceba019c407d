"""Outputs unchanged: token streams recorded through the router's old per-token path replay through
the current one (columnar TokenBatch on the wire, batched detokenization, SSE built from templates)
with every token, text, logprob, finish reason and SSE byte identical.

data/router_replay.json.gz was written by data/record_replay.py running on the router as it was
before those changes: real text (accents, CJK, emoji, tabs, math letters) as
token ids of the tiny byte-level tokenizer and of SmolLM2's, nine requests at once (stop strings
that straddle tokens, logprobs with -inf and with the sampled token missing, special tokens
mid-stream, max_tokens cuts), in decode steps of at most one token per request, some requests'
first token arriving after their second, duplicates and out-of-range indexes.
"""

from __future__ import annotations

import asyncio
import gzip
import json
from pathlib import Path

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import Register, Token, TokenBatch, decode
from pdserve.router.openai_responses import ChatFormat, CompletionFormat
from pdserve.router.registry import NodeInfo, Route
from pdserve.router.request_state import RouterRequest
from pdserve.router.router import Router
from tests.conftest import save_tiny_tokenizer

FIXTURE = Path(__file__).parent / "data" / "router_replay.json.gz"
NODE = "d0"


@pytest.fixture(scope="module")
def recorded():
    return {case["tokenizer"]: case for case in json.loads(gzip.decompress(FIXTURE.read_bytes()))["cases"]}


def _tokenizer(name: str, tmp_path):
    if name == "tiny":
        return save_tiny_tokenizer(tmp_path)
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("smollm2"))


def _delta_json(d) -> dict:
    return {"text": d.text, "token_ids": d.token_ids, "finish_reason": d.finish_reason,
            "logprobs": [[e.token_id, e.token, e.logprob, [list(x) for x in e.top], e.text_offset] for e in d.logprobs]}


async def _replay(case: dict, tokenizer) -> tuple[list, list, dict]:
    router = Router(tokenizer, "m")  # not started: the handler is called directly, as the control loop would
    route = Route(NodeInfo(Register("p0", "prefill", "m"), b"p0", 0.0),
                  NodeInfo(Register(NODE, "decode", "m"), NODE.encode(), 0.0))
    specs = case["requests"]
    reqs, fmts = [], {}
    for r, spec in enumerate(specs):
        params = SamplingParams(max_tokens=spec["max_tokens"], stop=spec["stop"], logprobs=spec["logprobs"],
                                ignore_eos=True)
        req = RouterRequest(f"r{r}", spec["prompt"], params, tokenizer)
        router.table.dispatched(req, route, len(spec["prompt"]))
        reqs.append(req)
        for kind, cls in (("completion", CompletionFormat), ("chat", ChatFormat)):
            fmt = cls(f"id-{r}", "m", include_usage=False, top_logprobs=spec["logprobs"], return_token_ids=r % 2 == 0)
            fmt.created = 1700000000
            fmts[(r, kind)] = fmt
    outputs, sse = [[] for _ in specs], {key: [] for key in fmts}
    first = dict.fromkeys(fmts, True)
    for b, batch in enumerate(case["plan"]):
        tokens = []
        for r, i in batch:
            spec = specs[r]
            maps = spec["logprob_maps"]
            in_range = i < len(spec["ids"])
            tokens.append(Token(reqs[r].wire_id, i, spec["ids"][i] if in_range else 0,
                                {k: v for k, v in maps[i]} if maps and in_range else None,
                                spec["finish"] if i == len(spec["ids"]) - 1 else None))
        await router.handlers.on_token_batch(NODE.encode(), decode(TokenBatch.from_tokens(NODE, tokens).encode()))
        for r, req in enumerate(reqs):
            deltas = req.take_deltas()
            assert len(deltas) <= 1, "one delta per request per batch"
            if deltas:
                outputs[r].append([b, _delta_json(deltas[0])])
                for kind in ("completion", "chat"):
                    sse[(r, kind)].append([b, fmts[(r, kind)].sse(deltas[0], first[(r, kind)]).decode()])
                    first[(r, kind)] = False
    return reqs, outputs, sse


@pytest.mark.parametrize("tokenizer_name", ["tiny", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_recorded_streams_replay_identically(tokenizer_name, recorded, tmp_path):
    case = recorded[tokenizer_name]
    reqs, outputs, sse = asyncio.run(_replay(case, _tokenizer(tokenizer_name, tmp_path)))
    num_tokens = 0
    for r, spec in enumerate(case["requests"]):
        name = spec["name"]
        assert outputs[r] == spec["outputs"], name
        for kind in ("completion", "chat"):
            assert sse[(r, kind)] == spec["sse"][kind], (name, kind)
        assert reqs[r].output_token_ids == spec["output_token_ids"], name
        assert reqs[r].status.value == spec["final_status"] and reqs[r].finish_reason == spec["finish_reason"], name
        num_tokens += len(spec["output_token_ids"])
    assert num_tokens > 300  # the fixture is not empty
    assert {s["final_status"] for s in case["requests"]} == {"finished", "decoding"}
    assert any(s["stop"] and len(s["output_token_ids"]) < len(s["ids"]) for s in case["requests"])  # stops hit
