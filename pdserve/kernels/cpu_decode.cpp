// Decode attention on the CPU, reading K/V in place through the block table (issue 13).
//
// One query token per sequence. Work item = a chunk of a sequence's tokens (whole blocks, sized for
// ~4 items per thread, at most 512 tokens: flash-decoding, so one long sequence still uses every
// thread), all heads at once, so each token's K and V rows (every KV head) are contiguous reads.
// Two passes over the chunk: the scores q.k in fp32, then the exp(s - max)-weighted sum of V; bf16
// K/V are widened in registers (bf16 is the top half of an fp32). The chunks of a sequence are
// merged with their maxima (the usual log-sum-exp merge) and the output is rounded once to the
// query's dtype. Items run on torch's intra-op threads (at::parallel_for): torch.set_num_threads
// governs it.
//
// Built by pdserve/kernels/cpu_native.py (torch.utils.cpp_extension, cached on disk). With AVX2
// and FMA the inner loops use them (4 tokens' dot products in flight, 8 exps at a time; head_dim a
// multiple of 8); any other CPU or head_dim takes the portable loops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1
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

#ifdef PDSERVE_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

struct Geometry {
  int64_t heads, kv_heads, head_dim, block_size, max_blocks, token_stride, block_stride;
};

#ifdef PDSERVE_AVX2
// exp of 8 floats (Cephes' expf polynomial, ~1 ulp; exp(x) = 0 below -87, so no denormal reaches
// the sums, and +inf above 88): the softmax's exps would otherwise cost more than its dot products.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 zero_mask = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 inf_mask = _mm256_cmp_ps(x, _mm256_set1_ps(88.0f), _CMP_GT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lo);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 finite = _mm256_andnot_ps(zero_mask, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  return _mm256_blendv_ps(finite, _mm256_set1_ps(std::numeric_limits<float>::infinity()), inf_mask);
}
#endif

// Ask for `n` elements from p on into the cache (L2: read within the next block's work).
template <typename T>
inline void prefetch_rows(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 2);
}

// A block's rows [count elements] as floats: fp32 read in place, bf16 widened once into `buf`
// (then every query head of a KV group reads them without widening them again).
inline const float* as_float(const float* p, int64_t, std::vector<float>&) { return p; }
inline const float* as_float(const uint16_t* p, int64_t count, std::vector<float>& buf) {
  if (static_cast<int64_t>(buf.size()) < count) buf.resize(count);
  float* out = buf.data();
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(out + i, load8(p + i));
#endif
  for (; i < count; ++i) out[i] = bf16_to_f32(p[i]);
  return out;
}

// Per-thread scratch of attend_chunk.
struct Scratch {
  std::vector<float> qf, scores, rows;
};

#ifdef PDSERVE_AVX2
// scores[h * n + j] = q_h . k_j for N consecutive token rows k_j (TS apart, query head h reading
// KV head h / G): N independent FMA chains in flight hide the FMA latency.
template <int N>
inline void dot_tokens(const float* k, const float* qf, float* scores, int64_t n, int64_t H, int64_t G,
                       int64_t D, int64_t TS) {
  for (int64_t h = 0; h < H; ++h) {
    const float* r = k + (h / G) * D;
    const float* qh = qf + h * D;
    __m256 a[N];
    for (int j = 0; j < N; ++j) a[j] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      const __m256 qv = _mm256_loadu_ps(qh + d);
      for (int j = 0; j < N; ++j) a[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r + j * TS + d), a[j]);
    }
    for (int j = 0; j < N; ++j) scores[h * n + j] = hsum(a[j]);
  }
}

// acc_h += sum over nb token rows v_i (TS apart) of p_h[i] v_i, 8 C columns of a head at a time,
// their sums in registers over the rows (C independent FMA chains); D a multiple of 8 C.
template <int C>
inline void weigh_rows(const float* v, const float* p, float* acc, int64_t nb, int64_t n, int64_t H, int64_t G,
                       int64_t D, int64_t TS) {
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t d = 0; d < D; d += 8 * C) {
      float* ah = acc + h * D + d;
      __m256 a[C];
      for (int j = 0; j < C; ++j) a[j] = _mm256_loadu_ps(ah + 8 * j);
      const float* vr = v + (h / G) * D + d;
      for (int64_t i = 0; i < nb; ++i, vr += TS) {
        const __m256 w = _mm256_broadcast_ss(p + h * n + i);
        for (int j = 0; j < C; ++j) a[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * j), a[j]);
      }
      for (int j = 0; j < C; ++j) _mm256_storeu_ps(ah + 8 * j, a[j]);
    }
  }
}
#endif

// One work item: every head of one sequence over tokens [t0, t1) (whole blocks but the last), read
// block by block through the table, so each token's K and V rows (all KV heads) are contiguous
// reads. Leaves the chunk's softmax state per query head: max m, sum l of exp(s - m), and acc, the
// exp-weighted sum of V rows.
template <typename T>
void attend_chunk(const T* q, const T* k, const T* v, const int32_t* table, int64_t t0, int64_t t1,
                  const Geometry& g, float scale, Scratch& sc, float* m_out, float* l_out, float* acc) {
  const int64_t H = g.heads, G = g.heads / g.kv_heads, D = g.head_dim, BS = g.block_size, TS = g.token_stride;
  const int64_t n = t1 - t0;
  sc.qf.resize(H * D);
  sc.scores.resize(H * n);
  float* qf = sc.qf.data();
  float* scores = sc.scores.data();
  for (int64_t x = 0; x < H * D; ++x) qf[x] = load(q + x) * scale;
  std::fill(acc, acc + H * D, 0.f);
  // token t's row (every KV head) in a cache, through the block table
  const auto row = [&](const T* cache, int64_t t) {
    return cache + static_cast<int64_t>(table[t / BS]) * g.block_stride + (t % BS) * TS;
  };
  // Pass 1: scores[h][t - t0] = q_h . k_t (query head h reads KV head h / G). The blocks are
  // scattered over the pool and out of cache after a layer's GEMMs; the hardware prefetcher does
  // not know the next one, so each block asks for the next block's K and its own V (pass 2).
  for (int64_t b0 = t0; b0 < t1; b0 += BS - b0 % BS) {
    const int64_t nb = std::min(t1, (b0 / BS + 1) * BS) - b0;
    if (b0 + nb < t1) prefetch_rows(row(k, b0 + nb), BS * TS);
    prefetch_rows(row(v, b0), nb * TS);
    const float* kb = as_float(row(k, b0), nb * TS, sc.rows);
    float* sb = scores + (b0 - t0);
    int64_t i = 0;
#ifdef PDSERVE_AVX2
    if (D % 8 == 0) {
      for (; i + 8 <= nb; i += 8) dot_tokens<8>(kb + i * TS, qf, sb + i, n, H, G, D, TS);
      for (; i + 4 <= nb; i += 4) dot_tokens<4>(kb + i * TS, qf, sb + i, n, H, G, D, TS);
    }
#endif
    for (; i < nb; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const float* kr = kb + i * TS + (h / G) * D;
        float a = 0.f;
        for (int64_t d = 0; d < D; ++d) a += qf[h * D + d] * kr[d];
        sb[h * n + i] = a;
      }
    }
  }
  // Softmax state of the chunk, per head; scores become exp(s - m).
  for (int64_t h = 0; h < H; ++h) {
    float* sh = scores + h * n;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, sh[i]);
    float sum = 0.f;
    int64_t i = 0;
#ifdef PDSERVE_AVX2
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sv = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + i), mv));
      _mm256_storeu_ps(sh + i, e);
      sv = _mm256_add_ps(sv, e);
    }
    sum = hsum(sv);
#endif
    for (; i < n; ++i) {
      sh[i] = std::exp(sh[i] - m);
      sum += sh[i];
    }
    m_out[h] = m;
    l_out[h] = sum;
  }
  // Pass 2: acc_h = sum over tokens of exp(s - m) v_t, block by block.
  for (int64_t b0 = t0; b0 < t1; b0 += BS - b0 % BS) {
    const int64_t nb = std::min(t1, (b0 / BS + 1) * BS) - b0;
    const float* vb = as_float(row(v, b0), nb * TS, sc.rows);
    const float* pb = scores + (b0 - t0);
#ifdef PDSERVE_AVX2
    if (D % 64 == 0) {
      weigh_rows<8>(vb, pb, acc, nb, n, H, G, D, TS);
      continue;
    }
    if (D % 32 == 0) {
      weigh_rows<4>(vb, pb, acc, nb, n, H, G, D, TS);
      continue;
    }
#endif
    for (int64_t i = 0; i < nb; ++i) {
      for (int64_t h = 0; h < H; ++h) {
        const float p = pb[h * n + i];
        const float* vr = vb + i * TS + (h / G) * D;
        float* ah = acc + h * D;
        for (int64_t d = 0; d < D; ++d) ah[d] += p * vr[d];
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
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t it = begin; it < end; ++it) {
      const int64_t x = owner[it], s = sp[x], t0 = (it - first[x]) * chunk;
      const int64_t t1 = std::min<int64_t>(lp[s], t0 + chunk);
      attend_chunk<T>(qp + rp[x] * q_row, kp, vp, tp + s * g.max_blocks, t0, t1, g, scale, scratch,
                      m.data() + it * H, l.data() + it * H, acc.data() + it * H * D);
    }
  });
  // Merge each sequence's chunks: out_h = sum_i exp(m_i - M) acc_i / sum_i exp(m_i - M) l_i.
  at::parallel_for(0, num_seqs, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(D);
    for (int64_t x = begin; x < end; ++x) {
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
        T* o = op + rp[x] * out_row + h * D;
        for (int64_t d = 0; d < D; ++d) store(o + d, merged[d] / denom);
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

#ifdef PDSERVE_AVX2
// 8 floats rounded to bf16 (nearest even, NaN kept quiet, as f32_to_bf16), still as floats
inline __m256 rnd8_bf16(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
  const __m256i nan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
  const __m256i pick = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_blendv_epi8(rounded, nan, pick), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
}
inline __m256 rnd8(__m256 x, float*) { return x; }
inline __m256 rnd8(__m256 x, uint16_t*) { return rnd8_bf16(x); }
template <typename T>
inline __m256 rnd8(__m256 x) { return rnd8(x, static_cast<T*>(nullptr)); }
// store 8 floats that are already values of the destination type (rnd8 first for bf16)
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(uint16_t* p, __m256 x) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// rows of at least ~16K elements per thread: a decode batch's row runs on one thread
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float total = 0.f;
#ifdef PDSERVE_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(x0, x0, a0);
    a1 = _mm256_fmadd_ps(x1, x1, a1);
  }
  total = hsum(_mm256_add_ps(a0, a1));
#endif
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
#ifdef PDSERVE_AVX2
        for (; i0 + 8 <= width; i0 += 8) {
          const __m256 v = rnd8<R>(_mm256_add_ps(load8(r + i0), rnd8<R>(load8(d + i0))));
          store8(r + i0, v);
          _mm256_storeu_ps(x.data() + i0, v);
        }
#endif
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
#ifdef PDSERVE_AVX2
      const __m256 sv = _mm256_set1_ps(scale);
      for (; i + 8 <= width; i += 8)
        store8(o + i, rnd8<O>(_mm256_mul_ps(load8(w + i), rnd8<O>(_mm256_mul_ps(_mm256_loadu_ps(x.data() + i), sv)))));
#endif
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
#ifdef PDSERVE_AVX2
        for (; i + 8 <= half; i += 8) {
          const __m256 lo = rnd8<C>(load8(src + i)), hi = rnd8<C>(load8(src + half + i));
          store8(dst + i, rnd8<C>(_mm256_add_ps(rnd8<C>(_mm256_mul_ps(lo, load8(c + i))),
                                                rnd8<C>(_mm256_mul_ps(hi, load8(s + i))))));
          store8(dst + half + i, rnd8<C>(_mm256_add_ps(rnd8<C>(_mm256_mul_ps(hi, load8(c + half + i))),
                                                       rnd8<C>(_mm256_mul_ps(lo, load8(s + half + i))))));
        }
#endif
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
#ifdef PDSERVE_AVX2
        for (; i + 8 <= dim; i += 8) store8(dst + i, rnd8<C>(load8(src + i)));
#endif
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
#ifdef PDSERVE_AVX2
      const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
      for (; i + 8 <= width; i += 8) {
        const __m256 x = load8(gr + i);
        const __m256 e = exp8(_mm256_xor_ps(x, sign));
        store8(o + i, rnd8<T>(_mm256_mul_ps(rnd8<T>(_mm256_div_ps(x, _mm256_add_ps(one, e))), load8(up + i))));
      }
#endif
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention over the block table (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual add and RMSNorm (CPU)");
  m.def("rope_store_kv", &rope_store_kv, "RoPE on q and k, k and v stored in the paged caches (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (CPU)");
}
