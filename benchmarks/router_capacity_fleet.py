"""Fake prefill and decode nodes for benchmarks/router_capacity.py: the project's own wire messages
and router links (node/router_links.py), no model, tokens as fast as asked.

A prefill fake answers each PrefillRequest with its FirstToken at once and hands the request to
the decode fake it names (in process: the KV transfer is not what is measured). The decode fake
steps every 1/rate seconds (`rate` is shared with the driver, so it can change between runs) and
each step sends one TokenBatch with one token for every request it runs, as a real decode node
does. With several router processes (`--api-server-count N`) both fakes link to all of them
(node/router_links.py, as real nodes do): the prefill fake answers each request on the router it
came from, the decode fake adopts that router for it (what a real decode node learns from the
KVReady), and each TokenBatch is split per router. The tokens are real: SmolLM2's token ids of real text (`corpus_token_ids`), each request
starting at its own offset, with finish_reason "length" at max_tokens. Heartbeats list the
requests each fake holds, so the router neither aborts them nor thinks them lost.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.engine.sampling_params import SamplingParams
from pdserve.node.router_discovery import RouterDiscovery
from pdserve.node.router_links import RouterLinks
from pdserve.protocol.messages import (
    Abort,
    FirstToken,
    Heartbeat,
    PrefillRequest,
    Register,
    Token,
    TokenBatch,
)

MODEL = "smollm2"
NUM_BLOCKS = 1_000_000  # the fakes never run out of KV
MAX_NUM_SEQS = 1_000_000  # nor refuse work: admission is the router's to measure


def corpus_token_ids(tokenizer) -> list[int]:
    """Token ids of real text: this repository's README and architecture notes (prose, code,
    tables, non-ASCII), encoded by the default model's tokenizer."""
    root = Path(__file__).resolve().parent.parent
    text = "\n".join(p.read_text(encoding="utf-8") for p in (root / "README.md", root / "docs" / "ARCHITECTURE.md")
                     if p.exists())
    return tokenizer.encode(text, add_special_tokens=False)


@dataclass
class _Running:
    request_id: str
    offset: int  # where in the corpus its tokens start
    max_tokens: int
    logprobs: bool
    next_index: int = 1  # index 0 was the prefill's FirstToken


def run_fleet(router_addrs: list[str], corpus: list[int], rate, stop, *, node_prefix: str = "fake",
              cpus: set[int] | None = None) -> None:
    """Serve the routers at `router_addrs` until `stop` (a multiprocessing Event) is set; `rate` (a
    multiprocessing Value) is the decode steps per second, so tokens per second per stream."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    common = dict(model=MODEL, num_total_blocks=NUM_BLOCKS, block_size=16, max_model_len=1 << 20,
                  pid=os.getpid(), max_num_seqs=MAX_NUM_SEQS)
    decode_id = f"{node_prefix}-d0"

    def links(register: Register) -> RouterLinks:
        return RouterLinks(RouterDiscovery(list(router_addrs), refresh_s=0), register, heartbeat_s=0.5)

    prefill = links(Register(node_id=f"{node_prefix}-p0", role="prefill", **common))
    decode = links(Register(node_id=decode_id, role="decode", kv_addr="tcp://127.0.0.1:1", **common))
    running: dict[str, _Running] = {}
    try:
        for link in (prefill, decode):
            link.set_heartbeat(_heartbeat(link, []))
            link.register()
        next_step = time.monotonic()
        while not stop.is_set():
            timeout_ms = max(0, int((next_step - time.monotonic()) * 1000))
            for msg in prefill.poll(timeout_ms):
                _on_prefill_message(msg, prefill, decode, running, corpus, decode_id)
            for msg in decode.poll(0):
                if isinstance(msg, Abort):
                    running.pop(msg.request_id, None)
            now = time.monotonic()
            if now >= next_step:
                _step(decode, running, corpus)
                next_step = max(next_step + 1.0 / rate.value, now - 0.1)  # catch up, within reason
            prefill.maybe_heartbeat(lambda: _heartbeat(prefill, []))
            decode.maybe_heartbeat(lambda: _heartbeat(decode, list(running)))
    finally:
        for link in (prefill, decode):
            link.deregister()
            link.close()


def _heartbeat(link: RouterLinks, request_ids: list[str]) -> Heartbeat:
    return Heartbeat(node_id=link.register_msg.node_id, num_free_blocks=NUM_BLOCKS, num_total_blocks=NUM_BLOCKS,
                     num_running=len(request_ids), num_waiting=0, ready=True, request_ids=request_ids)


def _on_prefill_message(msg, link: RouterLinks, decode: RouterLinks, running: dict[str, _Running],
                        corpus: list[int], decode_id: str) -> None:
    if not isinstance(msg, PrefillRequest):
        return  # an Abort before the hand-off: nothing is held here
    sampling = SamplingParams.from_dict(msg.sampling)
    offset = hash(msg.request_id) % len(corpus)
    logprobs = sampling.logprobs is not None
    token_id = corpus[offset]
    last = sampling.max_tokens <= 1
    link.send(FirstToken(request_id=msg.request_id, token_id=token_id, logprobs={token_id: -0.25} if logprobs else None,
                         finish_reason="length" if last else None, num_prompt_tokens=len(msg.prompt_token_ids)))
    if not last and msg.decode_node_id == decode_id:
        running[msg.request_id] = _Running(msg.request_id, offset, sampling.max_tokens, logprobs)
        decode.adopt(msg.request_id, link.origin(msg.request_id))  # its tokens go back to its router


def _step(link: RouterLinks, running: dict[str, _Running], corpus: list[int]) -> None:
    tokens, done = [], []
    n = len(corpus)
    for req in running.values():
        i = req.next_index
        token_id = corpus[(req.offset + i) % n]
        finish = "length" if i == req.max_tokens - 1 else None
        tokens.append(Token(req.request_id, i, token_id, {token_id: -0.25} if req.logprobs else None, finish))
        req.next_index += 1
        if finish:
            done.append(req.request_id)
    for request_id in done:
        del running[request_id]
    if tokens:
        link.send(TokenBatch.from_tokens(link.register_msg.node_id, tokens))
