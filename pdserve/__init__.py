"""pdserve: disaggregated prefill/decode LLM serving. `from pdserve import LLM, SamplingParams`
is the offline API; the packages below are the serving system (docs/ARCHITECTURE.md)."""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so `pdserve --help` and the pure-Python parts load without torch.
    if name in __all__:
        from pdserve import engine

        return getattr(engine, name)
    raise AttributeError(name)
