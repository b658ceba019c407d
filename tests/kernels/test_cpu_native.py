"""Where the compiled CPU ops are built and how a built library is found (kernels/cpu_native.py):
an environment that already holds the build for this source, torch and CPU imports it without a
compiler or a writable directory (a container's read-only venv: docker/Dockerfile builds it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from pdserve.kernels import cpu_native


@pytest.fixture
def built():
    module = cpu_native.load()
    assert module is not None, "the compiled ops build on a machine with a C++ compiler (make install)"
    return module


def _no_builder(*args, **kwargs):
    raise AssertionError("the builder ran although a built library was there")


@pytest.mark.timeout(60)
def test_a_built_library_in_a_read_only_environment_is_imported_not_rebuilt(built, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(cpu_native.os, "access", lambda *a: False)  # nothing writable
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    # without a build in the environment: the cache directory (the only writable place)
    directory, _ = cpu_native._build_dir()
    assert directory.is_relative_to(tmp_path / "cache")
    # with one (as the image's build stage leaves it): that one, imported as it is
    want = tmp_path / "venv" / "var" / "pdserve" / "cpu_decode" / directory.name
    want.mkdir(parents=True)
    shutil.copy(built.__file__, want / cpu_native._LIBRARY)
    assert cpu_native._build_dir()[0] == want
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _no_builder)
    imported = []
    real_import = cpu_native._import_built
    monkeypatch.setattr(cpu_native, "_import_built", lambda path: imported.append(path) or real_import(path))
    module = cpu_native.build()
    assert imported == [want / cpu_native._LIBRARY] and hasattr(module, "add_rms_norm")


@pytest.mark.timeout(60)
def test_a_library_that_does_not_import_is_built_again(tmp_path, monkeypatch):
    (tmp_path / "venv").mkdir()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    directory, _ = cpu_native._build_dir()
    assert directory.is_relative_to(tmp_path / "venv")
    directory.mkdir(parents=True)
    (directory / cpu_native._LIBRARY).write_bytes(b"not a library: a build cut short")
    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load",
                        lambda name, sources, **kw: calls.append((name, kw["build_directory"])) or "rebuilt")
    assert cpu_native.build() == "rebuilt"
    assert calls == [(cpu_native._NAME, str(directory))]


def test_an_isa_cap_narrows_the_build_flags(monkeypatch):
    monkeypatch.setattr(cpu_native.Path, "read_text", lambda self: "fma avx2 avx512f avx512dq")
    monkeypatch.delenv(cpu_native.ISA_ENV, raising=False)
    assert cpu_native._cpu_flags() == ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq"]
    monkeypatch.setenv(cpu_native.ISA_ENV, "avx2")
    assert cpu_native._cpu_flags() == ["-mavx2", "-mfma"]
    monkeypatch.setenv(cpu_native.ISA_ENV, "portable")
    assert cpu_native._cpu_flags() == []
    monkeypatch.setenv(cpu_native.ISA_ENV, "avx9000")
    with pytest.raises(ValueError, match="PDSERVE_CPU_ISA='avx9000'"):
        cpu_native._cpu_flags()


def _cpu_has(*flags: str) -> bool:
    try:
        return set(flags) <= set(open("/proc/cpuinfo").read().split())
    except OSError:
        return False


# The loops are written once for 16 and 8 lanes (cpu_lanes.h) with a scalar tail: on an AVX512 CPU
# the 8-lane and scalar loops only run in a build capped below it. Each narrower build takes the
# compiled ops' own tests (a fresh process: the library is loaded once per process).
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_narrower_builds_pass_the_compiled_ops_tests(isa):
    if isa == "avx2" and not _cpu_has("avx2", "fma", "avx512f", "avx512dq"):
        pytest.skip("the default build is the AVX2 one here (or there is none): the suite already ran it")
    if isa == "portable" and not _cpu_has("avx2", "fma"):
        pytest.skip("the default build is the portable one here: the suite already ran it")
    here = Path(__file__).parent
    tests = [str(here / name) for name in ("test_cpu_attention.py", "test_cpu_layer_ops.py", "test_cpu_gemm.py")]
    env = {**os.environ, cpu_native.ISA_ENV: isa}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], env=env,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
