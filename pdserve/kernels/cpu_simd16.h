// 16-lane helpers shared by cpu_decode.cpp (built with -mavx512f where the CPU has it) and
// cpu_amx.cpp (under its AVX512/AMX target pragma): included inside each file's anonymous namespace,
// after <immintrin.h> and <limits>, where AVX512F is on.
#pragma once

// exp of 16 floats: cpu_decode.cpp's exp8 polynomial (Cephes' expf, ~1 ulp; 0 below -87, +inf above 88)
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 zero_mask = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  const __mmask16 inf_mask = _mm512_cmp_ps_mask(x, _mm512_set1_ps(88.0f), _CMP_GT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 finite = _mm512_maskz_mul_ps(static_cast<__mmask16>(~zero_mask), y, _mm512_castsi512_ps(e));
  return _mm512_mask_blend_ps(inf_mask, finite, _mm512_set1_ps(std::numeric_limits<float>::infinity()));
}

// 16 floats rounded to bf16 (nearest even, NaN kept quiet, as torch), still as floats
inline __m512 rnd16_bf16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __m512i nan = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
  const __mmask16 pick = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(
      _mm512_and_si512(_mm512_mask_blend_epi32(pick, rounded, nan), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
