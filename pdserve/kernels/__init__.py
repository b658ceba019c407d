"""Attention and KV-cache kernels behind one contract, shared by the torch, cpu and Triton backends.

    store_kv(key, value, k_cache, v_cache, slot_mapping)
    paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, *,
                    max_query_len=None, max_seq_len=None, out=None, backend=None, plans=None) -> out

`reference` holds the plain-torch implementation (the oracle), `cpu_attention` the CPU default,
`triton_attention` the CUDA default; `dispatch` checks inputs and picks a backend.
This package never imports from engine/.
"""

from pdserve.kernels.dispatch import BACKENDS, paged_attention, resolve_backend, store_kv

__all__ = ["BACKENDS", "paged_attention", "resolve_backend", "store_kv"]
