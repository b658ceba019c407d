"""Factories for the tensor-parallel engine tests: tiny models of every shape the parity tests
cover, and the check that no worker rank of this test process is left running."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import save_tiny_model

# (arch, overrides): KV heads split (2 over 2 ranks) or replicated (1), tied and untied, odd vocab.
MODELS = {
    "llama-kv2-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-kv1-tied-odd-vocab": ("llama", dict(num_key_value_heads=1, tie_word_embeddings=True, vocab_size=259)),
    "qwen2-kv2-tied-odd-vocab": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True, vocab_size=261)),
    "qwen2-kv1-untied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False)),
}


def make_model(root: Path, name: str) -> Path:
    arch, overrides = MODELS[name]
    path = root / name
    if not path.exists():
        save_tiny_model(path, arch, **overrides)
    return path


def tp_worker_pids(parent_pid: int | None = None, *, zombies: bool = True) -> list[int]:
    """Worker ranks started by `parent_pid` (this process by default), found in /proc whoever their
    parent is now (a worker that outlived its node is re-parented). A zombie counts unless
    `zombies` is False: a child this process did not reap is a leak too."""
    parent_pid = os.getpid() if parent_pid is None else parent_pid
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if b"pdserve.engine.parallel.worker" not in argv or len(argv) < 2:
            continue
        if not zombies and status.rsplit(")", 1)[1].split()[0] == "Z":
            continue
        try:
            spec = json.loads([a for a in argv if a.startswith(b"{")][-1])
        except (IndexError, ValueError):
            continue
        if spec.get("parent_pid") == parent_pid:
            pids.append(int(entry))
    return pids
