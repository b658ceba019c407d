"""Fused RMSNorm (with the residual add) and rotary embedding in Triton, with torch references.

Both are memory-bound elementwise passes the model makes twice per layer; fused, each reads and
writes its rows once instead of once per torch op. They round where the engine's torch modules
(engine/models/llama.py) round, so the two agree to the last bit or two of the dtype:

    rms_norm:  residual = x + residual (in x's dtype); out = weight * (r * rsqrt(mean(r^2) + eps))
               with the normalised value rounded to the dtype before the weight multiply.
    rotary:    q <- q * cos + rotate_half(q) * sin (and k), cos/sin rounded to q's dtype first,
               in place; cos/sin are the [max_len, head_dim] tables with duplicated halves.

Not wired into the engine yet; the tests compare each against its `*_torch` reference below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.triton_cache import launcher, require


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [T, hidden]
    residual_ptr,  # [T, hidden], overwritten with x + residual (HAS_RESIDUAL only)
    weight_ptr,  # [hidden]
    out_ptr,  # [T, hidden]
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # hidden rounded up to a power of two: one row per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    # Arithmetic in float32, rounded to the dtype where torch rounds (and bf16 never computes
    # on its storage, which Triton's interpreter cannot do).
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + r).to(dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(dtype), mask=mask)


def rms_norm_launch(hidden: int, has_residual: bool) -> tuple[dict, int]:
    """(constexprs, num_warps): about 512 elements of the row per warp."""
    block = triton.next_power_of_2(hidden)
    return {"HAS_RESIDUAL": has_residual, "BLOCK": block}, min(16, max(1, block // 512))


def rotary_constexprs(head_dim: int, num_heads: int, num_kv_heads: int) -> dict:
    return {"HALF": head_dim // 2, "BLOCK_H": triton.next_power_of_2(max(num_heads, num_kv_heads))}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor:
    """RMSNorm of x ([T, hidden]); with `residual`, of x + residual, which is written back into
    `residual` (the next layer's residual stream)."""
    require(x.dim() == 2 and weight.shape == (x.shape[1],), f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}")
    require(x.dtype == weight.dtype, f"x is {x.dtype}, weight {weight.dtype}")
    require(x.shape[1] <= 16384, f"hidden size {x.shape[1]} is above the one-row-per-program limit 16384")
    for name, t in (("x", x), ("weight", weight), ("residual", residual)):
        require(t is None or t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    if residual is not None:
        require(residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x")
    num_tokens, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    constexprs, num_warps = rms_norm_launch(hidden, residual is not None)
    launcher(_rms_norm_kernel, x.device)[(num_tokens,)](
        x, residual if residual is not None else x, weight, out, hidden, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        **constexprs, num_warps=num_warps,
    )
    return out


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
                   ) -> torch.Tensor:
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [T] int64 or int32
    q_ptr,  # [T, num_heads, head_dim], rotated in place
    k_ptr,  # [T, num_kv_heads, head_dim], rotated in place
    cos_ptr,  # [max_len, head_dim] float32, halves duplicated: only the first is read
    sin_ptr,  # [max_len, head_dim] float32
    num_heads,
    num_kv_heads,
    stride_q_tok,
    stride_q_head,
    stride_k_tok,
    stride_k_head,
    stride_table,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_H: tl.constexpr,  # max(num_heads, num_kv_heads) rounded up to a power of two
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + pos * stride_table + d).to(dtype).to(tl.float32)[None, :]  # [1, HALF]
    sin = tl.load(sin_ptr + pos * stride_table + d).to(dtype).to(tl.float32)[None, :]
    # q and k the same way: first half x1, second half x2; (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    q_lo = q_ptr + tok * stride_q_tok + heads * stride_q_head + d[None, :]  # [BLOCK_H, HALF]
    q_mask = heads < num_heads
    q1 = tl.load(q_lo, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_lo + HALF, mask=q_mask, other=0.0).to(tl.float32)
    tl.store(q_lo, (q1 * cos - q2 * sin).to(dtype), mask=q_mask)
    tl.store(q_lo + HALF, (q2 * cos + q1 * sin).to(dtype), mask=q_mask)
    k_lo = k_ptr + tok * stride_k_tok + heads * stride_k_head + d[None, :]
    k_mask = heads < num_kv_heads
    k1 = tl.load(k_lo, mask=k_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_lo + HALF, mask=k_mask, other=0.0).to(tl.float32)
    tl.store(k_lo, (k1 * cos - k2 * sin).to(dtype), mask=k_mask)
    tl.store(k_lo + HALF, (k2 * cos + k1 * sin).to(dtype), mask=k_mask)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ([T, num_heads, head_dim]) and k ([T, num_kv_heads, head_dim]) in place by the
    rows `positions` of the cos/sin tables; returns (q, k)."""
    num_tokens, num_heads, head_dim = q.shape
    require(k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, "k does not match q")
    require(q.dtype == k.dtype, "q and k dtypes differ")
    require(cos.shape == sin.shape and cos.shape[1] == head_dim and cos.dtype == torch.float32,
            "cos/sin must be float32 [max_len, head_dim] tables")
    require(head_dim >= 2 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}")
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        require(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    require(cos.stride() == sin.stride() and positions.is_contiguous(), "tables must share strides")
    if num_tokens == 0:
        return q, k
    launcher(_rotary_kernel, q.device)[(num_tokens,)](
        positions, q, k, cos, sin, num_heads, k.shape[1],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        **rotary_constexprs(head_dim, num_heads, k.shape[1]),
    )
    return q, k


def rotary_torch(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, head_dim]
    sin = sin[positions].to(q.dtype).unsqueeze(1)

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
