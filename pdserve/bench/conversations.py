"""`--dataset-name conversation`: multi-turn conversations, each turn's prompt the whole history.

A conversation has K turns (`--conversation-turns`). Turn 0's prompt is a random user message of
about `--conversation-history-tokens` tokens (built as the `random` dataset builds prompts); turn
k+1's prompt is turn k's prompt, then turn k's reply (`--random-output-len` tokens asked), then a new
random user message of about `--conversation-new-tokens` tokens. So every follow-up turn's prompt
starts with everything the server computed for the previous turn: a server that keeps the KV of a
conversation (prefix caching, and a router that sends the turn where that KV is) recomputes only
the reply's last token and the new message.

The prefix is exact when the prompts are token ids: on the completions endpoint with
`return_token_ids` (the default) turn k+1 sends `prompt_ids + output_ids + new_ids`, the ids the
stream returned. If the server returns no ids, `--tokenizer` re-encodes the reply's text (close,
not exact), else the conversation ends with an error. With `--no-return-token-ids` the prompts are
text (random words, or the tokenizer's decoding of random ids): prompt + reply + " " + new message.
On the chat endpoint the history is messages: user, assistant, user, ...

Load: `--num-conversations` conversations start at `--request-rate` (conversations per second, with
`--burstiness`; default all at once) and `--max-concurrency` caps the conversations in flight (a
conversation holds its slot through its think times). Within a conversation the turns run one after
another, turn k+1 sent `--think-time` seconds after turn k's reply ended. Every turn is one
`RequestRecord` with its `conversation` and `turn`; when a turn fails, the later turns of that
conversation are not sent and are recorded as failed ("not sent: ...").
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import EndpointConfig, send_request
from pdserve.bench.datasets import MIN_RANDOM_TOKEN_ID, SampleRequest, _random_prompt, length_range
from pdserve.bench.request_record import RequestRecord
from pdserve.bench.runner import BenchmarkRun, LoadConfig, probe_before, warm_up

MODES = ("ids", "text", "chat")


@dataclass
class ConversationSpec:
    """What a conversation will send, fixed before the run: the first user message, the new user
    message of each later turn, and each turn's output length (max_tokens)."""

    index: int
    first: list[int] | str
    new: list[list[int] | str]  # turns 1..K-1
    first_len: int  # tokens of `first`
    new_lens: list[int]
    output_lens: list[int]  # turns 0..K-1

    @property
    def num_turns(self) -> int:
        return len(self.output_lens)


def conversation_specs(num_conversations: int, turns: int, history_len: int, new_len: int, output_len: int,
                       range_ratio: float = 0.0, *, vocab_size: int, seed: int = 0, as_text: bool = False,
                       tokenizer=None) -> list[ConversationSpec]:
    """Seeded: the same arguments give the same conversations. Lengths are drawn as vLLM's random
    dataset draws them (`range_ratio`)."""
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_RANDOM_TOKEN_ID}, got {vocab_size}")
    if turns < 1:
        raise ValueError(f"a conversation needs at least one turn, got {turns}")
    rng = random.Random(seed)
    hist_lo, hist_hi = length_range(history_len, range_ratio)
    new_lo, new_hi = length_range(new_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    specs = []
    for i in range(num_conversations):
        n_first = rng.randint(hist_lo, hist_hi)
        first = _random_prompt(rng, n_first, vocab_size, as_text, tokenizer)
        new_lens = [rng.randint(new_lo, new_hi) for _ in range(turns - 1)]
        new = [_random_prompt(rng, n, vocab_size, as_text, tokenizer) for n in new_lens]
        outs = [rng.randint(out_lo, out_hi) for _ in range(turns)]
        specs.append(ConversationSpec(i, first, new, n_first, new_lens, outs))
    return specs


class ConversationState:
    """The history of one conversation as it runs: `sample(turn)` is the next request,
    `advance(record, turn)` appends the reply and the next user message."""

    def __init__(self, spec: ConversationSpec, mode: str, tokenizer=None) -> None:
        if mode not in MODES:
            raise ValueError(f"conversation mode must be one of {MODES}, got {mode!r}")
        self.spec, self.mode, self.tokenizer = spec, mode, tokenizer
        self.prompt: list[int] | str = spec.first if mode != "chat" else ""
        self.messages = [{"role": "user", "content": spec.first}] if mode == "chat" else None
        self.prompt_len = spec.first_len

    def sample(self, turn: int) -> SampleRequest:
        output_len = self.spec.output_lens[turn]
        if self.mode == "chat":
            return SampleRequest(self.messages[-1]["content"], self.prompt_len, output_len,
                                 messages=[dict(m) for m in self.messages])
        return SampleRequest(list(self.prompt) if self.mode == "ids" else self.prompt, self.prompt_len, output_len)

    def advance(self, record: RequestRecord, turn: int) -> str | None:
        """Turn `turn` ended with `record`: build turn+1's prompt. Returns an error (the conversation
        cannot go on) or None."""
        new, new_len = self.spec.new[turn], self.spec.new_lens[turn]
        if self.mode == "ids":
            output = record.output_ids
            if not output and record.output_len > 0:
                if self.tokenizer is None:
                    return ("not sent: the server returned no output token ids, so the history cannot be "
                            "built exactly (pass --tokenizer to re-encode the reply, or --no-return-token-ids "
                            "for text prompts)")
                output = list(self.tokenizer.encode(record.generated_text, add_special_tokens=False))
            self.prompt = list(self.prompt) + list(output) + list(new)
            self.prompt_len = len(self.prompt)
            return None
        if self.mode == "text":
            self.prompt = f"{self.prompt}{record.generated_text} {new}"
        else:
            self.messages += [{"role": "assistant", "content": record.generated_text},
                              {"role": "user", "content": new}]
        self.prompt_len = record.prompt_len + record.output_len + new_len  # an estimate; usage corrects it
        return None


def conversation_mode(cfg: EndpointConfig) -> str:
    """ids on the completions endpoint when the server returns token ids, else text; chat: messages."""
    if cfg.is_chat:
        return "chat"
    return "ids" if cfg.return_token_ids else "text"


async def run_conversations(cfg: EndpointConfig, specs: list[ConversationSpec], load: LoadConfig,
                            run: BenchmarkRun, think_time_s: float = 0.0, tokenizer=None) -> BenchmarkRun:
    """Run every conversation (see the module docstring); records land in `run` as turns finish."""
    if not specs:
        raise ValueError("no conversations to run")
    if think_time_s < 0:
        raise ValueError(f"think time must be >= 0 s, got {think_time_s}")
    mode = conversation_mode(cfg)
    run.request_rate = load.request_rate
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=load.request_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if load.num_warmups:
            warm = await warm_up(session, cfg, load.warmup_samples or [ConversationState(specs[0], mode).sample(0)],
                                 load, sem)
            if any(not r.success for r in warm):
                print(f"warning: {sum(not r.success for r in warm)} of {len(warm)} warm-up requests failed: "
                      f"{next(r.error for r in warm if not r.success)}")
        offsets = (list(load.offsets) if load.offsets is not None
                   else arrival_offsets(len(specs), load.request_rate, load.burstiness, load.seed))
        await probe_before(load, run)
        bar = tqdm(total=sum(s.num_turns for s in specs), disable=load.disable_tqdm,
                   desc=f"conversations, rate {load.request_rate:g}")
        run.start = time.perf_counter()
        turns = max(s.num_turns for s in specs)

        async def one(spec: ConversationSpec, offset: float) -> None:
            await asyncio.sleep(max(0.0, run.start + offset - time.perf_counter()))
            async with sem if sem is not None else contextlib.nullcontext():
                state = ConversationState(spec, mode, tokenizer)
                for turn in range(spec.num_turns):
                    if turn and think_time_s:
                        await asyncio.sleep(think_time_s)
                    record = await send_request(session, cfg, state.sample(turn), spec.index * turns + turn,
                                                clock_zero=run.start)
                    record.conversation, record.turn = spec.index, turn
                    run.records.append(record)
                    bar.update(1)
                    why = None
                    if not record.success:
                        why = f"not sent: turn {turn} of its conversation failed"
                    elif turn + 1 < spec.num_turns:
                        why = state.advance(record, turn)
                    if why is not None:
                        for later in range(turn + 1, spec.num_turns):
                            run.records.append(RequestRecord(spec.index * turns + later, 0, spec.output_lens[later],
                                                             error=why, conversation=spec.index, turn=later))
                            bar.update(1)
                        return

        try:
            await asyncio.gather(*(one(spec, off) for spec, off in zip(specs, offsets)))
            run.end = time.perf_counter()
        finally:
            bar.close()
    return run
