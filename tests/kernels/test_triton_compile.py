"""Every Triton kernel variant the engine can launch compiles for an H200 (sm_90), without a GPU.

The interpreter accepts code that sm_90 rejects (tl.dot with an inner dim below 16, too much
shared memory), so this compiles the real thing: triton.compile(ASTSource(...), target=sm_90),
through ptxas. The launch options and constexprs come from the same functions the wrappers use.

Block size, sequence lengths and strides are runtime arguments, so one variant covers every block
size 8..128. Variants: attention = dtype x head_dim (16..256) x GQA group (1, 3, 4, 8) x path
(prefill, decode, split decode); its split reducer = dtype x head_dim; store_kv = dtype x head_dim
x kv heads rounded up (1, 2, 4, 8); the gather/scatter/copy kernel = dtype x direction x row tile.
The fast tier compiles a representative subset; the `slow` tier compiles the full cross product.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from pdserve.kernels import triton_attention, triton_cache

H200 = GPUTarget("cuda", 90, 32)
SM90_MAX_SHARED = 232448  # bytes of shared memory one block may opt into on sm_90
TYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = list(TYPE_NAMES)
HEAD_DIMS = [16, 32, 64, 128, 256]
GROUPS = [1, 3, 4, 8]
PATHS = {"prefill": (False, False), "decode": (True, False), "split": (True, True)}  # (decode, split)


# With TRITON_INTERPRET=1 set before Triton was imported, every @triton.jit function (tl.max
# included) is an interpreter object that cannot be compiled: then this file reruns itself in a
# process without the variable.
INTERPRETED_AT_IMPORT = not isinstance(triton_attention._paged_attention_kernel, JITFunction)


@pytest.fixture(autouse=True)
def compiled_mode(request, monkeypatch):
    if INTERPRETED_AT_IMPORT and request.function is not test_in_a_process_without_the_interpreter:
        pytest.skip("TRITON_INTERPRET=1 at import; test_in_a_process_without_the_interpreter compiles")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # kernel tests set it per test


@pytest.mark.skipif(not INTERPRETED_AT_IMPORT, reason="this process compiles in place")
@pytest.mark.timeout(1800)  # the child runs this file's tier, whose own tests have their timeouts
def test_in_a_process_without_the_interpreter(request):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    markers = request.config.getoption("-m") or "not slow"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", markers, __file__],
                            env=env, capture_output=True, text=True, timeout=1700)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]


def compile_for_h200(kernel: JITFunction, dtype: torch.dtype, constexprs: dict, **options):
    """Compile `kernel` with the argument types its wrapper passes (found by argument name)."""
    fn = kernel
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.startswith("part_"):
            signature[name] = "*fp32"
        elif name in ("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr", "slot_mapping_ptr"):
            signature[name] = "*i32"
        elif name.endswith("slots_ptr") or name == "positions_ptr":
            signature[name] = "*i64"
        elif name in ("cos_ptr", "sin_ptr"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*" + TYPE_NAMES[dtype]
        else:
            signature[name] = "fp32" if name in ("scale_log2", "eps") else "i32"
    # Torch allocations are 16-byte aligned; the JIT tells the compiler so, and so do we.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if name.endswith("_ptr")}
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=H200, options=options)
    assert compiled.metadata.shared <= SM90_MAX_SHARED, f"{compiled.metadata.shared} bytes of shared memory"
    assert compiled.asm.get("cubin"), "ptxas produced no cubin"
    return compiled


def compile_attention(dtype, head_dim, group, path) -> None:
    decode, split = PATHS[path]
    cfg = triton_attention.tile_config(head_dim, group, decode)
    constexprs = triton_attention.attention_constexprs(dtype, head_dim, group, decode, split)
    compiled = compile_for_h200(triton_attention._paged_attention_kernel, dtype, constexprs,
                                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    assert compiled.metadata.num_warps == cfg.num_warps


def compile_reduce(dtype, head_dim) -> None:
    compile_for_h200(triton_attention._reduce_splits_kernel, dtype, triton_attention.reduce_constexprs(head_dim),
                     num_warps=4)


def compile_store_kv(dtype, head_dim, num_kv_heads) -> None:
    compile_for_h200(triton_cache._store_kv_kernel, dtype, triton_cache.store_kv_constexprs(num_kv_heads, head_dim))


COPY_DIRECTIONS = {"gather": (True, False), "scatter": (False, True), "copy": (True, True)}
ROW_LENS = [16, 48, 64, 128, 256, 512, 1024, 4096]  # num_kv_heads * head_dim; row tiles 16..1024


def compile_copy(dtype, direction, row_len) -> None:
    constexprs = triton_cache.copy_rows_constexprs(row_len, *COPY_DIRECTIONS[direction])
    compile_for_h200(triton_cache._copy_rows_kernel, dtype, constexprs)


def ids(cases) -> list[str]:
    return ["-".join(TYPE_NAMES.get(x, str(x)) for x in case) for case in cases]


# ---- fast tier: one of each path, the engine's common shapes -----------------------------------

ATTENTION_FAST = [
    *[(torch.bfloat16, 64, 4, path) for path in PATHS],  # Llama-3.2-1B: 32 q / 8 kv heads, d 64
    *[(torch.bfloat16, 128, 4, path) for path in PATHS],
    (torch.bfloat16, 64, 3, "split"),  # SmolLM2: 9 q / 3 kv heads
    (torch.float32, 16, 1, "prefill"),
    (torch.float16, 256, 8, "prefill"),
    (torch.float16, 256, 8, "split"),
]


@pytest.mark.parametrize("case", ATTENTION_FAST, ids=ids(ATTENTION_FAST))
def test_attention_compiles_for_h200(case):
    compile_attention(*case)


@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float32, 256)])
def test_reduce_compiles_for_h200(dtype, head_dim):
    compile_reduce(dtype, head_dim)


@pytest.mark.parametrize("dtype,head_dim,num_kv_heads", [(torch.bfloat16, 64, 8), (torch.float32, 16, 3)])
def test_store_kv_compiles_for_h200(dtype, head_dim, num_kv_heads):
    compile_store_kv(dtype, head_dim, num_kv_heads)


@pytest.mark.parametrize("direction", list(COPY_DIRECTIONS))
def test_copy_rows_compiles_for_h200(direction):
    compile_copy(torch.bfloat16, direction, 512)


# ---- slow tier: the full cross product ---------------------------------------------------------

ATTENTION_ALL = list(itertools.product(DTYPES, HEAD_DIMS, GROUPS, PATHS))
REDUCE_ALL = list(itertools.product(DTYPES, HEAD_DIMS))
STORE_ALL = list(itertools.product(DTYPES, HEAD_DIMS, [1, 2, 4, 8]))
COPY_ALL = list(itertools.product(DTYPES, COPY_DIRECTIONS, ROW_LENS))


@pytest.mark.slow
@pytest.mark.parametrize("case", ATTENTION_ALL, ids=ids(ATTENTION_ALL))
def test_every_attention_variant_compiles(case):
    compile_attention(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", REDUCE_ALL, ids=ids(REDUCE_ALL))
def test_every_reduce_variant_compiles(case):
    compile_reduce(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", STORE_ALL, ids=ids(STORE_ALL))
def test_every_store_kv_variant_compiles(case):
    compile_store_kv(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", COPY_ALL, ids=ids(COPY_ALL))
def test_every_copy_variant_compiles(case):
    compile_copy(*case)
