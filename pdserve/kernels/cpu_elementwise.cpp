// A decoder layer's fused elementwise ops (residual add + RMSNorm, RoPE + K/V store, SiLU x up) and
// greedy sampling's argmax.
// Each layer op replaces a run of small torch ops (each paying torch's dispatch, dozens a layer) with
// one call and the same arithmetic: the same roundings to the activation dtype in the same places
// as the torch code (engine/ops: forward_native), so RoPE, the K/V store and the residual add
// give the torch path's bits; RMSNorm's sum of squares and SiLU's exp differ from torch's in the
// last bits (summation order; a polynomial exp, ~1 ulp). Compiled with -ffp-contract=off: no a*b+c
// is fused where torch rounds the product.

#include "cpu_common.h"
#include "cpu_ops.h"

namespace {

// ---- the elementwise loops, at each vector width ------------------------------------------------
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
