"""RoPE: the tables (default, linear and llama3 scaling), one forward's rows, and the op that applies
them to the qkv projection's q and k and stores k and v in the paged KV cache."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.model_config import ModelConfig
from pdserve.engine.ops.custom_op import CustomOp
from pdserve.kernels import cpu_native, store_kv


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the attention scaling, for default/linear/llama3 RoPE."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif rope_type == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """RoPE as transformers applies it, `x * cos + rotate_half(x) * sin`, with rotate_half(x) =
    cat(-x2, x1) written as roll(x) = cat(x2, x1) times a sin table whose first half is negated:
    the same products bit for bit (negation is exact), one op instead of two slices, a neg and a cat.
    `at(positions, dtype)` looks the rows up once per forward; every layer applies them."""

    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        inv_freq, attention_scaling = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        half = config.head_dim // 2
        sin = emb.sin() * attention_scaling
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_signed", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> RotaryRows:
        return RotaryRows(self.cos[positions].to(dtype).unsqueeze(1), self.sin_signed[positions].to(dtype).unsqueeze(1))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.at(positions, q.dtype)(positions, q, k)


class RotaryRows:
    """One forward's RoPE rows, cos and signed sin [T, 1, head_dim] in the activation dtype; called
    like RotaryEmbedding (positions, q, k) so that Attention takes either."""

    def __init__(self, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
        self.cos, self.sin_signed = cos, sin_signed

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim]
        half = q.shape[-1] // 2
        return (q * self.cos + q.roll(half, -1) * self.sin_signed,
                k * self.cos + k.roll(half, -1) * self.sin_signed)


class RopeStoreKV(CustomOp):
    """RoPE on the qkv projection's q and k [T, (heads + 2 kv_heads) dim], k and v into the paged
    caches at slot_mapping; returns q [T, heads, dim] in the cache's dtype. `attn` gives the head
    counts and sizes (models/llama.py: Attention). The compiled op (kernels/cpu_elementwise.cpp:
    rope_store_kv) gives forward_native's bits; it takes the rows looked up once (RotaryRows)."""

    __slots__ = ()

    def cpu_takes(self, qkv, positions, rotary, kv_cache, slot_mapping, attn) -> bool:
        return kv_cache[0].dtype in cpu_native.DTYPES and isinstance(rotary, RotaryRows)

    def forward_native(self, qkv, positions, rotary, kv_cache, slot_mapping, attn) -> torch.Tensor:
        num_tokens = qkv.shape[0]
        k_cache, v_cache = kv_cache
        q, k, v = qkv.to(k_cache.dtype).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(num_tokens, attn.num_heads, attn.head_dim)
        k = k.view(num_tokens, attn.num_kv_heads, attn.head_dim)
        v = v.view(num_tokens, attn.num_kv_heads, attn.head_dim)
        q, k = rotary(positions, q, k)
        store_kv(k, v, k_cache, v_cache, slot_mapping)
        return q

    def forward_cpu(self, module, qkv, positions, rotary, kv_cache, slot_mapping, attn) -> torch.Tensor:
        return module.rope_store_kv(qkv, rotary.cos, rotary.sin_signed, kv_cache[0], kv_cache[1], slot_mapping,
                                    attn.num_heads)


rope_store_kv = RopeStoreKV()
