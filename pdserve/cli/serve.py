"""`pdserve serve`: the local stack in one command — a router plus prefill and decode node
processes (or `--colocated` nodes that do both), on free ports, stopped together on Ctrl-C or
SIGTERM (nodes first, so they drain).

It also supervises them, as a container restart policy would: a process that dies is started
again with the same arguments (a node re-registers, a router comes back on the same ports and
the nodes re-register with it), unless it keeps dying (`MAX_RESTARTS` within `RESTART_WINDOW_S`),
in which case the stack stops. `--no-restart` stops the stack at the first death instead."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve serve", description="router + prefill + decode nodes on this machine")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--colocated", action="store_true", help="nodes that prefill and decode their own requests")
    p.add_argument("--num-nodes", type=int, default=1, help="with --colocated: how many nodes")
    p.add_argument("--num-threads", type=int, default=None, help="torch threads per node (default: cores / nodes)")
    p.add_argument("--prefill-args", default="", help="extra flags for prefill nodes, e.g. '--max-num-seqs 64'")
    p.add_argument("--decode-args", default="", help="extra flags for decode nodes")
    p.add_argument("--router-args", default="", help="extra flags for the router")
    p.add_argument("--api-key", default=None, help="require this Bearer key on /v1/* (passed to the router)")
    p.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                   help="CURVE-encrypt router/node and KV traffic with the keys in DIR (created if missing)")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument("--demo", action="store_true", help="once ready, ask the model one chat question and print it")
    p.add_argument("--no-restart", action="store_true", help="stop the stack when a process dies instead of restarting it")
    p.add_argument("--log-level", default="INFO")
    return p


MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan(args: argparse.Namespace, engine_argv: list[str]) -> list[tuple[str, list[str]]]:
    """(name, argv) of every process to start, router first."""
    py = [sys.executable, "-m"]
    control = f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", args.model, "--dtype", args.dtype, "--log-level", args.log_level, *engine_argv]
    if args.served_model_name:
        common += ["--served-model-name", args.served_model_name]
    secure = ["--zmq-curve-keys", args.zmq_curve_keys] if args.zmq_curve_keys else []
    common += secure
    roles = [("both", args.num_nodes)] if args.colocated else [("prefill", args.num_prefill), ("decode", args.num_decode)]
    num_nodes = sum(n for _, n in roles)
    threads = args.num_threads or max(1, (os.cpu_count() or 1) // num_nodes)
    procs = [("router", py + ["pdserve.router", "--host", args.host, "--port", str(args.port), "--control-addr", control,
                              "--log-level", args.log_level,
                              "--model", args.model, *(["--served-model-name", args.served_model_name]
                                                       if args.served_model_name else []),
                              *secure, *(["--api-key", args.api_key] if args.api_key else []),
                              *shlex.split(args.router_args)])]
    for role, count in roles:
        module = "pdserve.decode" if role == "decode" else "pdserve.prefill"
        extra = shlex.split(args.decode_args if role == "decode" else args.prefill_args)
        for i in range(count):
            argv = py + [module, "--router", control, "--node-id", f"{role}-{i}", "--num-threads", str(threads),
                         *common, *extra]
            if role == "both":
                argv += ["--role", "both"]
            procs.append((f"{role}-{i}", argv))
    return procs


def wait_ready(url: str, procs: list[subprocess.Popen], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def stop_all(procs: list[tuple[str, subprocess.Popen]], timeout: float = 30.0) -> None:
    """Nodes first (SIGTERM drains them), then the router; SIGKILL whatever outlives the timeout."""
    for group in (procs[1:], procs[:1]):
        for _, p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, p in group:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


DEMO_QUESTION = "What is the capital of France? Answer in one sentence."


def demo_chat(url: str, api_key: str | None = None) -> None:
    """One chat request through the stack, printed the way a user would see it."""
    import json

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


def main(argv: list[str] | None = None) -> int:
    args, engine_argv = build_parser().parse_known_args(argv)
    from pdserve.engine.loader import resolve_model

    resolve_model(args.model)  # fetch/convert once here, not in every node at the same time
    if args.zmq_curve_keys and not os.path.exists(os.path.join(args.zmq_curve_keys, "server.key_secret")):
        from pdserve.kvtransfer.curve import generate_keys

        generate_keys(args.zmq_curve_keys)
    procs: list[tuple[str, subprocess.Popen]] = []
    stopping = [False]

    def on_signal(signum, frame) -> None:
        stopping[0] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        commands = plan(args, engine_argv)
        for name, cmd in commands:
            procs.append((name, subprocess.Popen(cmd, start_new_session=True)))
        url = f"http://{args.host}:{args.port}"
        if not wait_ready(url + "/health", [p for _, p in procs], args.ready_timeout):
            print("pdserve serve: the stack did not become healthy; stopping", file=sys.stderr)
            return 1
        print(f"pdserve is ready: {url}/v1 (model {args.served_model_name or args.model}); Ctrl-C stops it",
              flush=True)
        if args.demo:
            demo_chat(url, args.api_key)
        restarts: dict[str, list[float]] = {}
        while not stopping[0]:
            for i, (name, proc) in enumerate(procs):
                if proc.poll() is None or stopping[0]:
                    continue
                recent = [t for t in restarts.get(name, []) if time.monotonic() - t < RESTART_WINDOW_S]
                if args.no_restart or len(recent) >= MAX_RESTARTS:
                    print(f"pdserve serve: {name} exited ({proc.returncode}); stopping the stack", file=sys.stderr)
                    return 1
                print(f"pdserve serve: {name} exited ({proc.returncode}); restarting it", file=sys.stderr, flush=True)
                restarts[name] = [*recent, time.monotonic()]
                procs[i] = (name, subprocess.Popen(dict(commands)[name], start_new_session=True))
            time.sleep(0.5)
        return 0
    finally:
        stop_all(procs)
