"""The engine's flags, named as vLLM names them (vLLM's EngineArgs), and the engine they build.

Every engine-running command takes them: `pdserve prefill`/`decode`/`chat`/`generate` parse them,
`pdserve serve` hands the ones that differ from their default to every node (`engine_argv`).
"""

from __future__ import annotations

import argparse

from pdserve.engine.scheduling_args import SCHEDULING_ARG_NAMES, add_scheduling_args

DEFAULT_BATCHED_TOKENS = 2048
# A CPU's GEMMs run near full speed at 512 tokens, so a prefill node that takes 512 prompt tokens
# per step hands each first token (and its KV) to the decode node sooner than one that prefills a
# burst of prompts in one step.
CPU_PREFILL_BATCHED_TOKENS = 512

ENGINE_ARG_NAMES = ("dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_gb", "gpu_memory_utilization",
                    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "enable_prefix_caching",
                    "enable_chunked_prefill", "swap_space_gb", "num_threads", "enforce_eager", "seed",
                    *SCHEDULING_ARG_NAMES, "speculative_config", "tensor_parallel_size", "tp_timeout_s",
                    "tp_startup_timeout_s", "kv_offload", "kv_offload_gb", "kv_offload_dir")


def add_engine_args(parser: argparse.ArgumentParser, title: str = "engine") -> None:
    """Engine flags, named as vLLM names them. Each help states its default, whatever the formatter."""
    g = parser.add_argument_group(title)
    g.add_argument("--model", default="smollm2",
                   help="local HF folder, .gguf file, or 'smollm2' (fetched and converted once) (default: %(default)s)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV dtype; auto = bfloat16 on CUDA or a CPU with native bf16, else float32 "
                        "(default: %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks in the pool (default: sized from --kv-cache-memory-gb, or on CUDA from "
                        "--gpu-memory-utilization)")
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="CPU KV pool size (default: %(default)s)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: share of the device to use, KV included (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per engine step (default: {DEFAULT_BATCHED_TOKENS}; "
                        f"{CPU_PREFILL_BATCHED_TOKENS} on a CPU prefill node)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings, capped by the pool)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of equal prompt prefixes (default: %(default)s)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over several steps (default: %(default)s)")
    g.add_argument("--swap-space-gb", type=float, default=0.0,
                   help="host memory for swapped-out requests; 0 = preempt by recompute (default: %(default)s)")
    g.add_argument("--kv-offload", default="none", choices=["none", "host", "disk"],
                   help="a tier below the KV pool: evicted prefix-cache blocks go there and come back on a hit "
                        "(verified by digest) instead of being recomputed; host = host memory (pinned on CUDA), "
                        "disk = a memory-mapped file (default: %(default)s)")
    g.add_argument("--kv-offload-gb", type=float, default=4.0,
                   help="size cap of the --kv-offload tier, GiB (default: %(default)s)")
    g.add_argument("--kv-offload-dir", default=None,
                   help="--kv-offload disk: directory of the tier's file, in a fresh subdirectory deleted when "
                        "the engine closes (default: the system's temp dir)")
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for this process, per rank with --tensor-parallel-size (default: torch's "
                        "choice; with tensor parallelism on the CPU, the CPUs divided among the ranks)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run decode without CUDA graphs (default: off)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler's draws (default: %(default)s)")
    add_scheduling_args(g)
    g.add_argument("--speculative-config", type=speculative_config_arg, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 3}\' or \'{"model": DRAFT_PATH, "num_speculative_tokens": 4}\' '
                        "(default: off)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks that split the model (Megatron), one process each: heads, MLP rows and vocab "
                        "(default: %(default)s)")
    g.add_argument("--tp-timeout-s", type=float, default=60.0,
                   help="tensor parallelism: seconds a collective may take before the node fails "
                        "(default: %(default)s)")
    g.add_argument("--tp-startup-timeout-s", type=float, default=120.0,
                   help="tensor parallelism: seconds each start-up phase of the worker ranks may take "
                        "(default: %(default)s)")


def speculative_config_arg(text: str) -> str:
    """argparse type of --speculative-config: the JSON text, once it parses into a valid config."""
    from pdserve.engine.spec_decode.config import SpeculativeConfig

    try:
        SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def engine_argv(args: argparse.Namespace, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> list[str]:
    """The engine flags whose value in `args` differs from `parser`'s default, as a command line
    (what `pdserve serve` hands every node)."""
    argv: list[str] = []
    for name in ENGINE_ARG_NAMES:
        value = getattr(args, name)
        if name in skip or value == parser.get_default(name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):  # store_true flags differ from their default only when set
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {n: getattr(args, n) for n in ENGINE_ARG_NAMES}
    if kwargs["max_num_batched_tokens"] is None:
        # Without chunked prefill a step must hold a whole prompt: keep the larger default then.
        small = getattr(args, "role", None) == "prefill" and args.device == "cpu" and args.enable_chunked_prefill
        kwargs["max_num_batched_tokens"] = CPU_PREFILL_BATCHED_TOKENS if small else DEFAULT_BATCHED_TOKENS
    return kwargs


def build_engine(args: argparse.Namespace, kv_allocator=None):
    """An LLMEngine (no tokenizer: nodes exchange token ids) from the engine flags."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loader import resolve_model

    config = EngineConfig(model_path=resolve_model(args.model), **engine_kwargs(args))
    return LLMEngine(config, kv_allocator=kv_allocator)
