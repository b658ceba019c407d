"""`pdserve router` / `python -m router`: the HTTP API plus the control socket nodes register on."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from aiohttp import web

from pdserve.engine.loader import DEFAULT_MODEL_ALIAS

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve router", description="OpenAI-compatible router for prefill/decode nodes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--control-addr", default="tcp://127.0.0.1:0", help="ZMQ address nodes connect to (:0 = free port)")
    p.add_argument("--model", default=DEFAULT_MODEL_ALIAS, help="local HF folder, .gguf file, or 'smollm2' (for the tokenizer)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: the alias or folder name)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0, help="seconds without a heartbeat before a node is dropped")
    p.add_argument("--prefix-affinity", action="store_true", help="route equal prompt prefixes to the same prefill node")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted (0 = never)")
    p.add_argument("--max-retries", type=int, default=3,
                   help="re-dispatches of a request whose node died or whose KV transfer failed, before an error")
    p.add_argument("--retry-wait", type=float, default=30.0,
                   help="seconds a re-dispatched request waits for a ready node before it fails (0 = fail at once)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests queued per node (beyond what it runs) before new ones get 429 + Retry-After")
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $PDSERVE_API_KEY; none = open)")
    p.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                   help="authenticate and encrypt the control socket with the CURVE keys in DIR (`pdserve keys DIR`)")
    p.add_argument("--log-level", default="INFO")
    return p


def default_served_name(model: str) -> str:
    if model == DEFAULT_MODEL_ALIAS:
        return model
    path = Path(model).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.resolve().name


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(model))


def main(argv: list[str] | None = None) -> int:
    from pdserve.router.app import create_app
    from pdserve.router.router import Router

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.cli.main import load_curve_keys

    router = Router(load_tokenizer(args.model), args.served_model_name or default_served_name(args.model),
                    control_addr=args.control_addr, heartbeat_timeout_s=args.heartbeat_timeout,
                    prefix_affinity=args.prefix_affinity, request_timeout_s=args.request_timeout or None,
                    max_retries=args.max_retries, retry_wait_s=args.retry_wait, max_queue=args.max_queue,
                    curve=load_curve_keys(args))
    app = create_app(router, api_key=args.api_key or None)

    async def start(_app: web.Application) -> None:
        await router.start()
        print(f"pdserve router: control socket at {router.control_addr}", flush=True)

    async def close(_app: web.Application) -> None:
        await router.close()

    app.on_startup.append(start)
    app.on_cleanup.append(close)
    # handler_cancellation: a client that hangs up cancels its handler at once, which aborts the request.
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True,
                print=lambda msg: print(f"pdserve router: {msg}", flush=True))
    return 0
