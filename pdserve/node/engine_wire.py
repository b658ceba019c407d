"""Wire messages built from a node's engine state, shared by the prefill and the decode node
(plain reads of engine attributes: nothing here runs the model), and the KV pool the hand-off uses."""

from __future__ import annotations

import dataclasses
import os

from pdserve.kvcache.dtypes import dtype_name
from pdserve.node.router_link import host_id
from pdserve.protocol.messages import KVLayout, Register, Token


def token_events(request) -> list[Token]:
    """Every output token the last engine step appended (several with speculative decoding), in
    order; only the last carries the finish reason."""
    num_new = max(1, request.num_new_output_tokens)
    first = request.num_output_tokens - num_new
    events = []
    for index in range(first, request.num_output_tokens):
        logprobs = request.output_logprobs[index] if request.output_logprobs else None
        last = index == request.num_output_tokens - 1
        events.append(Token(request_id=request.request_id, index=index, token_id=request.output_token_ids[index],
                            logprobs=logprobs, finish_reason=request.finish_reason if last else None))
    return events


def kv_layout(engine, served_model_name: str, **extra) -> KVLayout:
    """What this node's KV pool holds, for the handshake."""
    mc = engine.model_config
    dtype = dtype_name(engine.config.torch_dtype)
    return KVLayout(model=served_model_name, dtype=dtype, num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
                    head_dim=mc.head_dim, block_size=engine.config.block_size,
                    num_blocks=engine.block_manager.num_blocks, **extra)


def register_message(node_id: str, role: str, engine, served_model_name: str, kv_addr: str = "",
                     metrics_url: str = "") -> Register:
    return Register(node_id=node_id, role=role, model=served_model_name, kv_addr=kv_addr, metrics_url=metrics_url,
                    num_total_blocks=engine.block_manager.num_blocks, block_size=engine.config.block_size,
                    max_model_len=engine.config.max_model_len, host_id=host_id(), pid=os.getpid(),
                    max_num_seqs=engine.config.max_num_seqs)


def kv_shards(engine, shm_pool=None) -> list:
    """Every rank's KV pool, as the hand-off reads and writes it (KVSender, KVReceiver): the
    runner's shards (tensor parallelism: the node process maps every rank's pool), or, from a
    runner without them, one shard holding every head. `shm_pool`: the SharedKVPool the node's
    allocator put rank 0's pool in, named in its shard when the runner did not name it already."""
    from pdserve.kvcache.shard import KVShard  # torch: only where an engine runs

    runner = engine.runner
    shards = list(getattr(runner, "kv_shards", None) or [])
    if not shards:
        shards = [KVShard(0, 0, engine.model_config.num_kv_heads, runner.kv_buffer)]
    if shm_pool is not None:
        shards = [dataclasses.replace(s, shm=shm_pool)
                  if s.shm is None and s.tensor.data_ptr() == shm_pool.tensor.data_ptr() else s for s in shards]
    return shards
