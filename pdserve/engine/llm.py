"""The offline API, shaped like vLLM's:

    llm = LLM("smollm2")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))

With `SamplingParams(n=k)` a prompt gets k outputs in `outs[i].outputs` (choice j at j), from one
prefill whose KV blocks the k sequences share. With `tensor_parallel_size=N` the model runs on N
ranks (this process and N - 1 workers); `llm.close()` (or `with LLM(...) as llm:`) stops them.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.engine.request import child_id
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduling_policy import (
    DEFAULT_SCHEDULING_POLICY,
    DEFAULT_SJF_AGING_S,
    DEFAULT_SJF_LENGTH_FACTOR,
)

logger = logging.getLogger(__name__)


class LLM:
    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        device: str = "cpu",
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 2.0,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        swap_space_gb: float = 0.0,
        num_threads: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        skip_tokenizer_init: bool = False,
        speculative_config: dict | str | None = None,  # vLLM's keys (engine/spec_decode/config.py)
        scheduling_policy: str = DEFAULT_SCHEDULING_POLICY,
        sjf_length_factor: float = DEFAULT_SJF_LENGTH_FACTOR,
        sjf_aging_s: float = DEFAULT_SJF_AGING_S,
        tensor_parallel_size: int = 1,
        tp_timeout_s: float = 60.0,
        tp_startup_timeout_s: float = 120.0,
        kv_offload: str = "none",  # none | host | disk: a tier below the KV pool (engine/kv_tier.py)
        kv_offload_gb: float = 4.0,
        kv_offload_dir: str | None = None,
    ) -> None:
        from pdserve.engine.loader import resolve_model  # file I/O and maybe a download: only in this factory

        model_path = resolve_model(model)
        config = EngineConfig(
            model_path=model_path, dtype=dtype, device=device, block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching, enable_chunked_prefill=enable_chunked_prefill,
            swap_space_gb=swap_space_gb, num_threads=num_threads, enforce_eager=enforce_eager, seed=seed,
            speculative_config=speculative_config,
            scheduling_policy=scheduling_policy, sjf_length_factor=sjf_length_factor, sjf_aging_s=sjf_aging_s,
            tensor_parallel_size=tensor_parallel_size, tp_timeout_s=tp_timeout_s,
            tp_startup_timeout_s=tp_startup_timeout_s, kv_offload=kv_offload, kv_offload_gb=kv_offload_gb,
            kv_offload_dir=kv_offload_dir,
        )
        self.tokenizer = _load_tokenizer(model_path) if not skip_tokenizer_init else None
        self.engine = LLMEngine(config, tokenizer=self.tokenizer)

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks and delete a disk KV tier's file (idempotent)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order, one
        per prompt, with its n choices in `.outputs`."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = self._per_prompt(params if params is not None else SamplingParams(), len(prompts), "params")
        priorities = self._per_prompt(priority if priority is not None else 0, len(prompts), "priority")
        token_lists = [self._encode(p) for p in prompts]
        ids = []
        try:
            for tokens, sp, prio in zip(token_lists, params_list, priorities):
                ids.append(self.engine.add_request(tokens, sp, priority=prio))
            results = self._run(ids, [sp.n for sp in params_list], use_tqdm if use_tqdm is not None else len(ids) > 1)
        except BaseException:
            for request_id in ids:  # never leave half a batch holding blocks
                self.engine.abort(request_id)
            raise
        for prompt, out in zip(prompts, results):
            out.prompt = prompt if isinstance(prompt, str) else None
        return results

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        """One chat turn through the tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        token_ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(token_ids, dict) or hasattr(token_ids, "input_ids"):  # transformers 5 returns an encoding
            token_ids = token_ids["input_ids"]
        return self.generate([list(token_ids)], params, use_tqdm=False)[0]

    def _run(self, ids: list[str], ns: list[int], show_progress: bool) -> list[RequestOutput]:
        """Step until every request is done; an n > 1 request is done when its n choices are."""
        choices = {rid: [child_id(rid, i) for i in range(n)] if n > 1 else [rid] for rid, n in zip(ids, ns)}
        pending = {c for cs in choices.values() for c in cs}
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(pending), desc="generate", disable=not show_progress, unit="seq") as bar:
            while pending:
                for out in self.engine.step():
                    if out.request_id in pending:
                        pending.discard(out.request_id)
                        done[out.request_id] = out
                        bar.update(1)
        return [_merge(rid, [done[c] for c in cs]) if len(cs) > 1 else done[rid] for rid, cs in choices.items()]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise ValueError("a prompt must be a string or a list of token ids (ints)")
        return list(prompt)

    @staticmethod
    def _per_prompt(value, n: int, name: str) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise ValueError(f"{name}: got {len(value)} values for {n} prompts")
            return list(value)
        return [value] * n


def _merge(request_id: str, choices: list[RequestOutput]) -> RequestOutput:
    """One output for an n > 1 request from its choices' (in index order)."""
    first = choices[0]
    outputs = [dataclasses.replace(c.outputs[0], index=i) for i, c in enumerate(choices)]
    return dataclasses.replace(first, request_id=request_id, outputs=outputs,
                               metrics={"num_preemptions": sum(c.metrics.get("num_preemptions", 0) for c in choices)})


def _load_tokenizer(model_path):
    """The model folder's tokenizer, or None when it has none (tiny test models: token-id prompts)."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((model_path / n).exists() for n in names):
        logger.warning("%s has no tokenizer: prompts must be token ids and outputs carry no text", model_path)
        return None
    return AutoTokenizer.from_pretrained(model_path)
