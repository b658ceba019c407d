"""Engine configuration: plain values, validated in __post_init__ (vLLM's names)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine.scheduling_policy import (
    DEFAULT_SCHEDULING_POLICY,
    DEFAULT_SJF_AGING_S,
    DEFAULT_SJF_LENGTH_FACTOR,
    check_scheduling_values,
)
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.kvcache.dtypes import parse_dtype

KV_OFFLOAD_CHOICES = ("none", "host", "disk")


@dataclass
class EngineConfig:
    model_path: Path  # a local Hugging Face directory (see engine.loader.resolve_model)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 2.0  # CPU: the pool's size when num_kv_blocks is None
    gpu_memory_utilization: float = 0.9  # CUDA: the share of the device the engine may use, KV included
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped by the pool
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    swap_space_gb: float = 0.0  # host memory for swapped-out requests; 0 = preempt by recompute
    # A tier below the KV pool for evicted prefix-cache blocks (engine/kv_tier.py): none | host | disk
    kv_offload: str = "none"
    kv_offload_gb: float = 4.0  # the tier's size cap
    kv_offload_dir: str | None = None  # disk: where its file goes (a fresh subdirectory; default the temp dir)
    num_threads: int | None = None  # torch intra-op threads on the CPU
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs (engine/cuda_graphs.py); the CPU is always eager
    seed: int = 0
    # Speculative decoding (engine/spec_decode/): a SpeculativeConfig, a dict of vLLM's keys, or
    # their JSON; None = off. Parsed and checked here; a draft model is loaded by the engine.
    speculative_config: SpeculativeConfig | dict | str | None = None
    scheduling_policy: str = DEFAULT_SCHEDULING_POLICY  # fcfs | priority | sjf (engine/scheduling_policy.py)
    sjf_length_factor: float = DEFAULT_SJF_LENGTH_FACTOR  # sjf: estimate = min(prompt len x factor, max_tokens)
    sjf_aging_s: float = DEFAULT_SJF_AGING_S  # sjf: a request that waited this long is no longer overtaken
    # Tensor parallelism (engine/parallel/): ranks of this node, one process each (this one is rank 0).
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 60.0  # every collective; a rank that died or hangs fails the step after this
    tp_startup_timeout_s: float = 120.0  # each start-up phase of the worker ranks (join, load, KV pool)

    def __post_init__(self) -> None:
        self.model_path = Path(self.model_path)
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        check_scheduling_values(self.scheduling_policy, self.sjf_length_factor, self.sjf_aging_s)
        if self.dtype != "auto":
            parse_dtype(self.dtype)  # ValueError naming the choices
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1) or self.block_size > 128:
            raise ValueError(f"block_size must be a power of two in 1..128, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.swap_space_gb < 0:
            raise ValueError(f"swap_space_gb must be >= 0, got {self.swap_space_gb}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self._check_tp()
        self._check_kv_offload()

    def _check_kv_offload(self) -> None:
        if self.kv_offload not in KV_OFFLOAD_CHOICES:
            raise ValueError(f"kv_offload (--kv-offload) must be one of {', '.join(KV_OFFLOAD_CHOICES)}, "
                             f"got {self.kv_offload!r}")
        if isinstance(self.kv_offload_gb, bool) or not isinstance(self.kv_offload_gb, (int, float)) \
                or not self.kv_offload_gb > 0:
            raise ValueError(f"kv_offload_gb (--kv-offload-gb) must be > 0, got {self.kv_offload_gb!r}")
        if self.kv_offload_dir is not None and self.kv_offload != "disk":
            raise ValueError(f"kv_offload_dir (--kv-offload-dir) applies to --kv-offload disk only, "
                             f"not {self.kv_offload!r}")
        if self.kv_offload == "none":
            return
        if self.tensor_parallel_size != 1:
            raise ValueError(f"--kv-offload needs --tensor-parallel-size 1, got {self.tensor_parallel_size}")
        if not self.enable_prefix_caching:
            raise ValueError("--kv-offload needs prefix caching (it finds blocks by their prefix keys): "
                             "drop --no-enable-prefix-caching")
        if self.kv_offload_dir is not None:
            path = Path(self.kv_offload_dir)
            if path.exists() and not path.is_dir():
                raise ValueError(f"kv_offload_dir (--kv-offload-dir) {str(path)!r} is not a directory")

    def _check_tp(self) -> None:
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.tp_timeout_s <= 0 or self.tp_startup_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s and tp_startup_timeout_s must be > 0, got {self.tp_timeout_s} and "
                             f"{self.tp_startup_timeout_s}")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda:") and self.device != "cuda:0":
            raise ValueError(f"with tensor_parallel_size > 1 rank r runs on cuda:r: use device 'cuda', not {self.device!r}")
        spec = self.speculative_config
        if self.tensor_parallel_size > 1 and spec is not None and spec.method != "ngram":
            raise ValueError("speculative_config: a draft model does not run with tensor_parallel_size > 1 "
                             "(the ngram method does)")

    @property
    def use_cuda_graphs(self) -> bool:
        """CUDA graphs for decode steps: CUDA, not enforce_eager, and no tensor parallelism (a TP
        node runs eager: its collectives are not captured)."""
        return self.device.startswith("cuda") and not self.enforce_eager and self.tensor_parallel_size == 1

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.device.startswith("cuda") or cpu_has_native_bf16() else torch.float32
        return parse_dtype(self.dtype)


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (and several times faster than fp32)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags
