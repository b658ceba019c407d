// GEMMs on bf16 or fp32 weights, a few rows.
// y = x W^T (+ b) for x fp32 [M, K] and W bf16 or fp32 [N, K], packed once into panels of 16 weight rows,
// k-major ([N/16][K][16], zero-padded). A panel's 16 columns of y are two vectors: per k, MR rows
// of x broadcast one value each against the panel's two widened vectors (2 x MR sums in
// registers, no horizontal sums); each panel comes from memory once and from cache for the next
// rows. It reads the bf16 weights, half the bytes of the fp32 copy oneDNN reads for a bf16 model
// on a CPU without native bf16 (engine/models/cpu_bf16.py), and sums each output in k order in
// fp32, as a native bf16 GEMM does. An fp32 model's weights run the same loops without the
// widening (engine/ops/linear.py: its decode rows).
// With one or two rows the 2 x MR sums would each wait on the last add (a chain of fused
// multiply-adds, one per k): NP panels are worked on together instead (8 sums in flight), which
// also reads NP streams of weights at once; each output still sums in k order, so a row gets the
// same bits in any batch. A group of kGroup panels (72-192 KiB at the default model's depths)
// stays in L2 while every block of rows passes over it.
#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

constexpr int64_t kPanel = 16;
constexpr int64_t kGroup = 4;

#ifdef PDSERVE_AVX2
// Rows [0, MR) of NP adjacent panels (S elements apart); the last panel writes its first `cols`
// columns.
template <int MR, int NP, typename W>
void panel_rows(const float* x, int64_t K, const W* w, float* y, int64_t ldy, int64_t cols, const float* bias) {
  const int64_t S = K * kPanel;
  __m256 a[MR][NP][2];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) a[i][j][0] = a[i][j][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m256 w0[NP], w1[NP];
    for (int j = 0; j < NP; ++j) {
      w0[j] = Lanes8::load(w + j * S + k * kPanel);
      w1[j] = Lanes8::load(w + j * S + k * kPanel + 8);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256 xb = _mm256_broadcast_ss(x + i * K + k);
      for (int j = 0; j < NP; ++j) {
        a[i][j][0] = _mm256_fmadd_ps(xb, w0[j], a[i][j][0]);
        a[i][j][1] = _mm256_fmadd_ps(xb, w1[j], a[i][j][1]);
      }
    }
  }
  // The sums leave their registers in loops the compiler unrolls whole: with a loop it does not
  // (the copy below runs to `cols`), GCC kept the sums in memory and stored all of them at every k,
  // halving the FMA rate at 6 rows.
  alignas(32) float t[MR][NP][kPanel];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      _mm256_store_ps(t[i][j], a[i][j][0]);
      _mm256_store_ps(t[i][j] + 8, a[i][j][1]);
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NP; ++j) {
      const int64_t n = j == NP - 1 ? cols : kPanel;
      float* out = y + i * ldy + j * kPanel;
      for (int64_t c = 0; c < n; ++c) out[c] = bias == nullptr ? t[i][j][c] : t[i][j][c] + bias[j * kPanel + c];
    }
}

// Rows [0, MR) of `np` panels: NP at a time, then two (where NP is more), then one at a time.
template <int MR, int NP, typename W>
void rows_over(const float* x, int64_t K, const W* w, int64_t np, float* y, int64_t ldy, int64_t cols,
               const float* bias) {
  int64_t j = 0;
  for (; j + NP <= np; j += NP)
    panel_rows<MR, NP>(x, K, w + j * K * kPanel, y + j * kPanel, ldy, j + NP == np ? cols : kPanel,
                       bias == nullptr ? nullptr : bias + j * kPanel);
  for (; NP > 2 && j + 2 <= np; j += 2)
    panel_rows<MR, 2>(x, K, w + j * K * kPanel, y + j * kPanel, ldy, j + 2 == np ? cols : kPanel,
                      bias == nullptr ? nullptr : bias + j * kPanel);
  for (; j < np; ++j)
    panel_rows<MR, 1>(x, K, w + j * K * kPanel, y + j * kPanel, ldy, j + 1 == np ? cols : kPanel,
                      bias == nullptr ? nullptr : bias + j * kPanel);
}
#endif

// Rows [0, M) of `np` adjacent panels (the last one's first `cols` columns); portable loops
// without AVX2 (the same order of sums; each product rounded before its add).
template <typename W>
void panel_all_rows(const float* x, int64_t M, int64_t K, const W* w, int64_t np, float* y, int64_t ldy,
                    int64_t cols, const float* bias) {
  int64_t m = 0;
#ifdef PDSERVE_AVX2
  // blocks of 6 and 4 rows panel by panel (a panel read from memory once, from L1 for the next
  // block), then the one to three rows left over the whole group, several panels at once
  const int64_t many = M - M % 6 + (M % 6 >= 4 ? 4 : 0);
  for (int64_t j = 0; j < np; ++j) {
    const W* panel = w + j * K * kPanel;
    const int64_t c = j + 1 == np ? cols : kPanel;
    const float* pb = bias == nullptr ? nullptr : bias + j * kPanel;
    int64_t r = 0;
    for (; r + 6 <= many; r += 6) panel_rows<6, 1>(x + r * K, K, panel, y + r * ldy + j * kPanel, ldy, c, pb);
    for (; r + 4 <= many; r += 4) panel_rows<4, 1>(x + r * K, K, panel, y + r * ldy + j * kPanel, ldy, c, pb);
  }
  m = many;
  for (; m + 2 <= M; m += 2) rows_over<2, 2>(x + m * K, K, w, np, y + m * ldy, ldy, cols, bias);
  for (; m < M; ++m) rows_over<1, 4>(x + m * K, K, w, np, y + m * ldy, ldy, cols, bias);
#endif
  for (; m < M; ++m) {
    for (int64_t j = 0; j < np * kPanel - (kPanel - cols); ++j) {
      const W* panel = w + (j / kPanel) * K * kPanel;
      float a = 0.f;
      for (int64_t k = 0; k < K; ++k) a += x[m * K + k] * load(panel + k * kPanel + j % kPanel);
      y[m * ldy + j] = bias == nullptr ? a : a + bias[j];
    }
  }
}

}  // namespace

// W [N, K] bf16 or fp32 as the panels gemm_panels reads: [ceil(N / 16), K, 16] of W's dtype, zero-padded.
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_panels: a 2-D bfloat16 or float32 weight");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kPanel - 1) / kPanel;
  // rows padded to whole panels, then [P, 16, K] -> [P, K, 16]
  auto padded = torch::zeros({P * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({P, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K] fp32 (bf16 is widened first) times the packed W [N, K] (pack_panels), plus bias [N] fp32 if
// given: [M, N] fp32.
torch::Tensor gemm_panels(torch::Tensor x, torch::Tensor panels, int64_t out_features,
                          c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "gemm_panels: x must be 2-D float32 or bfloat16 (widened to float32)");
  TORCH_CHECK(panels.dim() == 3 && (panels.scalar_type() == at::kBFloat16 || panels.scalar_type() == at::kFloat) &&
                  panels.size(2) == kPanel && panels.is_contiguous() && panels.size(1) == x.size(1) &&
                  out_features > 0 && (out_features + kPanel - 1) / kPanel == panels.size(0),
              "gemm_panels: panels must be pack_panels of a [out_features, x.size(1)] weight");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat &&
                    bias->is_contiguous(), "gemm_panels: bias must be float32 [out_features]");
    b = bias->data_ptr<float>();
  }
  const auto xc = x.to(at::kFloat).contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = out_features;
  auto y = torch::empty({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t P = panels.size(0);
  const auto run = [&](auto* wp) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; p += kGroup) {
        const int64_t np = std::min(kGroup, p1 - p);
        panel_all_rows(xp, M, K, wp + p * K * kPanel, np, yp + p * kPanel, N,
                       p + np == P ? N - (P - 1) * kPanel : kPanel, b == nullptr ? nullptr : b + p * kPanel);
      }
    });
  };
  if (panels.scalar_type() == at::kFloat) run(static_cast<const float*>(panels.data_ptr<float>()));
  else run(ptr<uint16_t>(panels));
  return y;
}
