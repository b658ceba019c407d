"""Run `pdserve` as a user does: a fresh interpreter, this checkout on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_pdserve(*argv: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, **kw)
