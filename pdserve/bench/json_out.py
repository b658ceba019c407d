"""Benchmark results as strict JSON: one way every benchmark script writes its `--json` file."""

from __future__ import annotations

import json
import math
from pathlib import Path


def jsonable(value):
    """`value` with non-finite floats as strings ("inf", "nan") and paths as text: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def write_json(path: str | Path, doc, indent: int = 2) -> Path:
    """Write `doc` (made jsonable) to `path`, creating its folder; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(doc), indent=indent, allow_nan=False))
    return path


def report(result: dict, json_path: str | Path | None) -> None:
    """Print `result` as strict JSON, and write it to `json_path` too when one is given."""
    print(json.dumps(jsonable(result), indent=2))
    if json_path:
        write_json(json_path, result)
