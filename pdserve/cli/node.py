"""`pdserve prefill` and `pdserve decode`: a node process that serves one role and changes to the
other on a router's `SetRole`, model still loaded (pdserve/node/role_switch.py). This module is
the composition that imports both roles (a role package may not import the other, so
`python -m pdserve.prefill_node` and `python -m pdserve.decode_node` stay fixed-role).

Whatever the first role, the process builds at start:

    the engine      its KV pool in shared memory on the CPU (unless --no-shm), so that same-host
                    decode nodes can map it when this node serves prefill
    a KVSender      prefill's hand-off (leases: --lease-s), through a `SenderSlot`
    a KVReceiver    its socket bound on --host:--kv-port, advertised (Register.kv_addr) while
                    the node serves decode
    the links, the request table, the node metrics: one each, for every role object built

`--role both` (only `pdserve prefill`): the colocated node, built as before; it never changes
role (a SetRole to it is logged and ignored). A node that starts as prefill keeps the engine
flags' --speculative-config for its decode role (a prefill step never drafts: it samples first
tokens only, except for colocated requests).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

logger = logging.getLogger("pdserve.node")

ROLE_CHOICES = {"prefill": ["prefill", "both"], "decode": ["decode"]}


def build_parser(role: str = "prefill") -> argparse.ArgumentParser:
    """The flags of either role, so a node can serve both; `role` is the command's."""
    from pdserve.node.args import add_node_args

    p = argparse.ArgumentParser(prog=f"pdserve {role}",
                                description=f"a pdserve node serving {role} first; it changes role between "
                                            "prefill and decode when a router asks (SetRole)")
    p.set_defaults(switchable=True)
    choices = ROLE_CHOICES[role]
    p.add_argument("--role", default=role, choices=choices,
                   help="'both': prefill and decode its own requests, the colocated mode, which never changes "
                        "role (default: %(default)s)" if "both" in choices else argparse.SUPPRESS)
    p.add_argument("--role-change-timeout", type=float, default=60.0,
                   help="on a router's SetRole, seconds to finish the held requests before giving the rest "
                        "back to the router (retryable errors: it re-dispatches them) (default: %(default)s)")
    g = p.add_argument_group("prefill role")
    g.add_argument("--lease-s", type=float, default=30.0,
                   help="seconds handed-off KV stays pinned unless renewed (default: %(default)s)")
    g.add_argument("--no-shm", action="store_true", help="disable the same-host shared-memory KV path (default: off)")
    g.add_argument("--inject-kv-fault", default=None, help=argparse.SUPPRESS)  # node.faults
    g = p.add_argument_group("decode role")
    g.add_argument("--kv-port", type=int, default=0,
                   help="where prefill nodes connect to hand KV over; 0 = a free port (default: %(default)s)")
    g.add_argument("--kv-pull-timeout", type=float, default=30.0,
                   help="seconds to wait for a request's KV before giving it up, the router retrying it "
                        "(default: %(default)s)")
    g.add_argument("--kv-pull-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # node.faults
    add_node_args(p)
    return p


def _shm_allocator(setup, holder: list):
    """The engine's KV allocator putting rank 0's pool in shared memory (holder[0]: the pool), or
    None where no same-host peer could map it (--no-shm, not the CPU)."""
    args = setup.args
    if args.no_shm or args.device != "cpu":
        return None
    import torch

    from pdserve.kvcache.shm_pool import SharedKVPool, cleanup_stale_segments

    cleanup_stale_segments()

    def allocator(shape, dtype, device):
        try:
            holder[0] = setup.close_later(SharedKVPool.create(setup.node_id, shape, dtype))
        except OSError as e:  # /dev/shm too small (Docker's default is 64 MiB): a private pool
            logger.warning("no shared-memory KV pool (%s); decode nodes will pull over ZMQ", e)
            return torch.zeros(shape, dtype=dtype, device=device)
        return holder[0]  # the runner names it in its KV shard (runner.kv_shards[0].shm)

    return allocator


def build_node(setup):
    """The engine, both KV endpoints, the links, and the node of the first role (see the module
    docstring); `--role both` builds the colocated node as `python -m pdserve.prefill_node` does."""
    args = setup.args
    if args.role == "both":
        from pdserve.prefill_node.__main__ import build_node as build_fixed

        return build_fixed(setup)

    from pdserve.engine.args import build_engine
    from pdserve.kvtransfer.receiver import KVReceiver
    from pdserve.kvtransfer.sender import KVSender
    from pdserve.node.engine_wire import kv_layout, kv_shards
    from pdserve.node.router_link import advertised_addr

    holder: list = [None]
    engine = setup.close_later(build_engine(args, kv_allocator=_shm_allocator(setup, holder)))
    layout = kv_layout(engine, setup.served_model_name)
    shards = kv_shards(engine, holder[0])  # every rank's pool (tensor parallelism), or the one
    receiver = setup.close_later(KVReceiver(
        setup.node_id, layout, shards, bind_addr=f"tcp://{args.host}:{args.kv_port}",
        pull_timeout_s=args.kv_pull_timeout, curve=setup.curve))
    kv_addr = advertised_addr(receiver.kv_addr, setup.host)
    if args.no_shm:  # ranks in /dev/shm (TP > 1 on the CPU) are still not offered to peers
        shards = [dataclasses.replace(s, shm=None) if s.shm is not None else s for s in shards]

    def make_sender(release, on_error):
        return setup.close_later(KVSender(setup.node_id, layout, shards, release, lease_s=args.lease_s,
                                          curve=setup.curve, faults=setup.faults, on_error=on_error,
                                          insecure=args.insecure))

    link = setup.router_link(engine, kv_addr=kv_addr if args.role == "decode" else "")
    return compose(engine, link, receiver, make_sender, role=args.role, kv_addr=kv_addr,
                   max_queue_len=args.max_queue_len, faults=setup.faults, timeout_s=args.role_change_timeout)


def compose(engine, link, receiver, make_sender, *, role: str, kv_addr: str, max_queue_len: int = 1024,
            faults=None, timeout_s: float = 60.0):
    """A node serving `role` that may change role: one engine, one link (its request table), one
    KVReceiver (bound, advertised at `kv_addr`), one KVSender (`make_sender(release, on_error)`,
    called once, now) and one NodeMetrics, for every PrefillNode and DecodeNode it builds."""
    from pdserve.decode_node.node import DecodeNode
    from pdserve.node.metrics import NodeMetrics
    from pdserve.node.requests import table_of
    from pdserve.node.role_switch import RoleSwitcher, SenderSlot
    from pdserve.prefill_node.node import PrefillNode

    sender = SenderSlot(make_sender)
    metrics = NodeMetrics(link.register_msg.node_id, role)
    requests = table_of(link)

    def build(new_role: str):
        if new_role == "prefill":
            return PrefillNode(engine, link, make_sender=sender, max_queue_len=max_queue_len, faults=faults,
                               metrics=metrics, requests=requests)
        return DecodeNode(engine, link, receiver, max_queue_len=max_queue_len, faults=faults, metrics=metrics,
                          requests=requests)

    return RoleSwitcher(build, role, kv_addr=kv_addr, receiver=receiver, sender=sender.sender, timeout_s=timeout_s)


def main(role: str, argv: list[str] | None = None) -> int:
    from pdserve.node.runtime import run_node

    return run_node(build_parser(role), build_node, argv)


def main_prefill(argv: list[str] | None = None) -> int:
    """`pdserve prefill`"""
    return main("prefill", argv)


def main_decode(argv: list[str] | None = None) -> int:
    """`pdserve decode`"""
    return main("decode", argv)


if __name__ == "__main__":
    sys.exit(main_prefill())
