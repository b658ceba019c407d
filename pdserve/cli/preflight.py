"""What `pdserve serve` checks before it starts anything: the flags it hands each role parse with
that role's own parser and expose no socket without keys, a draft model in --speculative-config
exists, and the router's HTTP port is free (router/ports.py, shared with `pdserve router
--api-server-count`). Each check answers an error line (or None), so the command fails at once with
one clear line instead of a crash loop minutes later."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable


class _ParseError(Exception):
    pass


def _raise_instead_of_exit(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser`, made to raise _ParseError where argparse would print and exit (errors, --help)."""

    def error(message: str):
        raise _ParseError(message)

    def exit(status: int = 0, message: str | None = None):
        raise _ParseError(message or "asks for help; pass it to the role's own command")

    parser.error = error
    parser.exit = exit
    return parser


def _role_parsers() -> dict[str, tuple[str, Callable[[], argparse.ArgumentParser], list[str], Callable]]:
    """flag -> (the command it feeds, a parser factory, the required flags that parser needs, the
    ZMQ sockets the command opens, from its parsed flags)."""
    from pdserve.decode_node.__main__ import build_parser as decode_parser
    from pdserve.prefill_node.__main__ import build_parser as prefill_parser
    from pdserve.protocol.exposure import node_sockets, router_sockets
    from pdserve.router.cli import build_parser as router_parser

    node = ["--router", "tcp://127.0.0.1:1"]  # the one required node flag; serve's own is always loopback
    return {"--prefill-args": ("pdserve prefill", prefill_parser, node, node_sockets),
            "--decode-args": ("pdserve decode", decode_parser, node, node_sockets),
            "--router-args": ("pdserve router", router_parser, [], router_sockets)}


def check_role_args(values: dict[str, str], curve_keys: str | None = None) -> str | None:
    """An error line for the first of `values` ({"--decode-args": "--max-num-seqs 64", ...}) that
    its role's parser refuses, or that would expose one of the role's ZMQ sockets beyond loopback
    without CURVE keys (`curve_keys`, serve's own --zmq-curve-keys, or the role's) or --insecure:
    the process would exit at start, so the stack fails now instead of in a restart loop. Else None."""
    from pdserve.protocol.exposure import check_sockets

    parsers = _role_parsers()
    for flag, value in values.items():
        command, make_parser, required, sockets = parsers[flag]
        try:
            parsed = _raise_instead_of_exit(make_parser()).parse_args([*required, *shlex.split(value)])
            check_sockets(sockets(parsed), curve_keys or parsed.zmq_curve_keys, parsed.insecure)
        except ValueError as e:  # shlex: an unclosed quote; InsecureExposureError
            return f"{flag} {value!r}: {e}"
        except _ParseError as e:
            return f"{flag} {value!r}: {e} (see {command} --help)"
        error = check_draft_model(getattr(parsed, "speculative_config", None))
        if error:
            return f"{flag} {value!r}: {error}"
    return None


def parse_node_args(role: str, argv: list[str]) -> argparse.Namespace:
    """A node's flags (`role`: "prefill", "decode", or "both" for a colocated node, which runs
    `pdserve prefill`) parsed by that command's own parser. Call it on flags check_role_args passed."""
    _, make_parser, required, _ = _role_parsers()["--decode-args" if role == "decode" else "--prefill-args"]
    return make_parser().parse_args([*required, *argv])


def check_draft_model(speculative_config: str | None) -> str | None:
    """An error line if `speculative_config` (the JSON of --speculative-config, already valid)
    names a draft model that does not resolve (no such folder, not a model), else None: a decode
    node would fail on it only once it loads, after the stack started."""
    from pdserve.engine.loader import resolve_model
    from pdserve.engine.spec_decode.config import SpeculativeConfig

    spec = SpeculativeConfig.parse(speculative_config)
    if spec is None or spec.method != "draft_model":
        return None
    try:
        resolve_model(spec.model)
    except (ValueError, OSError) as e:
        first = str(e).split(". ")[0].rstrip(".")  # the loader's first sentence names the problem
        what = "draft m" + first[1:] if first.startswith("Model ") else f"draft model {spec.model!r}: {first}"
        return f"--speculative-config: {what}"
    return None
