"""What cache-aware routing costs the router: one routing decision (`Registry.route`, the code the
router runs for every request) with an exact KV index of 100,000 blocks, at 2,000 requests/s.

A fleet of `--prefill` + `--decode` nodes registers in a real `Registry`; their caches are filled
through the real index (`KVIndex.apply`, from KVEvents snapshots) with `--blocks` keys in all: the
prefixes of `--prefixes` shared prompts (system prompts, conversations' histories) spread over the
nodes, so a routed prompt hits part of them. Requests arrive at `--rate` per second for
`--seconds`; each is a shared prefix + a new suffix. Per request the benchmark times:

    route    Registry.route(prompt): keys hashed, every candidate's cached prefix looked up,
             the prefill node by expected TTFT, the decode node, the path
    apply    the KV events that request causes (its new blocks stored on two nodes, as many
             evicted), applied to the index as KVEvents deltas

and reports p50/p99/max of each, against the same decisions with an empty index (the router
before the index: least loaded). The decisions run back to back (a busy router), and the rate only
sets how many events each decision's share brings.

    python -m benchmarks.kv_routing                       # 100,000 blocks, 2,000 req/s, 10 s
    python -m benchmarks.kv_routing --json benchmarks/results/kv_routing.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

from pdserve.protocol.messages import Heartbeat, KVEvents, Register
from pdserve.router.kv_index import prompt_keys
from pdserve.router.registry import Registry

BLOCK_SIZE = 16


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def build(args, *, indexed: bool, rng: random.Random) -> tuple[Registry, list[list[int]]]:
    reg = Registry()
    names = [f"p{i}" for i in range(args.prefill)] + [f"d{i}" for i in range(args.decode)]
    for name in names:
        role = "prefill" if name.startswith("p") else "decode"
        reg.register(Register(name, role, "m", kv_addr=f"tcp://{name}", num_total_blocks=1 << 20,
                              block_size=BLOCK_SIZE), name.encode())
        reg.heartbeat(Heartbeat(name, 1 << 20, 1 << 20, 0, 0))
    per_prefix = max(1, args.blocks // (args.prefixes * 2))  # each prefix on two nodes
    prefixes = [[rng.randrange(50_000) for _ in range(per_prefix * BLOCK_SIZE)] for _ in range(args.prefixes)]
    if indexed:
        held: dict[str, list[int]] = {name: [] for name in names}
        for prefix in prefixes:
            keys = prompt_keys(prefix + [0], BLOCK_SIZE)
            for name in rng.sample(names, 2):
                held[name] += keys
        for name, keys in held.items():
            reg.kv_index.apply(KVEvents(name, 1, 0, stored=keys, reset=True))
    return reg, prefixes


def run(args, *, indexed: bool) -> dict:
    rng = random.Random(args.seed)
    reg, prefixes = build(args, indexed=indexed, rng=rng)
    names = list(reg.nodes)
    seqs = dict.fromkeys(names, 1)
    n = int(args.rate * args.seconds)
    route_s, apply_s = [], []
    for _ in range(n):
        prefix = prefixes[rng.randrange(len(prefixes))]
        prompt = prefix[:rng.randrange(len(prefix) // 2, len(prefix) + 1)] + [
            rng.randrange(50_000) for _ in range(args.suffix)]
        t0 = time.perf_counter()
        route = reg.route(prompt, 128)
        t1 = time.perf_counter()
        route_s.append(t1 - t0)
        if not indexed:
            continue
        # Its blocks stored where it was prefilled and decoded, as many old ones evicted there.
        new = prompt_keys(prompt + [0], BLOCK_SIZE)[-(args.suffix // BLOCK_SIZE + 1):]
        t0 = time.perf_counter()
        for node in {route.prefill.node_id, (route.decode or route.prefill).node_id}:
            cache = reg.kv_index.nodes[node].tiers["memory"]
            evict = [cache.pop() for _ in range(min(len(new), len(cache)))]
            cache.update(evict)  # put back: the msg below removes them, as the index would
            reg.kv_index.apply(KVEvents(node, seqs[node] + 1, seqs[node], stored=new, removed=evict,
                                        sent_at=time.time()))
            seqs[node] += 1
        apply_s.append(time.perf_counter() - t0)
    out = {"requests": n, "route": _stats(route_s)}
    if indexed:
        out["apply"] = _stats(apply_s)
        out["index_blocks"] = reg.kv_index.num_blocks
    return out


def _stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"p50_us": round(1e6 * statistics.median(xs), 1), "p99_us": round(1e6 * xs[int(0.99 * (len(xs) - 1))], 1),
            "max_us": round(1e6 * xs[-1], 1), "mean_us": round(1e6 * statistics.fmean(xs), 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=100_000, help="block keys in the index (default: %(default)s)")
    p.add_argument("--prefixes", type=int, default=200, help="shared prefixes they belong to (default: %(default)s)")
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--decode", type=int, default=8)
    p.add_argument("--rate", type=float, default=2000.0, help="requests/s (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--suffix", type=int, default=64, help="new tokens after the shared prefix (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = {"cpu": cpu_name(), "config": {k: v for k, v in vars(args).items() if k != "json"},
              "indexed": run(args, indexed=True), "no_index": run(args, indexed=False)}
    result["budget_per_request_us"] = round(1e6 / args.rate, 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
