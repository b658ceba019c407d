"""Step-time models for the fleet simulator (benchmarks/fleet_sim.py): fitted or roofline.

Both give `step_time(prefill_tokens, decode_seqs, context_tokens)` in seconds, numpy-vectorised
(the simulator prices a run of identical decode steps in one call).

fitted     seconds = c0 + c1*prefill_tokens + c2*decode_seqs + c3*context_tokens, the coefficients
           from a JSON file `{"coef": [c0, c1, c2, c3], ...}`; such a file is made from a JSON list of
           measured step samples `[[prefill_tokens, decode_seqs, context_tokens, seconds], ...]`
           (what nodes send in Heartbeat.step_samples) by `python -m benchmarks.fleet_sim fit
           SAMPLES.json --out FIT.json`, which fits them with the router's own StepModel.

roofline   per GPU (TP shards weights, KV and FLOPs evenly over `tp` GPUs):
             bytes  = weight_bytes/tp + kv_bytes_per_token/tp * (context_tokens + prefill_tokens)
             flops  = (2*params*(prefill_tokens + decode_seqs)
                       + 4*layers*hidden*(context_tokens + prefill_tokens**2/2)) / tp
             step   = max(bytes / (HBM_BW * MBU), flops / (PEAK * MFU)) + OVERHEAD + TP_COMM
           (a decode sequence reads its whole context once per step: 4*layers*hidden flops per
           context token for QK^T and AV; a prefill chunk attends causally within itself; earlier
           chunks' context of the same prompt is not counted.)
           MFU = 0.6, MBU = 0.8, OVERHEAD = 1 ms per step (scheduler, sampling, launch), TP_COMM =
           2 all-reduces per layer at 10 us each when tp > 1.
           GPUs: H100 SXM 3.35 TB/s HBM, 989 TFLOPS bf16 dense, 80 GB; H200 4.8 TB/s, 989 TFLOPS,
           141 GB. Shapes (bf16): Llama-3.1-8B 32 layers, hidden 4096, 8 KV heads, head_dim 128,
           8.03e9 params (16.06 GB); Llama-3.1-70B 80 layers, hidden 8192, 8 KV heads, head_dim 128,
           70.6e9 params (141.2 GB; TP 4 or 8). KV bytes per token = 2 (K,V) * layers * kv_heads *
           head_dim * 2 bytes: 128 KiB (8B), 320 KiB (70B). KV capacity = 90% of the node's HBM less
           the weights, in blocks of 16 tokens.
"""

from __future__ import annotations

import abc
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MFU = 0.6
MBU = 0.8
STEP_OVERHEAD_S = 1e-3
ALLREDUCE_S = 10e-6
MEM_FRACTION = 0.9
BLOCK_SIZE = 16

GPUS = {
    "h100": {"hbm_bw": 3.35e12, "flops": 989e12, "mem": 80e9},
    "h200": {"hbm_bw": 4.8e12, "flops": 989e12, "mem": 141e9},
}
SHAPES = {
    "llama-3.1-8b": {"layers": 32, "hidden": 4096, "kv_heads": 8, "head_dim": 128, "params": 8.03e9, "tp": 1},
    "llama-3.1-70b": {"layers": 80, "hidden": 8192, "kv_heads": 8, "head_dim": 128, "params": 70.6e9, "tp": 4},
}


@dataclass
class NodeModel(abc.ABC):
    """What a simulated node needs: its step time, KV size and capacity."""

    name: str
    kv_bytes_per_token: float  # whole node (all TP shards)
    num_blocks: int
    gpus_per_node: int = 1
    block_size: int = BLOCK_SIZE

    @abc.abstractmethod
    def step_time(self, prefill_tokens, decode_seqs, context_tokens):
        """Seconds of one engine step with these prefill tokens, decode sequences and context."""

    def describe(self) -> dict:
        return {"name": self.name, "kv_bytes_per_token": self.kv_bytes_per_token, "num_blocks": self.num_blocks,
                "gpus_per_node": self.gpus_per_node}


@dataclass
class FittedModel(NodeModel):
    coef: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def step_time(self, prefill_tokens, decode_seqs, context_tokens):
        c0, c1, c2, c3 = self.coef
        return c0 + c1 * prefill_tokens + c2 * decode_seqs + c3 * context_tokens

    def describe(self) -> dict:
        return {**super().describe(), "coef": list(self.coef)}


@dataclass
class RooflineModel(NodeModel):
    gpu: str = "h200"
    shape: str = "llama-3.1-8b"
    tp: int = 1
    mfu: float = MFU
    mbu: float = MBU
    overhead_s: float = STEP_OVERHEAD_S

    def __post_init__(self) -> None:
        s, g = SHAPES[self.shape], GPUS[self.gpu]
        self._weights = 2.0 * s["params"]
        self._flops_tok = 2.0 * s["params"]
        self._attn = 4.0 * s["layers"] * s["hidden"]
        self._bw = g["hbm_bw"] * self.mbu
        self._peak = g["flops"] * self.mfu
        self._fixed = self.overhead_s + (2 * s["layers"] * ALLREDUCE_S if self.tp > 1 else 0.0)

    def step_time(self, prefill_tokens, decode_seqs, context_tokens):
        tp = self.tp
        nbytes = (self._weights + self.kv_bytes_per_token * (context_tokens + prefill_tokens)) / tp
        flops = (self._flops_tok * (prefill_tokens + decode_seqs)
                 + self._attn * (context_tokens + np.square(prefill_tokens) / 2)) / tp
        return np.maximum(nbytes / self._bw, flops / self._peak) + self._fixed

    def describe(self) -> dict:
        return {**super().describe(), "gpu": self.gpu, "shape": self.shape, "tp": self.tp, "mfu": self.mfu,
                "mbu": self.mbu, "overhead_s": self.overhead_s}


def kv_bytes_per_token(shape: str) -> float:
    s = SHAPES[shape]
    return 2.0 * s["layers"] * s["kv_heads"] * s["head_dim"] * 2


def roofline(gpu: str, shape: str, tp: int | None = None) -> RooflineModel:
    if gpu not in GPUS:
        raise ValueError(f"--gpu must be one of {', '.join(GPUS)}, got {gpu!r}")
    if shape not in SHAPES:
        raise ValueError(f"--model-shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    tp = tp or SHAPES[shape]["tp"]
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    kv = kv_bytes_per_token(shape)
    free = GPUS[gpu]["mem"] * tp * MEM_FRACTION - 2.0 * SHAPES[shape]["params"]
    if free <= 0:
        raise ValueError(f"{shape} does not fit on {tp} x {gpu} (weights {2 * SHAPES[shape]['params'] / 1e9:.0f} GB): "
                         f"raise --tp")
    blocks = int(free // (kv * BLOCK_SIZE))
    return RooflineModel(f"roofline {gpu} {shape} tp{tp}", kv, blocks, tp, gpu=gpu, shape=shape, tp=tp)


def fitted(path, *, kv_bytes_per_token_: float, num_blocks: int) -> FittedModel:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--fit-file {path} does not exist (make one with: python -m benchmarks.fleet_sim fit "
                         f"SAMPLES.json --out {path})")
    data = json.loads(path.read_text())
    coef = data.get("coef") if isinstance(data, dict) else None
    if not (isinstance(coef, list) and len(coef) == 4 and all(isinstance(c, (int, float)) and c >= 0 and
                                                              math.isfinite(c) for c in coef)):
        raise ValueError(f"--fit-file {path}: expected {{\"coef\": [c0, c1, c2, c3]}} with 4 numbers >= 0")
    if num_blocks < 1:
        raise ValueError(f"--num-blocks must be >= 1, got {num_blocks}")
    return FittedModel(f"fitted {path.name}", kv_bytes_per_token_, num_blocks, coef=tuple(float(c) for c in coef))


def fit_samples(samples) -> dict:
    """Fit measured step samples with the router's StepModel (the same code the planner uses)."""
    from pdserve.router.speed import StepModel

    rows = [s for s in samples if isinstance(s, (list, tuple)) and len(s) == 4]
    if len(rows) < 4:
        raise ValueError(f"need at least 4 samples [prefill_tokens, decode_seqs, context_tokens, seconds], "
                         f"got {len(rows)}")
    model = StepModel(window=max(len(rows), 1))
    model.add(rows)
    coef = [float(c) for c in model.coefficients()]
    return {"coef": coef, "num_samples": model.num_samples, "known": model.known, "chunk": model.max_chunk}
