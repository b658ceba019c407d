"""Triton KV-cache kernels: the per-step K/V write and the one-pass token gather/scatter that the
KV transfer uses to move a request between pools.

Every wrapper here checks shapes, dtypes and strides (never tensor values, so no device sync) and
launches through `launcher`, which also runs the same kernels on CPU tensors under Triton's
interpreter when TRITON_INTERPRET=1 is set (how the tests check them without a GPU).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

_INTERPRETED: dict[object, InterpretedFunction] = {}  # a kernel's Python function -> its interpreted twin


def launcher(kernel, device: torch.device):
    """`kernel` on CUDA; on other devices its interpreted twin, when TRITON_INTERPRET=1.

    triton.jit picks compiled or interpreted once, at import; this picks per call, so a process
    that imported Triton without the variable (the test suite) can still interpret CPU tensors.
    """
    if isinstance(kernel, InterpretedFunction):
        _patch_interpreter()
        return kernel
    if device.type == "cuda":
        return kernel
    if not triton.knobs.runtime.interpret:
        raise ValueError(
            f"the 'triton' kernel backend is not available for {device.type} tensors unless "
            "TRITON_INTERPRET=1 (Triton's CPU interpreter); use backend='torch' or None"
        )
    _patch_interpreter()
    return _interpreted(kernel)


def _interpreted(fn: JITFunction) -> InterpretedFunction:
    # Keyed by the Python function: a JITFunction's own hash parses its source.
    if fn.fn not in _INTERPRETED:
        _INTERPRETED[fn.fn] = InterpretedFunction(fn.fn)
    return _INTERPRETED[fn.fn]


def _patch_interpreter() -> None:
    """Patch Triton 3.6's CPU interpreter once, in processes that use it, so that:

    - it runs kernels compiled-mode Triton imported: for each launch, every @triton.jit function
      the kernel can reach (its module's, triton.language's own such as tl.max and tl.sum) is
      swapped for an interpreted twin; the launch's patch scope restores them afterwards;
    - scalar loop bounds work with NumPy >= 2.4: scalars are 1-element arrays that __index__
      converts with int(), which NumPy 2.4 rejects (triton-lang/triton#9171, fixed by #9172);
    - bfloat16 tl.dot computes on values: bf16 is stored as uint16 and create_dot multiplied the
      bit patterns (triton-lang/triton#11584); widening to float32 first is what the GPU's bf16
      MMA with float32 accumulation computes;
    - float32 -> bfloat16 casts round to nearest even, as on the GPU, instead of truncating.
    """
    if getattr(interpreter, "pdserve_patched", False):
        return
    patch_lang = interpreter._patch_lang

    def patch_lang_for_late_interpreting(fn):
        scope = patch_lang(fn)
        scope.set_attr(tl.core.tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
        for module in (sys.modules[fn.__module__], tl, tl.standard):
            for name, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    scope.set_attr(module, name, _interpreted(value))
        return scope

    create_dot = interpreter.InterpreterBuilder.create_dot

    def create_dot_widening_bf16(self, a, b, *args):
        return create_dot(self, _bf16_as_fp32(a), _bf16_as_fp32(b), *args)

    cast_impl = interpreter.InterpreterBuilder.cast_impl

    def cast_rounding_to_bf16(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_fp32_to_bf16_bits(src.data), tl.bfloat16)
        return cast_impl(self, src, dst_type)

    interpreter._patch_lang = patch_lang_for_late_interpreting
    interpreter.InterpreterBuilder.create_dot = create_dot_widening_bf16
    interpreter.InterpreterBuilder.cast_impl = cast_rounding_to_bf16
    interpreter.pdserve_patched = True


def _fp32_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # nearest, ties to even
    return np.where(np.isnan(data), np.uint16(0x7FC0), rounded)


def _bf16_as_fp32(handle):
    if handle.dtype != tl.bfloat16:
        return handle
    widened = (handle.data.astype(np.uint32) << 16).view(np.float32)  # bf16 is fp32's top half
    return interpreter.TensorHandle(widened, tl.float32)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


# ---- store_kv ----------------------------------------------------------------------------------


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [T, num_kv_heads, head_dim]
    value_ptr,  # [T, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], k_cache's strides
    slot_mapping_ptr,  # [T] int32, -1 = skip
    num_kv_heads,
    stride_key_tok,
    stride_key_head,
    stride_value_tok,
    stride_value_head,
    stride_cache_slot,  # one token of a block; blocks are back to back, so slot * this works
    stride_cache_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # num_kv_heads rounded up to a power of two
):
    # One program per token writes all its kv heads: [BLOCK_H, HEAD_DIM] in one masked store.
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    mask = (heads[:, None] < num_kv_heads) & (slot >= 0)
    key = tl.load(key_ptr + tok * stride_key_tok + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    value = tl.load(
        value_ptr + tok * stride_value_tok + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    cache_offs = slot * stride_cache_slot + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(k_cache_ptr + cache_offs, key, mask=mask)
    tl.store(v_cache_ptr + cache_offs, value, mask=mask)


def store_kv_constexprs(num_kv_heads: int, head_dim: int) -> dict:
    return {"HEAD_DIM": head_dim, "BLOCK_H": triton.next_power_of_2(num_kv_heads)}


def store_kv(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int32, block * block_size + offset, -1 = skip
) -> None:
    """Write each token's K/V into its slot; dispatch.store_kv has checked shapes and dtypes."""
    num_tokens, num_kv_heads, head_dim = key.shape
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        require(t.stride(-1) == 1, f"{name} must be contiguous in head_dim, got strides {t.stride()}")
    require(k_cache.stride() == v_cache.stride(), "k_cache and v_cache must share strides")
    require(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    require(head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}")
    if num_tokens == 0:
        return
    launcher(_store_kv_kernel, key.device)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, num_kv_heads,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        **store_kv_constexprs(num_kv_heads, head_dim),
    )


# ---- token gather/scatter for the KV transfer --------------------------------------------------


@triton.jit
def _copy_rows_kernel(
    src_ptr,  # [num_layers * 2, src_rows, row_len]: a pool's slots or a payload's tokens
    dst_ptr,  # [num_layers * 2, dst_rows, row_len]
    src_slots_ptr,  # [T] int64: source row of token t (read only when SRC_INDEXED)
    dst_slots_ptr,  # [T] int64: destination row of token t (read only when DST_INDEXED)
    num_tokens,
    row_len,  # num_kv_heads * head_dim
    src_stride_layer,  # elements between (layer, K/V) planes of src
    dst_stride_layer,
    SRC_INDEXED: tl.constexpr,
    DST_INDEXED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # Program (token tile, layer plane) moves BLOCK_T whole rows: every layer and both K and V in
    # one launch, instead of one index_select per layer (or per block).
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    plane = tl.program_id(1).to(tl.int64)
    tok_ok = toks < num_tokens
    if SRC_INDEXED:
        src_rows = tl.load(src_slots_ptr + toks, mask=tok_ok, other=0).to(tl.int64)
    else:
        src_rows = toks.to(tl.int64)
    if DST_INDEXED:
        dst_rows = tl.load(dst_slots_ptr + toks, mask=tok_ok, other=0).to(tl.int64)
    else:
        dst_rows = toks.to(tl.int64)
    src_base = src_ptr + plane * src_stride_layer + src_rows[:, None] * row_len
    dst_base = dst_ptr + plane * dst_stride_layer + dst_rows[:, None] * row_len
    for r0 in range(0, row_len, BLOCK_R):
        cols = r0 + tl.arange(0, BLOCK_R)
        mask = tok_ok[:, None] & (cols[None, :] < row_len)
        rows = tl.load(src_base + cols[None, :], mask=mask)
        tl.store(dst_base + cols[None, :], rows, mask=mask)


def copy_rows_constexprs(row_len: int, src_indexed: bool, dst_indexed: bool) -> dict:
    block_r = min(triton.next_power_of_2(row_len), 1024)
    # About 4K elements per program: enough bytes in flight per SM without spilling registers.
    return {
        "SRC_INDEXED": src_indexed,
        "DST_INDEXED": dst_indexed,
        "BLOCK_T": max(1, 4096 // block_r),
        "BLOCK_R": block_r,
    }


def _pool_planes(kv_buffer: torch.Tensor) -> torch.Tensor:
    """[num_layers * 2, num_blocks * block_size, num_kv_heads * head_dim] view of a pool."""
    require(
        kv_buffer.dim() == 6 and kv_buffer.shape[1] == 2,
        f"expected a [layers, 2, blocks, block_size, heads, head_dim] pool, got {tuple(kv_buffer.shape)}",
    )
    require(kv_buffer.is_contiguous(), "the KV pool must be contiguous")
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv_buffer.shape
    return kv_buffer.view(num_layers * 2, num_blocks * block_size, num_kv_heads * head_dim)


def _slots(kv_buffer: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """[num_tokens] int64 slot of each token; block ids are host ints, so this check is free."""
    num_blocks, block_size = kv_buffer.shape[2], kv_buffer.shape[3]
    require(num_tokens <= len(block_ids) * block_size,
            f"{len(block_ids)} blocks of {block_size} cannot hold {num_tokens} tokens")
    require(not block_ids or (min(block_ids) >= 0 and max(block_ids) < num_blocks),
            f"block ids out of range [0, {num_blocks})")
    tokens = torch.arange(num_tokens)
    blocks = torch.as_tensor(block_ids, dtype=torch.int64)
    slots = blocks[tokens // block_size] * block_size + tokens % block_size
    return slots.to(kv_buffer.device, non_blocking=True)


def _launch_copy(src, dst, src_slots, dst_slots, num_tokens: int) -> None:
    """src/dst: [planes, rows, row_len] contiguous views; a None slot list means token order."""
    planes, _, row_len = dst.shape
    if num_tokens == 0 or planes == 0:
        return
    constexprs = copy_rows_constexprs(row_len, src_slots is not None, dst_slots is not None)
    dummy = src_slots if src_slots is not None else dst_slots
    grid = (triton.cdiv(num_tokens, constexprs["BLOCK_T"]), planes)
    launcher(_copy_rows_kernel, dst.device)[grid](
        src, dst,
        src_slots if src_slots is not None else dummy, dst_slots if dst_slots is not None else dummy,
        num_tokens, row_len, src.stride(0), dst.stride(0),
        **constexprs,
    )


def gather_tokens_triton(kv_buffer: torch.Tensor, block_ids: list[int], num_tokens: int) -> torch.Tensor:
    """A request's KV as one contiguous [num_layers, 2, num_tokens, num_kv_heads, head_dim] tensor.

    Same contract as kvtransfer.payload.gather_tokens, in one kernel launch.
    """
    src = _pool_planes(kv_buffer)  # [L*2, slots, H*D]
    num_layers, _, _, _, num_kv_heads, head_dim = kv_buffer.shape
    out = torch.empty(num_layers, 2, num_tokens, num_kv_heads, head_dim, dtype=kv_buffer.dtype,
                      device=kv_buffer.device)
    slots = _slots(kv_buffer, block_ids, num_tokens)
    _launch_copy(src, out.view(num_layers * 2, num_tokens, num_kv_heads * head_dim), slots, None, num_tokens)
    return out


def scatter_tokens_triton(kv_buffer: torch.Tensor, block_ids: list[int], payload: torch.Tensor) -> None:
    """Write a token-major [num_layers, 2, T, num_kv_heads, head_dim] payload into `block_ids` of
    `kv_buffer`, whatever its block size. Same contract as kvtransfer.payload.scatter_tokens."""
    dst = _pool_planes(kv_buffer)
    num_layers, _, _, _, num_kv_heads, head_dim = kv_buffer.shape
    require(payload.dim() == 5 and payload.shape[:2] == (num_layers, 2) and payload.shape[3:] == (num_kv_heads, head_dim),
            f"payload shape {tuple(payload.shape)} does not fit pool {tuple(kv_buffer.shape)}")
    require(payload.dtype == kv_buffer.dtype,
            f"payload dtype {payload.dtype} differs from the pool's {kv_buffer.dtype}")
    num_tokens = payload.shape[2]
    slots = _slots(kv_buffer, block_ids, num_tokens)
    src = payload.to(kv_buffer.device).contiguous().view(num_layers * 2, num_tokens, num_kv_heads * head_dim)
    _launch_copy(src, dst, None, slots, num_tokens)


def copy_tokens_triton(src_buffer: torch.Tensor, src_block_ids: list[int], dst_buffer: torch.Tensor,
                       dst_block_ids: list[int], num_tokens: int) -> None:
    """Pool to pool on one device (block sizes may differ), one launch and no staging tensor.
    Same contract as kvtransfer.payload.copy_tokens."""
    require(src_buffer.shape[:2] == dst_buffer.shape[:2] and src_buffer.shape[4:] == dst_buffer.shape[4:],
            f"pools {tuple(src_buffer.shape)} and {tuple(dst_buffer.shape)} are incompatible")
    require(src_buffer.dtype == dst_buffer.dtype, f"pool dtypes differ: {src_buffer.dtype} vs {dst_buffer.dtype}")
    require(src_buffer.device == dst_buffer.device, "copy_tokens_triton needs both pools on one device")
    src, dst = _pool_planes(src_buffer), _pool_planes(dst_buffer)
    src_slots = _slots(src_buffer, src_block_ids, num_tokens)
    dst_slots = _slots(dst_buffer, dst_block_ids, num_tokens)
    _launch_copy(src, dst, src_slots, dst_slots, num_tokens)
