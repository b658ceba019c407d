"""A draft model sharing the target's tokenizer proposes k tokens greedily, one forward each.

Its KV lives in a pool of its own with the same block ids as the target's: a request's draft KV
sits in the same blocks (same table, same slots) of the draft pool, so the scheduler's
allocation, lookahead slots and rollback cover both models and no second block manager exists.

The draft's KV is built here, on the node that decodes, the first time a request has lookahead
slots: one draft forward over its whole context (prompt + outputs) catches it up. It is never
shipped with the target's KV from a prefill node: a small draft's prefill costs a fraction of
the target's, and a KV hand-off that carried both models would tie every prefill node to the
decode node's draft choice.

Per request, `num_computed` says how many leading positions of the draft pool hold KV of the
request's current tokens. After verification only the positions the target kept stay valid,
so each step starts from min(num_computed, request.num_computed_tokens). A preemption (recompute
or swap: only the target's KV is swapped) throws the draft's state away.

Step, for the requests with lookahead slots (m of them for one request, m <= k):

    forward 1:  feed all_token_ids[num_computed:]   (catch-up, usually 1-2 tokens) → d_1
                (the first catch-up is the whole context: split into forwards of at most
                 max_num_batched_tokens)
    forward j:  feed d_j-1 at position N + j - 2     (one token per request)        → d_j, j = 2..m

The draft writes positions up to N + m - 2, inside the slots the scheduler allocated for the
target's verification (up to N + m - 1).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from pdserve.engine.attention_metadata import BatchChunk
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import RequestStatus


@dataclass
class _DraftState:
    request: object  # the Request (its status says when to forget it)
    num_preemptions: int
    num_computed: int = 0


class DraftProposer:
    def __init__(self, num_speculative_tokens: int, draft_path, config: EngineConfig,
                 target: ModelConfig, max_model_len: int) -> None:
        self.k = num_speculative_tokens
        self.model_config = ModelConfig.from_pretrained(draft_path)
        mc = self.model_config
        if mc.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocabulary ({mc.vocab_size}) differs from "
                             f"the target's ({target.vocab_size}); a draft must share the tokenizer")
        if mc.max_position_embeddings < max_model_len:
            raise ValueError(f"speculative_config: the draft model serves {mc.max_position_embeddings} positions, "
                             f"fewer than max_model_len={max_model_len}; lower --max-model-len")
        draft_config = dataclasses.replace(config, model_path=draft_path, enforce_eager=True,
                                           speculative_config=None)
        self.runner = ModelRunner(draft_config, mc, max_model_len)
        self.states: dict[str, _DraftState] = {}
        self.num_forwards = 0  # draft forward passes (for benchmarks)
        self.num_catch_up_tokens = 0  # tokens fed to catch the draft's KV up (prompt builds included)
        self.seconds = 0.0  # in draft forwards (each ends in a host read, so on CUDA too it is wall time)

    def kv_bytes_per_block(self) -> int:
        cfg = self.runner.config
        return (self.model_config.kv_elements_per_token * cfg.block_size
                * torch.tensor([], dtype=cfg.torch_dtype).element_size())

    def allocate_kv(self, num_blocks: int) -> None:
        self.runner.allocate_kv(num_blocks, 0)

    def propose(self, out) -> None:
        """Fill `spec_token_ids` of every scheduled request that has lookahead slots."""
        self._forget_finished()
        items = [s for s in out.scheduled if s.num_lookahead_tokens]
        if not items:
            return
        chunks = []
        for s in items:
            state = self._state(s.request)
            start = min(state.num_computed, s.request.num_computed_tokens)
            chunks.append(BatchChunk(s.request.all_token_ids[start:], start, s.block_ids, 1))
            self.num_catch_up_tokens += len(chunks[-1].token_ids)
            s.spec_token_ids = []
        tokens = self._catch_up(chunks)
        active = list(zip(items, tokens))
        for j in range(1, max(s.num_lookahead_tokens for s in items) + 1):
            for s, token in active:
                s.spec_token_ids.append(token)
                self.states[s.request.request_id].num_computed = s.request.num_tokens + j - 1
            active = [(s, t) for s, t in active if s.num_lookahead_tokens > j]
            if not active:
                break
            position = [s.request.num_tokens + j - 1 for s, _ in active]
            tokens = self._forward([BatchChunk([t], p, s.block_ids, 1) for (s, t), p in zip(active, position)])
            active = [(s, t) for (s, _), t in zip(active, tokens)]

    def _catch_up(self, chunks: list[BatchChunk]) -> list[int]:
        """Forward 1 (each chunk's last token's argmax), in forwards of at most the engine's token
        budget: a request's first catch-up is its whole context, and many may arrive at once. A
        chunk that does not fit is split; its later pieces go to later forwards, in order."""
        budget = self.runner.config.max_num_batched_tokens
        tokens: list[int] = [0] * len(chunks)
        batch: list[tuple[int | None, BatchChunk]] = []  # (chunk index if its last piece, piece)
        size = 0
        for i, chunk in enumerate(chunks):
            ids, start = chunk.token_ids, chunk.start
            while ids:
                if size == budget:
                    self._flush(batch, tokens)
                    batch, size = [], 0
                piece, ids = ids[: budget - size], ids[budget - size :]
                batch.append((None if ids else i, BatchChunk(piece, start, chunk.block_ids, 0 if ids else 1)))
                start += len(piece)
                size += len(piece)
        self._flush(batch, tokens)
        return tokens

    def _flush(self, batch: list[tuple[int | None, BatchChunk]], tokens: list[int]) -> None:
        if not batch:
            return
        got = iter(self._forward([piece for _, piece in batch]))
        for index, _ in batch:
            if index is not None:
                tokens[index] = next(got)

    def _forward(self, chunks: list[BatchChunk]) -> list[int]:
        self.num_forwards += 1
        start = time.perf_counter()
        tokens = self.runner.greedy_next(chunks)
        self.seconds += time.perf_counter() - start
        return tokens

    def _state(self, request) -> _DraftState:
        state = self.states.get(request.request_id)
        if state is None or state.request is not request or state.num_preemptions != request.num_preemptions:
            state = self.states[request.request_id] = _DraftState(request, request.num_preemptions)
        return state

    def _forget_finished(self) -> None:
        gone = [rid for rid, st in self.states.items() if st.request.status is not RequestStatus.RUNNING]
        for rid in gone:
            del self.states[rid]
