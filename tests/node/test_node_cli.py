"""`pdserve prefill` / `pdserve decode` (cli/node.py): one parser with both roles' flags, so a node
can serve either; its KV socket is checked for exposure whatever the first role; `--role both`
only for `pdserve prefill`; the top-level command routes both to it."""

from __future__ import annotations

import logging

import pytest

from pdserve.cli.main import LAZY_COMMANDS
from pdserve.cli.node import build_parser
from pdserve.node.args import check_exposure
from pdserve.protocol.exposure import InsecureExposureError


def test_both_roles_flags_parse_for_either_command():
    flags = ["--router", "tcp://127.0.0.1:1", "--lease-s", "5", "--no-shm", "--kv-port", "9300",
             "--kv-pull-timeout", "7", "--role-change-timeout", "12"]
    for role in ("prefill", "decode"):
        args = build_parser(role).parse_args(flags)
        assert (args.role, args.lease_s, args.no_shm, args.kv_port, args.kv_pull_timeout, args.role_change_timeout) \
            == (role, 5.0, True, 9300, 7.0, 12.0)
    assert build_parser("prefill").parse_args(["--router", "x"]).role_change_timeout == 60.0
    assert build_parser("prefill").parse_args(["--router", "x", "--role", "both"]).role == "both"
    with pytest.raises(SystemExit):
        build_parser("decode").parse_args(["--router", "x", "--role", "both"])


def test_a_prefill_first_node_binds_a_kv_socket_and_is_checked_for_it():
    log = logging.getLogger("test")
    exposed = ["--router", "tcp://127.0.0.1:1", "--host", "0.0.0.0", "--kv-port", "9200"]
    for role in ("prefill", "decode"):
        with pytest.raises(InsecureExposureError, match="KV socket on tcp://0.0.0.0:9200"):
            check_exposure(build_parser(role).parse_args(exposed), log)
        check_exposure(build_parser(role).parse_args([*exposed, "--insecure"]), log)
        check_exposure(build_parser(role).parse_args(["--router", "tcp://127.0.0.1:1"]), log)
    check_exposure(build_parser("prefill").parse_args([*exposed, "--role", "both"]), log)  # colocated: none bound


def test_the_commands_go_through_the_role_changing_node():
    assert LAZY_COMMANDS["prefill"] == "pdserve.cli.node:main_prefill"
    assert LAZY_COMMANDS["decode"] == "pdserve.cli.node:main_decode"
