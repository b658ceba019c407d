"""`--scheduling-policy`, `--sjf-length-factor`, `--sjf-aging-s` on every engine-running command:
bad values end the command at once with one error line naming the flag; `pdserve serve` hands the
values it was given to every node."""

from __future__ import annotations

import time

import pytest

from pdserve.cli.serve import build_parser, plan
from tests.cli.helpers import run_pdserve

BAD_VALUES = [
    ("--scheduling-policy", "shortest", "argument --scheduling-policy: invalid choice: 'shortest'"),
    ("--sjf-length-factor", "0", "argument --sjf-length-factor: must be a finite number > 0, got '0'"),
    ("--sjf-length-factor", "inf", "argument --sjf-length-factor: must be a finite number > 0, got 'inf'"),
    ("--sjf-aging-s", "-1", "argument --sjf-aging-s: must be > 0 seconds (inf: no aging), got '-1'"),
    ("--sjf-aging-s", "soon", "argument --sjf-aging-s: not a number: 'soon'"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("flag", "value", "message"), BAD_VALUES)
def test_serve_refuses_a_bad_value_with_one_line(flag, value, message):
    started = time.monotonic()
    result = run_pdserve("serve", flag, value, "--model", "/nonexistent", timeout=20)
    assert result.returncode == 2 and time.monotonic() - started < 15
    usage, error = result.stderr.splitlines()  # argparse's choices read "(choose from ...)" after the message
    assert usage == "usage: pdserve serve [options]" and error.startswith(f"pdserve serve: error: {message}")
    # Given to one role only, the role's own parser refuses it, in exactly one line.
    result = run_pdserve("serve", "--decode-args", f"{flag} {value}", "--model", "/nonexistent", timeout=20)
    [line] = result.stderr.splitlines()
    assert result.returncode == 2 and line.startswith("pdserve serve: error: --decode-args ") and message in line


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", [["generate", "hi"], ["chat", "hi"], ["prefill", "--router", "tcp://127.0.0.1:1"],
                                     ["decode", "--router", "tcp://127.0.0.1:1"]])
def test_every_engine_command_refuses_a_bad_value_naming_the_flag(command):
    flag, value, message = BAD_VALUES[3]
    result = run_pdserve(*command, flag, value, "--model", "/nonexistent", timeout=20)
    assert result.returncode == 2
    *usage, error = result.stderr.splitlines()  # argparse's usage lines come before the one error line
    assert error == f"pdserve {command[0]}: error: {message}" and not any("error" in line for line in usage)


def test_serve_forwards_the_scheduling_flags_to_every_node():
    from pdserve.cli.node import build_parser as node_parser

    parser = build_parser()
    args = parser.parse_args(["--model", "m", "--scheduling-policy", "sjf", "--sjf-length-factor", "2.5",
                              "--sjf-aging-s", "inf"])
    commands = dict(plan(args, parser, "abc"))
    for name, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        cmd = commands[name]  # python -m pdserve.cli.main ROLE FLAGS...: the role-changing node (cli/node.py)
        assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["pdserve.cli.main", role]
        node = node_parser(role).parse_args(cmd[cmd.index("-m") + 3:])
        assert (node.scheduling_policy, node.sjf_length_factor, node.sjf_aging_s) == ("sjf", 2.5, float("inf"))
    default = parser.parse_args(["--model", "m"])
    assert not any("--sjf" in a or "--scheduling" in a for a in dict(plan(default, parser, "x"))["decode-0"])
