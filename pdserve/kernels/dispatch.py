"""Public kernel entry points: check the inputs, pick a backend, run it.

The checks here look only at shapes, dtypes, devices and strides, never at tensor values, so they
cost no device sync. Value checks (lengths against block tables) live in the torch reference, which
reads the metadata to the host anyway; the cpu backend runs the same checks.

Backends: "torch" (reference.py, the plain-torch oracle every kernel is tested against), "cpu"
(cpu_attention.py: the reference's math, bit for bit, with its per-layer host work done once per
step; the default on CPU devices) and "triton" (the default on CUDA). backend=None picks the device's default, unless the
PDSERVE_ATTENTION_BACKEND environment variable names a backend: that one is used instead, e.g.
PDSERVE_ATTENTION_BACKEND=torch to benchmark the engine on the reference without editing code.

Adding a backend is one line in each table below, e.g. ``"triton": triton_attention.paged_attention``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from pdserve.kernels import cpu_attention, reference

BACKENDS = ("torch", "cpu", "triton")
BACKEND_ENV = "PDSERVE_ATTENTION_BACKEND"

try:  # Triton ships for Linux only; without it the torch backend is the only one.
    from pdserve.kernels import triton_attention, triton_cache
except ImportError:  # pragma: no cover
    triton_attention = triton_cache = None

# "triton" on a CPU tensor runs Triton's interpreter when TRITON_INTERPRET=1 and raises otherwise.
_STORE_KV: dict[str, Callable[..., None]] = {"torch": reference.store_kv, "cpu": reference.store_kv}
_PAGED_ATTENTION: dict[str, Callable[..., torch.Tensor]] = {
    "torch": reference.paged_attention,
    "cpu": cpu_attention.paged_attention,
}
if triton_attention is not None:
    _STORE_KV["triton"] = triton_cache.store_kv
    _PAGED_ATTENTION["triton"] = triton_attention.paged_attention


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """None means $PDSERVE_ATTENTION_BACKEND if set, else Triton on CUDA (when Triton is
    installed), "cpu" on the CPU and torch elsewhere."""
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or None
        if backend is not None and backend not in BACKENDS:
            raise ValueError(
                f"unknown kernel backend {backend!r} in ${BACKEND_ENV}; expected one of {BACKENDS}"
            )
    if backend is None:
        if device.type == "cuda":
            return "triton" if "triton" in _PAGED_ATTENTION else "torch"
        return "cpu" if device.type == "cpu" else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS} or None")
    if backend not in _PAGED_ATTENTION:
        raise ValueError(
            f"the {backend!r} kernel backend needs Triton, which is not installed here; "
            "use backend='torch' or None"
        )
    return backend


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int32, block * block_size + offset, -1 = skip
    *,
    backend: str | None = None,
) -> None:
    """Write the new tokens' K/V into the paged cache."""
    _check_cache_pair(k_cache, v_cache)
    _check_rank("key", key, 3)
    if key.shape != value.shape:
        raise ValueError(f"key and value shapes differ: {tuple(key.shape)} vs {tuple(value.shape)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key is [T, num_kv_heads, head_dim] = {tuple(key.shape)} but the cache holds "
            f"[num_kv_heads, head_dim] = {tuple(k_cache.shape[2:])}"
        )
    for name, t in (("key", key), ("value", value)):
        if t.dtype != k_cache.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the cache dtype {k_cache.dtype}")
    _check_metadata("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {key.shape[0]} tokens")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # Slots address [num_blocks * block_size] rows, so blocks must be laid out back to back.
        if cache.stride(0) != cache.shape[1] * cache.stride(1):
            raise ValueError(f"{name} blocks are not contiguous: strides {cache.stride()}")
    _check_same_device(k_cache, key=key, value=value, v_cache=v_cache, slot_mapping=slot_mapping)
    _STORE_KV[resolve_backend(backend, key.device)](key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32, KV length after this step (cached + new)
    block_tables: torch.Tensor,  # [S, max_blocks] int32, padded with -1
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,  # [T, num_heads, head_dim], q's dtype
    backend: str | None = None,
    plans: dict | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new queries over its paged KV; returns out.

    Request s owns q[query_start_loc[s]:query_start_loc[s + 1]]; those are the last q_len
    positions of its sequence of seq_lens[s] tokens. `plans`: a dict the caller keeps for as long
    as the metadata holds the same values (AttentionMetadata.plans: one step), where a backend may
    keep what it derives from it for the next layers (the cpu backend does).
    """
    # A step's layers pass the same metadata (the `plans` contract) and caches of one shape: the
    # checks, which read only shapes, dtypes and devices, and the backend are resolved at the
    # step's first layer and reused instead of redone in every layer. A step of decodes only on the CPU's
    # compiled kernel goes straight to it from the second layer on (cpu_attention._DirectDecode).
    if plans is not None and out is None and backend is None:
        direct = plans.get(cpu_attention.DIRECT_DECODE)
        result = None if direct is None else direct(q, k_cache, v_cache, scale)
        if result is not None:
            return result
    key = None
    if plans is not None and isinstance(q, torch.Tensor) and isinstance(k_cache, torch.Tensor) \
            and isinstance(v_cache, torch.Tensor) and (out is None or isinstance(out, torch.Tensor)):
        key = ("checked", backend, q.shape, q.dtype, q.device, k_cache.shape, k_cache.dtype, k_cache.device,
               v_cache.shape, v_cache.dtype, v_cache.device, None if out is None else (out.shape, out.dtype, out.device))
    impl = None if key is None else plans.get(key)
    if impl is None:
        impl = _checked_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out, backend)
        if key is not None:
            plans[key] = impl
    return impl(
        q,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_tables,
        scale,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        out=out,
        plans=plans,
    )


def _checked_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out, backend):
    """paged_attention's argument checks; returns the backend's implementation."""
    _check_cache_pair(k_cache, v_cache)
    _check_rank("q", q, 3)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} differs from the cache head_dim {k_cache.shape[3]}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    _check_batch_metadata(query_start_loc, seq_lens, block_tables)
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out must match q: got {tuple(out.shape)} {out.dtype}, want {tuple(q.shape)} {q.dtype}"
            )
    _check_same_device(
        q,
        k_cache=k_cache,
        v_cache=v_cache,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        out=out,
    )
    return _PAGED_ATTENTION[resolve_backend(backend, q.device)]


def _check_batch_metadata(
    query_start_loc: torch.Tensor,  # [S + 1]
    seq_lens: torch.Tensor,  # [S]
    block_tables: torch.Tensor,  # [S, max_blocks]
) -> None:
    _check_metadata("query_start_loc", query_start_loc, 1)
    _check_metadata("seq_lens", seq_lens, 1)
    _check_metadata("block_tables", block_tables, 2)
    num_requests = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_requests + 1:
        raise ValueError(
            f"query_start_loc has {query_start_loc.shape[0]} entries, want S + 1 = {num_requests + 1}"
        )
    if block_tables.shape[0] != num_requests:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_requests} requests")


def _check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    _check_rank("k_cache", k_cache, 4)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"k_cache and v_cache differ: {tuple(k_cache.shape)} {k_cache.dtype} "
            f"vs {tuple(v_cache.shape)} {v_cache.dtype}"
        )


def _check_metadata(name: str, t: torch.Tensor, rank: int) -> None:
    _check_rank(name, t, rank)
    if t.dtype != torch.int32:
        raise ValueError(f"{name} must be int32, got {t.dtype}")


def _check_rank(name: str, t: torch.Tensor, rank: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must have {rank} dims, got shape {tuple(t.shape)}")


def _check_same_device(ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device}, expected {ref.device}")
