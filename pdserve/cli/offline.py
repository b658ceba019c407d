"""`pdserve chat` and `pdserve generate`: the engine in this process, no server.

Where chat's messages come from, first match wins:

    MESSAGE arguments     each in turn, then exit
    a terminal on stdin   interactive: `user> ` prompts until an empty line, exit, quit or EOF
    piped stdin           one message a line (empty lines skipped), each answered as it arrives,
                          exit at EOF; empty input answers nothing
    neither (/dev/null)   one demo question
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
import sys
from collections.abc import Iterator

DEMO_QUESTION = "What is the capital of France? Answer in one sentence."


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most per answer (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest token set with this mass (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens; -1 = all (default: %(default)s)")


def _add_common_args(parser: argparse.ArgumentParser) -> None:
    from pdserve.engine.args import add_engine_args

    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING or ERROR (default: %(default)s)")
    add_engine_args(parser)
    add_sampling_args(parser)


def add_chat_parser(sub, help_line: str) -> None:
    chat = sub.add_parser("chat", help=help_line, description="Offline chat with a model, no server.")
    chat.add_argument("prompt", nargs="*", metavar="MESSAGE",
                      help="messages to send in turn; without them: piped stdin, one message a line (empty "
                           "input: no answer), else interactive on a terminal, else one demo question")
    _add_common_args(chat)
    chat.set_defaults(func=cmd_chat)


def add_generate_parser(sub, help_line: str) -> None:
    gen = sub.add_parser("generate", help=help_line, description="Offline completion of prompts, no server.")
    gen.add_argument("prompt", nargs="+", metavar="PROMPT", help="prompts to complete, as one batch (at least one)")
    _add_common_args(gen)
    gen.set_defaults(func=cmd_generate)


def stdin_is_piped() -> bool:
    """A pipe or a file on stdin (not a terminal, /dev/null or a closed stdin)."""
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (AttributeError, OSError, ValueError):
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISREG(mode) or stat.S_ISSOCK(mode)


def chat_messages(prompts: list[str]) -> Iterator[str]:
    """The user's messages, from wherever they come (see the module docstring)."""
    if prompts:
        yield from prompts
    elif sys.stdin is not None and sys.stdin.isatty():
        while True:
            try:
                text = input("user> ").strip()
            except EOFError:
                return
            if not text or text in ("exit", "quit"):
                return
            yield text
    elif stdin_is_piped():
        for line in sys.stdin:
            if line.strip():
                yield line.strip()
    else:
        yield DEMO_QUESTION


def _setup(args: argparse.Namespace, prog: str):
    from pdserve.cli.model import resolve_model_verbosely
    from pdserve.engine import LLM, SamplingParams
    from pdserve.engine.args import engine_kwargs

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    llm = LLM(str(resolve_model_verbosely(args.model, prog)), **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k)
    return llm, params


def cmd_chat(args: argparse.Namespace) -> int:
    llm, params = _setup(args, "pdserve chat")
    interactive = not args.prompt and sys.stdin is not None and sys.stdin.isatty()
    messages: list[dict] = []
    for text in chat_messages(args.prompt):
        if not interactive:  # a terminal shows what was typed already
            print(f"user> {text}")
        messages.append({"role": "user", "content": text})
        out = llm.chat(messages, params)
        print(f"assistant> {out.text.strip()}\n", flush=True)
        messages.append({"role": "assistant", "content": out.text})
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    llm, params = _setup(args, "pdserve generate")
    for out in llm.generate(args.prompt, params):
        print(f"{out.prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0

