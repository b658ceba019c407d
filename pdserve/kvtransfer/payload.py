"""KV payloads: gather a request's tokens out of a paged pool, scatter them into another, and turn
tensors into ZMQ frames and back.

A node's pool is one tensor (all layers, K and V, every block):

    kv_buffer: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]     (K at 0, V at 1)

Token t of a request lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``,
i.e. at slot ``block_ids[t // block_size] * block_size + t % block_size`` of the flattened
``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]`` view. The payload on the wire
is token-major, ``[num_layers, 2, num_tokens, num_kv_heads, head_dim]``, so the two sides may use
different block sizes: the receiver re-lays the tokens into its own blocks.
"""

from __future__ import annotations

import math
import warnings

import torch

# The one table between dtype names (on the wire, in KVLayout and KVData) and torch dtypes.
from pdserve.kvcache.dtypes import DTYPE_NAMES, DTYPES, dtype_name  # noqa: F401 (the one table, re-exported)


def slot_ids(block_ids: list[int], block_size: int, num_tokens: int, device: torch.device | str = "cpu"
             ) -> torch.Tensor:
    """[num_tokens] int64: the flattened slot of each token of a request."""
    if num_tokens > len(block_ids) * block_size:
        raise ValueError(f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    tokens = torch.arange(num_tokens, device=device)
    blocks = torch.as_tensor(block_ids, dtype=torch.int64, device=device)
    return blocks[tokens // block_size] * block_size + tokens % block_size


def _flat_slots(kv_buffer: torch.Tensor) -> torch.Tensor:
    """[num_layers * 2, num_blocks * block_size, num_kv_heads * head_dim] view of a pool."""
    if kv_buffer.dim() != 6 or kv_buffer.shape[1] != 2:
        raise ValueError(f"expected a [layers, 2, blocks, block_size, heads, head_dim] pool, got {tuple(kv_buffer.shape)}")
    if not kv_buffer.is_contiguous():
        raise ValueError("the KV pool must be contiguous")
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_buffer.shape
    return kv_buffer.view(num_layers * 2, num_blocks * block_size, num_kv_heads * head_dim)


def _check_blocks(kv_buffer: torch.Tensor, block_ids: list[int]) -> None:
    num_blocks = kv_buffer.shape[2]
    if block_ids and (min(block_ids) < 0 or max(block_ids) >= num_blocks):
        raise ValueError(f"block ids out of range [0, {num_blocks})")


def _triton_cache():
    """The one-pass Triton gather/scatter kernels, for pools on a CUDA device."""
    from pdserve.kernels import triton_cache

    return triton_cache


def gather_tokens(kv_buffer: torch.Tensor, block_ids: list[int], num_tokens: int,
                  heads: tuple[int, int] | None = None) -> torch.Tensor:
    """A request's KV as one contiguous [num_layers, 2, num_tokens, num_heads, head_dim] tensor:
    every head of the pool, or its heads [heads[0], heads[1]) (indexes into this pool)."""
    num_layers, _, _, _, num_kv_heads, head_dim = kv_buffer.shape
    start, end = heads if heads is not None else (0, num_kv_heads)
    if not 0 <= start < end <= num_kv_heads:
        raise ValueError(f"heads [{start}, {end}) out of the pool's {num_kv_heads}")
    if kv_buffer.is_cuda and (start, end) == (0, num_kv_heads):
        return _triton_cache().gather_tokens_triton(kv_buffer, block_ids, num_tokens)
    flat = _flat_slots(kv_buffer)[:, :, start * head_dim:end * head_dim]  # [L*2, slots, h*D]
    _check_blocks(kv_buffer, block_ids)
    slots = slot_ids(block_ids, kv_buffer.shape[3], num_tokens, kv_buffer.device)
    out = flat.index_select(1, slots)  # [L*2, num_tokens, h*D], one pass
    return out.view(num_layers, 2, num_tokens, end - start, head_dim)


def scatter_tokens(kv_buffer: torch.Tensor, block_ids: list[int], payload: torch.Tensor) -> None:
    """Write a token-major payload into `block_ids` of `kv_buffer` (whatever its block size)."""
    num_layers, _, _, _, num_kv_heads, head_dim = kv_buffer.shape
    if payload.dim() != 5 or payload.shape[:2] != (num_layers, 2) or payload.shape[3:] != (num_kv_heads, head_dim):
        raise ValueError(f"payload shape {tuple(payload.shape)} does not fit pool {tuple(kv_buffer.shape)}")
    if payload.dtype != kv_buffer.dtype:
        raise ValueError(f"payload dtype {payload.dtype} differs from the pool's {kv_buffer.dtype}")
    if kv_buffer.is_cuda:
        _triton_cache().scatter_tokens_triton(kv_buffer, block_ids, payload.to(kv_buffer.device))
        return
    flat = _flat_slots(kv_buffer)
    _check_blocks(kv_buffer, block_ids)
    num_tokens = payload.shape[2]
    slots = slot_ids(block_ids, kv_buffer.shape[3], num_tokens, kv_buffer.device)
    src = payload.to(kv_buffer.device).reshape(num_layers * 2, num_tokens, num_kv_heads * head_dim)
    flat.index_copy_(1, slots, src)


COPY_CHUNK_TOKENS = 1024  # bounds copy_tokens' staging tensor (134 MB for an 8B model in bf16)
_MAX_DIRECT_RUNS = 8


def copy_tokens(src_buffer: torch.Tensor, src_block_ids: list[int], dst_buffer: torch.Tensor,
                dst_block_ids: list[int], num_tokens: int, src_heads: tuple[int, int] | None = None,
                dst_heads: tuple[int, int] | None = None) -> None:
    """Copy a request's KV pool-to-pool (same host, block sizes may differ): every head, or heads
    [start, end) of the source pool into heads [start, end) of the destination (tensor parallelism:
    a rank's pool holds some heads only; kvtransfer.heads).

    When the tokens form a few runs contiguous in both pools, each run is one strided copy and
    nothing is staged. Otherwise it is index_select + index_copy_ in chunks of COPY_CHUNK_TOKENS:
    every torch copy is a parallel region, and a hundred small ones cost a scheduler time slice
    each when the cores are shared.
    """
    src_heads = _head_range(src_buffer, src_heads)
    dst_heads = _head_range(dst_buffer, dst_heads)
    if (src_buffer.shape[:2] != dst_buffer.shape[:2] or src_buffer.shape[5] != dst_buffer.shape[5]
            or src_heads[1] - src_heads[0] != dst_heads[1] - dst_heads[0]):
        raise ValueError(f"pools {tuple(src_buffer.shape)} heads {src_heads} and {tuple(dst_buffer.shape)} heads "
                         f"{dst_heads} are incompatible")
    if src_buffer.dtype != dst_buffer.dtype:
        raise ValueError(f"pool dtypes differ: {src_buffer.dtype} vs {dst_buffer.dtype}")
    whole = src_heads == (0, src_buffer.shape[4]) and dst_heads == (0, dst_buffer.shape[4])
    if whole and src_buffer.is_cuda and dst_buffer.device == src_buffer.device:
        _triton_cache().copy_tokens_triton(src_buffer, src_block_ids, dst_buffer, dst_block_ids, num_tokens)
        return
    head_dim = src_buffer.shape[5]
    src = _flat_slots(src_buffer)[:, :, src_heads[0] * head_dim:src_heads[1] * head_dim]  # [L*2, slots, h*D]
    dst = _flat_slots(dst_buffer)[:, :, dst_heads[0] * head_dim:dst_heads[1] * head_dim]
    _check_blocks(src_buffer, src_block_ids)
    _check_blocks(dst_buffer, dst_block_ids)
    src_slots = slot_ids(src_block_ids, src_buffer.shape[3], num_tokens)
    dst_slots = slot_ids(dst_block_ids, dst_buffer.shape[3], num_tokens)
    if num_tokens == 0:
        return
    breaks = ((src_slots.diff() != 1) | (dst_slots.diff() != 1)).nonzero().flatten() + 1
    if len(breaks) < _MAX_DIRECT_RUNS:
        starts = [0, *breaks.tolist()]
        ends = [*starts[1:], num_tokens]
        src_starts, dst_starts = src_slots[starts].tolist(), dst_slots[starts].tolist()
        for s, d, start, end in zip(src_starts, dst_starts, starts, ends, strict=True):
            dst[:, d:d + end - start].copy_(src[:, s:s + end - start])
        return
    for start in range(0, num_tokens, COPY_CHUNK_TOKENS):
        chunk = slice(start, start + COPY_CHUNK_TOKENS)
        staged = src.index_select(1, src_slots[chunk].to(src.device))
        dst.index_copy_(1, dst_slots[chunk].to(dst.device), staged.to(dst.device))


def _head_range(kv_buffer: torch.Tensor, heads: tuple[int, int] | None) -> tuple[int, int]:
    if kv_buffer.dim() != 6:
        raise ValueError(f"expected a [layers, 2, blocks, block_size, heads, head_dim] pool, got {tuple(kv_buffer.shape)}")
    num_heads = kv_buffer.shape[4]
    start, end = heads if heads is not None else (0, num_heads)
    if not 0 <= start < end <= num_heads:
        raise ValueError(f"heads [{start}, {end}) out of the pool's {num_heads}")
    return int(start), int(end)


# ---- tensors <-> ZMQ frames ---------------------------------------------------------------
def tensor_to_frame(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a buffer ZMQ can send without copying (host memory, C order).

    bfloat16 has no numpy dtype, so the bytes are viewed as uint8 first. The returned view keeps
    the (contiguous, CPU) tensor alive for as long as ZMQ holds the frame.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return memoryview(t.view(torch.uint8).numpy())


def frame_to_tensor(buf, dtype: str, shape: list[int] | tuple[int, ...]) -> torch.Tensor:
    """A received frame as a tensor of `dtype` (a wire name) and `shape`, sharing the frame's memory.

    Raises ValueError when the dtype is unknown or the byte count does not match the shape.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    if any(not isinstance(n, int) or n < 0 for n in shape):
        raise ValueError(f"bad shape {shape!r}")
    torch_dtype = DTYPES[dtype]
    nbytes = math.prod(shape) * torch_dtype.itemsize
    view = memoryview(buf).cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"frame holds {view.nbytes} bytes, {dtype}{list(shape)} needs {nbytes}")
    if nbytes == 0:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    with warnings.catch_warnings():  # read-only frames: we only ever read from the tensor
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=torch.uint8)
    return raw.view(torch_dtype).view(tuple(shape))
