// Decode attention on the CPU, reading K/V in place through the block table.
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
#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

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

}  // namespace

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
