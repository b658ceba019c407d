"""`python -m pdserve.prefill_node --router ADDR ...`: a FIXED-ROLE prefill node (a SetRole from a
router is logged and ignored; `pdserve prefill`, pdserve/cli/node.py, is the node that may change
role: this package may not import the decode node). With `--role both` the node prefills and
decodes its own requests: the colocated comparison mode. The process's life is
the node runtime's (`pdserve.node.runtime.run_node`); what is prefill's own is built here."""

from __future__ import annotations

import argparse
import logging
import sys

logger = logging.getLogger("pdserve.prefill_node")


def build_parser(prog: str = "pdserve prefill") -> argparse.ArgumentParser:
    from pdserve.node.args import add_node_args

    p = argparse.ArgumentParser(prog=prog, description="a pdserve prefill node")
    p.add_argument("--role", default="prefill", choices=["prefill", "both"],
                   help="'both': prefill and decode its own requests, the colocated mode (default: %(default)s)")
    p.add_argument("--lease-s", type=float, default=30.0, help="seconds handed-off KV stays pinned unless renewed (default: %(default)s)")
    p.add_argument("--no-shm", action="store_true", help="disable the same-host shared-memory KV path (default: off)")
    # node.faults: "drop:N" / "corrupt:N" spoils every Nth KV payload sent over ZMQ
    p.add_argument("--inject-kv-fault", default=None, help=argparse.SUPPRESS)
    add_node_args(p)
    return p


def build_node(setup):
    """The engine (its KV pool in shared memory when a same-host decode node may map it), the
    link, and the node with its KV sender."""
    from pdserve.engine.args import build_engine
    from pdserve.prefill_node.node import PrefillNode

    args = setup.args
    shm_pool = None
    allocator = None
    if args.role == "prefill" and not args.no_shm and args.device == "cpu":
        import torch

        from pdserve.kvcache.shm_pool import SharedKVPool, cleanup_stale_segments

        cleanup_stale_segments()

        def allocator(shape, dtype, device):
            nonlocal shm_pool
            try:
                shm_pool = setup.close_later(SharedKVPool.create(setup.node_id, shape, dtype))
            except OSError as e:  # /dev/shm too small (Docker's default is 64 MiB): a private pool
                logger.warning("no shared-memory KV pool (%s); decode nodes will pull over ZMQ", e)
                return torch.zeros(shape, dtype=dtype, device=device)
            return shm_pool  # the runner names it in its KV shard (runner.kv_shards[0].shm)

    if args.role == "prefill":  # it samples first tokens and hands requests off: nothing to speculate
        args.speculative_config = None
    engine = build_engine(args, kv_allocator=allocator)
    setup.close_later(engine)  # a tensor-parallel node's ranks stop with it
    link = setup.router_link(engine)
    make_sender = None
    if args.role == "prefill":
        import dataclasses

        from pdserve.kvtransfer.sender import KVSender
        from pdserve.node.engine_wire import kv_layout, kv_shards

        shards = kv_shards(engine, shm_pool)  # every rank's pool (tensor parallelism), or the one
        if args.no_shm:  # ranks in /dev/shm (TP > 1 on the CPU) are still not offered to peers
            shards = [dataclasses.replace(s, shm=None) if s.shm is not None else s for s in shards]

        def make_sender(release, on_error):
            sender = KVSender(setup.node_id, kv_layout(engine, setup.served_model_name), shards, release,
                              lease_s=args.lease_s, curve=setup.curve, faults=setup.faults, on_error=on_error,
                              insecure=args.insecure)
            return setup.close_later(sender)

    return PrefillNode(engine, link, role=args.role, make_sender=make_sender, max_queue_len=args.max_queue_len,
                       faults=setup.faults)


def main(argv: list[str] | None = None) -> int:
    from pdserve.node.runtime import run_node

    return run_node(build_parser(), build_node, argv)


if __name__ == "__main__":
    sys.exit(main())
