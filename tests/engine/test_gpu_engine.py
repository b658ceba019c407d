"""The engine on a CUDA GPU with the Triton kernels. Skipped without a GPU; the CPU counterparts
are the parity tests (torch reference) and tests/kernels (Triton under the interpreter)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from tests.conftest import save_tiny_model
from tests.engine.test_generate_parity import hf_greedy, make_prompts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs in gpu_check.sh)")]


def test_triton_engine_equals_transformers_float32(tmp_path):
    model = save_tiny_model(tmp_path, "llama")
    prompts = make_prompts(vocab=256)
    want = hf_greedy(model, prompts)
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", max_num_batched_tokens=128, max_num_seqs=16)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))]
    assert got == want


def test_smollm2_shaped_bf16_mostly_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from benchmarks.make_random_model import make

    make("smollm2", str(tmp_path), "bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).cuda().eval()
    prompts = make_prompts(n=16, vocab=49152)
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=32,
                            pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", max_num_seqs=16)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))]
    same = sum(g == w for g, w in zip(got, want))
    print(f"bf16 SmolLM2-shaped: {same}/{len(prompts)} prompts match transformers for 32 greedy tokens")
    assert same >= len(prompts) // 2


@pytest.mark.parametrize("spec", ["ngram", "draft"])
def test_speculative_decoding_on_the_gpu_is_token_identical(tmp_path, spec):
    """Verification queries of k+1 tokens through the Triton kernels, between CUDA-graph decode
    steps (a step without drafts still replays a graph); a draft model's pool on the GPU."""
    from tests.engine.spec_helpers import copy_prompts

    save_tiny_model(tmp_path, "llama")
    prompts = copy_prompts(8, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    base = LLM(str(tmp_path), dtype="float32", device="cuda", max_num_seqs=16)
    want = [o.token_ids for o in base.generate(prompts, params)]
    del base
    config = ({"method": "ngram", "num_speculative_tokens": 3} if spec == "ngram"
              else {"model": str(tmp_path), "num_speculative_tokens": 3})
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", max_num_seqs=16, speculative_config=config)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    assert llm.engine.block_manager.num_used_blocks == 0
