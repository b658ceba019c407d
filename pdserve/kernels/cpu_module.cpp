// The bindings of the CPU backend's module (kernels/cpu_native.py builds it from every .cpp here).
#include "cpu_amx.h"
#include "cpu_ops.h"

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
