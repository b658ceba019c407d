"""`pdserve`: the one command line. Every subcommand takes --help.

    pdserve serve      the local stack in one command: a router plus prefill and decode node
                       processes, supervised (cli/serve.py)
    pdserve router     the OpenAI-compatible HTTP API and the control socket nodes register on
                       (router/cli.py)
    pdserve prefill    a node serving prefill first, changing role on a router's SetRole; `--role both`
                       prefills and decodes, colocated (cli/node.py)
    pdserve decode     a node serving decode first, changing role on a router's SetRole (cli/node.py)
    pdserve chat       offline chat, no server: messages from the command line, piped stdin or a
                       terminal (cli/offline.py)
    pdserve generate   offline completion of prompts given on the command line (cli/offline.py)
    pdserve bench      load tests against any OpenAI-compatible server (bench/cli.py)
    pdserve keys       create the CURVE keys for --zmq-curve-keys (protocol/curve.py)

Only chat and generate are parsed here. The other six load their own module and hand it the rest
of the command line, so `pdserve --help` and `pdserve keys` never import torch. The engine flags
every engine-running command shares are the engine's (`pdserve/engine/args.py`); this module keeps
the model-resolution messages.
"""

from __future__ import annotations

import argparse
import sys

# Each command's line in `pdserve --help`, in help order.
COMMANDS = {
    "serve": "router + prefill + decode node processes on this machine, supervised",
    "router": "the OpenAI-compatible HTTP API that nodes register with",
    "prefill": "a prefill node (switches role on SetRole; --role both: colocated)",
    "decode": "a decode node (switches role on SetRole)",
    "chat": "offline chat with a model: arguments, piped stdin (a message a line) or a terminal",
    "generate": "offline completion of the prompts given on the command line",
    "bench": "load tests against any OpenAI-compatible server (e.g. pdserve serve)",
    "keys": "create the CURVE keys for --zmq-curve-keys",
}
# The commands parsed by their own module's main(argv) ("module:function" names another function),
# imported only when asked for.
LAZY_COMMANDS = {
    "serve": "pdserve.cli.serve",
    "router": "pdserve.router.cli",
    "prefill": "pdserve.cli.node:main_prefill",
    "decode": "pdserve.cli.node:main_decode",
    "bench": "pdserve.bench.cli",
    "keys": "pdserve.protocol.curve",
}

def build_parser() -> argparse.ArgumentParser:
    """The command tree. The six lazy commands are listed here (add_help=False) but parsed by their
    own module: main() hands them the command line before this parser sees it."""
    from pdserve.cli.offline import add_chat_parser, add_generate_parser

    parser = argparse.ArgumentParser(
        prog="pdserve", description="disaggregated prefill/decode LLM serving",
        epilog="`pdserve COMMAND --help` shows a command's flags and their defaults.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_line in COMMANDS.items():
        if name == "chat":
            add_chat_parser(sub, help_line)
        elif name == "generate":
            add_generate_parser(sub, help_line)
        else:
            sub.add_parser(name, help=help_line, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] in LAZY_COMMANDS:
            import importlib

            module, _, function = LAZY_COMMANDS[argv[0]].partition(":")
            return getattr(importlib.import_module(module), function or "main")(argv[1:])
        args = build_parser().parse_args(argv)
        from pdserve.engine.parallel.errors import TPWorkerError

        try:
            return args.func(args)
        except ValueError as e:  # bad input (a model path, a prompt too long): a clear line, not a traceback
            print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
            return 2
        except TPWorkerError as e:  # a tensor-parallel rank that never came up or died
            print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
            return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
