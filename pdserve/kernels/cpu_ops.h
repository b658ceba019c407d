// The CPU backend's ops, one module (kernels/cpu_native.py builds it from the .cpp files beside
// this header): what each translation unit defines for the others and for the bindings
// (cpu_module.cpp). The AMX GEMM and prefill attention are declared in cpu_amx.h.
#pragma once
#include <torch/extension.h>

#include <vector>

// cpu_decode_attention.cpp
void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                      torch::Tensor seq_lens, torch::Tensor seqs, torch::Tensor rows, torch::Tensor out, double scale);

// cpu_elementwise.cpp
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps, bool fp32_out);
torch::Tensor rope_store_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor argmax_rows(torch::Tensor logits);

// cpu_gemm.cpp
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor gemm_panels(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                          c10::optional<torch::Tensor> bias);

// cpu_decode_step.cpp
std::vector<torch::Tensor> decode_layers(torch::Tensor x, c10::optional<torch::Tensor> residual_in,
                                         std::vector<torch::Tensor> norm_weights, std::vector<int64_t> kinds,
                                         std::vector<torch::Tensor> gemm_weights, std::vector<int64_t> widths,
                                         std::vector<torch::Tensor> biases, std::vector<torch::Tensor> k_caches,
                                         std::vector<torch::Tensor> v_caches, torch::Tensor cos, torch::Tensor sin_signed,
                                         torch::Tensor slot_mapping, int64_t heads, torch::Tensor tables,
                                         torch::Tensor seq_lens, torch::Tensor seqs, torch::Tensor rows, double scale,
                                         double eps);
