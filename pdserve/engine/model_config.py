"""The model's shape, read from a Hugging Face config (transformers 4.x and 5.x spellings)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # {"rope_type": "linear"|"llama3", ...} or {}
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    torch_dtype: str = "float32"  # the checkpoint's dtype

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; pdserve runs {SUPPORTED_ARCHITECTURES}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        rope_type = self.rope_scaling.get("rope_type", "default")
        if rope_type not in ("default", "linear", "llama3"):
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        cfg = json.loads((model_dir / "config.json").read_text())
        gen_path = model_dir / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.exists() else {}
        return cls.from_dicts(cfg, gen)

    @classmethod
    def from_dicts(cls, cfg: dict, generation_config: dict | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or [_ARCH_BY_TYPE.get(cfg.get("model_type"), "?")]
        num_heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        eos = (generation_config or {}).get("eos_token_id", cfg.get("eos_token_id"))
        eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        arch = archs[0]
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch != "Qwen2ForCausalLM") else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rope_theta=float(rope_theta),
            rope_scaling=rope if rope.get("rope_type", "default") != "default" else {},
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            sliding_window=sliding,
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @property
    def kv_elements_per_token(self) -> int:
        """K and V elements for one token across all layers (times the dtype size gives bytes)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


_ARCH_BY_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
