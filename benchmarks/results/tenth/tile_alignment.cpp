#include <torch/extension.h>
#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdlib>
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
struct alignas(64) Cfg { uint8_t palette = 1, start = 0; uint8_t res[14] = {}; uint16_t colsb[16] = {}; uint8_t rows[16] = {}; };
static void cfg() { Cfg c; for (int i = 0; i < 8; ++i) c.colsb[i] = 64, c.rows[i] = 16; _tile_loadconfig(&c); }
static bool req() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }
// mode 0: loads only; mode 1: 2x2 blocking (4 loads, 4 TDPs); mode 2: stores only
double bench(int mode, int64_t offset, int64_t n, int64_t kb) {
  static bool ok = req(); (void)ok;
  cfg();
  char* raw = static_cast<char*>(std::aligned_alloc(4096, kb * 1024 + 8192));
  memset(raw, 0, kb * 1024 + 8192);
  uint16_t* b = reinterpret_cast<uint16_t*>(raw + offset);
  const int64_t tiles = kb;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  _tile_loadd(4, b, 64); _tile_loadd(5, b, 64);
  uint64_t t0 = __rdtsc();
  int64_t j = 0;
  for (int64_t i = 0; i < n; i += 4) {
    if (mode == 0) {
      _tile_loadd(6, b + (j % tiles) * 512, 64); ++j;
      _tile_loadd(7, b + (j % tiles) * 512, 64); ++j;
      _tile_loadd(6, b + (j % tiles) * 512, 64); ++j;
      _tile_loadd(7, b + (j % tiles) * 512, 64); ++j;
    } else if (mode == 1) {
      _tile_loadd(4, b + (j % tiles) * 512, 64); ++j;
      _tile_loadd(5, b + (j % tiles) * 512, 64); ++j;
      _tile_loadd(6, b + (j % tiles) * 512, 64); ++j;
      _tile_loadd(7, b + (j % tiles) * 512, 64); ++j;
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    } else {
      _tile_stored(0, b + (j % tiles) * 512, 64); ++j;
      _tile_stored(1, b + (j % tiles) * 512, 64); ++j;
      _tile_stored(2, b + (j % tiles) * 512, 64); ++j;
      _tile_stored(3, b + (j % tiles) * 512, 64); ++j;
    }
  }
  _tile_stored(0, b, 64);
  uint64_t t1 = __rdtsc();
  _tile_release();
  free(raw);
  return double(t1 - t0) / n;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("bench", &bench); }
