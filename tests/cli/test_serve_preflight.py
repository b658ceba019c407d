"""`pdserve serve` refuses bad flags and a busy port before it starts anything, hands every node
exactly the engine flags the user set, and trusts only its own router's /health."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve.cli.serve import build_parser, free_port, is_our_router_healthy, plan
from tests.cli.helpers import run_pdserve


@pytest.mark.timeout(30)
def test_unknown_flag_exits_2_at_once_naming_it():
    started = time.monotonic()
    result = run_pdserve("serve", "--bogus", "--model", "/nonexistent", timeout=20)
    assert result.returncode == 2
    assert time.monotonic() - started < 15
    assert result.stderr.splitlines() == ["usage: pdserve serve [options]",
                                          "pdserve serve: error: unrecognized arguments: --bogus"]
    assert result.stdout == ""


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--decode-args", "--bogus", "--bogus"),
    ("--prefill-args", "--max-num-seqs many", "invalid int value: 'many'"),
    ("--router-args", "--no-such-router-flag 1", "--no-such-router-flag"),
    ("--router-args", "--max-lag -1", "--max-lag"),
    ("--decode-args=", "--bogus", "--bogus"),
])
def test_bad_role_args_exit_2_at_once_with_one_line(flag, value, named):
    argv = [flag + value] if flag.endswith("=") else [flag, value]
    result = run_pdserve("serve", *argv, "--model", "/nonexistent", timeout=20)
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"pdserve serve: error: {flag.rstrip('=')} ") and named in line
    assert result.stdout == ""


@pytest.mark.timeout(40)
def test_busy_port_fails_at_once_with_one_clear_line(tiny_llama):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        started = time.monotonic()
        result = run_pdserve("serve", "--port", str(port), "--model", str(tiny_llama), timeout=30)
    assert result.returncode != 0
    assert time.monotonic() - started < 15
    assert result.stderr.splitlines() == [
        f"pdserve serve: error: port {port} on 127.0.0.1 is already in use (pass --port to pick another)"]
    assert "pdserve is ready" not in result.stdout + result.stderr


def _node_argv(argv: list[str]) -> list[str]:
    skip = 3 if argv[argv.index("-m") + 1] == "pdserve.cli.main" else 2  # `python -m module [command]`
    return argv[argv.index("-m") + skip:]


def test_plan_forwards_exactly_the_engine_flags_set_and_the_instance_id():
    from pdserve.decode_node.__main__ import build_parser as decode_parser
    from pdserve.prefill_node.__main__ import build_parser as prefill_parser

    parser = build_parser()
    args = parser.parse_args(["--model", "some/dir", "--max-num-seqs", "64", "--no-enable-prefix-caching",
                              "--enforce-eager", "--num-threads", "3", "--decode-args", "--kv-pull-timeout 5"])
    commands = dict(plan(args, parser, "abc123"))
    router = _node_argv(commands["router"])
    assert router[router.index("--instance-id") + 1] == "abc123"
    for name, make_parser in (("prefill-0", prefill_parser), ("decode-0", decode_parser)):
        argv = _node_argv(commands[name])
        assert "--block-size" not in argv and "--dtype" not in argv  # left at their defaults: not forwarded
        node = make_parser().parse_args(argv)
        assert (node.model, node.max_num_seqs, node.enable_prefix_caching, node.enforce_eager, node.num_threads) == (
            "some/dir", 64, False, True, 3)
        assert node.max_num_batched_tokens is None  # the node picks its role's default
    assert decode_parser().parse_args(_node_argv(commands["decode-0"])).kv_pull_timeout == 5


def test_plan_passes_router_args_such_as_max_lag_to_the_router():
    from pdserve.router.cli import build_parser as router_parser

    parser = build_parser()
    for extra, max_lag in (([], 0.1), (["--router-args", "--max-lag 0"], 0.0)):
        commands = dict(plan(parser.parse_args(["--model", "some/dir", *extra]), parser, "abc123"))
        assert router_parser().parse_args(_node_argv(commands["router"])).max_lag == max_lag


def test_plan_gives_node_i_the_ith_role_args_and_splits_threads_over_every_rank(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 12)
    parser = build_parser()
    args = parser.parse_args(["--model", "some/dir", "--num-prefill", "3", "--num-decode", "2",
                              "--prefill-args", "--tensor-parallel-size 2", "--prefill-args", "--max-num-seqs 8",
                              "--decode-args=--tensor-parallel-size=4"])
    commands = {name: _node_argv(argv) for name, argv in plan(args, parser, "abc123")}
    assert commands["prefill-0"][-2:] == ["--tensor-parallel-size", "2"]
    assert commands["prefill-1"][-2:] == ["--max-num-seqs", "8"]
    assert commands["prefill-2"][-2:] == ["--max-num-seqs", "8"]  # past the list: the last one
    assert commands["decode-0"][-1] == commands["decode-1"][-1] == "--tensor-parallel-size=4"
    # 2 + 1 + 1 prefill ranks and 4 + 4 decode ranks share the 12 cores: one thread per rank.
    for name in ("prefill-0", "prefill-1", "decode-1"):
        argv = commands[name]
        assert argv[argv.index("--num-threads") + 1] == "1"


class _Health(BaseHTTPRequestHandler):
    answer: tuple[int, dict] = (200, {})

    def do_GET(self):
        status, body = self.answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.mark.timeout(30)
def test_ready_only_when_our_router_answers_200():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    try:
        for status, body, ready in [(200, {"status": "ok"}, False),  # some other server on the port
                                    (200, {"status": "ok", "instance_id": "other"}, False),
                                    (503, {"instance_id": "ours"}, False),
                                    (200, {"status": "ok", "instance_id": "ours"}, True)]:
            _Health.answer = (status, body)
            assert is_our_router_healthy(url, "ours") is ready, (status, body)
    finally:
        server.shutdown()
        server.server_close()
    assert not is_our_router_healthy(f"http://127.0.0.1:{free_port()}/health", "ours")  # nothing listening


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv", [
    ["--speculative-config", '{"model": "/no/such/path", "num_speculative_tokens": 4}'],
    ["--decode-args", '--speculative-config \'{"model": "/no/such/path", "num_speculative_tokens": 4}\''],
])
def test_missing_draft_model_exits_2_at_once_with_one_line(argv):
    started = time.monotonic()
    result = run_pdserve("serve", *argv, "--model", "/nonexistent", timeout=20)
    assert result.returncode == 2
    assert time.monotonic() - started < 15
    [line] = result.stderr.splitlines()
    assert line.startswith("pdserve serve: error: ") and line.endswith(
        "--speculative-config: draft model '/no/such/path' is not a local model directory, a .gguf file or the "
        "alias 'smollm2'")
    assert result.stdout == ""


def test_draft_model_check(tmp_path, tiny_llama):
    from pdserve.cli.preflight import check_draft_model

    assert check_draft_model(None) is None
    assert check_draft_model('{"method": "ngram", "num_speculative_tokens": 4}') is None
    assert check_draft_model(json.dumps({"model": str(tiny_llama), "num_speculative_tokens": 2})) is None
    error = check_draft_model(json.dumps({"model": str(tmp_path), "num_speculative_tokens": 2}))
    assert error == f"--speculative-config: draft model directory '{tmp_path}' is missing config.json and " \
                    "*.safetensors weights"
