// bf16 GEMMs on Intel AMX tiles for a bf16 model's linear layers on CPUs that have them.
//
// y = x W^T (+ b) for x bf16 [M, K] and W bf16 [N, K], the sums in fp32, rounded once to bf16 (or
// kept fp32): what a native bf16 GEMM computes. oneDNN runs the same instructions, but at decode
// sizes (1-16 rows) its fixed cost per call and its blocking for larger problems keep it well above
// the time of streaming the weights once. Here a call is one pass over the weights, each weight
// tile read from memory once.
//
// W is packed once (pack_tiles) as the B operand of TDPBF16PS wants it: per panel of 16 weight
// rows (16 output columns), per 32 k, one 1 KiB tile of 16 rows (k pairs) x 16 columns x 2 (the
// pair): tiles[p][t][r][c][e] = W[16 p + c][32 t + 2 r + e], zero-padded in N and K. x is read as
// A tiles of 16 rows x 32 k (a copy zero-padded to whole tiles when M or K is not). One work item
// is a group of panels: with up to 16 rows, four panels against one A tile (four C tiles); with
// more, two panels against two A tiles (2 x 2 C tiles) per pair of row blocks, the group's weights
// asked into L2 during the group before and read from there by every pair. A block's sums leave
// the tiles through a staging buffer and are stored (rounded, plus the bias) by the vector units
// during the next block's tile steps, a few rows a step (Epilogue), and those steps ask ahead for
// the output lines the next stores write (in a model's step another core's op last held them).
// Each output's sum runs in k order within a tile's 32 and tile by tile, whatever M: a row gets the same bits in any batch.
//
// Compiled with target attributes (no -mamx flags for the rest of the library); amx_available()
// says at run time whether the CPU has AMX-BF16 and the kernel lets this process use the tile
// state (arch_prctl ARCH_REQ_XCOMP_PERM), and the Python side packs nothing otherwise.
#include "cpu_amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_amx_tiles.h"  // PDSERVE_AMX where the compiler has AMX; the tile shapes and configuration

namespace {

#ifdef PDSERVE_AMX
// AMX and AVX512 for what follows only (the rest of the library is built for the CPU's flags)
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,prfchw")  // PDSERVE_AMX_TARGET and PREFETCHW (a pragma takes no macro)
#define PDSERVE_AVX2 1  // both lane widths' operations (cpu_lanes.h): the AMX CPUs have them
#define PDSERVE_AVX512 1
#include "cpu_lanes.h"
#define AMX_TARGET

// One row of y, columns [0, cols), from one row of the staged sums c, plus the bias, rounded to
// bf16 (nearest even) or kept fp32.
AMX_TARGET void write_row(const float* c, int64_t cols, const float* bias, void* y, bool out_bf16) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (cols % 16)) - 1u);
  for (int64_t n = 0; n < cols; n += 16) {
    const __mmask16 m = n + 16 <= cols ? static_cast<__mmask16>(0xffff) : tail;
    __m512 v = _mm512_maskz_loadu_ps(m, c + n);
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + n));
    if (out_bf16) {
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(y) + n, m, (__m256i)_mm512_cvtneps_pbh(v));
    } else {
      _mm512_mask_storeu_ps(static_cast<float*>(y) + n, m, v);
    }
  }
}

// The gate_up projection's epilogue (pack_tiles of gate and up rows interleaved 16 by 16): one
// row's staged sums of `pairs` panel pairs (gate, up) become silu(gate) * up, with the roundings
// the unfused path makes: gate and up rounded to bf16 (the GEMM's output), then silu_mul's
// arithmetic (cpu_lanes.h: store_silu_times). The same bits as gemm_tiles + silu_mul.
AMX_TARGET void write_silu_row(const float* c, int64_t pairs, uint16_t* y) {
  const auto bf16 = [](__m512 v) {  // the GEMM's own rounding (write_row), back as floats
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
  };
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512 g = bf16(_mm512_loadu_ps(c + 2 * j * kCols));
    const __m512 u = bf16(_mm512_loadu_ps(c + (2 * j + 1) * kCols));
    store_silu_times<Lanes16, uint16_t>(y + j * kCols, g, u);
  }
}

// A block's staged sums on their way to y: write_row (or write_silu_row) a few rows at a time,
// called between the tile steps of the next block, so the vector units store one block while the
// tile unit multiplies the next (a block's stores after its products would leave the tile unit
// idle). The same stores.
struct Stores {
  const float* c = nullptr;  // the block's sums, ldc floats a row
  int64_t ldc = 0, rows = 0, next = 0, per_step = 1;  // next: the first row not yet stored
  int64_t cols = 0;  // the block's columns; with silu its (gate, up) panel pairs
  const float* bias = nullptr;
  char* y = nullptr;  // the block's row 0 of y, at its group's first column
  int64_t ld = 0;     // bytes from one row of y to the next
  bool out_bf16 = true, silu = false;

  AMX_TARGET void run(int64_t upto) {
    for (; next < upto; ++next) {
      char* row = y + next * ld;
      if (silu) write_silu_row(c + next * ldc, cols, reinterpret_cast<uint16_t*>(row));
      else write_row(c + next * ldc, cols, bias, row, out_bf16);
    }
  }
  AMX_TARGET void step() { run(std::min(rows, next + per_step)); }
  AMX_TARGET void finish() { run(rows); }
};

// In a call of several row blocks (prefill-sized; a decode call's one block streams its weights
// and writes a few rows), each tile step also asks for what the thread needs a block or a group
// later:
// - the rows of y of the block being multiplied, with intent to write, so that its stores a block
//   later find their lines in this core's cache: in a model's step the output buffer's lines were
//   last another core's op's, and a store to such a line waits for it;
// - the next group's weights [fetch, fetch_end) into L2, `fetch_lines` lines a step, spread over
//   this group's blocks (else the next group's first block waits on them from memory).
struct AskAhead {
  char* y = nullptr;  // the coming block's row 0 of y
  int64_t rows = 0, next = 0, per_step = 1, ld = 0, row_bytes = 0;
  const char* fetch = nullptr;
  const char* fetch_end = nullptr;
  int64_t fetch_lines = 0;

  AMX_TARGET void step() {
#ifndef PDSERVE_NO_Y_PREFETCH
    for (const int64_t end = std::min(rows, next + per_step); next < end; ++next)
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(y + next * ld + b, 1, 3);
#endif
#ifndef PDSERVE_NO_W_PREFETCH
    for (int64_t i = 0; i < fetch_lines && fetch < fetch_end; ++i, fetch += 64) _mm_prefetch(fetch, _MM_HINT_T1);
#endif
  }
};

// What a tile step does besides its products: the block before's stores and, with kAhead (calls
// of several row blocks), the asking ahead. A decode call's tile loops are compiled without the
// asking ahead: with it in the same structure, unused, the 16-row GEMMs run slower.
template <bool kAhead>
struct Epilogue {
  Stores stores;
  AskAhead ahead;
  AMX_TARGET void step() {
    stores.step();
    if constexpr (kAhead) ahead.step();
  }
};

// C tiles 0..NP-1 = one A block (16 rows at a, lda bytes apart) x NP panels (w, `stride` bf16 apart).
// Tile 4 holds A; B rotates through 5, 6, 7.
template <int NP, typename E>
AMX_TARGET void tiles_1xN(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t stride, int64_t KT,
                          float* c, int64_t ldc, E& prev) {
  _tile_zero(0);
  if (NP > 1) _tile_zero(1);
  if (NP > 2) _tile_zero(2);
  if (NP > 3) _tile_zero(3);
  for (int64_t t = 0; t < KT; ++t) {
    _tile_loadd(4, a + t * kDepth, lda);
    const uint16_t* b = w + t * kTile;
    _tile_loadd(5, b, 64);
    _tile_dpbf16ps(0, 4, 5);
    prev.step();
    if (NP > 1) {
      _tile_loadd(6, b + stride, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (NP > 2) {
      _tile_loadd(7, b + 2 * stride, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (NP > 3) {
      _tile_loadd(5, b + 3 * stride, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, ldc);
  if (NP > 1) _tile_stored(1, c + kCols, ldc);
  if (NP > 2) _tile_stored(2, c + 2 * kCols, ldc);
  if (NP > 3) _tile_stored(3, c + 3 * kCols, ldc);
}

// C tiles 0..3 = two A blocks (a, a + 16 rows) x NP (1 or 2) panels: A in 4, 5; B in 6, 7.
template <int NP, typename E>
AMX_TARGET void tiles_2xN(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t stride, int64_t KT,
                          float* c, int64_t ldc, E& prev) {
  const uint16_t* a1 = a + kRows * (lda / 2);
  _tile_zero(0);
  _tile_zero(2);
  if (NP > 1) {
    _tile_zero(1);
    _tile_zero(3);
  }
  for (int64_t t = 0; t < KT; ++t) {
    _tile_loadd(4, a + t * kDepth, lda);
    _tile_loadd(5, a1 + t * kDepth, lda);
    const uint16_t* b = w + t * kTile;
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    prev.step();
    if (NP > 1) {
      _tile_loadd(7, b + stride, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  float* c1 = c + kRows * (ldc / 4);
  _tile_stored(0, c, ldc);
  _tile_stored(2, c1, ldc);
  if (NP > 1) {
    _tile_stored(1, c + kCols, ldc);
    _tile_stored(3, c1 + kCols, ldc);
  }
}

// Panels [p0, p1) of the output for every row: the work of one thread. `silu`: the panels are
// (gate, up) pairs and y is their silu(gate) * up (write_silu_row), N / 2 wide. kAhead: M has
// several row blocks (Epilogue).
template <bool kAhead>
AMX_TARGET void gemm_range(const uint16_t* a, int64_t lda, int64_t M, const uint16_t* w, int64_t KT, int64_t p0,
                           int64_t p1, int64_t N, const float* bias, void* y, bool out_bf16, bool silu) {
  configure_tiles();
  const int64_t stride = KT * kTile;  // bf16 from one panel to the next
  const int64_t blocks = (M + kRows - 1) / kRows;
  const int64_t group = blocks == 1 ? 4 : 2;
  alignas(64) float staged[2][2 * kRows * 4 * kCols];  // one block's sums being stored, the next one's being made
  int turn = 0;
  const int64_t ldc = group * kCols;  // floats
  const int64_t e = out_bf16 ? 2 : 4;  // bytes an output (the silu form: bf16)
  const int64_t ld = (silu ? N / 2 : N) * e;  // bytes from one row of y to the next
  Epilogue<kAhead> last;  // the block before this one: its rows stored during this one's tile steps
  last.stores.ld = last.ahead.ld = ld;
  last.stores.out_bf16 = out_bf16, last.stores.silu = silu;
  for (int64_t p = p0; p < p1; p += group) {
    const int64_t np = std::min(group, p1 - p);
    const uint16_t* wp = w + p * stride;
    const int64_t col0 = p * kCols, cols = std::min(np * kCols, N - col0);
    char* y0 = static_cast<char*>(y) + (silu ? col0 / 2 : col0) * e;  // row 0, the group's first output
    if constexpr (kAhead) {
      last.ahead.row_bytes = (silu ? cols / 2 : cols) * e;
      if (p + group < p1) {  // the next group's weights, over this group's tile steps
        const int64_t lines = std::min(group, p1 - p - group) * stride * 2 / 64, steps = (blocks + 1) / 2 * KT;
        last.ahead.fetch = reinterpret_cast<const char*>(wp + group * stride);
        last.ahead.fetch_end = last.ahead.fetch + lines * 64;
        last.ahead.fetch_lines = (lines + steps - 1) / steps;
      }
    }
    for (int64_t b = 0; b < blocks; b += 2) {
      const uint16_t* ab = a + b * kRows * (lda / 2);
      const bool pair = b + 1 < blocks;
      float* c = staged[turn];
      const int64_t r0 = b * kRows, rows = std::min<int64_t>(pair ? 2 * kRows : kRows, M - r0);
      const int64_t per_step = (rows + KT - 1) / KT;  // rows stored (or asked for) a tile step
      char* yb = y0 + r0 * ld;  // this block's first output
      if constexpr (kAhead) {
        last.ahead.y = yb, last.ahead.rows = rows, last.ahead.next = 0, last.ahead.per_step = per_step;
      }
      if (pair) {
        if (np == 2) tiles_2xN<2>(ab, lda, wp, stride, KT, c, ldc * 4, last);
        else tiles_2xN<1>(ab, lda, wp, stride, KT, c, ldc * 4, last);
      } else {
        switch (np) {
          case 4: tiles_1xN<4>(ab, lda, wp, stride, KT, c, ldc * 4, last); break;
          case 3: tiles_1xN<3>(ab, lda, wp, stride, KT, c, ldc * 4, last); break;
          case 2: tiles_1xN<2>(ab, lda, wp, stride, KT, c, ldc * 4, last); break;
          default: tiles_1xN<1>(ab, lda, wp, stride, KT, c, ldc * 4, last); break;
        }
      }
      Stores& s = last.stores;  // the block before stored; this one is next (its sums in c)
      s.finish();
      s.c = c, s.ldc = ldc, s.rows = rows, s.next = 0, s.per_step = per_step;
      s.cols = silu ? np / 2 : cols, s.bias = bias == nullptr ? nullptr : bias + col0, s.y = yb;
      turn ^= 1;
    }
  }
  last.stores.finish();
  _tile_release();
}

#pragma GCC pop_options
#endif

}  // namespace

bool amx_available() {
#ifdef PDSERVE_AMX
  static const bool ok = request_amx();
  return ok;
#else
  return false;
#endif
}

torch::Tensor pack_tiles(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_tiles: a 2-D bfloat16 weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t P = (N + kCols - 1) / kCols, KT = (K + kDepth - 1) / kDepth;
  auto padded = torch::zeros({P * kCols, KT * kDepth}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [p, c, t, r, e] -> [p, t, r, c, e]
  return padded.view({P, kCols, KT, kDepth / 2, 2}).permute({0, 2, 3, 1, 4}).contiguous().view({P, KT, kTile});
}

namespace {
// gemm_tiles, or with `silu` its gate_up form (gemm_tiles_silu)
torch::Tensor run_tiles(torch::Tensor x, torch::Tensor tiles, int64_t out_features, c10::optional<torch::Tensor> bias,
                        bool out_bf16, bool silu) {
  TORCH_CHECK(amx_available(), "gemm_tiles: this CPU (or its kernel) gives no AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "gemm_tiles: x must be 2-D bfloat16");
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(2) == kTile && out_features > 0 && (out_features + kCols - 1) / kCols == tiles.size(0) &&
                  (x.size(1) + kDepth - 1) / kDepth == tiles.size(1),
              "gemm_tiles: tiles must be pack_tiles of a [out_features, x.size(1)] weight");
  const int64_t M = x.size(0), K = x.size(1), N = out_features, P = tiles.size(0), KT = tiles.size(1);
  const float* b = nullptr;
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "gemm_tiles: bias must be [out_features]");
    bias32 = bias->to(at::kFloat).contiguous();
    b = bias32.data_ptr<float>();
  }
  TORCH_CHECK(!silu || (out_bf16 && b == nullptr && N % (2 * kCols) == 0),
              "gemm_tiles_silu: gate and up of a multiple of 16 columns each, interleaved, no bias");
  auto y = torch::empty({M, silu ? N / 2 : N}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0) return y;
#ifdef PDSERVE_AMX
  // A tiles read whole tiles: x as it is when its rows are, else a copy padded with zeros
  // (a buffer of this thread's, not a new tensor: a decode step makes 121 such calls)
  const int64_t Mp = (M + kRows - 1) / kRows * kRows, Kp = KT * kDepth;
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(x.data_ptr());
  thread_local LineVector<uint16_t> padded;
  if (M != Mp || K != Kp || x.stride(1) != 1 || x.stride(0) != K) {
    padded.assign(Mp * Kp, 0);
    const int64_t row = x.stride(0);
    if (x.stride(1) == 1) {
      for (int64_t r = 0; r < M; ++r) std::memcpy(padded.data() + r * Kp, ap + r * row, K * sizeof(uint16_t));
    } else {
      for (int64_t r = 0; r < M; ++r)
        for (int64_t k = 0; k < K; ++k) padded[r * Kp + k] = ap[r * row + k * x.stride(1)];
    }
    ap = padded.data();
  }
  const auto* wp = reinterpret_cast<const uint16_t*>(tiles.data_ptr());
  void* yp = y.data_ptr();
  const int64_t blocks = Mp / kRows, group = blocks == 1 ? 4 : 2;
  const int64_t groups = (P + group - 1) / group;
  const auto range = blocks > 1 ? gemm_range<true> : gemm_range<false>;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    range(ap, Kp * 2, M, wp, KT, g0 * group, std::min(P, g1 * group), N, b, yp, out_bf16, silu);
  });
#endif
  return y;
}
}  // namespace

torch::Tensor gemm_tiles(torch::Tensor x, torch::Tensor tiles, int64_t out_features, c10::optional<torch::Tensor> bias,
                         bool out_bf16) {
  return run_tiles(x, tiles, out_features, bias, out_bf16, false);
}

torch::Tensor gemm_tiles_silu(torch::Tensor x, torch::Tensor tiles, int64_t out_features) {
  return run_tiles(x, tiles, out_features, c10::nullopt, true, true);
}
