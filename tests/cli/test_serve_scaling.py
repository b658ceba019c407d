"""`pdserve serve --planner`: the router gets the planner flags, and the stack starts and stops node
processes to match GET /planner's `desired` (cli/serve.py NodeScaler), against fake node starts
and a fake router HTTP server, no model."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time

import pytest

from pdserve.cli import serve
from pdserve.cli.serve import NodeScaler, build_parser, fetch_desired, main, plan
from pdserve.router.cli import build_parser as router_parser

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


# ---- flags ----------------------------------------------------------------------------------------
def router_args(commands):
    argv = commands["router"]
    return router_parser().parse_args(argv[argv.index("-m") + 2:])


def test_planner_flags_reach_the_router():
    parser = build_parser()
    args = parser.parse_args(["--model", "some/dir", "--planner", "--num-decode", "2", "--slo-ttft-ms", "500",
                              "--slo-tpot-ms", "40.5", "--max-nodes", "6"])
    r = router_args(dict(plan(args, parser, "x")))
    assert (r.planner, r.planner_scaler, r.planner_max_nodes, r.slo_ttft_ms, r.slo_tpot_ms) == (
        True, "serve", 6, 500.0, 40.5)
    default = parser.parse_args(["--model", "some/dir", "--planner", "--num-decode", "2"])
    r = router_args(dict(plan(default, parser, "x")))
    assert r.planner_max_nodes == 3  # as many nodes as it starts with
    assert (r.slo_ttft_ms, r.slo_tpot_ms) == (router_parser().get_default("slo_ttft_ms"),
                                              router_parser().get_default("slo_tpot_ms"))
    off = parser.parse_args(["--model", "some/dir"])
    r = router_args(dict(plan(off, parser, "x")))
    assert not r.planner and r.planner_scaler == "none"


def test_disagg_policy_reaches_the_router_and_zero_prefill_nodes_need_it():
    parser = build_parser()
    args = parser.parse_args(["--model", "some/dir", "--disagg-policy", "never", "--num-prefill", "0",
                              "--num-decode", "2"])
    commands = dict(plan(args, parser, "x"))
    assert router_args(commands).disagg_policy == "never"
    assert sorted(commands) == ["decode-0", "decode-1", "router"]
    plain = dict(plan(parser.parse_args(["--model", "some/dir"]), parser, "x"))
    assert router_args(plain).disagg_policy == "always" and "--disagg-policy" not in plain["router"]


@pytest.mark.parametrize("argv, message", [
    (["--num-prefill", "0"], "need --disagg-policy never or auto"),
    (["--num-decode", "0"], "at least 1 decode node"),
    (["--num-prefill", "-1"], "at least 1 decode node"),
    (["--planner", "--colocated"], "not with --colocated"),
    (["--max-nodes", "4"], "only with --planner"),
    (["--slo-ttft-ms", "100"], "only with --planner"),
    (["--planner", "--num-decode", "3", "--max-nodes", "2"], "less than the nodes it starts with"),
    (["--planner", "--slo-tpot-ms", "0"], "not a positive number"),
])
def test_planner_flag_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "some/dir", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ---- NodeScaler with fakes ----------------------------------------------------------------------
class FakeProc:
    def __init__(self, argv):
        self.argv, self.signals, self.returncode = argv, [], None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.signals.append(sig)


def node_cmd(name: str, extra=()) -> list[str]:
    return ["python", "-m", "pdserve.x", "--router", "tcp://r", "--node-id", name, "--num-threads", "2", *extra]


class Stack:
    def __init__(self, prefill=1, decode=1, max_nodes=4, extra=None):
        self.desired = None
        self.fetched = []
        self.now = 0.0
        extra = extra or (lambda role, i: [])
        self.commands = [("router", ["router"])]
        self.commands += [(f"prefill-{i}", node_cmd(f"prefill-{i}", extra("prefill", i))) for i in range(prefill)]
        self.commands += [(f"decode-{i}", node_cmd(f"decode-{i}", extra("decode", i))) for i in range(decode)]
        self.procs = [(name, FakeProc(argv)) for name, argv in self.commands]
        self.scaler = NodeScaler("http://r", self.commands, self.procs, max_nodes=max_nodes, api_key="k",
                                 node_extra=extra, fetch=self.fetch, start=FakeProc, poll_s=5, clock=lambda: self.now)

    def fetch(self, url, api_key):
        self.fetched.append((url, api_key))
        return self.desired

    def tick(self, desired, dt=5.0):
        self.desired = desired
        self.now += dt
        self.scaler.tick()

    def names(self):
        return [n for n, _ in self.procs]


def test_scales_up_with_new_node_ids_and_the_roles_argv():
    s = Stack()
    s.tick({"prefill": 1, "decode": 3})
    assert s.names() == ["router", "prefill-0", "decode-0", "decode-1", "decode-2"]
    argv = dict(s.procs)["decode-2"].argv
    assert argv == node_cmd("decode-2")
    assert dict(s.commands)["decode-2"] == argv  # the supervisor restarts it with these
    assert s.fetched == [("http://r", "k")]


def test_scales_down_highest_numbered_with_sigterm_and_keeps_them_out_of_supervision():
    import signal

    s = Stack(prefill=2, decode=3, max_nodes=5)
    s.tick({"prefill": 1, "decode": 1})
    assert s.names() == ["router", "prefill-0", "decode-0"]
    assert [n for n, _ in s.scaler.draining] == ["prefill-1", "decode-2", "decode-1"]
    assert all(p.signals == [signal.SIGTERM] for _, p in s.scaler.draining)
    assert "decode-1" not in dict(s.commands)
    # Draining ones are reaped once exited; a new node never reuses a number.
    for _, p in s.scaler.draining:
        p.returncode = 0
    s.tick({"prefill": 1, "decode": 2})
    assert s.scaler.draining == [] and s.names() == ["router", "prefill-0", "decode-0", "decode-3"]


def test_no_op_bounds_and_poll_interval():
    s = Stack(max_nodes=3)
    s.tick({"prefill": 1, "decode": 1})
    assert s.names() == ["router", "prefill-0", "decode-0"]
    s.tick({"prefill": 4, "decode": 4})  # --max-nodes 3
    assert len(s.names()) == 1 + 3
    s.tick({"prefill": 0, "decode": 0})  # decode never below 1; prefill may go to 0
    assert [n for n in s.names() if n != "router"] == ["decode-0"]
    s.tick({"prefill": 9, "decode": 1}, dt=1.0)  # not yet time to poll
    assert [n for n in s.names() if n != "router"] == ["decode-0"] and len(s.fetched) == 3
    s.tick(None)  # no answer: nothing changes
    s.tick({})
    assert [n for n in s.names() if n != "router"] == ["decode-0"]
    s.tick({"prefill": 1})  # one pool only
    assert [n for n in s.names() if n != "router"] == ["decode-0", "prefill-2"]


def test_new_nodes_get_their_own_per_node_flags():
    per_node = {0: ["--tensor-parallel-size", "2"], 1: ["--tensor-parallel-size", "1"]}

    def extra(role, i):
        return per_node[min(i, 1)] if role == "prefill" else []

    s = Stack(extra=extra)
    s.tick({"prefill": 2, "decode": 1})
    assert dict(s.procs)["prefill-1"].argv == node_cmd("prefill-1", ["--tensor-parallel-size", "1"])


# ---- GET /planner against a fake router -----------------------------------------------------------
class FakeRouter:
    """GET /planner answering `status`'s JSON with `desired`; records the Authorization headers."""

    def __init__(self, desired=None, status=200):
        self.desired, self.status, self.auth = desired, status, []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                outer.auth.append(self.headers.get("Authorization"))
                body = json.dumps({"desired": outer.desired, "split": [1, 1], "reason": "test"}).encode() \
                    if self.path == "/planner" and outer.status == 200 else b'{"error": "no planner"}'
                self.send_response(outer.status if self.path == "/planner" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def router():
    r = FakeRouter()
    yield r
    r.close()


def test_fetch_desired(router):
    router.desired = {"prefill": 2, "decode": 5}
    assert fetch_desired(router.url, "key") == {"prefill": 2, "decode": 5}
    assert router.auth == ["Bearer key"]
    router.desired = {}  # no decision yet
    assert fetch_desired(router.url) is None
    router.desired = {"decode": "x"}
    assert fetch_desired(router.url) is None
    router.status = 404  # a router process that runs no planner
    assert fetch_desired(router.url) is None
    assert fetch_desired("http://127.0.0.1:9") is None  # nothing there


@pytest.mark.timeout(30)
def test_run_stack_follows_the_planner(router, monkeypatch, capsys):
    """The whole loop: serve's supervisor polls the (fake) router and starts and stops (sleeping)
    node processes; on stop every one of them, draining ones included, is stopped."""
    commands = [("router", SLEEP), ("prefill-0", [*SLEEP, "--node-id", "prefill-0"]),
                ("decode-0", [*SLEEP, "--node-id", "decode-0"])]
    parser = build_parser()
    args = parser.parse_args(["--port", str(router.port), "--planner", "--max-nodes", "4"])
    monkeypatch.setattr(serve, "plan", lambda *_: [(n, list(a)) for n, a in commands])
    monkeypatch.setattr(serve, "wait_ready", lambda *_: None)
    monkeypatch.setattr(serve, "PLANNER_POLL_S", 0.2)
    started = []
    real_popen = serve.subprocess.Popen

    def popen(argv, **kw):
        p = real_popen(argv, **kw)
        started.append((argv, p))
        return p

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    stopping = [False]
    router.desired = {"prefill": 1, "decode": 3}
    result = []
    t = threading.Thread(target=lambda: result.append(serve.run_stack(args, parser, stopping)))
    t.start()
    try:
        wait_for(lambda: len(started) == 5)
        assert [a[a.index("--node-id") + 1] for a, _ in started[3:]] == ["decode-1", "decode-2"]
        router.desired = {"prefill": 0, "decode": 2}
        wait_for(lambda: started[1][1].poll() is not None and started[4][1].poll() is not None)  # SIGTERM
        assert started[3][1].poll() is None and started[2][1].poll() is None
        time.sleep(0.5)
        assert len(started) == 5  # stopped on purpose: not restarted
    finally:
        stopping[0] = True
        t.join(20)
    assert result == [0]
    assert all(p.poll() is not None for _, p in started)
    err = capsys.readouterr().err
    assert "planner: starting decode-1" in err and "planner: stopping prefill-0 (it drains)" in err


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
