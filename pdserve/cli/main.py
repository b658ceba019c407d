"""`pdserve` command line. Subcommands grow with the project:

    pdserve chat      offline chat with a model (the default model unless --model)
    pdserve generate  offline completion of prompts given on the command line
    pdserve router | prefill | decode | serve | bench | keys   (each loads its own module)
"""

from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_BATCHED_TOKENS = 2048
# A CPU's GEMMs run within ~5% of full speed at 512 tokens, so a prefill node that takes 512 prompt
# tokens per step hands each first token (and its KV) to the decode node several times sooner than
# one that prefills a burst of prompts in one step (benchmarks/RESULTS.md: TTFT p50 7.3 s -> 1.7 s).
CPU_PREFILL_BATCHED_TOKENS = 512


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, named as vLLM names them."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="smollm2", help="local HF folder, .gguf file, or 'smollm2' (default)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-gb", type=float, default=2.0, help="CPU KV pool size")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="CUDA: share of the device to use")
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help=f"tokens per engine step (default {DEFAULT_BATCHED_TOKENS}; "
                        f"{CPU_PREFILL_BATCHED_TOKENS} on a CPU prefill node)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--swap-space-gb", type=float, default=0.0)
    g.add_argument("--num-threads", type=int, default=None, help="torch threads for this process")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: run decode without CUDA graphs")
    g.add_argument("--seed", type=int, default=0)


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """Flags every serving node takes, whatever its role."""
    parser.add_argument("--router", required=True, help="the router's control address, e.g. tcp://127.0.0.1:5555")
    parser.add_argument("--node-id", default=None, help="default: ROLE-<random>")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1", help="interface for this node's endpoints (KV, status)")
    parser.add_argument("--status-port", type=int, default=0, help="GET /status (0 = a free port)")
    parser.add_argument("--advertise-host", default=None,
                        help="host peers use to reach this node (default: --host; with --host 0.0.0.0, this machine's IP)")
    parser.add_argument("--max-queue-len", type=int, default=1024,
                        help="requests waiting on this node before new ones are refused (the router retries them)")
    parser.add_argument("--drain-timeout", type=float, default=20.0,
                        help="on SIGTERM, seconds to finish held requests before leaving (the router re-dispatches the rest)")
    parser.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                        help="authenticate and encrypt ZMQ traffic with the CURVE keys in DIR (`pdserve keys DIR`)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--step-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow device
    add_engine_args(parser)


def engine_kwargs(args: argparse.Namespace) -> dict:
    names = ("dtype", "device", "block_size", "num_kv_blocks", "kv_cache_memory_gb", "gpu_memory_utilization",
             "max_num_seqs",
             "max_num_batched_tokens", "max_model_len", "enable_prefix_caching", "enable_chunked_prefill",
             "swap_space_gb", "num_threads", "enforce_eager", "seed")
    kwargs = {n: getattr(args, n) for n in names}
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


def served_name(args: argparse.Namespace) -> str:
    """The name clients use for the model: --served-model-name, else the alias or folder name."""
    from pathlib import Path

    return getattr(args, "served_model_name", None) or Path(str(args.model).rstrip("/")).name.removesuffix(".gguf")


def load_curve_keys(args: argparse.Namespace):
    """The CURVE keys named by --zmq-curve-keys (None without the flag)."""
    if not getattr(args, "zmq_curve_keys", None):
        return None
    from pdserve.kvtransfer.curve import CurveKeys

    return CurveKeys.load(args.zmq_curve_keys)


def install_stop_handlers() -> list[bool]:
    """SIGTERM/SIGINT set a flag the node loop reads (sockets are touched only from the loop)."""
    import signal

    flag = [False]

    def on_signal(signum, frame) -> None:
        flag[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return flag


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)


def cmd_chat(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    messages: list[dict] = []
    prompts = args.prompt or []
    interactive = not prompts and sys.stdin.isatty()
    if not prompts and not interactive:
        prompts = ["What is the capital of France? Answer in one sentence."]
    while True:
        if prompts:
            text = prompts.pop(0)
            print(f"user> {text}")
        elif interactive:
            try:
                text = input("user> ").strip()
            except EOFError:
                return 0
            if not text or text in ("exit", "quit"):
                return 0
        else:
            return 0
        messages.append({"role": "user", "content": text})
        out = llm.chat(messages, params)
        print(f"assistant> {out.text.strip()}\n", flush=True)
        messages.append({"role": "assistant", "content": out.text})


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    for out in llm.generate(args.prompt, params):
        print(f"{out.prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="disaggregated prefill/decode LLM serving",
        epilog="serving: pdserve serve | router | prefill | decode (each takes --help)")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="offline chat with a model")
    chat.add_argument("prompt", nargs="*", help="messages to send (default: interactive, or one demo question)")
    add_engine_args(chat)
    add_sampling_args(chat)
    chat.set_defaults(func=cmd_chat)
    gen = sub.add_parser("generate", help="offline completion of prompts")
    gen.add_argument("prompt", nargs="+")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    return parser


# Serving commands live with their role; they load only when asked for.
_ROLE_COMMANDS = {
    "router": "pdserve.router.__main__",
    "prefill": "pdserve.prefill.__main__",
    "decode": "pdserve.decode.__main__",
    "serve": "pdserve.cli.serve",
    "bench": "pdserve.bench.cli",
    "keys": "pdserve.kvtransfer.curve",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _ROLE_COMMANDS:
        import importlib

        return importlib.import_module(_ROLE_COMMANDS[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # bad input: a clear message, not a traceback
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
