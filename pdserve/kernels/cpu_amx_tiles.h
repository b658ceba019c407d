// What both AMX files share (cpu_amx.cpp: the GEMM; cpu_amx_attention.cpp: prefill attention):
// the tile shapes, and where the compiler has AMX (PDSERVE_AMX, set here) the tile configuration and
// the OS request for the tile state (in an anonymous namespace: each file its own copy).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define PDSERVE_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
// AMX and AVX512 for the functions that say so (the rest of the library is built for the CPU's flags)
#define PDSERVE_AMX_TARGET "amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16"
#endif

#include <cstdint>
#include <cstdlib>
#include <new>
#include <vector>

namespace {

constexpr int64_t kRows = 16;   // rows of an A or C tile
constexpr int64_t kCols = 16;   // columns of a C tile (fp32) or a B tile (bf16 pairs)
constexpr int64_t kDepth = 32;  // k of one tile (16 pairs of bf16)
constexpr int64_t kTile = kDepth * kCols;  // bf16 per B tile (1 KiB)

// Memory on 64-byte lines for what the tiles load or store: a tile row that straddles two cache
// lines costs a tile load ~4x (a std::vector's
// malloc memory sits 16 bytes past a line).
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, std::size_t) { std::free(p); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const { return false; }
};
template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

#ifdef PDSERVE_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: A (16 x 32 bf16), B (16 pairs x 16 x 2 bf16), C (16 x 16 fp32).
__attribute__((target(PDSERVE_AMX_TARGET))) inline void configure_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.colsb[i] = 64, cfg.rows[i] = kRows;
  _tile_loadconfig(&cfg);
}

// Whether the CPU has AMX-BF16 and AVX512-BF16 and Linux lets this process use the tile state.
inline bool request_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool bf16 = (edx >> 22) & 1u, tile = (edx >> 24) & 1u;
  const bool avx512_bf16 = __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) && ((eax >> 5) & 1u);
  if (!bf16 || !tile || !avx512_bf16) return false;
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // Linux: ask for the tile state
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}
#endif

}  // namespace
