"""The CPU backend's compiled ops, one extension module built from the .cpp files here:

    cpu_decode_attention.cpp  decode attention over the paged K/V cache
    cpu_elementwise.cpp       a decoder layer's fused elementwise ops (add + RMSNorm, RoPE + K/V store,
                              SiLU x up) and greedy sampling's argmax
    cpu_gemm.cpp              the few-row GEMM on weights packed in 16-column panels
    cpu_decode_step.cpp       a step of decodes through layers 1.. in one call (decode_layers)
    cpu_amx.cpp, cpu_amx_attention.cpp   the AMX GEMM and prefill attention (AMX CPUs, checked at run time)
    cpu_module.cpp            the bindings

It is built once per machine with torch's C++ extension builder and kept on disk, so
later processes only load it (~0.1 s).

    load()    the module, or None when it cannot be built here (no compiler, a failed build) or
              PDSERVE_CPU_NATIVE=0; the reason is logged once and the callers keep the torch path
    build()   the same, raising on failure (`make install` runs it, so `make serve` never waits)

The build directory is named by the source's hash, torch's version and the compiler flags (with the
instruction sets it is built for: AVX2 + FMA when this CPU has them, else portable code), under the Python environment's
var/pdserve (pdserve's cache directory if that is read-only): a changed source, torch or CPU builds
afresh, never loads a stale library. A first build takes ~30-75 s on 2 cores.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

NATIVE_ENV = "PDSERVE_CPU_NATIVE"  # "0": never build or load the kernel (the torch path)
# "avx2" or "portable": build for at most those instruction sets even where the CPU has more (to test
# the 8-lane or scalar loops on an AVX512 machine; the AMX GEMM asks the CPU at run time regardless)
ISA_ENV = "PDSERVE_CPU_ISA"
_ISA_CAPS = ("avx2", "portable")
_HERE = Path(__file__).parent
_SOURCES = tuple(_HERE / name for name in (
    "cpu_module.cpp", "cpu_decode_attention.cpp", "cpu_elementwise.cpp", "cpu_gemm.cpp", "cpu_decode_step.cpp",
    "cpu_amx.cpp", "cpu_amx_attention.cpp", "cpu_ops.h", "cpu_common.h", "cpu_lanes.h", "cpu_amx.h", "cpu_amx_tiles.h"))
_NAME = "pdserve_cpu_decode"
_LIBRARY = _NAME + ".so"  # what torch's builder links in the build directory
DTYPES = (torch.float32, torch.bfloat16)  # what the compiled ops take
_lock = threading.Lock()
_state: dict[str, object] = {}  # "module" once loaded, "error" once a build failed


def enabled() -> bool:
    return os.environ.get(NATIVE_ENV, "1") != "0"


def _cpu_flags() -> list[str]:
    """-mavx2 -mfma where this CPU runs them (what the source's fast path needs), with -mavx512f
    -mavx512dq where it runs those too (the 16-lane loops) and -mavx512bf16 where it has AVX512-BF16,
    else nothing; capped by
    $PDSERVE_CPU_ISA. (The AMX GEMM is compiled for its instructions alone and asks the CPU at run
    time: cpu_amx.cpp.)"""
    cap = os.environ.get(ISA_ENV, "")
    if cap and cap not in _ISA_CAPS:
        raise ValueError(f"${ISA_ENV}={cap!r}: expected one of {_ISA_CAPS} or unset")
    if cap == "portable":
        return []
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    if not {"avx2", "fma"} <= flags:
        return []
    wide = {"avx512f", "avx512dq"} <= flags and cap != "avx2"
    bf16 = wide and "avx512_bf16" in flags  # one-instruction bf16 rounding (cpu_lanes.h)
    return ["-mavx2", "-mfma", *(["-mavx512f", "-mavx512dq"] if wide else []), *(["-mavx512bf16"] if bf16 else [])]


def compile_flags() -> list[str]:
    """The compiler flags of this CPU's build (also what a benchmark's variant builds start from)."""
    return ["-O3", "-fopenmp", "-ffp-contract=off", *_cpu_flags()]


def cpp_sources() -> list[str]:
    """The extension's translation units."""
    return [str(p) for p in _SOURCES if p.suffix == ".cpp"]


def _build_dir() -> tuple[Path, list[str]]:
    """<root>/cpu_decode/<hash>: root is the Python environment's own var/pdserve (the venv that
    `make install` filled: a build belongs to its environment, whatever PDSERVE_CACHE_DIR a
    process sets), else pdserve's cache directory when the environment is read-only and holds no
    build of this hash (a container's venv holds the one its image built: docker/Dockerfile)."""
    from pdserve.utils.cache import cache_dir

    flags = compile_flags()
    tag = hashlib.sha256(b"".join(p.read_bytes() for p in _SOURCES) + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()[:16]
    root = Path(sys.prefix) / "var" / "pdserve"
    if not (root / "cpu_decode" / tag / _LIBRARY).exists() \
            and not os.access(root if root.exists() else Path(sys.prefix), os.W_OK):
        root = cache_dir()
    return root / "cpu_decode" / tag, flags


def _import_built(path: Path):
    """The built library imported as it is: no compiler, no ninja, no lock file (a read-only
    directory serves); None if it does not import (then the builder builds it again)."""
    spec = importlib.util.spec_from_file_location(_NAME, path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as e:
        logger.info("CPU decode kernel at %s does not import (%s): building it again", path, e)
        return None
    return module


def build():
    """Build (or load the cached build of) the extension; raises on failure."""
    from torch.utils.cpp_extension import load as load_extension

    directory, flags = _build_dir()
    start = time.perf_counter()
    if (directory / _LIBRARY).exists():
        module = _import_built(directory / _LIBRARY)
        if module is not None:
            logger.info("CPU decode kernel loaded in %.1f s (%s)", time.perf_counter() - start, directory)
            return module
    directory.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PATH", "")
    bin_dir = str(Path(sys.executable).parent)  # ninja installed into this environment
    if bin_dir not in os.environ["PATH"].split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ["PATH"]
    module = load_extension(
        _NAME, cpp_sources(), extra_cflags=flags,
        extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False,
    )
    logger.info("CPU decode kernel ready in %.1f s (%s)", time.perf_counter() - start, directory)
    return module


def load():
    """The module, or None (reason logged once): see the module docstring."""
    if not enabled():
        return None
    module = _state.get("module")  # every attention call asks: no lock once loaded
    if module is not None:
        return module
    with _lock:
        if "module" in _state:
            return _state["module"]
        if "error" in _state:
            return None
        try:
            _state["module"] = build()
        except Exception as e:  # no compiler, no ninja, a failed build: the torch path serves
            _state["error"] = e
            logger.warning("CPU decode kernel unavailable (%s: %s); decode attention uses the torch path",
                           type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        return _state["module"]
