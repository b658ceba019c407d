"""Where pdserve keeps what it fetches or builds once: converted models, compiled kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of pdserve's cache: $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pdserve"
