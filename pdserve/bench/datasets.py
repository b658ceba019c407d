"""The prompts a benchmark sends: random token ids (vLLM's `random` dataset), the same with a bimodal
output length (`bimodal`: most requests short, some long, for shortest-job-first), ShareGPT conversations,
or `system-prompt`: a few long random system prompts shared by many users, each request one of them
plus its own random user suffix (agents: the prefix-cache workload). Multi-turn conversations, whose
prompts depend on the replies, are built as they run: `conversations.py`.

Lengths follow vLLM: with `range_ratio` r, input and output lengths are drawn uniformly from the
integers in [floor(len * (1 - r)), ceil(len * (1 + r))] (outputs at least 1). Random prompts are
token ids, which the completions endpoint takes as they are, so the server sees exactly the drawn
length and no two prompts share a prefix; chat needs text, so there the ids are decoded with the
tokenizer when one is given, else the prompt is that many random common words (about one token each).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

# Ids below this are often special tokens (BOS, EOS, chat markers); random prompts avoid them.
MIN_RANDOM_TOKEN_ID = 10

_WORDS = ("the of and to in is was for on that with as by at from his her an which are this be had not "
          "but have one were they all their there been has when who will more no if out so said what up "
          "its about than into them can only other new some could time these two may then do first any "
          "my now such like our over man me even most made after also did many before must through back "
          "years where much your way well down should because each just those people how too little state "
          "good very make world still own see men work long get here between both life being under never "
          "day same another know while last might us great old year off come since against go came right").split()


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (completions endpoint only)
    prompt_len: int  # tokens (estimated as chars / 4 for text without a tokenizer)
    output_len: int  # the max_tokens to ask for
    messages: list[dict] | None = None  # chat messages to send instead of one user message of `prompt`

    def __post_init__(self) -> None:
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


def length_range(length: int, range_ratio: float, minimum: int = 1) -> tuple[int, int]:
    """The inclusive [low, high] range of lengths vLLM draws from."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"random range ratio must be in [0, 1), got {range_ratio}")
    return max(minimum, math.floor(length * (1 - range_ratio))), max(minimum, math.ceil(length * (1 + range_ratio)))


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float, *, vocab_size: int,
                    seed: int = 0, as_text: bool = False, tokenizer=None) -> list[SampleRequest]:
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_RANDOM_TOKEN_ID}, got {vocab_size}")
    rng = random.Random(seed)
    in_lo, in_hi = length_range(input_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    out = []
    for _ in range(num_prompts):
        n_in, n_out = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        out.append(SampleRequest(_random_prompt(rng, n_in, vocab_size, as_text, tokenizer), n_in, n_out))
    return out


def _random_prompt(rng: random.Random, n_in: int, vocab_size: int, as_text: bool, tokenizer) -> str | list[int]:
    ids = [rng.randrange(MIN_RANDOM_TOKEN_ID, vocab_size) for _ in range(n_in)]
    if as_text:
        return tokenizer.decode(ids) if tokenizer is not None else " ".join(rng.choices(_WORDS, k=n_in))
    return ids


def length_requests(lengths: list[tuple[int, int]], *, vocab_size: int, seed: int = 0, as_text: bool = False,
                    tokenizer=None) -> list[SampleRequest]:
    """Random prompts (as `random_requests` builds them) of given (input_len, output_len) pairs, e.g. a
    trace's. A length below 1 is taken as 1 (a trace may record 0 generated tokens)."""
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_RANDOM_TOKEN_ID}, got {vocab_size}")
    rng = random.Random(seed)
    out = []
    for n_in, n_out in lengths:
        n_in, n_out = max(1, n_in), max(1, n_out)
        out.append(SampleRequest(_random_prompt(rng, n_in, vocab_size, as_text, tokenizer), n_in, n_out))
    return out


def bimodal_requests(num_prompts: int, input_len: int, output_lens: tuple[int, int], long_fraction: float, *,
                     vocab_size: int, seed: int = 0, as_text: bool = False, tokenizer=None) -> list[SampleRequest]:
    """Random prompts of `input_len` tokens; each asks for the short output length (`output_lens[0]`)
    or, with probability `long_fraction`, the long one: the shortest-job-first workload (80% at 16
    and 20% at 512 by default in `pdserve bench serve`). Seeded: the classes do not depend on the
    prompts' ids."""
    short_len, long_len = output_lens
    if not 0 < short_len < long_len:
        raise ValueError(f"bimodal output lengths must be SHORT,LONG with 0 < SHORT < LONG, got {short_len},{long_len}")
    if not 0 <= long_fraction <= 1:
        raise ValueError(f"bimodal long fraction must be in [0, 1], got {long_fraction}")
    rng = random.Random(seed + 1)
    samples = random_requests(num_prompts, input_len, short_len, 0.0, vocab_size=vocab_size, seed=seed,
                              as_text=as_text, tokenizer=tokenizer)
    for sample in samples:
        if rng.random() < long_fraction:
            sample.output_len = long_len
    return samples


SYSTEM_PROMPT_DISTS = ("uniform", "zipf", "round-robin")


def system_prompt_requests(num_prompts: int, num_system_prompts: int, system_prompt_len: int, user_len: int,
                           output_len: int, range_ratio: float = 0.0, *, vocab_size: int, seed: int = 0,
                           dist: str = "uniform", as_text: bool = False,
                           tokenizer=None) -> tuple[list[SampleRequest], list[int]]:
    """`num_prompts` requests, each one of `num_system_prompts` random system prompts of
    `system_prompt_len` tokens followed by a fresh random user suffix (about `user_len` tokens, with
    the range ratio, as the output length). Which system prompt: seeded uniform draws, zipf (prompt i
    drawn with weight 1 / (i + 1): a few agents are most of the traffic) or round-robin. Returns the
    requests and each one's system prompt index. As token ids the prompt is system + user ids (the
    prefix is exact); as text (chat) the request carries a system message and a user message, and
    the completions text is the two joined by a newline."""
    if vocab_size <= MIN_RANDOM_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {MIN_RANDOM_TOKEN_ID}, got {vocab_size}")
    if num_system_prompts < 1 or system_prompt_len < 1:
        raise ValueError(f"need at least one system prompt of at least one token, got {num_system_prompts} "
                         f"of {system_prompt_len}")
    if dist not in SYSTEM_PROMPT_DISTS:
        raise ValueError(f"system prompt distribution must be one of {', '.join(SYSTEM_PROMPT_DISTS)}, got {dist!r}")
    rng = random.Random(seed)
    systems = [_random_prompt(rng, system_prompt_len, vocab_size, as_text, tokenizer) for _ in range(num_system_prompts)]
    in_lo, in_hi = length_range(user_len, range_ratio)
    out_lo, out_hi = length_range(output_len, range_ratio)
    weights = [1.0 / (i + 1) for i in range(num_system_prompts)]
    out, which = [], []
    for i in range(num_prompts):
        if dist == "round-robin":
            k = i % num_system_prompts
        elif dist == "zipf":
            k = rng.choices(range(num_system_prompts), weights=weights)[0]
        else:
            k = rng.randrange(num_system_prompts)
        n_in, n_out = rng.randint(in_lo, in_hi), rng.randint(out_lo, out_hi)
        user = _random_prompt(rng, n_in, vocab_size, as_text, tokenizer)
        system = systems[k]
        if isinstance(system, list):
            out.append(SampleRequest(system + user, system_prompt_len + n_in, n_out))
        else:
            messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
            out.append(SampleRequest(system + "\n" + user, system_prompt_len + n_in, n_out, messages=messages))
        which.append(k)
    return out, which


def parse_output_lens(text: str) -> tuple[int, int]:
    """'16,512' -> (16, 512)."""
    try:
        short_len, long_len = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"bimodal output lengths are SHORT,LONG (two integers), got {text!r}") from None
    return short_len, long_len


def count_tokens(text: str, tokenizer=None) -> int:
    if tokenizer is not None:
        return len(tokenizer.encode(text, add_special_tokens=False))
    return max(1, len(text) // 4)  # about four characters a token in English BPE vocabularies


def first_exchange(conversation: list[dict]) -> tuple[str, str] | None:
    """The first human turn and the model's reply to it, or None when either is missing."""
    for i, turn in enumerate(conversation):
        if turn.get("from") in ("human", "user"):
            for reply in conversation[i + 1:]:
                if reply.get("from") in ("gpt", "assistant", "chatgpt"):
                    return str(turn.get("value", "")), str(reply.get("value", ""))
            return None
    return None


def sharegpt_requests(path: str | Path, num_prompts: int, *, seed: int = 0, tokenizer=None,
                      output_len_cap: int | None = None) -> list[SampleRequest]:
    """`num_prompts` conversations drawn in a seeded order (fewer if the file has fewer usable ones).
    The output length is the reply's length, capped at `output_len_cap`."""
    entries = json.loads(Path(path).read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}}")
    order = list(range(len(entries)))
    random.Random(seed).shuffle(order)
    out = []
    for i in order:
        pair = first_exchange(entries[i].get("conversations") or []) if isinstance(entries[i], dict) else None
        if pair is None or not pair[0].strip():
            continue
        prompt, reply = pair
        n_out = count_tokens(reply, tokenizer) if reply else 1
        if output_len_cap is not None:
            n_out = min(n_out, output_len_cap)
        out.append(SampleRequest(prompt, count_tokens(prompt, tokenizer), max(1, n_out)))
        if len(out) == num_prompts:
            break
    return out


def load_tokenizer(name: str | None):
    """A transformers tokenizer from a local folder (or pdserve's model alias); None without a name."""
    if not name:
        return None
    from transformers import AutoTokenizer

    path = Path(name).expanduser()
    if not path.is_dir():
        from pdserve.engine.loader import resolve_model  # the "smollm2" alias and .gguf files

        path = resolve_model(name)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def vocab_size_of(tokenizer, default: int) -> int:
    return len(tokenizer) if tokenizer is not None else default
