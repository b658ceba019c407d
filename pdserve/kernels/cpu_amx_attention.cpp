// Causal attention of a prefill chunk (one request's new queries over its paged K/V) on AMX tiles,
// for bf16 caches with head_dim 64 or 128, in place of SDPA and the gathers around it.
//
// The scores are computed transposed, S^T = K Q^T: a vector's 16 lanes are 16 queries, so each
// query's max and sum over its keys are vertical (one op per 16 scores, no reduction across lanes)
// and the causal mask of a key row is one compare against the lanes' positions.
//
// Per call, the request's K and V (context and chunk) are packed once for the query heads that share
// them: K as rows [keys][dim] (A tiles: 16 keys x 32 dims), V transposed (vt[c][j][i]: A tiles of 16
// dims x 32 keys), zero past the sequence. One work item is one query head's 16 queries (the
// chunk's last item may hold fewer, zero-padded), Q^T as B tiles; over its keys, in passes of up to
// kPass keys:
//   1. S^T = K Q^T on tiles, stored as fp32 rows of 16 queries.
//   2. Each query's max over the keys it sees, then p = 2^((s - max) x scale x log2 e) (a degree-5
//      polynomial, 2.2e-7 relative) summed in fp32 and rounded to bf16 into P^T, in the pairs of keys
//      a B tile holds: the steps of SDPA's flash kernel for bf16 (fp32 exps, P rounded to bf16 for
//      the P V product).
//   3. O^T = V^T P^T on tiles in fp32; a later pass rescales the earlier sums and output by
//      2^(old max - new max), a flash-attention step once per kPass keys.
// Out = O / sum, transposed back and rounded to bf16. Threads take items from a shared counter,
// longest first, so the causal triangle's long rows do not pile up on one thread.
//
// Compiled with target attributes (no -mamx flags for the rest of the library); the caller asks
// amx_available() (cpu_amx.cpp) before it calls this.
#include "cpu_amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_amx_tiles.h"  // PDSERVE_AMX where the compiler has AMX; the tile shapes and configuration

namespace {

#ifdef PDSERVE_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")  // PDSERVE_AMX_TARGET (a pragma takes no macro)

constexpr int64_t kPass = 2048;  // keys per pass: a thread's S^T (128 KiB) and P^T (64 KiB) stay in L2
constexpr int64_t kMaxDim = 128;

struct Geometry {
  int64_t heads, kv_heads, dim, group;  // group: query heads per KV head
  int64_t q_len, seq_len, context;      // context = seq_len - q_len: keys before the chunk
  int64_t keys;                         // seq_len rounded up to 32 (the packed K and V per KV head)
};

// 2^x for x <= 0 (2^x for very negative x is 0; -inf gives NaN, masked by the callers): f = x -
// floor(x) by VREDUCEPS, 2^f on [0, 1) by a fitted polynomial (relative error 2.2e-7, 2^0 = 1
// exactly), then VSCALEFPS multiplies by 2^floor(x) itself: 8 operations.
inline __m512 exp2_16(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, 0x09);  // x - floor(x): 0 fraction bits kept, round down, no exception
  __m512 p = _mm512_set1_ps(1.8576009897515178e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.038320742547512e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5783357471227646e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4016965925693512e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931507587432861e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, x);
}

// r[j] lane i <- r[i] lane j: a 16 x 16 transpose of 32-bit elements.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // [r0 r1 interleaved by 32 bits within each 128-bit lane]
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 rows' elements per 128-bit lane
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: rows 0-3 with 4-7, 8-11 with 12-15
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// The K rows and V^T tiles of KV head c, keys [32 j, 32 j + 32), 0 past the sequence:
// k[(32 j + key) * dim + d] = K[32 j + key][d]; vt[(j * dim / 16 + i) * kTile + d * 32 + key] =
// V[32 j + key][16 i + d].
void pack_kv(const uint16_t* k_cache, const uint16_t* v_cache, const int32_t* table, int64_t block_size,
             int64_t token_stride, int64_t block_stride, const Geometry& g, int64_t c, int64_t j, uint16_t* k,
             uint16_t* vt) {
  const int64_t D = g.dim;
  const auto at = [&](const uint16_t* cache, int64_t key) -> const uint16_t* {
    return cache + table[key / block_size] * block_stride + (key % block_size) * token_stride + c * D;
  };
  for (int64_t key = j * kDepth; key < (j + 1) * kDepth; ++key) {
    if (key < g.seq_len) std::memcpy(k + key * D, at(k_cache, key), D * 2);
    else std::memset(k + key * D, 0, D * 2);
  }
  for (int64_t i = 0; i < D / kCols; ++i) {
    __m512i r[16];  // r[pair] lane d = (V[2 pair][16 i + d], V[2 pair + 1][16 i + d])
    for (int64_t pair = 0; pair < 16; ++pair) {
      const int64_t k0 = j * kDepth + 2 * pair;
      const __m512i lo = k0 < g.seq_len
          ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at(v_cache, k0) + i * kCols)))
          : _mm512_setzero_si512();
      const __m512i hi = k0 + 1 < g.seq_len
          ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at(v_cache, k0 + 1) + i * kCols)))
          : _mm512_setzero_si512();
      r[pair] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
    }
    transpose16(r);  // r[d] lane pair: row d of the A tile, its 32 keys in order
    uint16_t* dst = vt + (j * (D / kCols) + i) * kTile;
    for (int d = 0; d < 16; ++d) _mm512_storeu_si512(dst + d * kDepth, r[d]);
  }
}

// S^T rows [16 n16 keys][16 queries] at s (contiguous) = K rows [16 j0, ...) x the item's Q^T tiles.
// DT = 2 (dim 64): C 0-3 (64 keys at a time), K in 4-5, Q^T in 6-7. DT = 4 (dim 128): C 0-1, K in
// 2-3, Q^T in 4-7. Consecutive products go to different C tiles and K alternates between two tiles.
template <int DT>
void scores(const uint16_t* qt, const uint16_t* k, int64_t j0, int64_t n16, float* s) {
  constexpr int64_t D = DT * kDepth, ldk = D * 2;
  const auto a = [&](int64_t j, int64_t t) { return k + (j0 + j) * kRows * D + t * kDepth; };
  if constexpr (DT == 2) {
    _tile_loadd(6, qt, 64);
    _tile_loadd(7, qt + kTile, 64);
    int64_t j = 0;
    for (; j + 4 <= n16; j += 4) {
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      _tile_loadd(4, a(j, 0), ldk); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a(j + 1, 0), ldk); _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, a(j + 2, 0), ldk); _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, a(j + 3, 0), ldk); _tile_dpbf16ps(3, 5, 6);
      _tile_loadd(4, a(j, 1), ldk); _tile_dpbf16ps(0, 4, 7);
      _tile_loadd(5, a(j + 1, 1), ldk); _tile_dpbf16ps(1, 5, 7);
      _tile_loadd(4, a(j + 2, 1), ldk); _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, a(j + 3, 1), ldk); _tile_dpbf16ps(3, 5, 7);
      _tile_stored(0, s + j * 256, 64); _tile_stored(1, s + (j + 1) * 256, 64);
      _tile_stored(2, s + (j + 2) * 256, 64); _tile_stored(3, s + (j + 3) * 256, 64);
    }
    for (; j < n16; ++j) {
      _tile_zero(0);
      _tile_loadd(4, a(j, 0), ldk); _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a(j, 1), ldk); _tile_dpbf16ps(0, 5, 7);
      _tile_stored(0, s + j * 256, 64);
    }
  } else {
    _tile_loadd(4, qt, 64); _tile_loadd(5, qt + kTile, 64);
    _tile_loadd(6, qt + 2 * kTile, 64); _tile_loadd(7, qt + 3 * kTile, 64);
    int64_t j = 0;
    for (; j + 2 <= n16; j += 2) {
      _tile_zero(0); _tile_zero(1);
      _tile_loadd(2, a(j, 0), ldk); _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(3, a(j + 1, 0), ldk); _tile_dpbf16ps(1, 3, 4);
      _tile_loadd(2, a(j, 1), ldk); _tile_dpbf16ps(0, 2, 5);
      _tile_loadd(3, a(j + 1, 1), ldk); _tile_dpbf16ps(1, 3, 5);
      _tile_loadd(2, a(j, 2), ldk); _tile_dpbf16ps(0, 2, 6);
      _tile_loadd(3, a(j + 1, 2), ldk); _tile_dpbf16ps(1, 3, 6);
      _tile_loadd(2, a(j, 3), ldk); _tile_dpbf16ps(0, 2, 7);
      _tile_loadd(3, a(j + 1, 3), ldk); _tile_dpbf16ps(1, 3, 7);
      _tile_stored(0, s + j * 256, 64); _tile_stored(1, s + (j + 1) * 256, 64);
    }
    for (; j < n16; ++j) {
      _tile_zero(0);
      _tile_loadd(2, a(j, 0), ldk); _tile_dpbf16ps(0, 2, 4);
      _tile_loadd(3, a(j, 1), ldk); _tile_dpbf16ps(0, 3, 5);
      _tile_loadd(2, a(j, 2), ldk); _tile_dpbf16ps(0, 2, 6);
      _tile_loadd(3, a(j, 3), ldk); _tile_dpbf16ps(0, 3, 7);
      _tile_stored(0, s + j * 256, 64);
    }
  }
}

// O^T [64 dims][16 queries] += the V^T tiles of 64 dims (a(i): dims 16 i ..) x one P^T tile (32 keys),
// accumulated in C 0-3; P^T in 4 or 5 (by `odd`, so a tile's load need not wait for the last one's
// products), V^T in 6-7. pv_start zeroes C 0-3, pv_end stores them.
inline void pv_start() { _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); }

template <typename A>
inline void pv_tile(const uint16_t* pt, A a, bool odd) {
  if (odd) {
    _tile_loadd(5, pt, 64);
    _tile_loadd(6, a(0), 64); _tile_dpbf16ps(0, 6, 5);
    _tile_loadd(7, a(1), 64); _tile_dpbf16ps(1, 7, 5);
    _tile_loadd(6, a(2), 64); _tile_dpbf16ps(2, 6, 5);
    _tile_loadd(7, a(3), 64); _tile_dpbf16ps(3, 7, 5);
  } else {
    _tile_loadd(4, pt, 64);
    _tile_loadd(6, a(0), 64); _tile_dpbf16ps(0, 6, 4);
    _tile_loadd(7, a(1), 64); _tile_dpbf16ps(1, 7, 4);
    _tile_loadd(6, a(2), 64); _tile_dpbf16ps(2, 6, 4);
    _tile_loadd(7, a(3), 64); _tile_dpbf16ps(3, 7, 4);
  }
}

inline void pv_end(float* o) {
  _tile_stored(0, o, 64); _tile_stored(1, o + 256, 64);
  _tile_stored(2, o + 512, 64); _tile_stored(3, o + 768, 64);
}

// A thread's buffers, kept between calls (a step's layers reuse them); zeroed once, then only
// ever hold finite values.
struct Scratch {
  LineVector<float> s = LineVector<float>(kPass * 16);
  LineVector<uint16_t> pt = LineVector<uint16_t>(kPass * 16);
  LineVector<float> o = LineVector<float>(kMaxDim * 16), acc = LineVector<float>(kMaxDim * 16);
  LineVector<uint16_t> qt = LineVector<uint16_t>(kMaxDim * 16);
};

// One work item: query head h, the queries [q0, q0 + nq) of the chunk (nq <= 16).
template <int DT>
void attend_item(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride, const uint16_t* k,
                 const uint16_t* vt, const Geometry& g, int64_t h, int64_t q0, int64_t nq, float scale, Scratch& w) {
  constexpr int64_t D = DT * kDepth, D16 = D / kCols;
  const int64_t c = h / g.group;
  for (int64_t t = 0; t < DT; ++t) {  // Q^T tile t: row r lane n = Q[q0 + n][32 t + 2 r, + 1]
    __m512i r[16];
    for (int64_t n = 0; n < 16; ++n)
      r[n] = n < nq ? _mm512_loadu_si512(q + (q0 + n) * q_stride + h * D + t * kDepth) : _mm512_setzero_si512();
    transpose16(r);
    for (int i = 0; i < 16; ++i) _mm512_storeu_si512(w.qt.data() + t * kTile + i * kDepth, r[i]);
  }
  const uint16_t* kh = k + c * g.keys * D;
  const uint16_t* vth = vt + c * (g.keys / kDepth) * D16 * kTile;
  const __m512 c2 = _mm512_set1_ps(scale * 1.44269504088896341f);  // scores to base 2
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 m = ninf, l = _mm512_setzero_ps();
  const int64_t base = g.context + q0, end = base + nq;  // query n sees keys [0, base + n]
  // the lanes that see key `key`
  const auto seen = [&](int64_t key) -> __mmask16 {
    if (key < base) return 0xffff;
    if (key >= end) return 0;
    return _mm512_cmp_epi32_mask(lane, _mm512_set1_epi32(static_cast<int>(key - base)), _MM_CMPINT_NLT);
  };
  for (int64_t k0 = 0; k0 < end; k0 += kPass) {
    const int64_t nk = std::min(kPass, end - k0), n16 = (nk + kCols - 1) / kCols, n32 = (n16 + 1) / 2;
    scores<DT>(w.qt.data(), kh, k0 / kCols, n16, w.s.data());
    const float* s = w.s.data();
    // each query's max over the keys it sees: the keys every lane sees four rows at a time
    const int64_t all = std::clamp<int64_t>(base - k0, 0, nk);
    __m512 m0 = m, m1 = ninf, m2 = ninf, m3 = ninf;
    int64_t key = 0;
    for (; key + 4 <= all; key += 4) {
      m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + key * 16));
      m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + key * 16 + 16));
      m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + key * 16 + 32));
      m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + key * 16 + 48));
    }
    for (; key < nk; ++key) m0 = _mm512_mask_max_ps(m0, seen(k0 + key), m0, _mm512_loadu_ps(s + key * 16));
    const __m512 top = _mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3));
    // a query that has seen no key yet keeps -inf (only padding lanes): its shift is 0, its p 0
    const __m512 shift = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(top, ninf, _CMP_NEQ_OQ), top, c2);
    if (k0 > 0) {  // the earlier passes' sums and output, to the new max
      const __m512 alpha = exp2_16(_mm512_maskz_sub_ps(_mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ),
                                                       _mm512_mul_ps(m, c2), shift));
      l = _mm512_mul_ps(l, alpha);
      for (int64_t d = 0; d < D; ++d) _mm512_storeu_ps(w.acc.data() + d * 16, _mm512_mul_ps(_mm512_loadu_ps(w.acc.data() + d * 16), alpha));
    }
    m = top;
    // p = 2^(s c2 - top c2) for each pair of keys, interleaved as a B tile row: (p[2i][n], p[2i+1][n]);
    // each P^T tile's products with V^T issued once the next tile's exps are: the tile unit works
    // while the vector units compute (the first 64 dims; a dim 128 head's second half after)
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 l0 = _mm512_setzero_ps(), l1 = _mm512_setzero_ps();
    uint16_t* pt = w.pt.data();
    const auto vtile = [&](int64_t j, int64_t d0) {
      return [=](int64_t i) { return vth + ((k0 / kDepth + j) * D16 + d0 / kCols + i) * kTile; };
    };
    // dim 64: two P^T tiles in turn (the buffer stays in L1 beside S^T); more dims keep them all
    const auto ptile = [&](int64_t j) { return pt + (D > 4 * kCols ? j : j % 2) * kTile; };
    pv_start();
    for (int64_t j = 0; j < n32; ++j) {
      uint16_t* tile = ptile(j);
      for (key = j * kDepth; key < (j + 1) * kDepth; key += 2) {
        const bool full = k0 + key + 1 < base;
        __m512 e0 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + key * 16), c2, shift));
        __m512 e1 = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + key * 16 + 16), c2, shift));
        if (!full) {
          e0 = _mm512_maskz_mov_ps(key < nk ? seen(k0 + key) : 0, e0);
          e1 = _mm512_maskz_mov_ps(key + 1 < nk ? seen(k0 + key + 1) : 0, e1);
        }
        l0 = _mm512_add_ps(l0, e0);
        l1 = _mm512_add_ps(l1, e1);
        _mm512_storeu_si512(tile + (key - j * kDepth) * 16,
                            _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
      }
      if (j > 0) pv_tile(ptile(j - 1), vtile(j - 1, 0), (j - 1) % 2);
    }
    pv_tile(ptile(n32 - 1), vtile(n32 - 1, 0), (n32 - 1) % 2);
    pv_end(w.o.data());
    l = _mm512_add_ps(l, _mm512_add_ps(l0, l1));
    for (int64_t d0 = 4 * kCols; d0 < D; d0 += 4 * kCols) {  // dims past 64
      pv_start();
      for (int64_t j = 0; j < n32; ++j) pv_tile(pt + j * kTile, vtile(j, d0), j % 2);
      pv_end(w.o.data() + d0 * 16);
    }
    for (int64_t d = 0; d < D; ++d) {
      const __m512 v = _mm512_loadu_ps(w.o.data() + d * 16);
      _mm512_storeu_ps(w.acc.data() + d * 16, k0 == 0 ? v : _mm512_add_ps(_mm512_loadu_ps(w.acc.data() + d * 16), v));
    }
  }
  // out[q0 + n][h D + d] = acc[d][n] / l[n], 16 dims at a time through a transpose
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
  for (int64_t i = 0; i < D16; ++i) {
    __m512i r[16];
    for (int d = 0; d < 16; ++d)
      r[d] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(w.acc.data() + (i * 16 + d) * 16), inv));
    transpose16(r);
    for (int64_t n = 0; n < nq; ++n)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q0 + n) * out_stride + h * D + i * kCols),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[n])));
  }
}

void run(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride, const uint16_t* k_cache,
         const uint16_t* v_cache, const int32_t* table, int64_t block_size, int64_t token_stride, int64_t block_stride,
         const Geometry& g, float scale) {
  const int64_t D = g.dim, chunks = g.keys / kDepth;
  thread_local LineVector<uint16_t> k, vt;  // the caller's: packed once per call, read by every thread
  k.resize(g.kv_heads * g.keys * D);
  vt.resize(g.kv_heads * g.keys * D);
  uint16_t* kp = k.data();
  uint16_t* vtp = vt.data();
  at::parallel_for(0, g.kv_heads * chunks, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t c = i / chunks;
      pack_kv(k_cache, v_cache, table, block_size, token_stride, block_stride, g, c, i % chunks, kp + c * g.keys * D,
              vtp + c * g.keys * D);
    }
  });
  const int64_t blocks = (g.q_len + kRows - 1) / kRows, items = blocks * g.heads;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    thread_local Scratch w;
    configure_tiles();
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t b = blocks - 1 - i / g.heads, h = i % g.heads;  // the longest rows first
      const int64_t q0 = b * kRows, nq = std::min(kRows, g.q_len - q0);
      if (D == 64) attend_item<2>(q, q_stride, out, out_stride, kp, vtp, g, h, q0, nq, scale, w);
      else attend_item<4>(q, q_stride, out, out_stride, kp, vtp, g, h, q0, nq, scale, w);
    }
    _tile_release();
  });
}

#pragma GCC pop_options
#endif

}  // namespace

void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                       int64_t q_start, int64_t q_len, int64_t seq_len, torch::Tensor out, double scale) {
  TORCH_CHECK(amx_available(), "prefill_attention: this CPU (or its kernel) gives no AMX-BF16");
  for (const auto* t : {&q, &k_cache, &v_cache, &out})
    TORCH_CHECK(t->scalar_type() == at::kBFloat16, "prefill_attention: bfloat16 q, caches and out");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "prefill_attention: contiguous caches [blocks, block_size, kv_heads, head_dim] of one shape");
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1), kv_heads = k_cache.size(2),
                dim = k_cache.size(3);
  TORCH_CHECK(dim == 64 || dim == 128, "prefill_attention: head_dim 64 or 128");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == dim && q.stride(2) == 1 && q.stride(1) == dim &&
                  q.size(1) % kv_heads == 0,
              "prefill_attention: q [T, heads, head_dim] with contiguous heads, heads a multiple of kv_heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == dim,
              "prefill_attention: out shaped as q, with contiguous heads");
  TORCH_CHECK(q_start >= 0 && q_len > 0 && q_start + q_len <= q.size(0) && q_len <= seq_len,
              "prefill_attention: need 0 < q_len <= seq_len and the chunk's rows inside q");
  TORCH_CHECK(block_table.dim() == 1 && block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
              "prefill_attention: block_table [max_blocks] int32");
  const int64_t used = (seq_len + block_size - 1) / block_size;
  TORCH_CHECK(used <= block_table.size(0), "prefill_attention: seq_len ", seq_len, " needs ", used, " blocks");
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t i = 0; i < used; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < num_blocks, "prefill_attention: block ", table[i], " outside the cache");
#ifdef PDSERVE_AMX
  Geometry g{q.size(1), kv_heads, dim, q.size(1) / kv_heads, q_len, seq_len, seq_len - q_len,
             (seq_len + kDepth - 1) / kDepth * kDepth};
  const auto* k = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* v = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  run(reinterpret_cast<const uint16_t*>(q.data_ptr()) + q_start * q.stride(0), q.stride(0),
      reinterpret_cast<uint16_t*>(out.data_ptr()) + q_start * out.stride(0), out.stride(0), k, v, table, block_size,
      k_cache.stride(1), k_cache.stride(0), g, static_cast<float>(scale));
#endif
}
