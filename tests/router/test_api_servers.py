"""`--api-server-count N` without nodes: the control addresses the N router processes get, bad
values refused in one line, `pdserve serve` passing the count on and every node given every
router, and the parent supervising its children (a dead one restarted, all stopped on SIGTERM,
none left behind)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from pdserve.cli.serve import build_parser as serve_parser
from pdserve.cli.serve import plan
from pdserve.decode_node.__main__ import build_parser as decode_parser
from pdserve.node.router_discovery import parse_router_specs
from pdserve.router.api_servers import ApiServers, control_addresses
from pdserve.router.cli import main as router_main


def test_control_addresses_for_n_servers():
    assert control_addresses("tcp://127.0.0.1:5555", 3) == [
        "tcp://127.0.0.1:5555", "tcp://127.0.0.1:5556", "tcp://127.0.0.1:5557"]
    assert control_addresses("tcp://a:1, tcp://b:2", 2) == ["tcp://a:1", "tcp://b:2"]
    free = control_addresses("tcp://127.0.0.1:0", 2)
    assert len(set(free)) == 2 and all(not a.endswith(":0") for a in free)
    for bad in ("tcp://a:1,tcp://b:2,tcp://c:3", "ipc:///tmp/x", "tcp://127.0.0.1:65535"):
        with pytest.raises(ValueError, match="--control-addr"):
            control_addresses(bad, 2)


def test_bad_counts_and_addresses_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as e:
        router_main(["--api-server-count", "0"])
    assert e.value.code == 2 and "--api-server-count" in capsys.readouterr().err
    assert router_main(["--api-server-count", "2", "--control-addr", "tcp://a:1,tcp://b:2,tcp://c:3"]) == 2
    assert "error: --control-addr" in capsys.readouterr().err
    # A control socket beyond loopback without keys is refused before any child starts.
    assert router_main(["--api-server-count", "2", "--control-addr", "tcp://0.0.0.0:5555"]) == 2
    assert "without CURVE keys" in capsys.readouterr().err


def test_serve_gives_the_count_to_the_router_and_every_router_to_every_node():
    parser = serve_parser()
    args = parser.parse_args(["--model", "m", "--api-server-count", "2", "--num-prefill", "2"])
    commands = dict(plan(args, parser, "abc"))
    router = commands["router"]
    assert router[router.index("--api-server-count") + 1] == "2"
    controls = router[router.index("--control-addr") + 1].split(",")
    assert len(controls) == 2
    for name in ("prefill-0", "prefill-1", "decode-0"):
        argv = commands[name]
        assert parse_router_specs(argv[argv.index("--router") + 1]) == controls
    decode = decode_parser().parse_args(commands["decode-0"][commands["decode-0"].index("-m") + 3:])
    assert parse_router_specs(decode.router) == controls
    one = dict(plan(parser.parse_args(["--model", "m"]), parser, "abc"))["router"]
    assert "--api-server-count" not in one


def sleeper(seconds: float = 60) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({seconds})"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()[:1] \
        not in ("Z", "")


def test_a_dead_child_is_restarted_and_stop_ends_them_all():
    servers = ApiServers([sleeper(), sleeper()])
    stopping = [False]
    supervisor = threading.Thread(target=servers.supervise, args=(stopping, 0.05), daemon=True)
    try:
        first = [servers.start(i).pid for i in range(2)]
        supervisor.start()
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while servers.procs[0].pid == first[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers.procs[0].pid != first[0] and servers.procs[1].pid == first[1]
    finally:
        stopping[0] = True
        supervisor.join(5)
        killed = servers.stop(timeout_s=10)
    assert killed == [] and not any(alive(p.pid) for p in servers.procs)


def test_a_child_that_keeps_dying_stops_them_all():
    servers = ApiServers([[sys.executable, "-c", "raise SystemExit(3)"], sleeper()])
    try:
        for i in range(2):
            servers.start(i)
        assert servers.supervise([False], poll_s=0.05) == 1
    finally:
        servers.stop(timeout_s=10)
    assert not any(alive(p.pid) for p in servers.procs)


def test_the_parent_stops_its_children_on_sigterm_and_they_die_with_it():
    script = (
        "import sys\n"
        "from pdserve.router.api_servers import run_api_servers\n"
        f"sys.exit(run_api_servers([{sleeper()!r}, {sleeper()!r}]))\n"
    )
    for sig in (signal.SIGTERM, signal.SIGKILL):
        parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        pids = []
        while len(pids) < 2:
            line = parent.stdout.readline()
            assert line, "the parent ended before starting its children"
            pids.append(int(line.rsplit("pid ", 1)[1].rstrip(")\n")))
        parent.send_signal(sig)
        parent.wait(30)
        assert parent.returncode == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), f"children left behind after {sig!r}"
