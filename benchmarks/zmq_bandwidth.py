"""KV hand-off bandwidth over ZMQ on TCP loopback, plain against CURVE (encrypted, ZAP-checked), in
the same run: a KVSender/KVReceiver pair per mode (no shared memory), one request of N tokens
pulled R times, plain and CURVE interleaved. Timed: receiver.pull() to the "done" event, i.e.
KVPull, the sender's gather, the payload over TCP, the receiver's scatter. Payload = K and V of
every layer.

    python benchmarks/zmq_bandwidth.py --json out.json   # defaults: SmolLM2-135M shape, 2048 tokens, bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from pdserve.bench.json_out import jsonable, write_json
from pdserve.kvtransfer.curve import CurveKeys, generate_keys, stop_authenticator
from pdserve.kvtransfer.messages import KVLayout, KVReady
from pdserve.kvtransfer.payload import DTYPES, gather_tokens
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.kvtransfer.shm import layout_shape
from pdserve.kvtransfer.sockets import context


def _wait(sender: KVSender, receiver: KVReceiver, kind: str, request_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sender.poll(0)
        for event in receiver.poll(1):
            if event.request_id == request_id:
                if event.kind == "failed":
                    raise RuntimeError(f"{request_id} failed: {event.error}")
                if event.kind == kind:
                    return
    raise TimeoutError(f"no {kind!r} event for {request_id} in {timeout_s} s")


def _hand_off(sender: KVSender, receiver: KVReceiver, request_id: str, block_ids: list[int], num_tokens: int) -> float:
    """One request end to end; returns the seconds from pull() to "done"."""
    ready = KVReady(request_id=request_id, prompt_token_ids=[0] * num_tokens, first_token=0, first_logprobs=None,
                    sampling={}, num_tokens=num_tokens, block_ids=block_ids, block_size=sender.layout.block_size,
                    lease_s=60.0)
    sender.send("d0", receiver.kv_addr, ready)
    _wait(sender, receiver, "ready", request_id)
    start = time.perf_counter()
    receiver.pull(request_id, block_ids[::-1])  # other slots than the source's: a real scatter
    _wait(sender, receiver, "done", request_id)
    elapsed = time.perf_counter() - start
    while sender.num_held:  # the KVDone frees the sender's blocks
        sender.poll(1)
    return elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--io-threads", type=int, default=2, help="libzmq I/O threads (both ends share one process)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    context().set(zmq.IO_THREADS, args.io_threads)  # before the first socket

    num_blocks = -(-args.num_tokens // args.block_size)
    layout = KVLayout(model="bench", dtype=args.dtype, num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                      head_dim=args.head_dim, block_size=args.block_size, num_blocks=num_blocks)
    src = torch.randn(layout_shape(layout)).to(DTYPES[args.dtype])
    block_ids = torch.randperm(num_blocks).tolist()
    payload_bytes = args.num_tokens * src[:, :, 0, 0].numel() * src.element_size()

    key_dir = tempfile.TemporaryDirectory()
    keys = CurveKeys.load(generate_keys(Path(key_dir.name) / "keys"))
    pairs = {}
    for mode, curve in (("plain", None), ("curve", keys)):
        sender = KVSender("p0", layout, src, lambda _: None, curve=curve)
        receiver = KVReceiver("d0", layout, torch.zeros_like(src), enable_shm=False, curve=curve)
        pairs[mode] = (sender, receiver)
    times: dict[str, list[float]] = {mode: [] for mode in pairs}
    ok = True
    try:
        for rep in range(args.repeats + 1):  # the first round warms up (connection, handshake)
            for mode, (sender, receiver) in pairs.items():
                elapsed = _hand_off(sender, receiver, f"{mode}-{rep}", block_ids, args.num_tokens)
                if rep > 0:
                    times[mode].append(elapsed)
        want = gather_tokens(src, block_ids, args.num_tokens)
        for _, receiver in pairs.values():
            ok = ok and torch.equal(gather_tokens(receiver.kv_buffer, block_ids[::-1], args.num_tokens), want)
    finally:
        for sender, receiver in pairs.values():
            sender.close()
            receiver.close()
        stop_authenticator(context())
        key_dir.cleanup()

    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    result = {"payload_bytes": payload_bytes, "plain_s": med["plain"], "curve_s": med["curve"],
              "plain_MBps": payload_bytes / med["plain"] / 1e6, "curve_MBps": payload_bytes / med["curve"] / 1e6,
              "curve_over_plain": med["plain"] / med["curve"], "times_s": times, "bytes_identical": ok,
              "args": vars(args)}
    print(json.dumps(jsonable(result), indent=2))
    if args.json:
        write_json(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
