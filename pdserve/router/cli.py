"""`pdserve router` / `python -m pdserve.router`: the HTTP API plus the control socket nodes register on."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid

from aiohttp import web

from pdserve.engine.loader import DEFAULT_MODEL_ALIAS, served_model_name
from pdserve.protocol.exposure import INSECURE_HELP, InsecureExposureError, check_or_warn, router_sockets
from pdserve.router.disagg import POLICIES
from pdserve.router.redispatch import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_WAIT_S
from pdserve.router.registry import DEFAULT_MAX_QUEUE
from pdserve.router.saturation import DEFAULT_MAX_LAG_S
from pdserve.router.scaling import SCALERS

logger = logging.getLogger(__name__)

API_SERVER_HEADER = "X-Pdserve-Api-Server"  # which of --api-server-count processes answered


def build_parser() -> argparse.ArgumentParser:
    # Each help states its default itself: ArgumentDefaultsHelpFormatter would print the API key
    # taken from $PDSERVE_API_KEY, and a random instance id.
    p = argparse.ArgumentParser(prog="pdserve router", description="OpenAI-compatible router for prefill/decode nodes")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port of the HTTP API (default: %(default)s)")
    p.add_argument("--control-addr", default="tcp://127.0.0.1:0",
                   help="ZMQ address nodes connect to; port 0 picks a free one, printed at start. With "
                        "--api-server-count N: the first of N consecutive ports, or a comma list of N addresses "
                        "(default: %(default)s)")
    p.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="router processes sharing the HTTP port (SO_REUSEPORT), each with its own control "
                        "socket; nodes register with all of them (--router A,B,...) (default: %(default)s)")
    p.add_argument("--api-server-index", type=int, default=None, metavar="I",
                   help="set by the parent of --api-server-count: this process is API server I, opens the HTTP "
                        "port with SO_REUSEPORT and names itself in the X-Pdserve-Api-Server header (default: none)")
    p.add_argument("--model", default=DEFAULT_MODEL_ALIAS,
                   help="local HF folder, .gguf file, or 'smollm2'; the router only loads its tokenizer "
                        "(default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the alias, the .gguf file's stem or the folder's name)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat before a node is dropped (default: %(default)s)")
    p.add_argument("--prefix-affinity", action="store_true",
                   help="while no node reports its cache (KV events; prefix caching off on every node): route "
                        "equal prompt prefixes to the same prefill node by hashing the first 64 tokens (default: "
                        "off, least loaded). Nodes that report are routed by what their caches hold")
    p.add_argument("--cached-prefill-max-tokens", type=_non_negative_int, default=256, metavar="N",
                   help="a prompt whose prefix its decode node's cache holds (a conversation's next turn), with at "
                        "most N tokens left to compute, is prefilled on that decode node: no KV moves; 0: off "
                        "(default: %(default)s)")
    g = p.add_argument_group("disaggregation and planning")
    g.add_argument("--disagg-policy", choices=POLICIES, default="always",
                   help="where each request is prefilled: 'always' on a prefill node (KV handed to a decode "
                        "node), 'never' on its decode node, 'auto' per request by the cost model (default: "
                        "%(default)s)")
    g.add_argument("--local-prefill-max-tokens", type=_non_negative_int, default=None, metavar="N",
                   help="with --disagg-policy auto: prompts of at most N tokens are prefilled on their decode "
                        "node, longer ones on a prefill node, instead of the cost model (default: the cost model)")
    g.add_argument("--planner", action="store_true",
                   help="run the planner: choose each node's role (and, with --planner-scaler, the pools' "
                        "sizes) for the SLOs (only --api-server-index 0 runs it) (default: off)")
    g.add_argument("--slo-ttft-ms", type=_positive_float, default=1000.0, help="p90 TTFT target (default: %(default)s)")
    g.add_argument("--slo-tpot-ms", type=_positive_float, default=50.0, help="TPOT target (default: %(default)s)")
    g.add_argument("--planner-interval", type=_positive_float, default=5.0, metavar="SECONDS",
                   help="seconds between the planner's decisions (default: %(default)s)")
    g.add_argument("--planner-window", type=_positive_float, default=30.0, metavar="SECONDS",
                   help="seconds of traffic the planner's workload estimate covers (default: %(default)s)")
    g.add_argument("--planner-cooldown", type=_non_negative_float, default=15.0, metavar="SECONDS",
                   help="seconds after a role change before the next (default: %(default)s)")
    g.add_argument("--planner-scaler", choices=SCALERS, default="none",
                   help="who resizes the pools: 'none' (role changes only), 'export' "
                        "(pdserve_planner_desired_replicas only, for an HPA or KEDA), 'serve' (pdserve serve "
                        "reads GET /planner), 'docker' (the compose services, Docker Engine API), "
                        "'kubernetes' (the Deployments' replicas) (default: %(default)s)")
    g.add_argument("--planner-max-nodes", type=int, default=64, help="scaling: the largest fleet it asks for (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before a request is aborted, 0 = never (default: %(default)s)")
    p.add_argument("--max-retries", type=int, default=DEFAULT_MAX_RETRIES,
                   help="re-dispatches of a request whose node died or whose KV transfer failed, before an "
                        "error (default: %(default)s)")
    p.add_argument("--retry-wait", type=float, default=DEFAULT_RETRY_WAIT_S,
                   help="seconds a re-dispatched request waits for a ready node before it fails, 0 = fail at "
                        "once (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests queued per node (beyond what it runs) before new ones get 429 + Retry-After "
                        "(default: %(default)s)")
    p.add_argument("--max-lag", type=_seconds, default=DEFAULT_MAX_LAG_S, metavar="SECONDS",
                   help="shed new requests (429 + Retry-After) once the router's own event loop or control backlog "
                        "runs this late, so accepted streams keep flowing; 0 = never shed (default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on all but /health, /metrics and /openapi.json "
                        "(default: $PDSERVE_API_KEY; unset = open)")
    p.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                   help="authenticate and encrypt the control socket with the CURVE keys in DIR, made by "
                        "`pdserve keys DIR` (default: plain TCP)")
    p.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    p.add_argument("--instance-id", default=None, metavar="ID",
                   help="an id GET /health answers, so that a launcher can tell this router from another "
                        "process on the port (default: a random uuid4 hex)")
    p.add_argument("--log-level", default="INFO",
                   help="DEBUG, INFO, WARNING or ERROR; /health and /metrics requests are logged at DEBUG "
                        "(default: %(default)s)")
    return p


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number")
    return number


def _non_negative_float(value: str) -> float:
    return _seconds(value)


def _non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number (0 or more)")
    return number


def planning(args: argparse.Namespace):
    """(PathPolicy, Planner or None, Scaler or None) from the flags."""
    from pdserve.router.disagg import PathPolicy
    from pdserve.router.planner import Planner, PlannerConfig
    from pdserve.router.scaling import make_scaler

    slo_tpot_s = args.slo_tpot_ms / 1e3
    path = PathPolicy(args.disagg_policy, args.local_prefill_max_tokens,
                      cached_prefill_max_tokens=args.cached_prefill_max_tokens,
                      slo_tpot_s=slo_tpot_s if args.planner else None,
                      slo_ttft_s=args.slo_ttft_ms / 1e3 if args.planner else None)
    if not args.planner or (args.api_server_index or 0) != 0:
        return path, None, None
    config = PlannerConfig(slo_ttft_s=args.slo_ttft_ms / 1e3, slo_tpot_s=slo_tpot_s,
                           interval_s=args.planner_interval, window_s=args.planner_window,
                           cooldown_s=args.planner_cooldown, max_nodes=args.planner_max_nodes,
                           # under `always` every request needs a prefill node: never move the last one
                           min_prefill=1 if args.disagg_policy == "always" else 0)
    return path, Planner(config), make_scaler(args.planner_scaler)


def _seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds >= 0:  # nan is not either
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds (0 or more)")
    return seconds


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.api_server_count < 1:
        parser.error(f"argument --api-server-count: {args.api_server_count} is not a process count (1 or more)")
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.local_prefill_max_tokens is not None and args.disagg_policy != "auto":
        parser.error("argument --local-prefill-max-tokens: only with --disagg-policy auto")
    if args.planner_scaler != "none" and not args.planner:
        parser.error("argument --planner-scaler: only with --planner")
    if args.api_server_count > 1:
        return run_parent(args, sys.argv[1:] if argv is None else list(argv))
    try:  # before the tokenizer loads, so the refusal is immediate
        check_or_warn(router_sockets(args), args.zmq_curve_keys, args.insecure, logger)
    except InsecureExposureError as e:
        print(f"pdserve router: error: {e}", file=sys.stderr)
        return 2

    from pdserve.protocol.curve import CurveKeys
    from pdserve.router.access_log import RouterAccessLogger
    from pdserve.router.app import create_app
    from pdserve.router.router import Router

    curve = CurveKeys.load(args.zmq_curve_keys) if args.zmq_curve_keys else None
    path, planner, scaler = planning(args)
    router = Router(load_tokenizer(args.model), served_model_name(args.model, args.served_model_name),
                    control_addr=args.control_addr, heartbeat_timeout_s=args.heartbeat_timeout,
                    prefix_affinity=args.prefix_affinity, request_timeout_s=args.request_timeout or None,
                    max_retries=args.max_retries, retry_wait_s=args.retry_wait, max_queue=args.max_queue,
                    max_lag_s=args.max_lag or None, curve=curve, path=path, planner=planner, scaler=scaler)
    app = create_app(router, api_key=args.api_key or None, instance_id=args.instance_id)

    name = "pdserve router" if args.api_server_index is None else f"pdserve router {args.api_server_index}"

    async def start(_app: web.Application) -> None:
        await router.start()
        print(f"{name}: control socket at {router.control_addr}", flush=True)

    async def close(_app: web.Application) -> None:
        await router.close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    index = args.api_server_index
    if index is not None:  # one of --api-server-count processes: say which one answered
        async def name_server(_request: web.Request, response: web.StreamResponse) -> None:
            response.headers[API_SERVER_HEADER] = str(index)

        app.on_response_prepare.append(name_server)
    # handler_cancellation: a client that hangs up cancels its handler at once, which aborts the request.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, reuse_port=index is not None,
                access_log_class=RouterAccessLogger,
                print=lambda msg: print(f"{name}: {msg}", flush=True))
    return 0


def run_parent(args: argparse.Namespace, argv: list[str]) -> int:
    """--api-server-count N > 1: check what the children would refuse, then start and supervise
    them (router/api_servers.py). Each child gets this command line with its own control
    address, index and the shared instance id and port appended (argparse keeps the last value)."""
    from pdserve.router.api_servers import control_addresses, run_api_servers
    from pdserve.router.ports import check_port_free
    from pdserve.utils.processes import free_port

    n = args.api_server_count
    try:
        addrs = control_addresses(args.control_addr, n)
        check_or_warn([(a, "control socket", False) for a in addrs], args.zmq_curve_keys, args.insecure, logger)
    except (ValueError, InsecureExposureError) as e:
        print(f"pdserve router: error: {e}", file=sys.stderr)
        return 2
    port = args.port or free_port(args.host)
    error = check_port_free(args.host, port)
    if error:
        print(f"pdserve router: error: {error}", file=sys.stderr)
        return 1
    instance_id = args.instance_id or uuid.uuid4().hex  # one for all: /health answers it whichever serves
    commands = [[sys.executable, "-m", "pdserve.router", *argv, "--api-server-count", "1", "--api-server-index",
                 str(i), "--control-addr", addr, "--port", str(port), "--instance-id", instance_id]
                for i, addr in enumerate(addrs)]
    print(f"pdserve router: {n} API servers on http://{args.host}:{port}; nodes register with all of them: "
          f"--router {','.join(addrs)}", flush=True)
    return run_api_servers(commands)
