// Decode attention on the CPU, reading K/V in place through the block table (issue 13).
//
// One query token per sequence. Work item = a chunk of a sequence's tokens (whole blocks, sized for
// ~4 items per thread, at most 512 tokens: flash-decoding, so one long sequence still uses every
// thread), all heads at once, so each token's K and V rows (every KV head) are contiguous reads.
// One pass over the chunk's blocks (online softmax): the block's scores q.k in fp32, the running
// max and sum updated, the block's V rows weighed in; the query heads sharing a KV head (GQA) are
// worked on together, so each K and V vector is read and widened from bf16 (the top half of an
// fp32) once. Each thread walks its blocks as one list and asks for the blocks ahead of it (the
// table scatters them; a layer's GEMMs evicted them). The chunks of a sequence are merged with
// their maxima (the usual log-sum-exp merge) and the output is rounded once to the query's dtype.
// Items run on torch's intra-op threads (at::parallel_for): torch.set_num_threads governs it.
//
// Built by pdserve/kernels/cpu_native.py (torch.utils.cpp_extension, cached on disk). With AVX2
// and FMA the inner loops use them (4 tokens x 3 heads of dot products in flight, 8 exps at a time;
// head_dim a multiple of 8); any other CPU or head_dim takes the portable loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_amx.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
#endif
#if defined(PDSERVE_AVX2) && defined(__AVX512F__) && defined(__AVX512DQ__)
#define PDSERVE_AVX512 1  // the loops 16 lanes wide (built with -mavx512f -mavx512dq)
#endif

namespace {

inline float bf16_to_f32(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's conversion
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float load(const float* p) { return *p; }
inline float load(const uint16_t* p) { return bf16_to_f32(*p); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = f32_to_bf16(v); }

#include "cpu_lanes.h"  // Lanes8, Lanes16: the vector operations each loop below is written with

struct Geometry {
  int64_t heads, kv_heads, head_dim, block_size, max_blocks, token_stride, block_stride;
};

// One block's K and V rows as a work item reads them (`rows` tokens).
template <typename T>
struct BlockRef {
  const T* k;
  const T* v;
  int64_t rows;
};

// Blocks are scattered over the pool and out of cache after a layer's GEMMs, and the hardware
// prefetcher cannot guess the next one: the block kAhead places further down a thread's list is
// asked for while the current one is worked on, a few cache lines at a time (a burst of a whole
// block's prefetches stalls the loads the work itself needs).
constexpr int64_t kAhead = 4;
struct Prefetcher {
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t bytes = 0, off = 0, lines = 1;
  template <typename T>
  void start(const BlockRef<T>* block, int64_t token_stride, int64_t steps) {
    if (block == nullptr) {
      bytes = 0;
      return;
    }
    k = reinterpret_cast<const char*>(block->k), v = reinterpret_cast<const char*>(block->v);
    bytes = block->rows * token_stride * static_cast<int64_t>(sizeof(T)), off = 0;
    lines = std::max<int64_t>(1, (bytes / 64 + steps - 1) / steps);
  }
  void step() {
    for (int64_t i = 0; i < lines && off < bytes; ++i, off += 64) {
      __builtin_prefetch(k + off, 0, 2);
      __builtin_prefetch(v + off, 0, 2);
    }
  }
  void rest() {
    for (; off < bytes; off += 64) {
      __builtin_prefetch(k + off, 0, 2);
      __builtin_prefetch(v + off, 0, 2);
    }
  }
};

#ifdef PDSERVE_AVX2
// The NG (<= 3) query heads of one KV head at once, so each K or V vector is loaded (and widened
// from bf16) once for all of them; q, s and acc point at the group's first head. L is the lane
// width (cpu_lanes.h): head_dim a multiple of it.
//
// s[g * BS + t] = q_g . k_t for the block's nb tokens (k_t at k + t * TS): 4 tokens x NG heads of
// sums in registers (12 at most), one prefetch step every 4 tokens.
template <int NG, typename L, typename T>
inline void group_scores(const T* k, const float* q, float* s, int64_t nb, int64_t D, int64_t TS, int64_t BS,
                         Prefetcher& pf) {
  using V = typename L::V;
  int64_t t = 0;
  for (; t + 4 <= nb; t += 4) {
    V a[NG][4];
    for (int g = 0; g < NG; ++g)
      for (int j = 0; j < 4; ++j) a[g][j] = L::zero();
    for (int64_t d = 0; d < D; d += L::W) {
      V kv[4];
      for (int j = 0; j < 4; ++j) kv[j] = L::load(k + (t + j) * TS + d);
      for (int g = 0; g < NG; ++g) {
        const V qv = L::load(q + g * D + d);
        for (int j = 0; j < 4; ++j) a[g][j] = L::fma(qv, kv[j], a[g][j]);
      }
    }
    for (int g = 0; g < NG; ++g) _mm_storeu_ps(s + g * BS + t, L::sum4(a[g][0], a[g][1], a[g][2], a[g][3]));
    pf.step();
  }
  for (; t < nb; ++t) {
    V a[NG];
    for (int g = 0; g < NG; ++g) a[g] = L::zero();
    for (int64_t d = 0; d < D; d += L::W) {
      const V kv = L::load(k + t * TS + d);
      for (int g = 0; g < NG; ++g) a[g] = L::fma(L::load(q + g * D + d), kv, a[g]);
    }
    for (int g = 0; g < NG; ++g) s[g * BS + t] = L::sum(a[g]);
  }
}

// acc_g += sum over the block's tokens of p[g * BS + t] v_t: C vectors (C x W columns) x NG heads of
// sums in registers over the tokens; C = 4 while 4 vectors of columns are left, then 1.
template <int NG, int C, typename L, typename T>
inline void group_weigh_cols(const T* v, const float* p, float* acc, int64_t nb, int64_t D, int64_t TS, int64_t BS,
                             int64_t d) {
  using V = typename L::V;
  V a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < C; ++j) a[g][j] = L::load(acc + g * D + d + L::W * j);
  for (int64_t t = 0; t < nb; ++t) {
    V vv[C];
    for (int j = 0; j < C; ++j) vv[j] = L::load(v + t * TS + d + L::W * j);
    for (int g = 0; g < NG; ++g) {
      const V w = L::set(p[g * BS + t]);
      for (int j = 0; j < C; ++j) a[g][j] = L::fma(w, vv[j], a[g][j]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int j = 0; j < C; ++j) L::store(acc + g * D + d + L::W * j, a[g][j]);
}

template <int NG, typename L, typename T>
inline void group_weigh(const T* v, const float* p, float* acc, int64_t nb, int64_t D, int64_t TS, int64_t BS) {
  int64_t d = 0;
  for (; d + 4 * L::W <= D; d += 4 * L::W) group_weigh_cols<NG, 4, L>(v, p, acc, nb, D, TS, BS, d);
  for (; d < D; d += L::W) group_weigh_cols<NG, 1, L>(v, p, acc, nb, D, TS, BS, d);
}

// f(c, h0, NG) for every KV head c and its query heads h0.., in groups of up to 3 (NG).
template <typename F>
inline void head_groups(int64_t kv_heads, int64_t G, F f) {
  for (int64_t c = 0; c < kv_heads; ++c)
    for (int64_t g0 = 0; g0 < G; g0 += 3) f(c, c * G + g0, std::min<int64_t>(3, G - g0));
}

// sh[t] = exp(sh[t] - top) for t from `t` on, W at a time; returns their sum, leaves t at the rest
template <typename L>
inline float exp_run(float* sh, int64_t& t, int64_t nb, float top) {
  const typename L::V mv = L::set(top);
  typename L::V sum = L::zero();
  for (; t + L::W <= nb; t += L::W) {
    const typename L::V e = exp_lanes<L>(L::sub(L::load(sh + t), mv));
    L::store(sh + t, e);
    sum = L::add(sum, e);
  }
  return L::sum(sum);
}
#endif

// The running softmax state of every head updated with a block's scores s[h * BS + t] (t < nb),
// which become exp(s - m): the max m grown (what the earlier blocks summed rescaled), the sum l.
inline void softmax_block(float* s, float* m, float* l, float* acc, int64_t nb, int64_t H, int64_t D, int64_t BS) {
  for (int64_t h = 0; h < H; ++h) {
    float* sh = s + h * BS;
    float top = m[h];
    for (int64_t t = 0; t < nb; ++t) top = std::max(top, sh[t]);
    if (top > m[h]) {
      const float alpha = std::exp(m[h] - top);  // 0 for the first block (m = -inf)
      l[h] *= alpha;
      for (float* a = acc + h * D; a < acc + (h + 1) * D; ++a) *a *= alpha;
      m[h] = top;
    }
    float sum = 0.f;
    int64_t t = 0;
#ifdef PDSERVE_AVX512
    sum += exp_run<Lanes16>(sh, t, nb, top);
#endif
#ifdef PDSERVE_AVX2
    sum += exp_run<Lanes8>(sh, t, nb, top);
#endif
    for (; t < nb; ++t) {
      sh[t] = std::exp(sh[t] - top);
      sum += sh[t];
    }
    l[h] += sum;
  }
}

#ifdef PDSERVE_AVX2
// softmax_block for a block of at most 16 tokens on 16 lanes: each head's scores are one vector
// (the max and the sum one reduction each, no scalar loop over the tokens); false where it does
// not apply (8 lanes, a longer block) and softmax_block serves.
inline bool softmax_short(Lanes8, float*, float*, float*, float*, int64_t, int64_t, int64_t, int64_t) { return false; }
#endif
#ifdef PDSERVE_AVX512
inline bool softmax_short(Lanes16, float* s, float* m, float* l, float* acc, int64_t nb, int64_t H, int64_t D,
                          int64_t BS) {
  if (nb > 16) return false;
  const __mmask16 valid = static_cast<__mmask16>((1u << nb) - 1u);
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < H; ++h) {
    float* sh = s + h * BS;
    const __m512 x = _mm512_mask_loadu_ps(ninf, valid, sh);
    const float top = std::max(m[h], _mm512_reduce_max_ps(x));
    if (top > m[h]) {
      const float alpha = std::exp(m[h] - top);  // 0 for the first block (m = -inf)
      l[h] *= alpha;
      float* a = acc + h * D;
      int64_t d = 0;
      for (; d + 16 <= D; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(_mm512_loadu_ps(a + d), _mm512_set1_ps(alpha)));
      for (; d < D; ++d) a[d] *= alpha;
      m[h] = top;
    }
    const __m512 e = _mm512_maskz_mov_ps(valid, exp_lanes<Lanes16>(_mm512_sub_ps(x, _mm512_set1_ps(top))));
    _mm512_mask_storeu_ps(sh, valid, e);
    l[h] += _mm512_reduce_add_ps(e);
  }
  return true;
}
#endif

#ifdef PDSERVE_AVX2
// One block of a work item on L lanes: every head group's scores, the softmax state, the V rows.
template <typename L, typename T>
inline void attend_block(const T* kb, const T* vb, const float* qf, float* s, float* m, float* l, float* acc,
                         int64_t nb, const Geometry& g, Prefetcher& pf) {
  const int64_t H = g.heads, G = g.heads / g.kv_heads, D = g.head_dim, BS = g.block_size, TS = g.token_stride;
  head_groups(g.kv_heads, G, [&](int64_t c, int64_t h0, int64_t ng) {
    if (ng == 3) group_scores<3, L>(kb + c * D, qf + h0 * D, s + h0 * BS, nb, D, TS, BS, pf);
    else if (ng == 2) group_scores<2, L>(kb + c * D, qf + h0 * D, s + h0 * BS, nb, D, TS, BS, pf);
    else group_scores<1, L>(kb + c * D, qf + h0 * D, s + h0 * BS, nb, D, TS, BS, pf);
  });
  pf.rest();
  if (!softmax_short(L{}, s, m, l, acc, nb, H, D, BS)) softmax_block(s, m, l, acc, nb, H, D, BS);
  head_groups(g.kv_heads, G, [&](int64_t c, int64_t h0, int64_t ng) {
    if (ng == 3) group_weigh<3, L>(vb + c * D, s + h0 * BS, acc + h0 * D, nb, D, TS, BS);
    else if (ng == 2) group_weigh<2, L>(vb + c * D, s + h0 * BS, acc + h0 * D, nb, D, TS, BS);
    else group_weigh<1, L>(vb + c * D, s + h0 * BS, acc + h0 * D, nb, D, TS, BS);
  });
}
#endif

// One work item: every head of one sequence over blocks [b, e) of the thread's list (n in all),
// in one pass (flash attention's online softmax): per block the scores q.k in fp32, the softmax
// state updated, the block's V rows weighed in. Leaves per query head the max m, the sum l of
// exp(s - m) and acc, the exp-weighted sum of V rows. qf: the query times the scale, in fp32.
template <typename T>
void attend_item(const float* qf, const BlockRef<T>* blocks, int64_t b, int64_t e, int64_t n, const Geometry& g,
                 std::vector<float>& scores, float* m, float* l, float* acc) {
  const int64_t H = g.heads, G = g.heads / g.kv_heads, D = g.head_dim, BS = g.block_size, TS = g.token_stride;
  scores.resize(H * BS);
  float* s = scores.data();
  std::fill(acc, acc + H * D, 0.f);
  std::fill(m, m + H, -std::numeric_limits<float>::infinity());
  std::fill(l, l + H, 0.f);
  Prefetcher pf;
  for (int64_t j = b; j < e; ++j) {
    const int64_t nb = blocks[j].rows;
    const T* kb = blocks[j].k;
    const T* vb = blocks[j].v;
    // one prefetch step per 4 tokens of each head group's scores
    pf.start(j + kAhead < n ? blocks + j + kAhead : nullptr, TS, g.kv_heads * ((G + 2) / 3) * std::max<int64_t>(1, BS / 4));
#ifdef PDSERVE_AVX512
    if (D % 16 == 0) {
      attend_block<Lanes16>(kb, vb, qf, s, m, l, acc, nb, g, pf);
      continue;
    }
#endif
#ifdef PDSERVE_AVX2
    if (D % 8 == 0) {
      attend_block<Lanes8>(kb, vb, qf, s, m, l, acc, nb, g, pf);
      continue;
    }
#endif
    pf.rest();
    for (int64_t t = 0; t < nb; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const T* kr = kb + t * TS + (h / G) * D;
        float a = 0.f;
        for (int64_t d = 0; d < D; ++d) a += qf[h * D + d] * load(kr + d);
        s[h * BS + t] = a;
      }
    }
    softmax_block(s, m, l, acc, nb, H, D, BS);
    for (int64_t t = 0; t < nb; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const float p = s[h * BS + t];
        const T* vr = vb + t * TS + (h / G) * D;
        float* ah = acc + h * D;
        for (int64_t d = 0; d < D; ++d) ah[d] += p * load(vr + d);
      }
    }
  }
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& tables,
         const torch::Tensor& lens, const torch::Tensor& seqs, const torch::Tensor& rows, torch::Tensor& out,
         float scale) {
  const Geometry g{q.size(1), k.size(2), q.size(2), k.size(1), tables.size(1), k.stride(1), k.stride(0)};
  const T* qp = reinterpret_cast<const T*>(q.data_ptr());
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t q_row = q.stride(0), out_row = out.stride(0), H = g.heads, D = g.head_dim, BS = g.block_size;
  const int64_t num_seqs = seqs.size(0);
  // Split every sequence into chunks of whole blocks, small enough for ~4 items per thread
  // (flash-decoding: one long sequence still uses every thread), at most 512 tokens.
  int64_t total = 0;
  for (int64_t x = 0; x < num_seqs; ++x) total += lp[sp[x]];
  const int64_t target = 4 * static_cast<int64_t>(at::get_num_threads());
  int64_t chunk = (total + target - 1) / target;
  chunk = std::min<int64_t>(512, std::max<int64_t>(BS, (chunk + BS - 1) / BS * BS));
  std::vector<int64_t> first(num_seqs + 1, 0);  // items of sequence x: [first[x], first[x + 1])
  for (int64_t x = 0; x < num_seqs; ++x) first[x + 1] = first[x] + std::max<int64_t>(1, (lp[sp[x]] + chunk - 1) / chunk);
  const int64_t num_items = first[num_seqs];
  std::vector<int64_t> owner(num_items);
  for (int64_t x = 0; x < num_seqs; ++x)
    for (int64_t it = first[x]; it < first[x + 1]; ++it) owner[it] = x;
  std::vector<float> m(num_items * H), l(num_items * H), acc(num_items * H * D);
  const auto store_head = [&](int64_t x, int64_t h, const float* sum, float denom) {  // out of sequence x, head h
    T* o = op + rp[x] * out_row + h * D;
    for (int64_t d = 0; d < D; ++d) store(o + d, sum[d] / denom);
  };
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    // The thread's blocks in the order it reads them, so the prefetch runs ahead across items.
    std::vector<BlockRef<T>> blocks;
    std::vector<int64_t> item_start(end - begin + 1, 0);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t x = owner[it], s = sp[x], t0 = (it - first[x]) * chunk;
      const int64_t t1 = std::min<int64_t>(lp[s], t0 + chunk);
      const int32_t* table = tp + s * g.max_blocks;
      for (int64_t b0 = t0; b0 < t1; b0 += BS) {
        const int64_t offset = static_cast<int64_t>(table[b0 / BS]) * g.block_stride;
        blocks.push_back({kp + offset, vp + offset, std::min<int64_t>(BS, t1 - b0)});
      }
      item_start[it - begin + 1] = static_cast<int64_t>(blocks.size());
    }
    const int64_t n = static_cast<int64_t>(blocks.size());
    Prefetcher first_blocks;
    for (int64_t j = 0; j < std::min(kAhead, n); ++j) {
      first_blocks.start(blocks.data() + j, g.token_stride, 1);
      first_blocks.rest();
    }
    std::vector<float> qf(H * D), scores;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t x = owner[it];
      const T* qx = qp + rp[x] * q_row;
      for (int64_t e = 0; e < H * D; ++e) qf[e] = load(qx + e) * scale;
      attend_item<T>(qf.data(), blocks.data(), item_start[it - begin], item_start[it - begin + 1], n, g, scores,
                     m.data() + it * H, l.data() + it * H, acc.data() + it * H * D);
      if (first[x + 1] - first[x] == 1)  // the sequence's only item: its output now (the merge's, with one term)
        for (int64_t h = 0; h < H; ++h) store_head(x, h, acc.data() + (it * H + h) * D, l[it * H + h]);
    }
  });
  // Merge the chunks of each sequence split in several: out_h = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i.
  std::vector<int64_t> split;
  for (int64_t x = 0; x < num_seqs; ++x)
    if (first[x + 1] - first[x] > 1) split.push_back(x);
  if (split.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(split.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t j = begin; j < end; ++j) {
      const int64_t x = split[j];
      for (int64_t h = 0; h < H; ++h) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t it = first[x]; it < first[x + 1]; ++it) top = std::max(top, m[it * H + h]);
        float denom = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t it = first[x]; it < first[x + 1]; ++it) {
          const float w = std::exp(m[it * H + h] - top);
          denom += w * l[it * H + h];
          const float* a = acc.data() + (it * H + h) * D;
          for (int64_t d = 0; d < D; ++d) merged[d] += w * a[d];
        }
        store_head(x, h, merged.data(), denom);
      }
    }
  });
}

// ---- fused elementwise ops of a decoder layer ----------------------------------------------
// Each replaces a run of small torch ops (~5-10 us of dispatch each at decode sizes, ~40 a layer)
// with one call and the same arithmetic: the same roundings to the activation dtype in the same
// places as the torch code in engine/models/llama.py, so RoPE, the K/V store and the residual add
// give the torch path's bits; RMSNorm's sum of squares and SiLU's exp differ from torch's in the
// last bits (summation order; a polynomial exp, ~1 ulp). Compiled with -ffp-contract=off: no a*b+c
// is fused where torch rounds the product.

inline float round_as(float x, float*) { return x; }
inline float round_as(float x, uint16_t*) { return bf16_to_f32(f32_to_bf16(x)); }
template <typename T>
inline float rnd(float x) { return round_as(x, static_cast<T*>(nullptr)); }

// ---- the elementwise loops, at each vector width ------------------------------------------------
// f(Lanes16{}) then f(Lanes8{}), the widths this build has: each loop runs 16 lanes a step, then 8,
// then the scalar tail, with the same roundings at every width.
template <typename F>
inline void each_width(F f) {
#ifdef PDSERVE_AVX512
  f(Lanes16{});
#endif
#ifdef PDSERVE_AVX2
  f(Lanes8{});
#endif
  (void)f;
}

// Each loop below runs from i on, L::W elements a step, and leaves i where the vectors end.
template <typename L>
inline float squares_run(const float* x, int64_t& i, int64_t n) {  // sum of x^2, two sums in flight
  typename L::V a0 = L::zero(), a1 = a0;
  for (; i + 2 * L::W <= n; i += 2 * L::W) {
    const typename L::V x0 = L::load(x + i), x1 = L::load(x + i + L::W);
    a0 = L::fma(x0, x0, a0);
    a1 = L::fma(x1, x1, a1);
  }
  return L::sum(L::add(a0, a1));
}

template <typename L, typename R, typename D>
inline void add_run(R* r, const D* d, float* x, int64_t& i, int64_t n) {  // r = x = R(r + R(d))
  for (; i + L::W <= n; i += L::W) {
    L::store(x + i, store_rnd_kept<L, R>(r + i, L::add(L::load(r + i), load_rnd<L, R>(d + i))));
  }
}

template <typename L, typename W, typename O>
inline void norm_run(const float* x, const W* w, O* o, float scale, int64_t& i, int64_t n) {  // o = O(w O(x s))
  const typename L::V sv = L::set(scale);
  for (; i + L::W <= n; i += L::W)
    store_rnd<L, O>(o + i, L::mul(L::load(w + i), rnd_lanes<L, O>(L::mul(L::load(x + i), sv))));
}

// RoPE of the pairs (src_i, src_{i + half}) into dst: each product and their sum rounded to C
template <typename L, typename F, typename C>
inline void rope_run(const F* src, const C* c, const C* s, C* dst, int64_t half, int64_t& i) {
  using V = typename L::V;
  for (; i + L::W <= half; i += L::W) {
    const V lo = load_rnd<L, C>(src + i), hi = load_rnd<L, C>(src + half + i);
    store_rnd<L, C>(dst + i, L::add(rnd_lanes<L, C>(L::mul(lo, L::load(c + i))), rnd_lanes<L, C>(L::mul(hi, L::load(s + i)))));
    store_rnd<L, C>(dst + half + i, L::add(rnd_lanes<L, C>(L::mul(hi, L::load(c + half + i))),
                                           rnd_lanes<L, C>(L::mul(lo, L::load(s + half + i)))));
  }
}

template <typename L, typename F, typename C>
inline void copy_run(const F* src, C* dst, int64_t& i, int64_t n) {  // dst = C(src)
  for (; i + L::W <= n; i += L::W) store_rnd<L, C>(dst + i, L::load(src + i));
}

template <typename L, typename T>
inline void silu_run(const T* gate, const T* up, T* o, int64_t& i, int64_t n) {  // o = T(T(silu(gate)) up)
  for (; i + L::W <= n; i += L::W) store_silu_times<L, T>(o + i, L::load(gate + i), L::load(up + i));
}

// rows of at least ~16K elements per thread: a decode batch's row runs on one thread
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
  each_width([&](auto lanes) { total += squares_run<decltype(lanes)>(x, i, n); });
  float part[8] = {};  // a build without vectors: eight sums in flight too (one sum drifts ~10 ulps at 576)
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += x[i + j] * x[i + j];
  for (int j = 0; j < 8; ++j) total += part[j];
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

// R residual, D delta, W weight, O out. residual[t] = R(residual[t] + R(delta[t])) when delta is
// given; x = float(residual[t]); out[t] = O(w * O(x * rsqrt(mean(x^2) + eps))) (llama.RMSNorm:
// with O = float and an fp32 weight, the `hand_fp32_out` form; with O = R, transformers' form).
template <typename R, typename D, typename W, typename O>
void add_rms_norm_impl(R* res, const D* delta, const W* w, O* out, int64_t rows, int64_t width, int64_t res_stride,
                       int64_t delta_stride, float eps) {
  at::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> x(width);
    for (int64_t t = begin; t < end; ++t) {
      R* r = res + t * res_stride;
      int64_t i0 = 0;
      if (delta != nullptr) {
        const D* d = delta + t * delta_stride;
        each_width([&](auto lanes) { add_run<decltype(lanes)>(r, d, x.data(), i0, width); });
        for (int64_t i = i0; i < width; ++i) {
          const float v = rnd<R>(load(r + i) + rnd<R>(load(d + i)));
          store(r + i, v);
          x[i] = v;
        }
      } else {
        for (int64_t i = 0; i < width; ++i) x[i] = load(r + i);
      }
      const float scale = 1.f / std::sqrt(sum_squares(x.data(), width) / static_cast<float>(width) + eps);
      O* o = out + t * width;
      int64_t i = 0;
      each_width([&](auto lanes) { norm_run<decltype(lanes)>(x.data(), w, o, scale, i, width); });
      for (; i < width; ++i) store(o + i, rnd<O>(load(w + i) * rnd<O>(x[i] * scale)));
    }
  });
}

template <typename T>
T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

// q = RoPE(q), k = RoPE(k) as llama.RotaryRows computes them in C (the cache dtype): each of x * cos,
// roll(x) * sin_signed and their sum rounded to C; q rows to q_out, k and C(v) rows to the caches
// at slot_mapping (-1: skipped). qkv rows are [q heads | k heads | v heads] in F (fp32 or C).
template <typename F, typename C>
void rope_store_impl(const F* qkv, int64_t qkv_stride, const C* cos, const C* sin, int64_t rope_stride,
                     C* k_cache, C* v_cache, int64_t slot_stride, const int32_t* slots, C* q_out, int64_t tokens,
                     int64_t heads, int64_t kv_heads, int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, row_grain((heads + 2 * kv_heads) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const F* row = qkv + t * qkv_stride;
      const C* c = cos + t * rope_stride;
      const C* s = sin + t * rope_stride;
      const int32_t slot = slots[t];
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        const F* src = row + h * dim;
        C* dst = h < heads ? q_out + (t * heads + h) * dim
                           : (slot < 0 ? nullptr : k_cache + slot * slot_stride + (h - heads) * dim);
        if (dst == nullptr) continue;
        // pairs (x_i, x_{i + half}): roll(x)_i = x_{i + half}, roll(x)_{i + half} = x_i
        int64_t i = 0;
        each_width([&](auto lanes) { rope_run<decltype(lanes)>(src, c, s, dst, half, i); });
        for (; i < half; ++i) {
          const float lo = rnd<C>(load(src + i)), hi = rnd<C>(load(src + half + i));
          store(dst + i, rnd<C>(rnd<C>(lo * load(c + i)) + rnd<C>(hi * load(s + i))));
          store(dst + half + i, rnd<C>(rnd<C>(hi * load(c + half + i)) + rnd<C>(lo * load(s + half + i))));
        }
      }
      if (slot < 0) continue;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const F* src = row + (heads + kv_heads + h) * dim;
        C* dst = v_cache + slot * slot_stride + h * dim;
        int64_t i = 0;
        each_width([&](auto lanes) { copy_run<decltype(lanes)>(src, dst, i, dim); });
        for (; i < dim; ++i) store(dst + i, load(src + i));
      }
    }
  });
}

// out = T(T(silu(gate)) * up), gate | up the two halves of each row (llama.MLP).
template <typename T>
void silu_mul_impl(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, row_grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* gr = gate_up + t * stride;
      const T* up = gr + width;
      T* o = out + t * width;
      int64_t i = 0;
      each_width([&](auto lanes) { silu_run<decltype(lanes)>(gr, up, o, i, width); });
      for (; i < width; ++i) {
        const float x = load(gr + i);
        store(o + i, rnd<T>(rnd<T>(x / (1.f + std::exp(-x))) * load(up + i)));
      }
    }
  });
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a 2-D tensor with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
}


// ---- GEMMs on bf16 or fp32 weights, a few rows ---------------------------------------------
// y = x W^T (+ b) for x fp32 [M, K] and W bf16 or fp32 [N, K], packed once into panels of 16 weight rows,
// k-major ([N/16][K][16], zero-padded). A panel's 16 columns of y are two vectors: per k, MR rows
// of x broadcast one value each against the panel's two widened vectors (2 x MR sums in
// registers, no horizontal sums); each panel comes from memory once and from cache for the next
// rows. It reads the bf16 weights, half the bytes of the fp32 copy oneDNN reads for a bf16 model
// on a CPU without native bf16 (engine/models/cpu_bf16.py), and sums each output in k order in
// fp32, as a native bf16 GEMM does. An fp32 model's weights run the same loops without the
// widening (engine/parallel/layers.py: its decode rows).
// With one or two rows the 2 x MR sums would each wait on the last add (a chain of fused
// multiply-adds, one per k): NP panels are worked on together instead (8 sums in flight), which
// also reads NP streams of weights at once; each output still sums in k order, so a row gets the
// same bits in any batch. A group of kGroup panels (72-192 KiB at the default model's depths)
// stays in L2 while every block of rows passes over it.
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

// ---- greedy sampling: each row's argmax ------------------------------------------------------
// The first index of a row's largest value, or of its first NaN where it has one, as torch.argmax
// and numpy's argmax give. bf16 logits are compared as the floats they are (exact), so the lm_head's
// bf16 output needs no float32 copy first. A piece of a row is read in runs of kArgRun values: a
// vertical max over the run and one horizontal max; only a run that holds a new best (rare after the
// first few) is looked at again for its first index, and one with a NaN or an infinity is scanned
// value by value.
constexpr int64_t kArgRun = 256;

struct ArgBest {  // a piece starts at its first index with -inf: an all -inf piece keeps it
  float value;
  int64_t index;
  bool nan;
};

template <typename T>
inline void argmax_scalar(const T* x, int64_t i, int64_t e, ArgBest& best) {
  for (; i < e && !best.nan; ++i) {
    const float v = load(x + i);
    if (std::isnan(v)) best = {v, i, true};
    else if (v > best.value) best.value = v, best.index = i;
  }
}

template <typename L, typename T>
inline void argmax_runs(const T* x, int64_t& i, int64_t e, ArgBest& best) {
  float lanes[L::W];
  for (; i + kArgRun <= e && !best.nan; i += kArgRun) {
    typename L::V top = L::load(x + i), odd = L::zero();
    for (int64_t j = i; j < i + kArgRun; j += L::W) {
      const typename L::V v = L::load(x + j);
      top = L::max(top, v);
      odd = L::add(odd, L::sub(v, v));  // NaN where v is a NaN or an infinity, else 0
    }
    if (std::isnan(L::sum(odd))) {
      argmax_scalar(x, i, i + kArgRun, best);
      continue;
    }
    L::store(lanes, top);
    float m = lanes[0];
    for (int k = 1; k < L::W; ++k) m = std::max(m, lanes[k]);
    if (!(m > best.value)) continue;
    int64_t j = i;
    while (load(x + j) != m) ++j;
    best.value = m, best.index = j;
  }
}

template <typename T>
ArgBest argmax_piece(const T* x, int64_t b, int64_t e) {
  ArgBest best{-std::numeric_limits<float>::infinity(), b, false};
  int64_t i = b;
  each_width([&](auto lanes) { argmax_runs<decltype(lanes)>(x, i, e, best); });
  argmax_scalar(x, i, e, best);
  return best;
}

template <typename T>
void argmax_rows_impl(const T* x, int64_t stride, int64_t rows, int64_t n, int64_t* out) {
  if (rows == 0) return;
  // a row in `parts` pieces where there are fewer rows than threads; kArgGrain values at least a
  // thread (one row of a 49,152-word vocabulary stays on one: waking the others costs more)
  constexpr int64_t kArgGrain = 131072;
  const int64_t threads = at::get_num_threads();
  const int64_t parts = std::max<int64_t>(1, std::min((threads + rows - 1) / rows, n / (kArgGrain / 2)));
  const int64_t piece = (n + parts - 1) / parts;
  std::vector<ArgBest> found(rows * parts);
  at::parallel_for(0, rows * parts, std::max<int64_t>(1, kArgGrain / piece), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t r = k / parts, b = (k % parts) * piece;
      found[k] = argmax_piece(x + r * stride, b, std::min(n, b + piece));
    }
  });
  for (int64_t r = 0; r < rows; ++r) {  // the pieces in order: a NaN ends the row, a tie keeps the first
    ArgBest best = found[r * parts];
    for (int64_t k = 1; k < parts && !best.nan; ++k) {
      const ArgBest& next = found[r * parts + k];
      if (next.nan || next.value > best.value) best = next;
    }
    out[r] = best.index;
  }
}

}  // namespace

// residual += delta (rounded to residual's dtype; delta may be None), then RMSNorm of the new
// residual; returns the norm [T, H] in out_dtype's dtype (float32 or the residual's).
torch::Tensor add_rms_norm(torch::Tensor residual, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                           double eps, bool fp32_out) {
  check_rows(residual, "add_rms_norm residual");
  const int64_t rows = residual.size(0), width = residual.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == width && weight.is_contiguous(), "add_rms_norm: weight [H]");
  const bool res16 = is_bf16(residual);
  TORCH_CHECK(fp32_out ? weight.scalar_type() == at::kFloat : weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: an fp32 weight for fp32 output, else the residual's dtype");
  auto out = torch::empty({rows, width}, residual.options().dtype(fp32_out ? at::kFloat : residual.scalar_type()));
  const void* d = nullptr;
  bool d16 = res16;
  int64_t d_stride = 0;
  if (delta.has_value()) {
    check_rows(*delta, "add_rms_norm delta");
    TORCH_CHECK(delta->sizes() == residual.sizes(), "add_rms_norm: delta and residual shapes differ");
    d = delta->data_ptr();
    d16 = is_bf16(*delta);
    d_stride = delta->stride(0);
    TORCH_CHECK(res16 || !d16, "add_rms_norm: a bf16 delta for an fp32 residual");
  }
  const float e = static_cast<float>(eps);
  const int64_t rs = residual.stride(0);
  if (!res16) {
    add_rms_norm_impl(ptr<float>(residual), static_cast<const float*>(d), ptr<float>(weight), ptr<float>(out), rows,
                      width, rs, d_stride, e);
  } else if (fp32_out && d16) {
    add_rms_norm_impl(ptr<uint16_t>(residual), static_cast<const uint16_t*>(d), ptr<float>(weight), ptr<float>(out),
                      rows, width, rs, d_stride, e);
  } else if (fp32_out) {
    add_rms_norm_impl(ptr<uint16_t>(residual), static_cast<const float*>(d), ptr<float>(weight), ptr<float>(out),
                      rows, width, rs, d_stride, e);
  } else if (d16) {
    add_rms_norm_impl(ptr<uint16_t>(residual), static_cast<const uint16_t*>(d), ptr<uint16_t>(weight),
                      ptr<uint16_t>(out), rows, width, rs, d_stride, e);
  } else {
    add_rms_norm_impl(ptr<uint16_t>(residual), static_cast<const float*>(d), ptr<uint16_t>(weight),
                      ptr<uint16_t>(out), rows, width, rs, d_stride, e);
  }
  return out;
}

// RoPE on q and k, k and v into the paged caches at slot_mapping; returns q [T, heads, dim] in the
// caches' dtype. qkv [T, (heads + 2 kv_heads) dim] in float32 or that dtype; cos, sin_signed
// [T, 1, dim] in that dtype (llama.RotaryRows).
torch::Tensor rope_store_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin_signed, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t heads) {
  check_rows(qkv, "rope_store_kv qkv");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "rope_store_kv: contiguous caches [blocks, block_size, kv_heads, dim] of one dtype");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(2), dim = k_cache.size(3);
  TORCH_CHECK(dim % 2 == 0 && qkv.size(1) == (heads + 2 * kv_heads) * dim, "rope_store_kv: qkv width");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "rope_store_kv: a float32 or bfloat16 cache");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == dtype, "rope_store_kv: qkv in fp32 or the cache's dtype");
  for (const auto* t : {&cos, &sin_signed})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(2) == dim && t->stride(2) == 1 &&
                    t->scalar_type() == dtype, "rope_store_kv: cos / sin rows [T, 1, dim] in the cache's dtype");
  TORCH_CHECK(cos.stride(0) == sin_signed.stride(0), "rope_store_kv: cos and sin laid out alike");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.scalar_type() == at::kInt &&
                  slot_mapping.is_contiguous(), "rope_store_kv: slot_mapping [T] int32");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int32_t* slots = slot_mapping.data_ptr<int32_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_slots, "rope_store_kv: slot ", slots[t], " outside the cache's ", num_slots);
  auto q = torch::empty({tokens, heads, dim}, qkv.options().dtype(dtype));
  const int64_t ss = k_cache.stride(1), rs = cos.stride(0), qs = qkv.stride(0);
  if (dtype == at::kFloat) {
    rope_store_impl(ptr<float>(qkv), qs, ptr<float>(cos), ptr<float>(sin_signed), rs, ptr<float>(k_cache),
                    ptr<float>(v_cache), ss, slots, ptr<float>(q), tokens, heads, kv_heads, dim);
  } else if (qkv.scalar_type() == at::kFloat) {
    rope_store_impl(ptr<float>(qkv), qs, ptr<uint16_t>(cos), ptr<uint16_t>(sin_signed), rs, ptr<uint16_t>(k_cache),
                    ptr<uint16_t>(v_cache), ss, slots, ptr<uint16_t>(q), tokens, heads, kv_heads, dim);
  } else {
    rope_store_impl(ptr<uint16_t>(qkv), qs, ptr<uint16_t>(cos), ptr<uint16_t>(sin_signed), rs,
                    ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache), ss, slots, ptr<uint16_t>(q), tokens, heads,
                    kv_heads, dim);
  }
  return q;
}

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

// Each row's argmax of [S, V] float32 or bfloat16 logits, [S] int64 (engine/sampler.py: argmax_rows).
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_rows(logits, "argmax_rows");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: rows of at least one value");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  torch::Tensor out = torch::empty({rows}, logits.options().dtype(at::kLong));
  if (is_bf16(logits)) argmax_rows_impl(ptr<uint16_t>(logits), stride, rows, n, out.data_ptr<int64_t>());
  else argmax_rows_impl(ptr<float>(logits), stride, rows, n, out.data_ptr<int64_t>());
  return out;
}

// silu(gate) * up of [T, 2I] rows (gate | up); returns [T, I] in the input's dtype.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: an even width (gate | up)");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  auto out = torch::empty({rows, width}, gate_up.options());
  if (is_bf16(gate_up)) {
    silu_mul_impl(ptr<uint16_t>(gate_up), gate_up.stride(0), ptr<uint16_t>(out), rows, width);
  } else {
    silu_mul_impl(ptr<float>(gate_up), gate_up.stride(0), ptr<float>(out), rows, width);
  }
  return out;
}

// out[rows[n]] = attention of q[rows[n]] over sequence seqs[n]'s first lens[seqs[n]] tokens.
void decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                      torch::Tensor seq_lens, torch::Tensor seqs, torch::Tensor rows, torch::Tensor out, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "decode_attention: shapes");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                  q.scalar_type() == out.scalar_type(), "decode_attention: one dtype for q, K, V and out");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2),
              "decode_attention: q and out rows must be contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: contiguous caches");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "decode_attention: int32 block tables and lengths");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && rows.scalar_type() == at::kLong && seqs.size(0) == rows.size(0),
              "decode_attention: int64 seqs and rows");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "decode_attention: heads must be a multiple of kv heads");
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    run<float>(q, k_cache, v_cache, block_tables, seq_lens.contiguous(), seqs.contiguous(), rows.contiguous(), out, s);
  } else if (q.scalar_type() == at::kBFloat16) {
    run<uint16_t>(q, k_cache, v_cache, block_tables, seq_lens.contiguous(), seqs.contiguous(), rows.contiguous(), out,
                  s);
  } else {
    TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only");
  }
}

// ---- a step of decodes through the model's layers, in one call --------------------------------
// DecoderLayer.forward_direct (engine/models/llama.py) for layers [0, L), the same ops in the same
// order, so the same bits, without ~40 us of Python a layer (a one-row step of the default model is
// ~12 ms). Per layer: two norm weights (fp32 where the norm hands fp32 to a bf16 model's fp32 GEMMs,
// else the residual's dtype), four GEMMs of kind 0 (AMX tiles: cpu_amx.cpp, bf16 out) or 1 (panels:
// gemm_panels, fp32 out), the third (gate_up) followed by silu_mul, or of kind 2 for it (gate_up on
// tiles with SiLU x up fused: gemm_tiles_silu), with their packed weights, output widths and biases
// (an empty tensor: none),
// and the layer's K/V caches. The decode attention's arguments are the step's (cpu_attention:
// _DirectDecode). Returns (the last layer's MLP output, the residual stream before it).
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over the block table (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual add and RMSNorm (CPU)");
  m.def("rope_store_kv", &rope_store_kv, "RoPE on q and k, k and v stored in the paged caches (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (CPU)");
  m.def("argmax_rows", &argmax_rows, "each row's argmax, first on ties, a NaN's where there is one (CPU)");
  m.def("pack_panels", &pack_panels, "a bf16 or fp32 weight packed for gemm_panels (CPU)");
  m.def("gemm_panels", &gemm_panels, "x W^T + b on a packed bf16 or fp32 weight, a few rows (CPU)");
  m.def("decode_layers", &decode_layers, "a step of decodes through decoder layers, in one call (CPU)");
  m.def("gemm_tiles_silu", &gemm_tiles_silu, "silu(gate) * up of a gate_up GEMM on AMX tiles (CPU)");
  m.def("prefill_attention", &prefill_attention, "causal attention of a prefill chunk over its paged K/V, AMX (CPU)");
  m.def("amx_available", &amx_available, "whether this CPU and OS run the AMX-BF16 GEMM");
  m.def("pack_tiles", &pack_tiles, "a bf16 weight packed as AMX B tiles for gemm_tiles (CPU)");
  m.def("gemm_tiles", &gemm_tiles, "x W^T + b on AMX tiles, bf16 in, bf16 or fp32 out (CPU)");
}
