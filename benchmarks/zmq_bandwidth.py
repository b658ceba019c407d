"""KV hand-off bandwidth between a KVSender and a KVReceiver in one process: ZMQ over TCP loopback,
plain against CURVE (encrypted, ZAP-checked), and optionally the same-host shared-memory copy, in
the same run. One pair per mode, one request of N tokens handed off R times, the modes interleaved.
Timed: receiver.pull() to the "done" event — for ZMQ: KVPull, the sender's gather, the payload over
TCP, the receiver's scatter; for shm: one pool-to-pool copy out of the mapped segment. Both ends
share the process (and the cores): a lower bound. Payload = K and V of every layer.
`--kernels` also times the payload kernels alone (gather, scatter, copy_tokens) on the CPU pools.

    python -m benchmarks.zmq_bandwidth --json out.json   # defaults: SmolLM2-135M shape, 2048 tokens, bf16
    python -m benchmarks.zmq_bandwidth --modes plain shm --dst-block-size 8 --kernels
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from pdserve.bench.json_out import report
from pdserve.kvcache.shm_pool import SharedKVPool
from pdserve.kvtransfer.layout import bytes_per_token, layout_shape
from pdserve.kvtransfer.payload import DTYPES, copy_tokens, gather_tokens, scatter_tokens
from pdserve.kvtransfer.receiver import KVEventKind, KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.protocol.curve import CurveKeys, generate_keys, stop_authenticator
from pdserve.protocol.messages import KVLayout, KVReady
from pdserve.protocol.sockets import context

MODES = ("plain", "curve", "shm")


def _wait(sender: KVSender, receiver: KVReceiver, kind: KVEventKind, request_id: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sender.poll(0)
        for event in receiver.poll(1):
            if event.request_id == request_id:
                if event.kind is KVEventKind.FAILED:
                    raise RuntimeError(f"{request_id} failed: {event.error}")
                if event.kind is kind:
                    return
    raise TimeoutError(f"no {kind.value!r} event for {request_id} in {timeout_s} s")


def _hand_off(sender: KVSender, receiver: KVReceiver, request_id: str, src_ids: list[int], dst_ids: list[int],
              num_tokens: int, timeout_s: float = 60.0) -> float:
    """One request end to end; returns the seconds from pull() to "done"."""
    ready = KVReady(request_id=request_id, prompt_token_ids=[0] * num_tokens, first_token=0, first_logprobs=None,
                    sampling={}, num_tokens=num_tokens, block_ids=src_ids, block_size=sender.layout.block_size,
                    lease_s=60.0)
    sender.send("d0", receiver.kv_addr, ready)
    _wait(sender, receiver, KVEventKind.READY, request_id, timeout_s)
    start = time.perf_counter()
    receiver.pull(request_id, dst_ids)
    _wait(sender, receiver, KVEventKind.DONE, request_id, timeout_s)
    elapsed = time.perf_counter() - start
    deadline = time.monotonic() + timeout_s
    while sender.num_held:  # the KVDone frees the sender's blocks
        if time.monotonic() > deadline:
            raise TimeoutError(f"the sender still holds {request_id} after {timeout_s} s")
        sender.poll(1)
    return elapsed


def _time_kernels(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int], num_tokens: int,
                  repeats: int) -> dict[str, float]:
    """Median seconds of each payload kernel on its own (after one warm-up call)."""
    payload = gather_tokens(src, src_ids, num_tokens)
    kernels: dict[str, Callable[[], object]] = {
        "gather": lambda: gather_tokens(src, src_ids, num_tokens),
        "scatter": lambda: scatter_tokens(dst, dst_ids, payload),
        "copy_tokens": lambda: copy_tokens(src, src_ids, dst, dst_ids, num_tokens),
    }
    out = {}
    for name, fn in kernels.items():
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=30)
    p.add_argument("--num-kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--num-tokens", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16, help="the sender's block size")
    p.add_argument("--dst-block-size", type=int, default=None, help="the receiver's (default: --block-size)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--modes", nargs="+", choices=MODES, default=["plain", "curve"],
                   help="plain: ZMQ; curve: ZMQ with CURVE; shm: same-host copy out of a /dev/shm segment")
    p.add_argument("--kernels", action="store_true", help="also time gather, scatter and copy_tokens alone")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--io-threads", type=int, default=2, help="libzmq I/O threads (both ends share one process)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    context().set(zmq.IO_THREADS, args.io_threads)  # before the first socket

    dst_block_size = args.dst_block_size or args.block_size
    layouts = {side: KVLayout(model="bench", dtype=args.dtype, num_layers=args.num_layers,
                              num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, block_size=block_size,
                              num_blocks=-(-args.num_tokens // block_size))
               for side, block_size in (("src", args.block_size), ("dst", dst_block_size))}
    src_layout, dst_layout = layouts["src"], layouts["dst"]
    src_ids = torch.randperm(src_layout.num_blocks).tolist()  # scattered: no accidental contiguity
    dst_ids = torch.randperm(dst_layout.num_blocks).tolist()
    payload_bytes = args.num_tokens * bytes_per_token(src_layout)

    key_dir = tempfile.TemporaryDirectory()
    keys = CurveKeys.load(generate_keys(Path(key_dir.name) / "keys"))
    shm_pool = None
    pairs: dict[str, tuple[KVSender, KVReceiver]] = {}
    ok = True
    try:
        src = torch.randn(layout_shape(src_layout)).to(DTYPES[args.dtype])
        if "shm" in args.modes:
            shm_pool = SharedKVPool.create("bench", layout_shape(src_layout), DTYPES[args.dtype])
            shm_pool.tensor.copy_(src)
        for mode in args.modes:
            sender_pool = shm_pool.tensor if mode == "shm" else src
            curve = keys if mode == "curve" else None
            sender = KVSender("p0", src_layout, sender_pool, lambda _: None, curve=curve,
                              shm_pool=shm_pool if mode == "shm" else None)
            receiver = KVReceiver("d0", dst_layout, torch.zeros(layout_shape(dst_layout), dtype=src.dtype),
                                  enable_shm=mode == "shm", curve=curve)
            pairs[mode] = (sender, receiver)
        times: dict[str, list[float]] = {mode: [] for mode in pairs}
        for rep in range(args.repeats + 1):  # the first round warms up (connection, handshake)
            for mode, (sender, receiver) in pairs.items():
                elapsed = _hand_off(sender, receiver, f"{mode}-{rep}", src_ids, dst_ids, args.num_tokens)
                if rep > 0:
                    times[mode].append(elapsed)
        want = gather_tokens(src, src_ids, args.num_tokens)
        for mode, (_, receiver) in pairs.items():
            ok = ok and torch.equal(gather_tokens(receiver.kv_buffer, dst_ids, args.num_tokens), want)
            expected = "shm" if mode == "shm" else "zmq"
            if set(receiver.num_transfers) != {expected}:
                raise RuntimeError(f"mode {mode} moved the KV by {dict(receiver.num_transfers)}, not {expected}")
        kernels = (_time_kernels(src, src_ids, pairs[args.modes[0]][1].kv_buffer, dst_ids, args.num_tokens,
                                 args.repeats) if args.kernels else {})
    finally:
        for sender, receiver in pairs.values():
            sender.close()
            receiver.close()
        if shm_pool is not None:
            shm_pool.close()
        stop_authenticator(context())
        key_dir.cleanup()

    med = {mode: statistics.median(ts) for mode, ts in times.items()}
    result = {"payload_bytes": payload_bytes}
    for mode, seconds in med.items():
        result[f"{mode}_s"] = seconds
        result[f"{mode}_MBps"] = payload_bytes / seconds / 1e6
    if "plain" in med and "curve" in med:
        result["curve_over_plain"] = med["plain"] / med["curve"]
    if kernels:
        result["kernels_s"] = kernels
        result["kernels_MBps"] = {name: payload_bytes / s / 1e6 for name, s in kernels.items()}
    result.update({"times_s": times, "bytes_identical": ok, "args": vars(args)})
    report(result, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
