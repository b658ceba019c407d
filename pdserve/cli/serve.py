"""`pdserve serve`: the local stack in one command — a router plus prefill and decode node
processes (or `--colocated` nodes that do both), on free ports, stopped together on Ctrl-C or
SIGTERM (nodes first, so they drain).

It also supervises them, as a container restart policy would: a process that dies is started
again with the same arguments (a node re-registers, a router comes back on the same ports and
the nodes re-register with it), unless it keeps dying (`MAX_RESTARTS` within `RESTART_WINDOW_S`),
in which case the stack stops. `--no-restart` stops the stack at the first death instead.
With `--api-server-count N` the router is N processes sharing `--port` (`pdserve router
--api-server-count N`, which supervises them itself), and every node registers with each of them.

Before it starts anything it checks what would otherwise fail later (cli/preflight.py): unknown
flags, flags in --prefill-args/--decode-args/--router-args that the role's own parser refuses or
that would expose a ZMQ socket beyond loopback without CURVE keys (`--zmq-curve-keys DIR`) or
--insecure, and a busy --port. It reports ready only when /health answers
200 with the instance id it gave its own router (never because another server holds the port), and
whichever way it ends (Ctrl-C, a crash loop, never becoming healthy) it stops every process and
prints one last `stopped` line.

`--planner` also sizes the pools: the router runs its planner (`--planner --planner-scaler serve`,
with --slo-ttft-ms/--slo-tpot-ms), and every PLANNER_POLL_S this command reads GET /planner's
`desired` pool sizes and starts node processes (the next `prefill-N`/`decode-N`, with the flags
its role's nodes get) or stops the highest-numbered ones with SIGTERM (they drain, then exit; no
restart). Never more than --max-nodes prefill + decode nodes (default: as many as it started
with, so the planner can shrink an idle stack and grow it back; raise it to let the planner go
beyond, each new node with the same --num-threads), never below one decode node."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable

from pdserve.cli.model import resolve_model_verbosely
from pdserve.cli.preflight import check_draft_model, check_role_args, parse_node_args
from pdserve.engine.args import add_engine_args, engine_argv
from pdserve.engine.loader import served_model_name
from pdserve.router.ports import check_port_free
from pdserve.utils.processes import free_port, stop_processes

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    # conflict_handler: serve's own --num-threads (per node) replaces the engine group's.
    p = argparse.ArgumentParser(
        prog="pdserve serve", usage="pdserve serve [options]", conflict_handler="resolve",
        description="router + prefill + decode node processes on this machine, on free ports, supervised; "
                    "Ctrl-C or SIGTERM stops them all",
        epilog="Engine flags set here go to every node; --prefill-args/--decode-args add per-role flags "
               "(any flag of `pdserve prefill`/`pdserve decode`), checked before anything starts.")
    add_engine_args(p, "engine (the ones set are forwarded to every node)")
    g = p.add_argument_group("stack")
    g.add_argument("--host", default="127.0.0.1", help="address the router's HTTP API listens on (default: %(default)s)")
    g.add_argument("--port", type=int, default=8000, help="port of the router's HTTP API (default: %(default)s)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the alias, the .gguf file's stem or the folder's name)")
    g.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="router processes sharing --port, each node registering with all of them "
                        "(`pdserve router --api-server-count`) (default: %(default)s)")
    g.add_argument("--num-prefill", type=int, default=1, help="prefill nodes (default: %(default)s)")
    g.add_argument("--num-decode", type=int, default=1, help="decode nodes (default: %(default)s)")
    g.add_argument("--colocated", action="store_true",
                   help="nodes that prefill and decode their own requests, no KV transfer (default: off)")
    g.add_argument("--num-nodes", type=int, default=1, help="with --colocated: how many nodes (default: %(default)s)")
    g.add_argument("--num-threads", type=int, default=None, help="torch threads per node, per rank with --tensor-parallel-size (default: cores / ranks of "
                        "every node)")
    g.add_argument("--prefill-args", action="append", default=None,
                   help="extra flags for prefill (and colocated) nodes, e.g. '--max-num-seqs 64'; given more "
                        "than once, node i gets the i-th (the last one for the rest), e.g. a different "
                        "--tensor-parallel-size per node (default: none)")
    g.add_argument("--decode-args", action="append", default=None,
                   help="extra flags for decode nodes; repeatable like --prefill-args (default: none)")
    g.add_argument("--router-args", default="",
                   help="extra flags for the router, e.g. '--request-timeout 60' (default: none)")
    g.add_argument("--api-key", default=None,
                   help="require this Bearer key on /v1/* (passed to the router) (default: none, open)")
    g.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                   help="CURVE-encrypt router/node and KV traffic with the keys in DIR, created if missing "
                        "(default: plain TCP)")
    g.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds to wait for the stack to become healthy (default: %(default)s)")
    g.add_argument("--demo", action="store_true",
                   help="once ready, ask the model one chat question and print it (default: off)")
    g.add_argument("--no-restart", action="store_true",
                   help="stop the stack when a process dies instead of restarting it (default: off)")
    g.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR, for this command and every process (default: %(default)s)")
    g = p.add_argument_group("disaggregation and the planner (docs/disaggregation.md)")
    g.add_argument("--disagg-policy", choices=["always", "never", "auto"], default="always",
                   help="where the router has each request prefilled: 'always' on a prefill node, 'never' on its "
                        "decode node, 'auto' per request by the cost model (default: %(default)s)")
    g.add_argument("--planner", action="store_true",
                   help="the router's planner chooses each node's role and the pool sizes; this command starts "
                        "and stops nodes to match (not with --colocated) (default: off)")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="with --planner: the p90 TTFT target (default: the router's)")
    g.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="with --planner: the TPOT target (default: the router's)")
    g.add_argument("--max-nodes", type=int, default=None, metavar="N",
                   help="with --planner: at most N prefill + decode nodes (default: --num-prefill + --num-decode)")
    return p


MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def plan(args: argparse.Namespace, parser: argparse.ArgumentParser,
         instance_id: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of every process to start, router first."""
    py = [sys.executable, "-m"]
    # One control socket per router process; every node registers with all of them.
    control = ",".join(f"tcp://127.0.0.1:{free_port()}" for _ in range(args.api_server_count))
    many = ["--api-server-count", str(args.api_server_count)] if args.api_server_count > 1 else []
    named = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    secure = ["--zmq-curve-keys", args.zmq_curve_keys] if args.zmq_curve_keys else []
    common = ["--model", args.model, "--log-level", args.log_level, *named, *secure,
              *engine_argv(args, parser, skip=("num_threads",))]
    roles = [("both", args.num_nodes)] if args.colocated else [("prefill", args.num_prefill), ("decode", args.num_decode)]
    extras = {role: [node_args(args, role, i) for i in range(count)] for role, count in roles}
    # A node with --tensor-parallel-size N runs N ranks, each with --num-threads threads.
    num_ranks = sum(parse_node_args(role, [*common, *extra]).tensor_parallel_size
                    for role, per_role in extras.items() for extra in per_role)
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // num_ranks)
    procs = [("router", py + ["pdserve.router", "--host", args.host, "--port", str(args.port), "--control-addr", control,
                              "--instance-id", instance_id, "--log-level", args.log_level, "--model", args.model,
                              *named, *secure, *(["--api-key", args.api_key] if args.api_key else []), *many,
                              *policy_argv(args), *planner_argv(args), *shlex.split(args.router_args)])]
    for role, count in roles:
        # `pdserve prefill` / `pdserve decode` (cli/node.py): nodes that change role on the router's SetRole
        command = "decode" if role == "decode" else "prefill"
        for i in range(count):
            argv = py + ["pdserve.cli.main", command, "--router", control, "--node-id", f"{role}-{i}", "--num-threads", str(threads),
                         *common, *extras[role][i]]
            if role == "both":
                argv += ["--role", "both"]
            procs.append((f"{role}-{i}", argv))
    return procs


def max_nodes(args: argparse.Namespace) -> int:
    return args.max_nodes if args.max_nodes is not None else args.num_prefill + args.num_decode


def planner_argv(args: argparse.Namespace) -> list[str]:
    """The router's planner flags for `--planner` (none without it)."""
    if not getattr(args, "planner", False):
        return []
    slo = [a for flag, v in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms))
           if v is not None for a in (flag, f"{v:g}")]
    return ["--planner", "--planner-scaler", "serve", "--planner-max-nodes", str(max_nodes(args)), *slo]


def policy_argv(args: argparse.Namespace) -> list[str]:
    """The router's --disagg-policy (only when not the default: --router-args may set it too)."""
    policy = getattr(args, "disagg_policy", "always")
    return ["--disagg-policy", policy] if policy != "always" else []


def node_args(args: argparse.Namespace, role: str, index: int) -> list[str]:
    """Node `index` of `role`'s own flags: the index-th --prefill-args/--decode-args (the last one
    for the nodes past the list)."""
    values = (args.decode_args if role == "decode" else args.prefill_args) or [""]
    return shlex.split(values[min(index, len(values) - 1)])


def is_our_router_healthy(url: str, instance_id: str) -> bool:
    """GET /health answers 200 and carries this stack's instance id (not another server's on the port)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200 and json.loads(r.read()).get("instance_id") == instance_id
    except (OSError, ValueError):  # not up yet, 503 (HTTPError), or not our JSON
        return False


def wait_ready(url: str, instance_id: str, procs: list[tuple[str, subprocess.Popen]], timeout: float,
               stopping: list[bool]) -> str | None:
    """None once this stack's router is healthy, else why not (an error line; "" when asked to stop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopping[0]:
            return ""
        for name, p in procs:
            if p.poll() is not None:
                return f"{name} exited ({p.returncode}) before the stack became healthy; stopping"
        if is_our_router_healthy(url, instance_id):
            return None
        time.sleep(0.5)
    return f"the stack did not become healthy within {timeout:g} s (--ready-timeout); stopping"


def stop_all(procs: list[tuple[str, subprocess.Popen]], timeout: float = 30.0) -> list[str]:
    """Nodes first (SIGTERM drains them), then the router; SIGKILL whatever outlives the timeout.
    Returns the names of the processes that had to be killed."""
    killed = []
    for group in (procs[1:], procs[:1]):
        killed += [group[i][0] for i in stop_processes([p for _, p in group], timeout)]
    return killed


def stopped_line(procs: list[tuple[str, subprocess.Popen]], killed: list[str]) -> str:
    num_nodes = sum(1 for name, _ in procs if name != "router")
    what = ("router and " if procs and procs[0][0] == "router" else "") + f"{num_nodes} node{'s' * (num_nodes != 1)}"
    return f"pdserve serve: stopped ({what} exited" + (f"; killed {', '.join(killed)})" if killed else ")")


DEMO_QUESTION = "What is the capital of France? Answer in one sentence."


def demo_chat(url: str, api_key: str | None = None) -> None:
    """One chat request through the stack, printed the way a user would see it."""
    body = {"messages": [{"role": "user", "content": DEMO_QUESTION}], "max_tokens": 64, "temperature": 0}
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
    except OSError as e:
        print(f"demo request failed: {e}", file=sys.stderr)
        return
    print(f"user> {DEMO_QUESTION}\nassistant> {answer.strip()}\n", flush=True)
    print(f"try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
          f"-d '{{\"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'", flush=True)


def supervise(commands: list[tuple[str, list[str]]], procs: list[tuple[str, subprocess.Popen]],
              stopping: list[bool], no_restart: bool, on_tick: Callable[[], None] | None = None) -> int:
    """Restart processes that die until asked to stop (0), or until one keeps dying (1).
    `on_tick` (the --planner scaler) runs first in every round; it may add to or take from
    `commands` and `procs`."""
    restarts: dict[str, list[float]] = {}
    while not stopping[0]:
        if on_tick is not None:
            on_tick()
        for i, (name, proc) in enumerate(procs):
            if proc.poll() is None or stopping[0]:
                continue
            recent = [t for t in restarts.get(name, []) if time.monotonic() - t < RESTART_WINDOW_S]
            if no_restart or len(recent) >= MAX_RESTARTS:
                why = "" if no_restart else f" {len(recent) + 1} times within {RESTART_WINDOW_S:g} s"
                print(f"pdserve serve: {name} exited ({proc.returncode}){why}; stopping the stack",
                      file=sys.stderr, flush=True)
                return 1
            print(f"pdserve serve: {name} exited ({proc.returncode}); restarting it", file=sys.stderr, flush=True)
            restarts[name] = [*recent, time.monotonic()]
            procs[i] = (name, subprocess.Popen(dict(commands)[name], start_new_session=True))
        time.sleep(0.5)
    return 0


def run_stack(args: argparse.Namespace, parser: argparse.ArgumentParser, stopping: list[bool]) -> int:
    """Start every process, wait until this stack's router is healthy, supervise; always stop them all."""
    instance_id = uuid.uuid4().hex  # tells our router's /health from another server's on the port
    commands = plan(args, parser, instance_id)
    procs: list[tuple[str, subprocess.Popen]] = []
    scaler: NodeScaler | None = None
    try:
        for name, cmd in commands:
            procs.append((name, subprocess.Popen(cmd, start_new_session=True)))
        url = f"http://{args.host}:{args.port}"
        not_ready = wait_ready(url + "/health", instance_id, procs, args.ready_timeout, stopping)
        if not_ready is not None:
            if not_ready:
                print(f"pdserve serve: {not_ready}", file=sys.stderr, flush=True)
            return 1 if not_ready else 0
        print(f"pdserve is ready: {url}/v1 (model {served_model_name(args.model, args.served_model_name)}); "
              "Ctrl-C stops it", flush=True)
        if args.demo:
            demo_chat(url, args.api_key)
        if getattr(args, "planner", False):
            scaler = NodeScaler(url, commands, procs, max_nodes=max_nodes(args), api_key=args.api_key,
                                node_extra=lambda role, i: node_args(args, role, i), poll_s=PLANNER_POLL_S)
        return supervise(commands, procs, stopping, args.no_restart, scaler.tick if scaler else None)
    finally:
        killed = stop_all(procs + (scaler.draining if scaler else []))
        if procs:
            print(stopped_line(procs, killed), file=sys.stderr, flush=True)


PLANNER_POLL_S = 5.0
POOLS = ("prefill", "decode")
MIN_NODES = {"decode": 1}


def fetch_desired(url: str, api_key: str | None = None) -> dict[str, int] | None:
    """GET /planner's `desired` pool sizes; None when there is no answer to act on (not up, 404 from
    a router process that runs no planner, no decision yet)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/planner", headers=headers), timeout=2) as r:
            desired = json.loads(r.read()).get("desired") or {}
    except (OSError, ValueError, AttributeError):
        return None
    try:
        return {pool: int(desired[pool]) for pool in POOLS if pool in desired} or None
    except (TypeError, ValueError):
        return None


def start_process(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, start_new_session=True)


class NodeScaler:
    """`--planner`: every `poll_s`, makes the prefill and decode node processes as many as the
    router's GET /planner asks for (bounded by `max_nodes` and one decode node). A new node gets the
    next number of its role and its role's argv (node 0's, with its own --node-id and per-node
    flags); a node let go is the highest-numbered of its role, sent SIGTERM and moved from `procs`
    (which the supervisor restarts) to `draining` (stopped with the stack if still there)."""

    def __init__(self, url: str, commands: list[tuple[str, list[str]]], procs: list[tuple[str, subprocess.Popen]],
                 *, max_nodes: int, api_key: str | None = None,
                 node_extra: Callable[[str, int], list[str]] = lambda role, i: [],
                 fetch: Callable[[str, str | None], dict[str, int] | None] = fetch_desired,
                 start: Callable[[list[str]], subprocess.Popen] = start_process,
                 poll_s: float = PLANNER_POLL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.url, self.commands, self.procs = url, commands, procs
        self.max_nodes, self.api_key, self.node_extra = max_nodes, api_key, node_extra
        self.fetch, self.start, self.poll_s, self.clock = fetch, start, poll_s, clock
        self.draining: list[tuple[str, subprocess.Popen]] = []
        self.templates = {node_role(name): argv for name, argv in commands
                          if node_role(name) in POOLS and node_number(name) == 0}
        self._next = {role: 1 + max((node_number(n) for n, _ in commands if node_role(n) == role), default=-1)
                      for role in POOLS}
        self._last = -math.inf

    def nodes(self, role: str) -> list[str]:
        return sorted((name for name, _ in self.procs if node_role(name) == role), key=node_number)

    def tick(self) -> None:
        now = self.clock()
        if now - self._last < self.poll_s:
            return
        self._last = now
        self.draining = [(n, p) for n, p in self.draining if p.poll() is None]
        desired = self.fetch(self.url, self.api_key)
        if desired:
            self.scale(desired)

    def scale(self, desired: dict[str, int]) -> None:
        want = {role: max(desired[role], MIN_NODES.get(role, 0)) for role in POOLS if role in desired}
        for role, n in want.items():  # down first: it frees room under max_nodes
            for name in reversed(self.nodes(role)[n:]):  # highest-numbered first
                self.stop(name)
        for role, n in want.items():
            for _ in range(n - len(self.nodes(role))):
                if sum(len(self.nodes(r)) for r in POOLS) >= self.max_nodes:
                    logger.info("planner wants %d %s nodes; --max-nodes %d reached", n, role, self.max_nodes)
                    break
                self.add(role)

    def add(self, role: str) -> None:
        template = self.templates.get(role)
        if template is None:
            logger.warning("planner wants more %s nodes, but this stack started none to copy", role)
            return
        index = self._next[role]
        self._next[role] += 1
        name = f"{role}-{index}"
        extra0 = self.node_extra(role, 0)
        argv = list(template[:len(template) - len(extra0)]) + self.node_extra(role, index)
        argv[argv.index("--node-id") + 1] = name
        print(f"pdserve serve: planner: starting {name}", file=sys.stderr, flush=True)
        self.commands.append((name, argv))
        self.procs.append((name, self.start(argv)))

    def stop(self, name: str) -> None:
        (i,) = [i for i, (n, _) in enumerate(self.procs) if n == name]
        _, proc = self.procs.pop(i)
        self.commands[:] = [(n, a) for n, a in self.commands if n != name]
        print(f"pdserve serve: planner: stopping {name} (it drains)", file=sys.stderr, flush=True)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        self.draining.append((name, proc))


def node_role(name: str) -> str:
    return name.rsplit("-", 1)[0]


def node_number(name: str) -> int:
    tail = name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


ROLE_ARG_FLAGS = ("--prefill-args", "--decode-args", "--router-args")


def join_role_args(argv: list[str]) -> list[str]:
    """`--decode-args --max-num-seqs` as `--decode-args=--max-num-seqs`: argparse would take a
    value that looks like a flag for a flag, and complain that --decode-args has no value."""
    joined = []
    tokens = iter(argv)
    for token in tokens:
        value = next(tokens, None) if token in ROLE_ARG_FLAGS else None
        joined.append(token if value is None else f"{token}={value}")
    return joined


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # An unknown flag: usage + error, exit 2, before anything starts.
    args = parser.parse_args(join_role_args(sys.argv[1:] if argv is None else argv))
    if not 0 < args.port < 65536:  # 0 would be a free port this command could not find
        parser.error(f"argument --port: {args.port} is not a port number (1..65535)")
    if args.api_server_count < 1:
        parser.error(f"argument --api-server-count: {args.api_server_count} is not a process count (1 or more)")
    if not args.colocated and (args.num_prefill < 0 or args.num_decode < 1):
        parser.error(f"arguments --num-prefill/--num-decode: {args.num_prefill} and {args.num_decode}: "
                     "0 or more prefill nodes and at least 1 decode node")
    if not args.colocated and args.num_prefill == 0 and args.disagg_policy == "always" \
            and "--disagg-policy" not in shlex.split(args.router_args):
        parser.error("argument --num-prefill: 0 prefill nodes need --disagg-policy never or auto "
                     "(decode nodes prefill their own requests)")
    if args.planner and args.colocated:
        parser.error("argument --planner: not with --colocated (the planner sizes prefill and decode pools)")
    if not args.planner and (args.max_nodes, args.slo_ttft_ms, args.slo_tpot_ms) != (None, None, None):
        parser.error("arguments --max-nodes, --slo-ttft-ms, --slo-tpot-ms: only with --planner")
    if args.planner and max_nodes(args) < max(2, args.num_prefill + args.num_decode):
        parser.error(f"argument --max-nodes: {max_nodes(args)} is less than the nodes it starts with "
                     f"({args.num_prefill + args.num_decode}) or 2")
    for flag, value in (("--slo-ttft-ms", args.slo_ttft_ms), ("--slo-tpot-ms", args.slo_tpot_ms)):
        if value is not None and not value > 0:
            parser.error(f"argument {flag}: {value:g} is not a positive number of milliseconds")
    role_args = [("--prefill-args", value) for value in args.prefill_args or []]
    role_args += [("--decode-args", value) for value in args.decode_args or []]
    role_args += [("--router-args", args.router_args)]
    error = next((e for flag, value in role_args if value and (e := check_role_args({flag: value}, args.zmq_curve_keys))),
                 None) or check_draft_model(args.speculative_config)
    if error:
        print(f"pdserve serve: error: {error}", file=sys.stderr)
        return 2
    error = check_port_free(args.host, args.port)
    if error:
        print(f"pdserve serve: error: {error}", file=sys.stderr)
        return 1
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # Fetch/convert once here, not in every node at the same time.
        resolve_model_verbosely(args.model, "pdserve serve")
    except ValueError as e:
        print(f"pdserve serve: error: {e}", file=sys.stderr)
        return 2
    if args.zmq_curve_keys and not os.path.exists(os.path.join(args.zmq_curve_keys, "server.key_secret")):
        from pdserve.protocol.curve import generate_keys

        generate_keys(args.zmq_curve_keys)
    stopping = [False]

    def on_signal(signum, frame) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return run_stack(args, parser, stopping)
