"""Where the compiled CPU ops are built and how a built library is found (kernels/cpu_native.py):
an environment that already holds the build for this source, torch and CPU imports it without a
compiler or a writable directory (a container's read-only venv: docker/Dockerfile builds it)."""

from __future__ import annotations

import shutil
import sys

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
