"""The flags every serving node takes, whatever its role, and what is read from them before the
model loads (the exposure check, the CURVE keys)."""

from __future__ import annotations

import argparse
import logging

from pdserve.engine.args import add_engine_args
from pdserve.protocol.exposure import INSECURE_HELP, check_or_warn, node_sockets


def add_node_args(parser: argparse.ArgumentParser) -> None:
    """Flags every serving node takes, plus the engine flags (named as vLLM names them)."""
    parser.add_argument("--router", required=True, action="append", metavar="ADDR",
                        help="a router's control address, e.g. tcp://127.0.0.1:5555; repeat it or give a comma list "
                             "for several routers (the node registers with each); a host name stands for every "
                             "address it resolves to (a headless Service on Kubernetes), re-resolved every "
                             "--router-refresh-s")
    parser.add_argument("--api-server-count", type=int, default=1, metavar="N",
                        help="the routers run with --api-server-count N: each tcp --router address stands for N "
                             "consecutive control ports from its own (default: %(default)s)")
    parser.add_argument("--router-refresh-s", type=float, default=10.0,
                        help="seconds between DNS look-ups of the --router host names, finding routers that "
                             "come later; 0 = resolve once (default: %(default)s)")
    parser.add_argument("--node-id", default=None, help="this node's name at the router (default: ROLE-<random>)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model's name in Register and the KV handshake (default: derived from --model)")
    parser.add_argument("--host", default="127.0.0.1", help="interface for this node's endpoints (KV, status) (default: %(default)s)")
    parser.add_argument("--status-port", type=int, default=0, help="port of GET /status, /metrics, /health; 0 = a free port (default: %(default)s)")
    parser.add_argument("--advertise-host", default=None,
                        help="host peers use to reach this node (default: --host; with --host 0.0.0.0, this machine's IP)")
    parser.add_argument("--max-queue-len", type=int, default=1024,
                        help="requests waiting on this node before new ones are refused, the router retrying them "
                             "(default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=20.0,
                        help="on SIGTERM, seconds to finish held requests before leaving, the router re-dispatching "
                             "the rest (default: %(default)s)")
    parser.add_argument("--zmq-curve-keys", default=None, metavar="DIR",
                        help="authenticate and encrypt ZMQ traffic with the CURVE keys in DIR, made by `pdserve keys DIR` "
                             "(default: off)")
    parser.add_argument("--insecure", action="store_true", help=INSECURE_HELP)
    parser.add_argument("--log-level", default="INFO", help="(default: %(default)s)")
    # node.faults.FaultInjection; the role parsers add --kv-pull-delay-s (decode), --inject-kv-fault (prefill)
    parser.add_argument("--step-delay-s", type=float, default=0.0, help=argparse.SUPPRESS)  # tests: a slow device
    add_engine_args(parser)


def load_curve_keys(args: argparse.Namespace):
    """The CURVE keys named by --zmq-curve-keys (None without the flag)."""
    if not getattr(args, "zmq_curve_keys", None):
        return None
    from pdserve.protocol.curve import CurveKeys

    return CurveKeys.load(args.zmq_curve_keys)


def check_exposure(args: argparse.Namespace, logger: logging.Logger) -> None:
    """Refuse (InsecureExposureError, one line) a node whose router link or KV socket (a decode
    node's, or any node that may change role: `args.switchable`) is reachable beyond this machine without --zmq-curve-keys or --insecure; with --insecure, log
    the warning. Call before anything loads."""
    sockets = node_sockets(args)
    if getattr(args, "switchable", False) and args.role == "prefill":  # binds its KV socket whatever its role
        host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
        sockets.append((f"tcp://{host}:{args.kv_port}", "KV socket", False))
    check_or_warn(sockets, getattr(args, "zmq_curve_keys", None), args.insecure, logger)
