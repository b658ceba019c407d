"""The compose stack in containers, measured: image sizes, `make image` time (cached, and cold with
--cold), time from `up` to healthy, the serving benchmark through the containers next to the same
stack as plain processes (what the container network costs), and the KV hand-off between
containers over TCP with CURVE on and off (what encryption costs).

    python -m benchmarks.containers --json benchmarks/results/containers.json
    python -m benchmarks.containers --cold ...   # also time a cold `make image` (removes the images
                                                 # and the wheelhouse first; pip's own cache stays)

Needs a Docker engine (see docker/build.sh). Both stacks: 1 prefill + 1 decode node, the default
model, the same dtype and one torch thread per node; the load is `pdserve bench serve`'s client
(random prompts, ignore_eos). The KV part runs two more compose stacks whose decode node has a
/dev/shm of its own (KV over TCP between containers), one with CURVE keys (as shipped), one with
--insecure, and reads the decode node's pdserve_kv_transfer_seconds / _bytes over long prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.compose import (
    IMAGES,
    PACKAGE_PARENT,
    ComposeStack,
    base_command,
    build_images,
    docker,
    metric_sum,
    own_shm_override,
    write_override,
)
from benchmarks.harness.stack import Stack
from pdserve.bench.client import EndpointConfig
from pdserve.bench.datasets import random_requests
from pdserve.bench.json_out import report
from pdserve.bench.metrics import summarize
from pdserve.bench.runner import BenchmarkRun, LoadConfig, run_benchmark


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--runs", type=int, default=3, help="serving runs per system (medians quoted)")
    p.add_argument("--kv-prompt-len", type=int, default=1536, help="tokens per KV hand-off in the CURVE part")
    p.add_argument("--kv-requests", type=int, default=12)
    p.add_argument("--cold", action="store_true", help="also time a cold `make image`")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: build,serving,curve")
    p.add_argument("--json", type=Path, default=None)
    return p


def time_build(cold: bool) -> float:
    if cold:  # the images, their build cache and the wheelhouse; the base image and pip's cache stay
        for image in IMAGES:
            docker("rmi", "-f", image, check=False)
        docker("image", "prune", "-f", check=False)
        shutil.rmtree(PACKAGE_PARENT / "build" / "wheelhouse", ignore_errors=True)
    start = time.monotonic()
    build_images(python=sys.executable)
    return time.monotonic() - start


def samples(args, vocab_size: int = 49152):
    return random_requests(args.num_prompts, args.input_len, args.output_len, 0.0, vocab_size=vocab_size, seed=0)


def serve_runs(url: str, args) -> list[dict]:
    cfg = EndpointConfig(url + "/v1/completions", "smollm2", ignore_eos=True, return_token_ids=True)
    out = []
    for i in range(args.runs):
        load = LoadConfig(float("inf"), max_concurrency=args.max_concurrency, seed=i, num_warmups=2 if i == 0 else 0)
        run = asyncio.run(run_benchmark(cfg, samples(args), load, BenchmarkRun()))
        out.append(summarize(run.records, run.duration_s, [50.0, 99.0]))
    return out


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def serving(args, project: str) -> dict:
    result = {}
    stack = ComposeStack(project, env={"PDSERVE_DTYPE": args.dtype})
    try:
        start = time.monotonic()
        stack.up(prefill=1, decode=1)
        stack.wait_pools(prefill=1, decode=1, timeout=900)
        result["up_to_healthy_s"] = time.monotonic() - start
        result["containers"] = serve_runs(stack.url, args)
    finally:
        stack.close()
    plain = Stack("smollm2", num_prefill=1, num_decode=1, extra=["--dtype", args.dtype], timeout=900)
    try:
        result["processes"] = serve_runs(plain.url, args)
    finally:
        plain.close()
    return result


def insecure_override(path: Path) -> Path:
    """Every role with --insecure in place of its CURVE keys (decode's own /dev/shm: a second -f)."""
    def swap(service):
        cmd = base_command(service)
        i = cmd.index("--zmq-curve-keys")
        return cmd[:i] + ["--insecure"] + cmd[i + 2:]
    return write_override(path, {service: {"command": swap(service)} for service in ("router", "prefill", "decode")})


def kv_over_tcp(args, project: str, overrides: list[Path]) -> dict:
    stack = ComposeStack(project, files=overrides, env={"PDSERVE_DTYPE": args.dtype})
    try:
        stack.up(prefill=1, decode=1)
        stack.wait_pools(prefill=1, decode=1, timeout=900)
        prompt = list(range(1000, 1000 + args.kv_prompt_len))
        for k in range(args.kv_requests + 2):  # two warm-ups
            if k == 2:
                before = next(iter(stack.node_metrics("decode").values()))
            status, body = stack.post("/v1/completions", {"prompt": [k, *prompt], "max_tokens": 2,
                                                          "temperature": 0})
            assert status == 200, body
        after = next(iter(stack.node_metrics("decode").values()))
        def delta(name, **labels):
            return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)
        seconds, count = delta("pdserve_kv_transfer_seconds_sum"), delta("pdserve_kv_transfer_seconds_count")
        nbytes = delta("pdserve_kv_transfer_bytes_total", direction="received")
        assert delta("pdserve_kv_transfers_total", path="zmq") == count == args.kv_requests
        return {"transfers": count, "mean_ms": 1e3 * seconds / count, "bytes_per_transfer": nbytes / count,
                "gb_per_s": nbytes / seconds / 1e9}
    finally:
        stack.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    out: dict = {"config": vars(args) | {"json": str(args.json)}, "cpu": _cpu()}
    if "build" not in skip:
        if args.cold:
            out["build_cold_s"] = time_build(cold=True)
        out["build_cached_s"] = time_build(cold=False)
        out["image_bytes"] = {i: int(docker("image", "inspect", "-f", "{{.Size}}", i).strip()) for i in IMAGES}
        print(f"make image: cold {out.get('build_cold_s', float('nan')):.0f} s, cached {out['build_cached_s']:.1f} s; "
              f"images {out['image_bytes']}", flush=True)
    tag = f"pdbench{os.getpid()}"
    if "serving" not in skip:
        out["serving"] = serving(args, tag + "s")
        for system in ("containers", "processes"):
            runs = out["serving"][system]
            print(f"{system}: output tok/s median {median_of(runs, 'output_throughput'):.1f} "
                  f"(runs {[round(r['output_throughput'], 1) for r in runs]}), TTFT p50 "
                  f"{median_of(runs, 'median_ttft_ms'):.1f} ms, TPOT p50 {median_of(runs, 'median_tpot_ms'):.2f} ms")
    if "curve" not in skip:
        with tempfile.TemporaryDirectory() as tmp:
            own_shm = own_shm_override(Path(tmp) / "own-shm.yml")
            out["kv_curve"] = kv_over_tcp(args, tag + "c", [own_shm])
            out["kv_plain"] = kv_over_tcp(args, tag + "p", [own_shm, insecure_override(Path(tmp) / "insecure.yml")])
        for name in ("kv_curve", "kv_plain"):
            r = out[name]
            print(f"{name}: {r['transfers']:.0f} transfers of {r['bytes_per_transfer'] / 1e6:.1f} MB, "
                  f"mean {r['mean_ms']:.1f} ms, {r['gb_per_s']:.2f} GB/s")
    report(out, args.json)
    return 0


def _cpu() -> str:
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = "unknown"
    return f"{model}, {os.cpu_count()} cores"


if __name__ == "__main__":
    sys.exit(main())
