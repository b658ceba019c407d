"""`pdserve --help` lists every command; each command's --help is its own, with every default."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.cli.main import COMMANDS, build_parser, main
from tests.cli.helpers import ROOT, run_pdserve

ALL_COMMANDS = ["serve", "router", "prefill", "decode", "chat", "generate", "bench", "keys"]


@pytest.mark.timeout(30)
def test_top_level_help_lists_every_command_on_one_line_without_importing_torch():
    code = ("import sys\nfrom pdserve.cli.main import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=20).stdout
    assert out.rstrip().endswith("no torch")
    lines = out.splitlines()
    for name in ALL_COMMANDS:
        entries = [line for line in lines if line.split()[:1] == [name]]
        assert len(entries) == 1, f"{name!r} should have one line in `pdserve --help`:\n{out}"
        assert len(entries[0].split()) > 2, f"{name!r} has no help text"
    assert list(COMMANDS) == ALL_COMMANDS


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ALL_COMMANDS)
def test_each_command_help_is_its_own(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: pdserve {name}")
    assert "--" in out.split("\n", 1)[1], "the full help lists the command's flags"


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _serve_parser() -> argparse.ArgumentParser:
    from pdserve.cli.serve import build_parser as serve_parser

    return serve_parser()


@pytest.mark.parametrize("make_parser", [lambda: _subparser("chat"), lambda: _subparser("generate"), _serve_parser],
                         ids=["chat", "generate", "serve"])
def test_every_flag_has_help_stating_its_default(make_parser):
    parser = make_parser()
    flags = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert flags
    missing = [a.option_strings[0] for a in flags if not a.help or "default" not in a.help]
    assert not missing, f"flags without help or default: {missing}"
    text = parser.format_help()
    assert "(default: None)" not in text and "%(default)" not in text


@pytest.mark.timeout(30)
def test_serve_help_shows_defaults_and_the_engine_flags_it_forwards():
    result = run_pdserve("serve", "--help", timeout=20)
    assert result.returncode == 0
    out = result.stdout
    assert "(default:" in out
    assert "forwarded to every node" in out
    for flag in ("--max-num-seqs", "--block-size", "--max-num-batched-tokens", "--enable-prefix-caching",
                 "--kv-cache-memory-gb", "--dtype", "--device", "--seed"):
        assert flag in out, flag


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", ["router", "prefill", "decode"])
def test_insecure_flag_says_what_it_allows_and_when(name, capsys):
    with pytest.raises(SystemExit):
        main([name, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "--insecure" in out
    for words in ("without CURVE keys", "register as a node", "trusted, isolated network", "warning", "default: off"):
        assert words in out, words
