// Vector lanes for the CPU kernels: Lanes8 (AVX2 + FMA) and Lanes16 (AVX512F/DQ) give one set of
// operations, so that each loop and the exp polynomial are written once for both widths; a loop
// runs 16 lanes a step where the CPU has them, then 8, then the scalar tail. The templates at the
// end name only L's operations: a build without either width never instantiates them. Included inside the
// anonymous namespace of cpu_common.h (PDSERVE_AVX2 / PDSERVE_AVX512 from the build flags) and of
// cpu_amx.cpp (both, under its AVX512/AMX target pragma), after <immintrin.h>, <limits> and
// <type_traits>.
#pragma once

#ifdef PDSERVE_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Four 8-lane sums reduced to their four totals.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128-bit half
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

struct Lanes8 {
  using V = __m256;
  using M = __m256;  // a compare's lanes, all ones or all zeros
  static constexpr int64_t W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const uint16_t* p) {  // bf16 widened: the top half of an fp32
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static constexpr bool kStoreRounds = false;  // store(uint16_t*) keeps the top halves: x already bf16
  static void store(uint16_t* p, V x) {  // x already holds bf16 values (rnd_bf16)
    const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V min(V a, V b) { return _mm256_min_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }    // a b + c
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
  static V round(V x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {  // 2^n for whole n in the normal range
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static M lt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static M gt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
  static V zero_where(M m, V x) { return _mm256_andnot_ps(m, x); }
  static V select(M m, V a, V b) { return _mm256_blendv_ps(a, b, m); }  // b where m, else a
  // rounded to bf16 (nearest even, NaN kept quiet, as f32_to_bf16), still as floats
  static V rnd_bf16(V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256i nan = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    const __m256i pick = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_castsi256_ps(
        _mm256_and_si256(_mm256_blendv_epi8(rounded, nan, pick), _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static float sum(V x) { return hsum(x); }
  static __m128 sum4(V a, V b, V c, V d) { return hsum4(a, b, c, d); }
};
#endif

#ifdef PDSERVE_AVX512
// 16 lanes folded to 8 (the two halves added)
inline __m256 fold(__m512 v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }

struct Lanes16 {
  using V = __m512;
  using M = __mmask16;
  static constexpr int64_t W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
#ifdef __AVX512BF16__
  // one VCVTNEPS2BF16 rounds and narrows any x (rnd_bf16's note on denormals applies): two uops
  // where the shift and VPMOVDW take three
  static constexpr bool kStoreRounds = true;
  static void store(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
  }
#else
  static constexpr bool kStoreRounds = false;
  static void store(uint16_t* p, V x) {  // x already holds bf16 values (rnd_bf16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
  }
#endif
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V scale2(V p, V n) { return _mm512_scalef_ps(p, n); }  // p 2^n: inf above, 0 below the range
  static V min(V a, V b) { return _mm512_min_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V neg(V a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.f)); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V round(V x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static M gt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static V zero_where(M m, V x) { return _mm512_maskz_mov_ps(static_cast<__mmask16>(~m), x); }
  static V select(M m, V a, V b) { return _mm512_mask_blend_ps(m, a, b); }
  static V rnd_bf16(V x) {
#ifdef __AVX512BF16__
    // VCVTNEPS2BF16: nearest even, NaN kept quiet; denormals (below 1.2e-38) flush to 0, where
    // torch keeps them: the one difference from the bit operations below
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
#endif
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
    const __mmask16 pick = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_mask_blend_epi32(pick, rounded, nan),
                                                _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
  }
  static float sum(V x) { return hsum(fold(x)); }
  static __m128 sum4(V a, V b, V c, V d) { return hsum4(fold(a), fold(b), fold(c), fold(d)); }
};
#endif

// exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' expf
// polynomial (~1 ulp): returns e^r and leaves n, for the caller to scale by 2^n its own way
template <typename L>
inline typename L::V exp_reduced(typename L::V x, typename L::V& n) {
  using V = typename L::V;
  n = L::round(L::mul(x, L::set(1.44269504088896341f)));
  V r = L::fnma(n, L::set(0.693359375f), x);
  r = L::fnma(n, L::set(-2.12194440e-4f), r);
  V p = L::set(1.9875691500e-4f);
  p = L::fma(p, r, L::set(1.3981999507e-3f));
  p = L::fma(p, r, L::set(8.3334519073e-3f));
  p = L::fma(p, r, L::set(4.1665795894e-2f));
  p = L::fma(p, r, L::set(1.6666665459e-1f));
  p = L::fma(p, r, L::set(5.0000001201e-1f));
  return L::add(L::fma(L::mul(p, r), r, r), L::set(1.0f));
}

// exp of a vector (exp(x) = 0 below -87, so no denormal reaches the sums, and +inf above 88): the
// softmax's exps would otherwise cost more than its dot products.
template <typename L>
inline typename L::V exp_lanes(typename L::V x) {
  using V = typename L::V;
  V n;
#ifdef PDSERVE_AVX512
  if constexpr (L::W == 16) {  // 2^n by VSCALEFPS: no clamps, no exponent bits built
    const auto zero_mask = L::lt(x, L::set(-87.0f));
    const V y = exp_reduced<L>(x, n);
    return L::zero_where(zero_mask, L::scale2(y, n));  // inf from 88.7 up, as expf
  }
#endif
  const V lo = L::set(-87.0f);
  const auto zero_mask = L::lt(x, lo);
  const auto inf_mask = L::gt(x, L::set(88.0f));
  const V y = exp_reduced<L>(L::max(L::min(x, L::set(88.0f)), lo), n);
  const V finite = L::zero_where(zero_mask, L::mul(y, L::pow2(n)));
  return L::select(inf_mask, finite, L::set(std::numeric_limits<float>::infinity()));
}

// x rounded to the storage type T's values: bf16 (uint16_t) rounds, float keeps x
template <typename L, typename T>
inline typename L::V rnd_lanes(typename L::V x) {
  if constexpr (std::is_same_v<T, uint16_t>) return L::rnd_bf16(x);
  else return x;
}

// T(x) stored at p: a float store, or x rounded to bf16 and narrowed (by the store itself where it rounds)
template <typename L, typename T>
inline void store_rnd(T* p, typename L::V x) {
  if constexpr (std::is_same_v<T, uint16_t> && !L::kStoreRounds) L::store(p, L::rnd_bf16(x));
  else L::store(p, x);
}

// store_rnd, and T(x) back as floats for the caller's next use (bf16: read back from p, a load
// the store forwards, where rounding as floats first would take as many vector uops again)
template <typename L, typename T>
inline typename L::V store_rnd_kept(T* p, typename L::V x) {
  store_rnd<L, T>(p, x);
  if constexpr (std::is_same_v<T, uint16_t>) return L::load(p);
  else return x;
}

// S values at p as T's values: a bf16 source (every bf16 is a float too) or S = T needs no rounding
template <typename L, typename T, typename S>
inline typename L::V load_rnd(const S* p) {
  if constexpr (std::is_same_v<S, uint16_t> || std::is_same_v<S, T>) return L::load(p);
  else return rnd_lanes<L, T>(L::load(p));
}

// T(T(silu(x)) * up), silu(x) = x / (1 + exp(-x)), stored at p: silu_mul's arithmetic (cpu_elementwise.cpp),
// also the fused gate_up GEMM's epilogue (cpu_amx.cpp), so the two give the same bits
template <typename L, typename T>
inline void store_silu_times(T* p, typename L::V x, typename L::V up) {
  const typename L::V e = exp_lanes<L>(L::neg(x));
  store_rnd<L, T>(p, L::mul(rnd_lanes<L, T>(L::div(x, L::add(L::set(1.f), e))), up));
}
