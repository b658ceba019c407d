// A step of decodes through the model's layers, in one call.
// DecoderLayer.forward_direct (engine/models/llama.py) for layers [0, L), the same ops in the same
// order, so the same bits, without the Python calls around each layer's ops. Per layer: two norm weights (fp32 where the norm hands fp32 to a bf16 model's fp32 GEMMs,
// else the residual's dtype), four GEMMs of kind 0 (AMX tiles: cpu_amx.cpp, bf16 out) or 1 (panels:
// gemm_panels, fp32 out), the third (gate_up) followed by silu_mul, or of kind 2 for it (gate_up on
// tiles with SiLU x up fused: gemm_tiles_silu), with their packed weights, output widths and biases
// (an empty tensor: none), and the layer's K/V caches. The decode attention's arguments are the
// step's (kernels/cpu_attention.py: _DirectDecode). Returns (the last layer's MLP output, the residual stream before it).
#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_ops.h"

namespace {
torch::Tensor layer_gemm(const torch::Tensor& x, int64_t kind, const torch::Tensor& w, int64_t n,
                         const torch::Tensor& bias) {
  c10::optional<torch::Tensor> b;
  if (bias.numel() > 0) b = bias;
  if (kind == 0) return gemm_tiles(x, w, n, b, true);
  if (kind == 2) return gemm_tiles_silu(x, w, n);
  return gemm_panels(x, w, n, b);
}
}  // namespace

std::vector<torch::Tensor> decode_layers(torch::Tensor x, c10::optional<torch::Tensor> residual_in,
                                         std::vector<torch::Tensor> norm_weights, std::vector<int64_t> kinds,
                                         std::vector<torch::Tensor> gemm_weights, std::vector<int64_t> widths,
                                         std::vector<torch::Tensor> biases, std::vector<torch::Tensor> k_caches,
                                         std::vector<torch::Tensor> v_caches, torch::Tensor cos, torch::Tensor sin_signed,
                                         torch::Tensor slot_mapping, int64_t heads, torch::Tensor tables,
                                         torch::Tensor seq_lens, torch::Tensor seqs, torch::Tensor rows, double scale,
                                         double eps) {
  const size_t L = k_caches.size();
  TORCH_CHECK(v_caches.size() == L && norm_weights.size() == 2 * L && kinds.size() == 4 * L &&
                  gemm_weights.size() == 4 * L && widths.size() == 4 * L && biases.size() == 4 * L,
              "decode_layers: per layer 2 norm weights, 4 GEMMs (kind, weight, width, bias) and 2 caches");
  for (size_t j = 0; j < kinds.size(); ++j)
    TORCH_CHECK(kinds[j] == 0 || kinds[j] == 1 || (kinds[j] == 2 && j % 4 == 2),
                "decode_layers: GEMM kind 0 (tiles) or 1 (panels); 2 (tiles, SiLU x up fused) for gate_up");
  torch::Tensor residual;
  bool has_residual = residual_in.has_value();
  if (has_residual) residual = *residual_in;
  for (size_t i = 0; i < L; ++i) {
    const auto norm = [&](const torch::Tensor& delta, const torch::Tensor& w) {
      if (!has_residual) {  // the first layer of the model: the residual is x itself
        residual = delta;
        has_residual = true;
        return add_rms_norm(residual, c10::nullopt, w, eps, w.scalar_type() == at::kFloat && is_bf16(residual));
      }
      return add_rms_norm(residual, delta, w, eps, w.scalar_type() == at::kFloat && is_bf16(residual));
    };
    const auto gemm = [&](const torch::Tensor& in, size_t j) {
      return layer_gemm(in, kinds[4 * i + j], gemm_weights[4 * i + j], widths[4 * i + j], biases[4 * i + j]);
    };
    torch::Tensor h = norm(x, norm_weights[2 * i]);
    torch::Tensor q = rope_store_kv(gemm(h, 0), cos, sin_signed, k_caches[i], v_caches[i], slot_mapping, heads);
    torch::Tensor out = torch::empty_like(q);
    decode_attention(q, k_caches[i], v_caches[i], tables, seq_lens, seqs, rows, out, scale);
    h = norm(gemm(out.view({out.size(0), -1}), 1), norm_weights[2 * i + 1]);
    const torch::Tensor up = gemm(h, 2);
    x = gemm(kinds[4 * i + 2] == 2 ? up : silu_mul(up), 3);
  }
  return {x, residual};
}
