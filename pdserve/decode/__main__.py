"""`pdserve decode --router ADDR ...` (also `python -m decode_node`)."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

logger = logging.getLogger("pdserve.decode")


def build_parser(prog: str = "pdserve decode") -> argparse.ArgumentParser:
    from pdserve.cli.main import add_node_args

    p = argparse.ArgumentParser(prog=prog, description="a pdserve decode node")
    p.add_argument("--kv-port", type=int, default=0, help="where prefill nodes connect to hand KV over (0 = free)")
    p.add_argument("--kv-pull-timeout", type=float, default=30.0,
                   help="seconds to wait for a request's KV before giving it up (the router retries it)")
    p.add_argument("--kv-pull-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: slow network
    add_node_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.cli.main import build_engine, install_stop_handlers, load_curve_keys, served_name
    from pdserve.decode.node import DecodeNode
    from pdserve.kvtransfer.receiver import KVReceiver
    from pdserve.node.messages import kv_layout, register_message
    from pdserve.node.router_link import RouterLink, StatusServer, advertise_host, advertised_addr, serve_node

    stop = install_stop_handlers()
    curve = load_curve_keys(args)
    node_id = args.node_id or f"decode-{uuid.uuid4().hex[:8]}"
    name = served_name(args)
    host = advertise_host(args.host, args.advertise_host)
    # Up before the model loads: /health answers 503 until warm-up is done.
    status = StatusServer(args.host, args.status_port, advertise_host=host, ready=False)
    engine = build_engine(args)
    receiver = KVReceiver(node_id, kv_layout(engine, name), engine.runner.kv_buffer,
                          bind_addr=f"tcp://{args.host}:{args.kv_port}", pull_timeout_s=args.kv_pull_timeout,
                          curve=curve)
    kv_addr = advertised_addr(receiver.kv_addr, host)
    link = RouterLink(args.router, register_message(node_id, "decode", engine, name, kv_addr=kv_addr), curve=curve)
    node = DecodeNode(engine, link, receiver, kv_pull_delay_s=args.kv_pull_delay_s, max_queue_len=args.max_queue_len,
                      step_delay_s=args.step_delay_s)
    status.status_fn, status.metrics_fn = node.status, node.metrics.render
    link.register_msg.metrics_url = status.url
    engine.warm_up()
    status.ready = True
    logger.info("%s ready (kv %s, status %s), registering with %s", node_id, kv_addr, status.url, args.router)
    try:
        serve_node(node, link, stop_flag=stop, drain_timeout_s=args.drain_timeout)
    finally:
        for closer in (receiver, link, status):
            closer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
