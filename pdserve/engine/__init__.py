"""pdserve's engine: what both node roles share, and the offline `LLM` API."""

from pdserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # torch and transformers load only when the engine itself is used, so the pure-Python parts
    # (scheduler, block manager, sampling params) stay importable and fast to test.
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name in ("LLMEngine", "RequestOutput"):
        from pdserve.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(name)
