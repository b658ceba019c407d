// bf16 GEMMs and prefill attention on AMX tiles (cpu_amx.cpp, cpu_amx_attention.cpp), bound in cpu_module.cpp.
#pragma once
#include <torch/extension.h>

// Whether this CPU has AMX-BF16 (and AVX512-BF16) and the OS lets this process use the tiles.
bool amx_available();
// W [N, K] bf16 as gemm_tiles reads it: [ceil(N / 16), ceil(K / 32), 512] bf16, zero-padded.
torch::Tensor pack_tiles(torch::Tensor weight);
// x [M, K] bf16 times the packed W (pack_tiles), plus bias [N] if given: [M, N], bf16 (rounded once
// from the fp32 sums) or fp32.
torch::Tensor gemm_tiles(torch::Tensor x, torch::Tensor tiles, int64_t out_features, c10::optional<torch::Tensor> bias,
                         bool out_bf16);
// gemm_tiles of a gate_up weight whose gate and up rows are interleaved 16 by 16 (out_features =
// 2 x I, I a multiple of 16): silu(gate) * up [M, I] bf16, the same bits as gemm_tiles then silu_mul.
torch::Tensor gemm_tiles_silu(torch::Tensor x, torch::Tensor tiles, int64_t out_features);
// Causal attention of one request's prefill chunk: q rows [q_start, q_start + q_len) [T, heads, dim]
// over its seq_len keys in the paged bf16 caches (block_table [max_blocks] int32), the chunk's
// queries being the last q_len positions; writes out's rows of the chunk. head_dim 64 or 128, AMX
// CPUs only (cpu_amx_attention.cpp).
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                       int64_t q_start, int64_t q_len, int64_t seq_len, torch::Tensor out, double scale);
