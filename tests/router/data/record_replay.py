"""Writes router_replay.json.gz: fixed token streams through the router's per-token path, and what
came out (deltas per batch, SSE bytes, final state). It was run on the router as it was before the
columnar TokenBatch, batched detokenization and templated SSE (commit b2c4e80), and
tests/router/test_replay.py checks the current router against that file. The logic below is the
one that ran then, tidied (names, lint); run on today's code it writes the same file.

    python -m tests.router.data.record_replay tests/router/data/router_replay.json
    gzip -9 tests/router/data/router_replay.json
"""

from __future__ import annotations

import json
import sys
import tempfile

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import Token
from pdserve.router.openai_responses import ChatFormat, CompletionFormat
from pdserve.router.request_state import Delta, RouterRequest
from tests.conftest import save_tiny_tokenizer

TEXT = ("Hello, world! Ça va? 日本語のテキスト 🎉🎉 naïve café\n\tTabs  and   spaces."
        " The quick brown fox jumps over the lazy dog; 1234567890 — “quotes” ÷ ∑ 𝔘𝔫𝔦.")


def tokenizers() -> dict:
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    return {"tiny": save_tiny_tokenizer(tempfile.mkdtemp()),
            "smollm2": AutoTokenizer.from_pretrained(resolve_model("smollm2"))}


def scenarios(tok) -> list[dict]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompt = tok.encode("Say something:", add_special_tokens=False)
    eos = tok.eos_token_id
    n = len(ids)

    def top_map(i: int, t: int) -> dict:  # deterministic; sometimes without the sampled token, with -inf
        top = {int(t): -0.1 * (i % 5) - 0.01, int(ids[(i + 1) % n]): -1.5 - i * 0.001, int(ids[(i + 7) % n]): -3.25}
        if i % 4 == 3:
            top.pop(int(t))
        if i % 6 == 5:
            top[int(ids[(i + 3) % n])] = float("-inf")
        return top

    out = [dict(name="plain_length", ids=ids, stop=[], logprobs=None, max_tokens=n, finish="length"),
           dict(name="stop_straddles", ids=ids, stop=["ld! Ç", "zzz"], logprobs=None, max_tokens=n + 5, finish="length"),
           dict(name="stop_cjk", ids=ids, stop=["テキ"], logprobs=2, max_tokens=n, finish="length"),
           dict(name="logprobs_all", ids=ids, stop=[], logprobs=3, max_tokens=n, finish="length"),
           dict(name="stop_at_end_emoji", ids=ids[: n // 2], stop=["∑"], logprobs=None, max_tokens=n, finish="length"),
           dict(name="eos_in_middle", ids=ids[:10] + [eos] + ids[10:20] + [eos], stop=[], logprobs=1, max_tokens=n,
                finish="stop"),
           dict(name="max_tokens_cut", ids=ids, stop=[], logprobs=None, max_tokens=12, finish="length"),
           dict(name="stop_many", ids=ids, stop=["fox", "—", "quick"], logprobs=0, max_tokens=n, finish="length"),
           dict(name="stop_space", ids=ids, stop=["  "], logprobs=None, max_tokens=n, finish="length")]
    for s in out:
        s["prompt"] = prompt
        s["logprob_maps"] = [top_map(i, t) for i, t in enumerate(s["ids"])] if s["logprobs"] is not None else None
    return out


def batches(num_reqs: int, lens: list[int]) -> list[list[tuple[int, int]]]:
    """(request, index) per batch: at most one token per request per step; an odd request's
    index 0 (the prefill's) comes after its index 1; some requests skip steps; request 2 gets a
    duplicate and an out-of-range index."""
    out, step, pos = [], 0, [0] * num_reqs
    while any(pos[r] < lens[r] for r in range(num_reqs)):
        batch = []
        for r in range(num_reqs):
            if (step + r) % 3 == 2 and pos[r] > 0:
                continue
            if 0 <= pos[r] < lens[r]:
                i = pos[r]
                if r % 2 == 1 and i == 0 and lens[r] > 1:
                    batch.append((r, 1))
                    pos[r] = -1  # index 0 still owed
                else:
                    batch.append((r, i))
                    pos[r] = i + 1
        for r in range(num_reqs):
            if pos[r] == -1 and not any(b[0] == r for b in batch):
                batch.append((r, 0))
                pos[r] = 2
        if step == 5 and num_reqs > 2:
            batch += [(2, 1), (2, 10_000)]
        out.append(batch)
        step += 1
    return out


def delta_json(d: Delta) -> dict:
    return {"text": d.text, "token_ids": d.token_ids, "finish_reason": d.finish_reason,
            "logprobs": [[e.token_id, e.token, e.logprob, [list(x) for x in e.top], e.text_offset] for e in d.logprobs]}


def merge(deltas: list[Delta]) -> Delta:
    m = Delta()
    for d in deltas:
        m.text += d.text
        m.token_ids += d.token_ids
        m.logprobs += d.logprobs
        m.finish_reason = d.finish_reason or m.finish_reason
    return m


def sse(fmt, delta: Delta, first: bool) -> str:
    return "".join("data: " + json.dumps(c, ensure_ascii=False) + "\n\n" for c in fmt.chunks(delta, first))


def record_one(tok_name: str, tok) -> dict:
    scs = scenarios(tok)
    plan = batches(len(scs), [len(s["ids"]) for s in scs])
    reqs, fmts = [], {}
    for r, s in enumerate(scs):
        params = SamplingParams(max_tokens=s["max_tokens"], stop=s["stop"], logprobs=s["logprobs"], ignore_eos=True)
        reqs.append(RouterRequest(f"r{r}", s["prompt"], params, tok))
        for kind, cls in (("completion", CompletionFormat), ("chat", ChatFormat)):
            f = cls(f"id-{r}", "m", include_usage=False, top_logprobs=s["logprobs"], return_token_ids=(r % 2 == 0))
            f.created = 1700000000
            fmts[(r, kind)] = f
    outputs = [[] for _ in scs]
    first = dict.fromkeys(fmts, True)
    sse_out = {key: [] for key in fmts}
    for b, batch in enumerate(plan):
        got: dict[int, list[Delta]] = {}
        for r, i in batch:
            s = scs[r]
            in_range = i < len(s["ids"])
            maps = s["logprob_maps"][i] if s["logprob_maps"] is not None and in_range else None
            d = reqs[r].receive(Token(reqs[r].wire_id, i, s["ids"][i] if in_range else 0, maps,
                                      s["finish"] if i == len(s["ids"]) - 1 else None))
            if d is not None:
                got.setdefault(r, []).append(d)
        for r, ds in got.items():
            m = merge(ds)
            outputs[r].append([b, delta_json(m)])
            for kind in ("completion", "chat"):
                sse_out[(r, kind)].append([b, sse(fmts[(r, kind)], m, first[(r, kind)])])
                first[(r, kind)] = False
    cases = []
    for r, s in enumerate(scs):
        cases.append({**{k: s[k] for k in ("name", "ids", "stop", "logprobs", "max_tokens", "finish", "prompt")},
                      "logprob_maps": [[[k, v] for k, v in m.items()] for m in s["logprob_maps"]]
                      if s["logprob_maps"] else None,
                      "outputs": outputs[r], "sse": {k: sse_out[(r, k)] for k in ("completion", "chat")},
                      "final_status": reqs[r].status.value, "output_token_ids": reqs[r].output_token_ids,
                      "finish_reason": reqs[r].finish_reason})
    return {"tokenizer": tok_name, "plan": plan, "requests": cases}


def main(path: str) -> None:
    fixture = {"text": TEXT, "cases": [record_one(name, tok) for name, tok in tokenizers().items()]}
    with open(path, "w") as f:
        f.write(json.dumps(fixture, ensure_ascii=False, allow_nan=True))


if __name__ == "__main__":
    main(sys.argv[1])
