"""Model implementations over the flattened batch. One family for now: Llama (Mistral, Qwen2)."""

from pdserve.engine.models.llama import LlamaForCausalLM

__all__ = ["LlamaForCausalLM"]
