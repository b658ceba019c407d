// What the CPU backend's translation units share: the includes, the build's vector widths
// (PDSERVE_AVX2, PDSERVE_AVX512 from the compiler flags: kernels/cpu_native.py), bf16 <-> fp32
// conversions, the lanes of cpu_lanes.h and a few tensor helpers. Everything here sits in an
// anonymous namespace: each translation unit gets its own copy.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

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

inline float round_as(float x, float*) { return x; }
inline float round_as(float x, uint16_t*) { return bf16_to_f32(f32_to_bf16(x)); }
template <typename T>
inline float rnd(float x) { return round_as(x, static_cast<T*>(nullptr)); }

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

// rows of at least ~16K elements per thread: a decode batch's row runs on one thread
inline int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width)); }

template <typename T>
T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

inline bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == at::kBFloat16; }

inline void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": a 2-D tensor with contiguous rows");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, ": float32 or bfloat16");
}

}  // namespace
