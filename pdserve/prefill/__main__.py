"""`pdserve prefill --router ADDR ...` (also `python -m prefill_node`). With `--role both` the
node prefills and decodes its own requests: the colocated comparison mode."""

from __future__ import annotations

import argparse
import logging
import sys
import uuid

logger = logging.getLogger("pdserve.prefill")


def build_parser(prog: str = "pdserve prefill") -> argparse.ArgumentParser:
    from pdserve.cli.main import add_node_args

    p = argparse.ArgumentParser(prog=prog, description="a pdserve prefill node")
    p.add_argument("--role", default="prefill", choices=["prefill", "both"],
                   help="'both': prefill and decode its own requests (the colocated mode)")
    p.add_argument("--lease-s", type=float, default=30.0, help="how long handed-off KV stays pinned")
    p.add_argument("--no-shm", action="store_true", help="disable the same-host shared-memory KV path")
    # tests and chaos runs: "drop:N" / "corrupt:N" spoils every Nth KV payload sent over ZMQ
    p.add_argument("--inject-kv-fault", default=None, help=argparse.SUPPRESS)
    add_node_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from pdserve.cli.main import build_engine, install_stop_handlers, load_curve_keys, served_name
    from pdserve.node.messages import kv_layout, register_message
    from pdserve.node.router_link import RouterLink, StatusServer, advertise_host, serve_node
    from pdserve.prefill.node import PrefillNode

    stop = install_stop_handlers()
    curve = load_curve_keys(args)
    node_id = args.node_id or f"{args.role}-{uuid.uuid4().hex[:8]}"
    # Up before the model loads: /health answers 503 until warm-up is done.
    status = StatusServer(args.host, args.status_port, advertise_host=advertise_host(args.host, args.advertise_host),
                          ready=False)
    name = served_name(args)
    shm_pool = None
    allocator = None
    if args.role == "prefill" and not args.no_shm and args.device == "cpu":
        from pdserve.kvtransfer.shm import SharedKVPool, cleanup_stale_segments

        cleanup_stale_segments()

        def allocator(shape, dtype, device):
            nonlocal shm_pool
            try:
                shm_pool = SharedKVPool.create(node_id, shape, dtype)
            except OSError as e:  # /dev/shm too small (Docker's default is 64 MiB): a private pool
                logger.warning("no shared-memory KV pool (%s); decode nodes will pull over ZMQ", e)
                return torch.zeros(shape, dtype=dtype, device=device)
            return shm_pool.tensor

    engine = build_engine(args, kv_allocator=allocator)
    link = RouterLink(args.router, register_message(node_id, args.role, engine, name), curve=curve)
    node = PrefillNode(engine, link, role=args.role, max_queue_len=args.max_queue_len,
                       step_delay_s=args.step_delay_s)
    status.status_fn, status.metrics_fn = node.status, node.metrics.render
    link.register_msg.metrics_url = status.url
    if args.role == "prefill":
        from pdserve.kvtransfer.sender import KVSender

        node.sender = KVSender(node_id, kv_layout(engine, name), engine.runner.kv_buffer, node._release,
                               lease_s=args.lease_s, shm_pool=shm_pool, curve=curve)
        node.sender.on_error = node._handoff_failed
        if args.inject_kv_fault:
            node.sender.inject_fault(args.inject_kv_fault)
    engine.warm_up()
    status.ready = True
    logger.info("%s ready (status %s), registering with %s", node_id, status.url, args.router)
    try:
        serve_node(node, link, stop_flag=stop, drain_timeout_s=args.drain_timeout)
    finally:
        for closer in (node.sender, link, status, shm_pool):
            if closer is not None:
                closer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
