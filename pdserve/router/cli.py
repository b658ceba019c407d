"""`pdserve router` / `python -m pdserve.router`: the HTTP API plus the control socket nodes register on."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from aiohttp import web

from pdserve.engine.loader import DEFAULT_MODEL_ALIAS, served_model_name
from pdserve.kvtransfer.exposure import INSECURE_HELP, InsecureExposureError, check_or_warn, router_sockets
from pdserve.router.redispatch import DEFAULT_MAX_RETRIES, DEFAULT_RETRY_WAIT_S
from pdserve.router.registry import DEFAULT_MAX_QUEUE

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    # Each help states its default itself: ArgumentDefaultsHelpFormatter would print the API key
    # taken from $PDSERVE_API_KEY, and a random instance id.
    p = argparse.ArgumentParser(prog="pdserve router", description="OpenAI-compatible router for prefill/decode nodes")
    p.add_argument("--host", default="127.0.0.1", help="address the HTTP API listens on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port of the HTTP API (default: %(default)s)")
    p.add_argument("--control-addr", default="tcp://127.0.0.1:0",
                   help="ZMQ address nodes connect to; port 0 picks a free one, printed at start (default: %(default)s)")
    p.add_argument("--model", default=DEFAULT_MODEL_ALIAS,
                   help="local HF folder, .gguf file, or 'smollm2'; the router only loads its tokenizer "
                        "(default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the alias, the .gguf file's stem or the folder's name)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat before a node is dropped (default: %(default)s)")
    p.add_argument("--prefix-affinity", action="store_true",
                   help="route equal prompt prefixes to the same prefill node (default: off, least loaded)")
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


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # before the tokenizer loads, so the refusal is immediate
        check_or_warn(router_sockets(args), args.zmq_curve_keys, args.insecure, logger)
    except InsecureExposureError as e:
        print(f"pdserve router: error: {e}", file=sys.stderr)
        return 2

    from pdserve.kvtransfer.curve import CurveKeys
    from pdserve.router.access_log import RouterAccessLogger
    from pdserve.router.app import create_app
    from pdserve.router.router import Router

    curve = CurveKeys.load(args.zmq_curve_keys) if args.zmq_curve_keys else None
    router = Router(load_tokenizer(args.model), served_model_name(args.model, args.served_model_name),
                    control_addr=args.control_addr, heartbeat_timeout_s=args.heartbeat_timeout,
                    prefix_affinity=args.prefix_affinity, request_timeout_s=args.request_timeout or None,
                    max_retries=args.max_retries, retry_wait_s=args.retry_wait, max_queue=args.max_queue,
                    curve=curve)
    app = create_app(router, api_key=args.api_key or None, instance_id=args.instance_id)

    async def start(_app: web.Application) -> None:
        await router.start()
        print(f"pdserve router: control socket at {router.control_addr}", flush=True)

    async def close(_app: web.Application) -> None:
        await router.close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    # handler_cancellation: a client that hangs up cancels its handler at once, which aborts the request.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                access_log_class=RouterAccessLogger,
                print=lambda msg: print(f"pdserve router: {msg}", flush=True))
    return 0
