"""`python -m pdserve.decode_node --router ADDR ...`: a FIXED-ROLE decode node (a SetRole from a
router is logged and ignored; `pdserve decode`, pdserve/cli/node.py, is the node that may change
role: this package may not import the prefill node). The process's life is the
node runtime's (`pdserve.node.runtime.run_node`); what is decode's own is built here."""

from __future__ import annotations

import argparse
import sys


def build_parser(prog: str = "pdserve decode") -> argparse.ArgumentParser:
    from pdserve.node.args import add_node_args

    p = argparse.ArgumentParser(prog=prog, description="a pdserve decode node")
    p.set_defaults(role="decode")
    p.add_argument("--kv-port", type=int, default=0, help="where prefill nodes connect to hand KV over; 0 = a free port (default: %(default)s)")
    p.add_argument("--kv-pull-timeout", type=float, default=30.0,
                   help="seconds to wait for a request's KV before giving it up, the router retrying it "
                        "(default: %(default)s)")
    p.add_argument("--kv-pull-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # node.faults: slow network
    add_node_args(p)
    return p


def build_node(setup):
    """The engine, the KV socket prefill nodes hand KV to, the link, and the node."""
    from pdserve.decode_node.node import DecodeNode
    from pdserve.engine.args import build_engine
    from pdserve.kvtransfer.receiver import KVReceiver
    from pdserve.node.engine_wire import kv_layout, kv_shards
    from pdserve.node.router_link import advertised_addr

    args = setup.args
    engine = build_engine(args)
    setup.close_later(engine)  # a tensor-parallel node's ranks stop with it
    receiver = setup.close_later(KVReceiver(  # every rank's pool: a transfer fills each with its heads
        setup.node_id, kv_layout(engine, setup.served_model_name), kv_shards(engine),
        bind_addr=f"tcp://{args.host}:{args.kv_port}", pull_timeout_s=args.kv_pull_timeout, curve=setup.curve))
    link = setup.router_link(engine, kv_addr=advertised_addr(receiver.kv_addr, setup.host))
    return DecodeNode(engine, link, receiver, max_queue_len=args.max_queue_len, faults=setup.faults)


def main(argv: list[str] | None = None) -> int:
    from pdserve.node.runtime import run_node

    return run_node(build_parser(), build_node, argv)


if __name__ == "__main__":
    sys.exit(main())
