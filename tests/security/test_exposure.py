"""Secure by default beyond loopback (pdserve.protocol.exposure): a ZMQ socket other machines
can reach is refused at start without CURVE keys, in one line and before the model loads; with
--insecure the process starts and says what that exposes; loopback-only and keyed stacks start
with no warning."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from pdserve.cli.serve import free_port
from pdserve.protocol.curve import generate_keys
from pdserve.protocol.exposure import (
    InsecureExposureError,
    check_exposed,
    check_or_warn,
    check_sockets,
    is_local,
    is_local_host,
    node_sockets,
    warn_insecure,
)

ROOT = Path(__file__).resolve().parents[2]
REFUSAL_S = 20  # generous on a loaded 2-core machine; the refusal itself takes about a second
WARNING_MARK = "--insecure: no CURVE authentication"

LOCAL_HOSTS = ["127.0.0.1", "127.8.9.10", "localhost", "[::1]", "::1"]
EXPOSED_HOSTS = ["0.0.0.0", "*", "::", "10.1.2.3", "router"]


# ---- the rule ------------------------------------------------------------------------------------
@pytest.mark.parametrize("host", LOCAL_HOSTS)
def test_loopback_is_local(host):
    assert is_local_host(host)
    assert is_local(f"tcp://{host}:5555")


@pytest.mark.parametrize("host", EXPOSED_HOSTS)
def test_wildcards_other_addresses_and_names_are_exposed(host):
    assert not is_local_host(host)
    assert not is_local(f"tcp://{host}:5555")


@pytest.mark.parametrize("addr, local", [
    ("ipc://x", True), ("inproc://x", True), ("ipc:///tmp/pdserve.sock", True),
    ("tcp://LOCALHOST:0", True), ("tcp://[::1]:0", True),
    ("tcp://127.0.0.1;127.0.0.2:5555", True),  # source;destination: both loopback
    ("tcp://127.0.0.1;10.0.0.2:5555", False), ("tcp://eth0;127.0.0.1:5555", False),
    ("tcp://[::]:5555", False), ("tcp://:5555", False), ("udp://127.0.0.1:5555", False),
    ("ws://127.0.0.1:5555", False), ("router:5555", False), ("", False),
])
def test_is_local_endpoints(addr, local):
    assert is_local(addr) is local


def test_check_exposed_says_what_and_how_to_fix_in_one_line():
    with pytest.raises(InsecureExposureError) as e:
        check_exposed("tcp://0.0.0.0:5555", None, False, "control socket")
    msg = str(e.value)
    assert msg.startswith("refusing to bind the control socket on tcp://0.0.0.0:5555 without CURVE keys: ")
    assert "pdserve keys DIR" in msg and "--zmq-curve-keys DIR" in msg and "--insecure" in msg and "\n" not in msg
    assert isinstance(e.value, ValueError)
    with pytest.raises(InsecureExposureError, match="^refusing to connect to the router's control socket at "
                                                     "tcp://router:5555 without"):
        check_exposed("tcp://router:5555", None, False, "router's control socket", connect=True)
    with pytest.raises(InsecureExposureError, match="bind the KV socket on 0.0.0.0 "):
        check_exposed("0.0.0.0", None, False, "KV socket")  # a bare bind host
    for curve, insecure in ((object(), False), (None, True)):
        check_exposed("tcp://0.0.0.0:5555", curve, insecure, "control socket")
    check_exposed("tcp://127.0.0.1:5555", None, False, "control socket")
    check_exposed("localhost", None, False, "KV socket")


def test_warning_names_the_sockets_and_the_risk(caplog):
    logger = logging.getLogger("test.exposure")
    with caplog.at_level(logging.WARNING, logger="test.exposure"):
        warn_insecure(logger, [])
        assert not caplog.records
        warn_insecure(logger, ["the control socket bound on tcp://0.0.0.0:5555"])
    (record,) = caplog.records
    msg = record.getMessage()
    assert record.levelno == logging.WARNING and "tcp://0.0.0.0:5555" in msg
    for risk in ("register as a node", "prompts", "inject tokens", "trusted, isolated network", "pdserve keys"):
        assert risk in msg, risk


def test_check_or_warn_warns_only_for_insecure_exposed_sockets(caplog):
    logger = logging.getLogger("test.exposure")
    local = [("tcp://127.0.0.1:5555", "control socket", False)]
    exposed = [("tcp://0.0.0.0:5555", "control socket", False), ("tcp://router:5555", "router", True)]
    with caplog.at_level(logging.WARNING, logger="test.exposure"):
        check_or_warn(local, None, False, logger)
        check_or_warn(exposed, "/keys", False, logger)
        check_or_warn(exposed, "/keys", True, logger)  # keys: nothing is exposed in clear
        assert not caplog.records
        with pytest.raises(InsecureExposureError):
            check_or_warn(exposed, None, False, logger)
        check_or_warn(exposed, None, True, logger)
    (record,) = caplog.records
    assert "the control socket bound on tcp://0.0.0.0:5555 and the connection to the router at " \
           "tcp://router:5555" in record.getMessage()


def test_which_node_sockets_are_checked():
    from pdserve.decode_node.__main__ import build_parser as decode_parser
    from pdserve.prefill_node.__main__ import build_parser as prefill_parser

    decode = decode_parser().parse_args(["--router", "tcp://127.0.0.1:1", "--host", "0.0.0.0", "--kv-port", "9200"])
    assert [a for a, _, _ in node_sockets(decode)] == ["tcp://127.0.0.1:1", "tcp://0.0.0.0:9200"]
    with pytest.raises(InsecureExposureError, match="KV socket on tcp://0.0.0.0:9200"):
        check_sockets(node_sockets(decode), None, False)
    v6 = decode_parser().parse_args(["--router", "tcp://[::1]:1", "--host", "::1"])
    check_sockets(node_sockets(v6), None, False)  # tcp://[::1]:0
    # A prefill node binds no ZMQ socket (its status server is HTTP); KVSender checks its KV connections.
    for role in ("prefill", "both"):
        prefill = prefill_parser().parse_args(["--router", "tcp://127.0.0.1:1", "--host", "0.0.0.0", "--role", role])
        check_sockets(node_sockets(prefill), None, False)
    for parser in (decode_parser, prefill_parser):
        assert not parser().parse_args(["--router", "x"]).insecure
        assert parser().parse_args(["--router", "x", "--insecure"]).insecure


# ---- the commands --------------------------------------------------------------------------------
def env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def refused(module: str, *argv: str) -> str:
    """Run `python -m module argv...`; it must exit 2 quickly with one stderr line; returns it."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, env=env(), stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert time.monotonic() - start < REFUSAL_S
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "pdserve keys" in lines[0] and "--insecure" in lines[0] and "Traceback" not in result.stderr
    return lines[0]


class Started:
    """A process started in its own session, output to a file; killed (group) on close."""

    def __init__(self, module: str, argv: list[str], log: Path):
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, env=env(),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def output(self) -> str:
        return self.log.read_text()

    def wait_http(self, url: str, timeout_s: float = 60.0) -> int:
        """The first HTTP status `url` answers (503 counts: the process is up)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.output()[-3000:]}"
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    return r.status
            except urllib.error.HTTPError as e:
                return e.code
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"{url} never answered:\n{self.output()[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_router(tmp_path: Path, model: Path, control: str, *extra: str) -> tuple[Started, int]:
    port = free_port()
    router = Started("pdserve.router", ["--port", str(port), "--control-addr", control, "--model", str(model),
                                        *extra], tmp_path / "router.log")
    return router, port


@pytest.mark.timeout(60)
def test_router_refuses_an_exposed_control_socket_without_keys():
    port = free_port()
    line = refused("pdserve.router", "--port", str(free_port()), "--control-addr", f"tcp://0.0.0.0:{port}",
                   "--model", "/nonexistent")  # refused before the tokenizer would fail to load
    assert line.startswith(f"pdserve router: error: refusing to bind the control socket on tcp://0.0.0.0:{port} "
                           "without CURVE keys")


@pytest.mark.timeout(120)
def test_router_with_insecure_starts_and_warns(tmp_path, tiny_llama):
    router, port = start_router(tmp_path, tiny_llama, f"tcp://0.0.0.0:{free_port()}", "--insecure")
    try:
        assert router.wait_http(f"http://127.0.0.1:{port}/health") in (200, 503)
        out = router.output()
        assert f"WARNING pdserve.router.cli: {WARNING_MARK}" in out and "tcp://0.0.0.0:" in out
        assert "register as a node" in out
    finally:
        router.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setup", ["wildcard-with-keys", "loopback-without-keys"])
def test_router_with_keys_or_on_loopback_starts_without_warning(tmp_path, tiny_llama, setup):
    if setup == "wildcard-with-keys":
        control, extra = f"tcp://0.0.0.0:{free_port()}", ["--zmq-curve-keys", str(generate_keys(tmp_path / "keys"))]
    else:
        control, extra = f"tcp://127.0.0.1:{free_port()}", []
    router, port = start_router(tmp_path, tiny_llama, control, *extra)
    try:
        assert router.wait_http(f"http://127.0.0.1:{port}/health") in (200, 503)
        out = router.output()
        assert "--insecure" not in out and "WARNING" not in out, out
        assert f"control socket at {control}" in out
    finally:
        router.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("module", ["pdserve.decode_node", "pdserve.prefill_node"])
def test_node_refuses_an_exposed_router_address_without_keys(module):
    port = free_port()
    line = refused(module, "--router", f"tcp://0.0.0.0:{port}", "--model", "/nonexistent")
    role = module.split(".")[1].removesuffix("_node")  # the command is `pdserve decode` / `pdserve prefill`
    assert line.startswith(f"pdserve {role}: error: refusing to connect to the router's control socket at "
                           f"tcp://0.0.0.0:{port} without CURVE keys")
    refused(module, "--router", "tcp://router:5555", "--model", "/nonexistent")


@pytest.mark.timeout(60)
def test_decode_refuses_an_exposed_kv_socket_without_keys():
    line = refused("pdserve.decode_node", "--router", f"tcp://127.0.0.1:{free_port()}", "--host", "0.0.0.0",
                   "--kv-port", "9200", "--model", "/nonexistent")
    assert line.startswith("pdserve decode: error: refusing to bind the KV socket on tcp://0.0.0.0:9200 "
                           "without CURVE keys")


@pytest.mark.timeout(120)
def test_decode_with_insecure_starts_and_warns(tmp_path, tiny_llama):
    """Exposed router link and KV socket, --insecure: the node comes up (its status server answers
    while the model loads) and the warning names both sockets."""
    status = free_port()
    node = Started("pdserve.decode_node", ["--router", f"tcp://router-host:{free_port()}", "--host", "0.0.0.0",
                                      "--status-port", str(status), "--model", str(tiny_llama), "--dtype", "float32",
                                      "--num-kv-blocks", "16", "--insecure"], tmp_path / "decode.log")
    try:
        assert node.wait_http(f"http://127.0.0.1:{status}/health") in (200, 503)
        out = node.output()
        assert WARNING_MARK in out and "the connection to the router's control socket at tcp://router-host:" in out
        assert "the KV socket bound on tcp://0.0.0.0:0" in out
    finally:
        node.close()


@pytest.mark.timeout(60)
def test_serve_refuses_role_args_that_expose_a_socket():
    """`pdserve serve` keeps its sockets on loopback; role flags that expose one without keys are
    refused before anything starts (not in a restart loop)."""
    line = refused("pdserve.cli.main", "serve", "--model", "/nonexistent", "--port", str(free_port()),
                   "--decode-args", "--host 0.0.0.0")
    assert line.startswith("pdserve serve: error: --decode-args '--host 0.0.0.0': refusing to bind the KV socket")
    line = refused("pdserve.cli.main", "serve", "--model", "/nonexistent", "--port", str(free_port()),
                   "--router-args", "--control-addr tcp://0.0.0.0:0")
    assert "refusing to bind the control socket on tcp://0.0.0.0:0" in line


def test_serve_role_args_check_accepts_keys_and_insecure():
    from pdserve.cli.preflight import check_role_args as check_role_exposure

    decode = {"--decode-args": "--host 0.0.0.0"}
    assert "refusing to bind the KV socket" in check_role_exposure(decode, None)
    assert check_role_exposure(decode, "/keys") is None  # serve's own --zmq-curve-keys goes to every node
    assert check_role_exposure({"--decode-args": "--host 0.0.0.0 --insecure"}, None) is None
    assert check_role_exposure({"--prefill-args": "--host 0.0.0.0", "--decode-args": "", "--router-args": ""},
                               None) is None
    assert check_role_exposure({"--router-args": "--control-addr tcp://10.0.0.1:5555"}, None).startswith(
        "--router-args '--control-addr tcp://10.0.0.1:5555': refusing to bind the control socket")
