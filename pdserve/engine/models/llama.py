"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) over a flattened `[T]` batch.

Linear layers act on `[T, hidden]`; only attention knows request boundaries, through
`AttentionMetadata` and the paged KV cache. Numerics follow transformers' implementation
(RMSNorm in float32, RoPE tables in float32 cast to the activation dtype) so that greedy
outputs match it token for token in float32.

The residual stream runs beside the layers' outputs (as in vLLM): each norm adds the last block's
output to the residual and normalises the sum (`RMSNorm.add_norm`), the same math as
`x = x + block(norm(x))`. The elementwise ops (add + norm, RoPE + K/V store, SiLU x up) and
attention pick their implementation by device (engine/ops/: compiled on a CPU, torch elsewhere or
without the build); the model has one forward path. Two CPU fast paths keep its ops and their order
(so its bits): a layer's GEMMs called straight, chosen once per row count (`layer_gemms`,
`DecoderLayer.forward_direct`), and a step of decodes through layers 1.. in one compiled call
(`decode_rest`, the one place that dispatches to it).

With tensor parallelism (engine/parallel/) the model is built as the shard of this process's rank
(`tp_rank()` of `tp_size()`): its query and KV heads, its MLP rows, its vocab rows; `load_weights`
slices the full checkpoint tensors. At size 1 that is the whole model, with no collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
from torch import nn

from pdserve.engine.attention_metadata import AttentionMetadata
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.ops.layer_ops import add_rms_norm, silu_mul
from pdserve.engine.ops.linear import TILE_MAX_ROWS, SiluAfter, compiled_gemm
from pdserve.engine.ops.rotary import RotaryEmbedding, RotaryRows, rope_store_kv
from pdserve.engine.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pdserve.engine.parallel.sharding import check_tp, kv_head_range, q_head_range, shard_range
from pdserve.engine.parallel.state import tp_rank, tp_size
from pdserve.kernels import cpu_native, paged_attention
from pdserve.kernels.cpu_attention import DIRECT_DECODE
from pdserve.kernels.cpu_gemm import Tiles

__all__ = ["DecoderLayer", "LlamaForCausalLM", "RMSNorm", "RotaryEmbedding", "RotaryRows"]

# Row counts up to this keep their layers' chosen GEMMs (LlamaForCausalLM.layer_gemms): decode
# batches; a prefill chunk's step is long enough that choosing again does not show.
DIRECT_GEMMS_KEPT_ROWS = 512


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight32: torch.Tensor | None = None  # set: hand fp32 to the next GEMM (hand_fp32_out)

    def hand_fp32_out(self) -> None:
        """Return weight * normalised x in fp32 (the fp32 weight kept, not widened every call)."""
        self.weight32 = self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight32 is not None:
            return self.weight32 * x32
        return self.weight * x32.to(x.dtype)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(r), r) with r = residual + x, or r = x for the first layer (ops.layer_ops.AddRMSNorm)."""
        return add_rms_norm(x, residual, self)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        super().__init__()
        q_start, q_end = q_head_range(rank, size, config.num_heads)
        kv_start, kv_end = kv_head_range(rank, size, config.num_kv_heads)
        # this rank's heads only: its KV pool holds KV heads [kv_start, kv_end)
        self.num_heads, self.num_kv_heads, self.head_dim = q_end - q_start, kv_end - kv_start, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        d = self.head_dim
        q_part = (q_start * d, q_end * d, config.num_heads * d)
        kv_part = (kv_start * d, kv_end * d, config.num_kv_heads * d)
        # q, k and v in one matmul; loaded from the checkpoint's separate q/k/v_proj.
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_part, kv_part, kv_part], bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(q_part, config.hidden_size, size)
        self.scale = self.head_dim**-0.5

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata,
                kv_cache: tuple[torch.Tensor, torch.Tensor], rotary: RotaryEmbedding | RotaryRows) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # float32 where the GEMM hands fp32 on (hand_fp32_to_gemms)
        return self.o_proj(self.attend(positions, qkv, meta, kv_cache, rotary))

    def attend(self, positions, qkv, meta, kv_cache, rotary) -> torch.Tensor:
        """RoPE on the qkv projection's q and k, k and v into the paged caches, paged attention:
        [T, q_size] in the cache's dtype."""
        k_cache, v_cache = kv_cache
        q = rope_store_kv(qkv, positions, rotary, kv_cache, meta.slot_mapping, self)
        out = paged_attention(
            q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, self.scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, plans=meta.plans,
        )  # [T, num_heads, head_dim]
        return out.view(qkv.shape[0], self.q_size)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        super().__init__()
        start, end = shard_range(rank, size, config.intermediate_size)
        part = (start, end, config.intermediate_size)
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [part, part], bias=False)
        self.down_proj = RowParallelLinear(part, config.hidden_size, size)
        self.gate_up_silu: Tiles | None = None  # the gate_up GEMM with SiLU x up fused (fuse_silu)

    def fuse_silu(self) -> bool:
        """Where the gate_up projection has AMX tiles (ops/linear.py: pack_cpu_linears), pack it
        again with SiLU x up fused into the GEMM (Tiles(silu=True): the same bits, no [T, 2I]
        output) and drop the unfused tiles; True if done."""
        proj = self.gate_up_proj
        if proj.tiles is None or (proj.out_features // 2) % 16:
            return False
        self.gate_up_silu = Tiles(cpu_native.load(), proj.weight, silu=True)
        proj.tiles = None
        return True

    def activation(self, rows: int) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """h -> the down projection's input at `rows` rows as one call: the fused tiles, or the
        gate_up GEMM's direct call then SiLU x up (SiluAfter); None where neither is a direct call."""
        if self.gate_up_silu is not None and rows <= TILE_MAX_ROWS:
            return self.gate_up_silu
        gemm = self.gate_up_proj.direct_gemm(rows)
        return None if gemm is None else SiluAfter(gemm)

    def activate(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of x's gate_up projection: the down projection's input."""
        if self.gate_up_silu is not None and x.dim() == 2 and 0 < x.shape[0] <= TILE_MAX_ROWS:
            return self.gate_up_silu(x)
        return silu_mul(self.gate_up_proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rank: int, size: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, rank, size)
        self.mlp = MLP(config, rank, size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, residual, meta, kv_cache, rotary) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it is added); residual None: the
        first layer, x the embeddings (the next norm adds the output: RMSNorm.add_norm)."""
        attn, mlp = self.self_attn, self.mlp
        return self._run(positions, x, residual, meta, kv_cache, rotary,
                         (attn.qkv_proj, attn.o_proj, mlp.activate, mlp.down_proj))

    def forward_direct(self, positions, x, residual, meta, kv_cache, rotary, gemms):
        """forward with its four GEMMs called straight (`direct_gemms`): the same ops in the same
        order, so the same bits, without the Python of the module calls around them."""
        return self._run(positions, x, residual, meta, kv_cache, rotary, gemms)

    def _run(self, positions, x, residual, meta, kv_cache, rotary, gemms):
        qkv, o, activation, down = gemms
        h, residual = self.input_layernorm.add_norm(x, residual)
        out = self.self_attn.attend(positions, qkv(h), meta, kv_cache, rotary)
        h, residual = self.post_attention_layernorm.add_norm(o(out), residual)
        return down(activation(h)), residual

    def direct_gemms(self, rows: int) -> list[Callable[[torch.Tensor], torch.Tensor]] | None:
        """The GEMMs of the qkv, o, gate_up and down projections as plain calls when each of them,
        at `rows` rows, is exactly one GEMM with its output handed on as it is (ops/linear.py:
        direct_gemm; models/cpu_bf16.py); else None."""
        gemms = []
        for proj in (self.self_attn.qkv_proj, self.self_attn.o_proj, self.mlp, self.mlp.down_proj):
            direct = getattr(proj, "activation" if proj is self.mlp else "direct_gemm", None)
            gemm = None if direct is None else direct(rows)
            if gemm is None:
                return None
            gemms.append(gemm)
        return gemms

    def hand_fp32_to_gemms(self) -> None:
        """For a bf16 model whose GEMMs run in fp32 on bf16 values (models/cpu_bf16.py): the two
        norms and the gate_up projection hand fp32 straight on to the next GEMM, which would widen
        bf16 to fp32 anyway. The bf16 roundings in between go (results differ by rounding only),
        and with them casts and bf16 elementwise ops, slow on CPUs without native bf16. The
        residual stream, q/k/v, the KV cache and attention stay bf16: the qkv, o and down
        projections hand on what their GEMM gives (out_dtype None) and what takes it rounds it to
        bf16 first (Attention, RMSNorm.add_norm), in the compiled op where there is one: no
        separate cast, the same values. A layer whose output a collective sums (tensor
        parallelism) keeps bf16 out, as every rank's sum did."""
        self.input_layernorm.hand_fp32_out()
        self.post_attention_layernorm.hand_fp32_out()
        self.mlp.gate_up_proj.out_dtype = torch.float32
        self.self_attn.qkv_proj.out_dtype = None
        for proj in (self.self_attn.o_proj, self.mlp.down_proj):
            if proj.tp_combine is None:
                proj.out_dtype = None


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_len: int) -> None:
        super().__init__()
        self.config = config
        # the shard of this process's tensor-parallel rank (rank 0 of 1: the whole model)
        rank, size = self.tp_rank, self.tp_size = tp_rank(), tp_size()
        check_tp(config, size)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, rank, size)
        self.layers = nn.ModuleList(DecoderLayer(config, rank, size) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, rank, size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config, max_len)
        # rows -> each layer's direct_gemms(rows), chosen on the first forward of that many rows
        self._direct_gemms: dict[int, list] = {}
        # rows -> the arguments of the compiled layer loop for layers 1.. (None: not every GEMM is one it runs)
        self._compiled: dict[int, tuple | None] = {}
        self.compiled_decode = True  # a step of decodes runs layers 1.. in one compiled call (decode_rest)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: [num_blocks, block_size, kv_heads, head_dim] x2
    ) -> torch.Tensor:  # [T, hidden]
        x = self.embed_tokens(input_ids)
        rotary = self.rotary.at(positions, x.dtype)  # the RoPE rows, once for every layer
        residual = None
        plans = self.layer_gemms(x.shape[0]) if x.device.type == "cpu" else itertools.repeat(None)
        for i, (layer, kv_cache, gemms) in enumerate(zip(self.layers, kv_caches, plans)):
            if gemms is None:
                x, residual = layer(positions, x, residual, meta, kv_cache, rotary)
            else:
                x, residual = layer.forward_direct(positions, x, residual, meta, kv_cache, rotary, gemms)
            if i == 0:
                rest = self.decode_rest(x, residual, meta, kv_caches, rotary)
                if rest is not None:
                    x, residual = rest
                    break
        return self.norm.add_norm(x, residual)[0]

    def decode_rest(self, x, residual, meta, kv_caches, rotary) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layers 1.. in one compiled call (kernels/cpu_decode_step.cpp: decode_layers) where the first
        layer's attention found a step of decodes only (its plan: kernels/cpu_attention.py) and every
        GEMM of those layers is one the call runs; else None (the Python layers go on)."""
        if not self.compiled_decode or meta.plans is None or DIRECT_DECODE not in meta.plans or len(self.layers) < 2:
            return None
        module = cpu_native.load()
        rest = None if module is None else self.compiled_layers(x.shape[0])
        if rest is None:
            return None
        first, d = self.layers[0], meta.plans[DIRECT_DECODE]
        x, residual = module.decode_layers(
            x, residual, *rest, [c[0] for c in kv_caches[1:]], [c[1] for c in kv_caches[1:]],
            rotary.cos, rotary.sin_signed, meta.slot_mapping, first.self_attn.num_heads, d.tables,
            d.seq_lens, d.seqs, d.rows, first.self_attn.scale, first.input_layernorm.eps)
        return x, residual

    def compiled_layers(self, rows: int) -> tuple | None:
        """Layers 1.. as the compiled loop takes them (kernels/cpu_decode_step.cpp: decode_layers): norm
        weights, GEMM kinds, packed weights, widths and biases; None unless every one of their GEMMs
        is the tiles' or the panels' at `rows` rows. Kept per row count like layer_gemms."""
        if rows in self._compiled:
            return self._compiled[rows]
        norms, kinds, weights, widths, biases = [], [], [], [], []
        result = None
        plans = self.layer_gemms(rows)
        if all(p is not None for p in plans[1:]):
            gemms = [compiled_gemm(g) for p in plans[1:] for g in p]
            if all(g is not None for g in gemms):
                for layer in self.layers[1:]:
                    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                        norms.append(norm.weight if norm.weight32 is None else norm.weight32)
                for kind, packed, width, bias in gemms:
                    kinds.append(kind), weights.append(packed), widths.append(width), biases.append(bias)
                result = (norms, kinds, weights, widths, biases)
        if rows <= DIRECT_GEMMS_KEPT_ROWS:
            self._compiled[rows] = result
        return result

    def layer_gemms(self, rows: int) -> list[list[Callable[[torch.Tensor], torch.Tensor]] | None]:
        """Each layer's direct_gemms(rows), chosen once per row count up to DIRECT_GEMMS_KEPT_ROWS
        (decode batches repeat theirs, and choosing for every layer is a visible part of a small
        step). Layers are final once loaded: whatever changes them after a forward (a test, an A/B
        harness) calls forget_direct_gemms()."""
        plans = self._direct_gemms.get(rows)
        if plans is None:
            plans = [layer.direct_gemms(rows) for layer in self.layers]
            if rows <= DIRECT_GEMMS_KEPT_ROWS:
                self._direct_gemms[rows] = plans
        return plans

    def fuse_silu(self) -> int:
        """Each MLP's gate_up GEMM with SiLU x up fused where it has AMX tiles (MLP.fuse_silu); how many."""
        self.forget_direct_gemms()
        return sum(layer.mlp.fuse_silu() for layer in self.layers)

    def forget_direct_gemms(self) -> None:
        self._direct_gemms.clear()
        self._compiled.clear()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocab logits [S, vocab] on every rank (the lm_head gathers the vocab shards), in the
        lm_head's dtype: a greedy step's argmax reads a bf16 model's as they are (sampler.argmax_rows),
        and the Sampler upcasts them to float32 before anything else."""
        return self.lm_head(hidden)

    # ---- weights --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, fusing q/k/v and gate/up; a sharded layer takes its rank's
        slice of each full tensor (`load_shard`). Raises on a missing or unknown weight."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            target, part = _fused_target(name)
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in the checkpoint")
            module_name, _, param_name = target.rpartition(".")
            module = modules[module_name]
            with torch.no_grad():
                try:
                    if hasattr(module, "load_shard"):
                        module.load_shard(param_name, tensor, part)
                    else:
                        _copy_whole(params[target], tensor)
                except ValueError as exc:
                    raise ValueError(f"weight {name!r}: {exc}") from None
            loaded.add(f"{target}:{part}")
        _check_all_loaded(params, loaded)


# checkpoint projection -> (our fused projection, its part index)
_FUSED_PARTS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_NUM_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}


def _fused_target(name: str) -> tuple[str, int]:
    """Checkpoint name → (our parameter, the part of it the tensor fills: 0 when not fused)."""
    for part_name, (fused, part) in _FUSED_PARTS.items():
        if f".{part_name}." in name:
            return name.replace(part_name, fused), part
    return name, 0


def _copy_whole(param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)}, model expects {tuple(param.shape)}")
    param.copy_(tensor)


def _check_all_loaded(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = []
    for name in params:
        fused = next((f for f in _NUM_PARTS if f".{f}." in name), None)
        num_parts = 1 if fused is None else _NUM_PARTS[fused]
        if any(f"{name}:{part}" not in loaded for part in range(num_parts)):
            missing.append(name)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")
