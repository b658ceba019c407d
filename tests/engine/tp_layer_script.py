"""One tensor-parallel rank for tests/engine/test_tp_layers.py:
``python -m tests.engine.tp_layer_script '<json>'``, run from the repository root.

The JSON (plain values; nothing is pickled) holds rank, size, init_method, timeout_s, mode, out
(a folder) and, for the "model" mode, model_dir. Modes:

    model      the tiny model's shard: a few steps (prefill, a chunked prefill, decodes) through
               LlamaForCausalLM with a paged KV cache of this rank's heads
    layers     each parallel layer alone on seeded weights (`layer_weights`)
    dead_peer  rank 1 exits at once; rank 0's all-reduce must raise TPCollectiveError
    hung_peer  rank 1 sleeps; rank 0's all-reduce must raise TPCollectiveError after timeout_s
    alone      rank 0 of 2 with no peer: init_tp must raise TPCollectiveError after timeout_s

Rank r writes out/rank<r>.safetensors (tensors) and out/rank<r>.json (plain values). The test
process imports `run_model` and `layer_weights` to compute the TP 1 reference the same way.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

BLOCK_SIZE = 4
BLOCKS_PER_SEQ = 8  # room for the longest prompt plus the decoded tokens
PROMPTS = [[1, 5, 9, 2, 259], [7, 3, 255, 4, 8, 6, 2, 1, 9, 10, 11, 12, 13, 14, 15, 16, 17], [258, 3, 33, 4, 5, 90, 2, 8, 1]]
FIRST_CHUNK = {1: 10}  # prompt 1 is prefilled in two chunks: 10 tokens, then the rest with cached KV
NUM_STEPS = 5


def make_batch(chunks: list[tuple[list[int], int, list[int]]]):
    """(ids [T], positions [T], AttentionMetadata, last-token indices [S]) for chunks of
    (token ids, position of the first, block table), as the model runner flattens a step."""
    from pdserve.engine.attention_metadata import AttentionMetadata

    ids, positions, slots, qsl, seq_lens, last = [], [], [], [0], [], []
    for token_ids, start, block_ids in chunks:
        for i, token_id in enumerate(token_ids):
            pos = start + i
            ids.append(token_id)
            positions.append(pos)
            slots.append(block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl.append(len(ids))
        seq_lens.append(start + len(token_ids))
        last.append(len(ids) - 1)
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(seq_lens, **i32),
        block_tables=torch.tensor([c[2] for c in chunks], **i32), slot_mapping=torch.tensor(slots, **i32),
        max_query_len=max(len(c[0]) for c in chunks), max_seq_len=max(seq_lens),
    )
    return torch.tensor(ids), torch.tensor(positions), meta, torch.tensor(last)


def run_model(model_dir: str) -> tuple[dict[str, torch.Tensor], list[list[int]]]:
    """This process's shard of the model through NUM_STEPS steps; returns the hidden states, the
    logits and the final KV pool of every step, and the greedy sequences."""
    from pdserve.engine.loader import iter_safetensors
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.models import LlamaForCausalLM

    config = ModelConfig.from_pretrained(model_dir)
    model = LlamaForCausalLM(config, max_len=BLOCK_SIZE * BLOCKS_PER_SEQ)
    model.load_weights(iter_safetensors(Path(model_dir)))
    model.float().eval()
    num_heads = model.layers[0].self_attn.num_kv_heads  # this rank's KV heads
    kv = torch.zeros(config.num_layers, 2, len(PROMPTS) * BLOCKS_PER_SEQ, BLOCK_SIZE, num_heads, config.head_dim)
    kv_caches = [(kv[i, 0], kv[i, 1]) for i in range(config.num_layers)]
    seqs = [list(p) for p in PROMPTS]
    computed = [0] * len(seqs)
    tensors = {}
    with torch.inference_mode():
        for step in range(NUM_STEPS):
            chunks = []
            for i, seq in enumerate(seqs):
                end = FIRST_CHUNK.get(i, len(seq)) if step == 0 else len(seq)
                blocks = list(range(i * BLOCKS_PER_SEQ, (i + 1) * BLOCKS_PER_SEQ))
                chunks.append((seq[computed[i] : end], computed[i], blocks))
            ids, positions, meta, last = make_batch(chunks)
            hidden = model(ids, positions, meta, kv_caches)
            logits = model.compute_logits(hidden[last])
            tensors[f"hidden_{step}"], tensors[f"logits_{step}"] = hidden.clone(), logits.clone()
            for i, (token_ids, start, _) in enumerate(chunks):
                computed[i] = start + len(token_ids)
                if computed[i] == len(seqs[i]):  # the prompt is done: sample greedily
                    seqs[i].append(int(logits[i].argmax()))
    tensors["kv"] = kv
    return tensors, seqs


# ---- single layers --------------------------------------------------------------------------
HIDDEN, INTER, VOCAB, NUM_ROWS = 8, 12, 11, 5


def layer_weights() -> dict[str, torch.Tensor]:
    """Full (unsharded) seeded weights and inputs of the layers test; every rank makes the same."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    return {"gate": rand(INTER, HIDDEN), "up": rand(INTER, HIDDEN), "gate_bias": rand(INTER), "up_bias": rand(INTER),
            "down": rand(HIDDEN, INTER), "embed": rand(VOCAB, HIDDEN), "head": rand(VOCAB, HIDDEN),
            "x": rand(NUM_ROWS, HIDDEN)}


def run_layers(rank: int, size: int) -> dict[str, torch.Tensor]:
    from pdserve.engine.models.cpu_bf16 import Bf16ViaFp32Linear
    from pdserve.engine.parallel.layers import (
        ColumnParallelLinear,
        ParallelLMHead,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from pdserve.engine.parallel.sharding import shard_range

    w = layer_weights()
    start, end = shard_range(rank, size, INTER)
    part = (start, end, INTER)
    gate_up = ColumnParallelLinear(HIDDEN, [part, part], bias=True)
    down = RowParallelLinear(part, HIDDEN, size)
    embed = VocabParallelEmbedding(VOCAB, HIDDEN, rank, size)
    head = ParallelLMHead(VOCAB, HIDDEN, rank, size)
    with torch.no_grad():
        for i, name in enumerate(("gate", "up")):
            gate_up.load_shard("weight", w[name], i)
            gate_up.load_shard("bias", w[f"{name}_bias"], i)
        down.load_shard("weight", w["down"])
        embed.load_shard("weight", w["embed"])
        head.load_shard("weight", w["head"])
        columns = gate_up(w["x"])
        gate, up = columns.chunk(2, dim=-1)
        act = F.silu(gate) * up
        return {"columns": columns, "mlp": down(act), "embed": embed(torch.arange(VOCAB)),
                "logits": head(w["x"]), "logits_empty": head(w["x"][:0]),
                # the CPU bf16 swap (models/cpu_bf16.py) keeps the row-parallel all-reduce
                "mlp_bf16": Bf16ViaFp32Linear(down)(act.bfloat16())}


# ---- faults -------------------------------------------------------------------------------
def run_fault(rank: int, mode: str) -> dict:
    from pdserve.engine.parallel.state import TPCollectiveError, all_reduce

    if rank == 1:
        if mode == "dead_peer":
            os._exit(3)
        time.sleep(120)  # hung_peer: the test kills this rank
    t0 = time.monotonic()
    try:
        all_reduce(torch.ones(4))
    except TPCollectiveError as exc:
        return {"error": str(exc), "elapsed_s": time.monotonic() - t0}
    return {"error": None, "elapsed_s": time.monotonic() - t0}


def main(args: dict) -> int:
    from pdserve.engine.parallel.state import TPCollectiveError, destroy_tp, init_tp

    torch.set_num_threads(1)
    rank, size, out = args["rank"], args["size"], Path(args["out"])
    t0 = time.monotonic()
    try:
        init_tp(rank, size, args["init_method"], "gloo", args["timeout_s"])
    except TPCollectiveError as exc:
        (out / f"rank{rank}.json").write_text(json.dumps({"init_error": str(exc), "elapsed_s": time.monotonic() - t0}))
        return 0
    try:
        mode, tensors, values = args["mode"], {}, {}
        if mode == "model":
            tensors, values["seqs"] = run_model(args["model_dir"])
        elif mode == "layers":
            tensors = run_layers(rank, size)
        else:
            values = run_fault(rank, mode)
        if tensors:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / f"rank{rank}.safetensors"))
        (out / f"rank{rank}.json").write_text(json.dumps(values))
    finally:
        destroy_tp()
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
