"""What attention needs to find each request's KV in the flattened batch (DESIGN.md, "The batch").

Built once per step by the model runner and passed down explicitly (no module globals).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [S+1] int32: request s owns tokens qsl[s]:qsl[s+1]
    seq_lens: torch.Tensor  # [S] int32: KV length of request s after this step (cached + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32: logical → physical block, padded with -1
    slot_mapping: torch.Tensor  # [T] int32: block * block_size + offset for each new token; -1 = skip
    max_query_len: int  # host-side maxima, so kernel launches need no device-to-host sync
    max_seq_len: int
    # what an attention backend derives from this metadata, kept for the step's other layers (the
    # cpu backend's plan: kernels/cpu_attention.py); new with every AttentionMetadata, so never stale
    plans: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass
class BatchChunk:
    """One request's part of a flattened batch, before it becomes tensors (model_runner.prepare_chunks)."""

    token_ids: list[int]  # fed this step
    start: int  # position of token_ids[0]: the KV of positions [0, start) is already in the blocks
    block_ids: list[int]  # the request's block table; covers positions up to start + len(token_ids)
    num_logits: int  # logits wanted for the last num_logits tokens (0: none)
