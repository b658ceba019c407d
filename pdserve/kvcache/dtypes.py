"""The one table of dtype names: what `--dtype` accepts and what the KV handshake and payload
headers carry. Aliases (bf16, fp32, half, ...) are accepted on input only; the wire always
uses the canonical name."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
ALIASES: dict[str, str] = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                           "half": "float16"}


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a supported torch dtype; ValueError for any other."""
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype}")
    return DTYPE_NAMES[dtype]


def parse_dtype(name: str) -> torch.dtype:
    """A dtype from a canonical name or an alias; ValueError naming the choices otherwise."""
    canonical = ALIASES.get(name, name)
    if canonical not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or auto); got {name!r}")
    return DTYPES[canonical]
