"""How many tokens per second one router process can carry, and what it does past that.

A real router process (`python -m pdserve.router`, what `pdserve router` runs) pinned to one core
(`--router-cpu`), fake prefill and decode nodes that produce real SmolLM2 token ids as fast as
asked (router_capacity_fleet.py), and a cheap load client (router_capacity_client.py), both pinned
to another core (`--load-cpu`). The router alone is the bottleneck; each run checks that the load
core was not (its busy share is reported, and figures taken with it above 90% are flagged).

    ceiling, streamed      `--streams` streams (started evenly over the warm-up); each probe runs
                           the decode fake at a per-stream rate (x1.25 per probe) until the router
                           stops keeping up: client tok/s below 90% of the offered rate, a 429, or
                           a p99 inter-token gap past 0.5 s (if the start rate is already too
                           much, it goes down first). The ceiling is the best client tok/s of a
                           probe that kept up.
    ceiling, not streamed  the same with "stream": false (tokens counted from usage).
    time per token         the router's CPU time per token, and its own split by stage (decode,
                           detokenize, sse, write) from its /metrics, at the streamed ceiling.
    overload               twice the streams at the ceiling's per-stream rate (2x the ceiling
                           offered) for `--overload-s` (300 for the 5-minute check), the first
                           third (at most 10 s) as warm-up: p99 gap of the accepted streams, 429s,
                           client tok/s, router RSS every second (growth counted after warm-up).

Several router processes (`--api-server-count N`, `pdserve router --api-server-count N`) share
the port; the fakes link to all of them (router_capacity_fleet.py). Their /metrics are scraped
over fresh connections until every process (its `X-Pdserve-Api-Server` index) has answered and
summed; router CPU and RSS are the sums over the N processes. `--router-cpu`/`--load-cpu` take
core lists; the report says which cores each part had, how busy each core was (/proc/stat), and
whether routers and load shared cores (then a ceiling is what the machine does, a lower bound for
the routers).

    python -m benchmarks.router_capacity --json benchmarks/results/router_capacity.json
    python -m benchmarks.router_capacity --overload-s 300     # the 5-minute RSS check
    python -m benchmarks.router_capacity --api-server-count 2 --router-cpu 0,1 --load-cpu 2,3 --streams 512
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request

from benchmarks.router_capacity_client import LoadClient
from benchmarks.router_capacity_fleet import MODEL, corpus_token_ids, run_fleet
from pdserve.bench.json_out import report
from pdserve.router.cli import API_SERVER_HEADER
from pdserve.utils.processes import free_port

STAGES = ("decode", "detokenize", "sse", "write")
KEEP_UP = 0.9  # a probe kept up when clients got this share of the tokens offered


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--probe-s", type=float, default=8.0, help="seconds per probe (the first 2 are warm-up)")
    p.add_argument("--start-rate", type=float, default=100.0, help="tokens/s per stream of the first probe")
    p.add_argument("--overload-s", type=float, default=30.0)
    p.add_argument("--api-server-count", type=int, default=1, help="router processes sharing the port")
    p.add_argument("--router-cpu", type=_cpus, default=_cpus("0"), help="cores of the router process(es): 0 or 0,1")
    p.add_argument("--load-cpu", type=_cpus, default=_cpus("1"), help="cores of the fakes and the client")
    p.add_argument("--overload-rate", type=float, default=None,
                   help="tokens/s per stream of the overload run (default: the streamed ceiling's)")
    p.add_argument("--skip", default="", help="comma list of phases to skip: stream,nostream,overload")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from pdserve.engine.loader import resolve_model

    corpus = corpus_token_ids(AutoTokenizer.from_pretrained(resolve_model(MODEL)))
    os.sched_setaffinity(0, set(args.load_cpu))
    bench = Bench(args, corpus)
    try:
        result = bench.run()
    finally:
        bench.close()
    report(result, args.json)
    print(table(result), file=sys.stderr)
    return 0


def _cpus(value: str) -> list[int]:
    try:
        cpus = sorted({int(c) for c in value.split(",") if c.strip()})
    except ValueError:
        cpus = []
    if not cpus or min(cpus) < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a list of cores (0 or 0,1)")
    return cpus


class Bench:
    def __init__(self, args, corpus: list[int]) -> None:
        self.args, self.corpus = args, corpus
        self.n = args.api_server_count
        self.port = free_port()
        self.control_addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(self.n)]
        many = ["--api-server-count", str(self.n)] if self.n > 1 else []
        self.router = subprocess.Popen(
            ["taskset", "-c", ",".join(map(str, args.router_cpu)), sys.executable, "-m", "pdserve.router",
             "--model", MODEL, "--port", str(self.port), "--control-addr", ",".join(self.control_addrs),
             "--log-level", "WARNING", *many], stdout=subprocess.PIPE, text=True)
        self.router_pids: dict[int, int] = {} if self.n > 1 else {0: self.router.pid}
        threading.Thread(target=self._read_router_stdout, daemon=True).start()
        ctx = multiprocessing.get_context("fork")
        self.rate, self.stop = ctx.Value("d", args.start_rate), ctx.Event()
        self.fleet = ctx.Process(target=run_fleet, args=(self.control_addrs, corpus, self.rate, self.stop),
                                 kwargs={"cpus": set(args.load_cpu)}, daemon=True)
        self.fleet.start()
        self._wait_healthy()

    def _read_router_stdout(self) -> None:
        """Drain the router's stdout (the children share it), noting each child's pid."""
        for line in self.router.stdout:
            m = re.search(r"API server (\d+) started \(pid (\d+)\)", line)
            if m:
                self.router_pids[int(m.group(1))] = int(m.group(2))

    def close(self) -> None:
        self.stop.set()
        self.fleet.join(10)
        if self.fleet.is_alive():
            self.fleet.kill()
        self.router.terminate()
        try:
            self.router.wait(10)
        except subprocess.TimeoutExpired:
            self.router.kill()
            self.router.wait()

    def _get(self, path: str) -> tuple[int, bytes, int]:
        """(status, body, index of the router process that answered) over a fresh connection."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                return resp.status, resp.read(), int(resp.headers.get(API_SERVER_HEADER) or 0)
        except urllib.error.HTTPError as e:
            return e.code, e.read(), int(e.headers.get(API_SERVER_HEADER) or 0)
        except OSError:
            return 0, b"", -1

    def _each(self, path: str, attempts: int = 200) -> dict[int, tuple[int, bytes]]:
        """`path` from every router process: fresh connections (the kernel spreads them over the
        processes) until each index has answered, or `attempts` run out."""
        answers: dict[int, tuple[int, bytes]] = {}
        for _ in range(attempts):
            status, body, index = self._get(path)
            if index >= 0:
                answers[index] = (status, body)
            if len(answers) == self.n:
                break
        return answers

    def _wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            answers = self._each("/health", attempts=4 * self.n)
            if len(answers) == self.n == len(self.router_pids) and all(a[0] == 200 for a in answers.values()):
                return
            if self.router.poll() is not None:
                raise RuntimeError(f"the router exited with {self.router.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the router never became healthy ({len(answers)} of {self.n} answered)")
            time.sleep(0.2)

    def _metrics(self) -> dict[str, float]:
        """Every router process's counters and gauges, summed; per process under "server:I:NAME"."""
        answers = self._each("/metrics")
        if len(answers) < self.n:
            raise RuntimeError(f"only router processes {sorted(answers)} of {self.n} answered /metrics")
        out: dict[str, float] = {}
        for index, (_, body) in answers.items():
            for line in body.decode().splitlines():
                m = re.match(r'(pdserve_\w+?)(?:\{stage="(\w+)"\})? ([0-9.e+-]+)$', line)
                if m:
                    key = m.group(1) + (":" + m.group(2) if m.group(2) else "")
                    out[key] = out.get(key, 0.0) + float(m.group(3))
                    out[f"server:{index}:{key}"] = float(m.group(3))
        return out

    def _settle(self, timeout_s: float = 30.0) -> None:
        """Wait until no router has a request in flight or an in-flight limit left from a probe."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self._metrics()
            if all(m.get(k, 0) == 0 for k in ("pdserve_router_in_flight_limit", "pdserve_router_control_backlog",
                                              "pdserve_num_requests_running")):
                return
            time.sleep(0.5)
        print(f"the routers did not settle in {timeout_s:g} s (an in-flight limit still lifting?): going on",
              file=sys.stderr)

    def _cpu_s(self, pids) -> float:
        total = 0.0
        for pid in pids:
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            except OSError:  # a child that died (the parent restarts it): its time is lost
                continue
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total

    def _rss_mb(self) -> float:
        """The router processes' RSS, summed."""
        total = 0.0
        for pid in self.router_pids.values():
            try:
                for line in open(f"/proc/{pid}/status"):
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) / 1024
            except OSError:
                pass
        return total

    def probe(self, streams: int, rate: float, stream: bool, duration_s: float, on_tick=None,
              warm_s: float | None = None) -> dict:
        """One run at `rate` tokens/s per stream; what the clients got, and what it cost."""
        self._settle()
        self.rate.value = rate
        max_tokens = max(32, int(rate * (4 if stream else 2)))  # streams of ~4 s, bodies of ~2 s
        client = LoadClient("127.0.0.1", self.port, model=MODEL, prompt_token_ids=self.corpus[:32],
                            max_tokens=max_tokens, stream=stream)
        warm_s = min(3.0, duration_s / 3) if warm_s is None else warm_s
        before = self._metrics()
        cores0 = _core_times()
        cpu0 = (self._cpu_s(self.router_pids.values()), time.process_time(), self._cpu_s([self.fleet.pid]))
        t0 = time.monotonic()
        stats = client.run(streams, duration_s, measure_from_s=warm_s, on_tick=on_tick, ramp_s=warm_s * 2 / 3)
        wall = time.monotonic() - t0
        cpu1 = (self._cpu_s(self.router_pids.values()), time.process_time(), self._cpu_s([self.fleet.pid]))
        core_busy = _core_busy(cores0, _core_times())
        after = self._metrics()
        measured_s = duration_s - warm_s
        tok_s = stats.tokens / measured_s
        offered = streams * rate
        router_cpu = cpu1[0] - cpu0[0]
        split = {s: _per_token_us(before, after, s) for s in STAGES}
        return {"streams": streams, "rate_per_stream": rate, "offered_tok_s": offered, "client_tok_s": tok_s,
                "kept_up": (tok_s >= KEEP_UP * offered and stats.refused_429 == 0 and stats.errors == 0
                            and stats.gap_quantile_s(0.99) <= 0.5),
                "refused_429": stats.refused_429, "errors": stats.errors, "requests_done": stats.requests_done,
                "p50_gap_s": stats.gap_quantile_s(0.5), "p99_gap_s": stats.gap_quantile_s(0.99),
                "router_cpu_share": router_cpu / wall, "load_cpu_share": (cpu1[1] - cpu0[1] + cpu1[2] - cpu0[2]) / wall,
                "core_busy": {c: core_busy.get(c, 0.0) for c in sorted({*self.args.router_cpu, *self.args.load_cpu})},
                "load_core_busy": max((core_busy.get(c, 0.0) for c in self.args.load_cpu), default=0.0),
                "server_generation_tokens": [
                    after.get(f"server:{i}:pdserve_generation_tokens_total", 0)
                    - before.get(f"server:{i}:pdserve_generation_tokens_total", 0) for i in range(self.n)],
                "router_cpu_us_per_token": router_cpu / max(1, stats.tokens * wall / measured_s) * 1e6,
                "stage_us_per_token": split, "max_tokens": max_tokens}

    def ceiling(self, stream: bool) -> dict:
        """Probe up by 1.25x while the router keeps up; if it does not at the start rate, down
        first until it does."""
        rate, probes, step = self.args.start_rate, [], None
        while len(probes) < 20:
            result = self.probe(self.args.streams, rate, stream, self.args.probe_s)
            probes.append(result)
            print(f"{'stream' if stream else 'no-stream'} rate {rate:.0f}/s/stream: {result['client_tok_s']:.0f} "
                  f"tok/s, kept up: {result['kept_up']}, router cpu {result['router_cpu_share']:.2f}, "
                  f"load cpu {result['load_cpu_share']:.2f}, load core busy {result['load_core_busy']:.0%}",
                  file=sys.stderr)
            if step is None:
                step = 1.25 if result["kept_up"] else 1 / 1.25
            if (step > 1) != result["kept_up"] or rate < 1:
                break  # up: the first failure; down: the first success
            rate *= step
        kept = [p for p in probes if p["kept_up"]]
        best = max(kept, key=lambda p: p["client_tok_s"]) if kept else None
        return {"ceiling_tok_s": best["client_tok_s"] if best else 0.0, "at": best,
                "saturated_tok_s": max(p["client_tok_s"] for p in probes), "probes": probes}

    def overload(self, rate: float) -> dict:
        rss: list[tuple[float, float]] = []
        self._settle()  # before t0: the RSS samples' times count from the run's start
        t0 = time.monotonic()

        def tick() -> None:
            rss.append((round(time.monotonic() - t0, 1), round(self._rss_mb(), 1)))

        warm_s = min(10.0, self.args.overload_s / 3)
        result = self.probe(2 * self.args.streams, rate, True, self.args.overload_s, on_tick=tick, warm_s=warm_s)
        tail = [mb for t, mb in rss if t >= warm_s]
        second_half = [mb for t, mb in rss if t >= self.args.overload_s / 2]
        result.update(rss_mb=rss, rss_growth_mb=(tail[-1] - tail[0]) if len(tail) > 1 else 0.0,
                      rss_growth_second_half_mb=(second_half[-1] - second_half[0]) if len(second_half) > 1 else 0.0)
        return result

    def run(self) -> dict:
        skip = set(filter(None, self.args.skip.split(",")))
        shared = sorted(set(self.args.router_cpu) & set(self.args.load_cpu))
        out: dict = {"args": vars(self.args), "cpus": os.cpu_count(), "api_server_count": self.n,
                     "cores": {"router": self.args.router_cpu, "load": self.args.load_cpu, "shared": shared},
                     "router_pids": self.router_pids, "router_rss_start_mb": self._rss_mb()}
        if "stream" not in skip:
            out["streamed"] = self.ceiling(stream=True)
        if "nostream" not in skip:
            out["not_streamed"] = self.ceiling(stream=False)
        at = (out.get("streamed") or {}).get("at")
        rate = self.args.overload_rate or (at or {}).get("rate_per_stream")
        if "overload" not in skip and rate:
            out["overload"] = self.overload(rate)
        return out


def _core_times() -> dict[int, tuple[int, int]]:
    """(busy, total) clock ticks of every core so far, from /proc/stat."""
    out = {}
    for line in open("/proc/stat"):
        m = re.match(r"cpu(\d+) (.*)", line)
        if m:
            ticks = [int(t) for t in m.group(2).split()]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
            out[int(m.group(1))] = (sum(ticks[:8]) - idle, sum(ticks[:8]))
    return out


def _core_busy(before: dict, after: dict) -> dict[int, float]:
    return {c: (after[c][0] - before[c][0]) / max(1, after[c][1] - before[c][1]) for c in after if c in before}


def _per_token_us(before: dict, after: dict, stage: str) -> float:
    seconds = after.get(f"pdserve_router_token_stage_seconds_total:{stage}", 0) - before.get(
        f"pdserve_router_token_stage_seconds_total:{stage}", 0)
    tokens = after.get(f"pdserve_router_token_stage_tokens_total:{stage}", 0) - before.get(
        f"pdserve_router_token_stage_tokens_total:{stage}", 0)
    return seconds / tokens * 1e6 if tokens else 0.0


def table(result: dict) -> str:
    cores, n = result.get("cores") or {}, result.get("api_server_count", 1)
    shared = cores.get("shared")
    rows = [f"{n} router process{'es' * (n > 1)} on core(s) {_cores(cores.get('router'))}, fakes and client on "
            f"core(s) {_cores(cores.get('load'))}"
            + (f"; they SHARE core(s) {_cores(shared)}: the ceilings are this machine's, a lower bound for the "
               "routers" if shared else ""), "",
            "| mode | streams | client tok/s | router µs/token (all processes) | load cores busy |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for key, name in (("streamed", "streaming"), ("not_streamed", "non-streaming")):
        at = (result.get(key) or {}).get("at")
        if at:
            flag = " (saturated: a lower bound)" if at.get("load_core_busy", at["load_cpu_share"]) > 0.9 else ""
            rows.append(f"| {name} (ceiling) | {at['streams']} | {at['client_tok_s']:,.0f} | "
                        f"{at['router_cpu_us_per_token']:.1f} | {at.get('load_core_busy', 0):.0%}{flag} |")
            if n > 1:
                total = sum(at["server_generation_tokens"]) or 1
                shares = " / ".join(f"{t / total:.0%}" for t in at["server_generation_tokens"])
                rows.append(f"| (tokens per router process: {shares}) | | | | |")
    at = (result.get("streamed") or {}).get("at")
    if at:
        split = ", ".join(f"{s} {at['stage_us_per_token'][s]:.1f}" for s in STAGES)
        rows.append(f"\nper-token split at the streamed ceiling (µs): {split}")
    ov = result.get("overload")
    if ov:
        rows.append(f"overload (2x: {ov['streams']} streams at {ov['rate_per_stream']:.0f} tok/s each): "
                    f"{ov['client_tok_s']:,.0f} tok/s, p99 gap {ov['p99_gap_s'] * 1000:.0f} ms, "
                    f"{ov['refused_429']} x 429, RSS {ov['rss_mb'][0][1] if ov['rss_mb'] else 0:.0f} -> "
                    f"{ov['rss_mb'][-1][1] if ov['rss_mb'] else 0:.0f} MB (growth after warm-up "
                    f"{ov['rss_growth_mb']:+.1f} MB, in the second half {ov['rss_growth_second_half_mb']:+.1f} MB)")
    return "\n".join(rows)


def _cores(cpus) -> str:
    return ",".join(map(str, cpus or [])) or "?"


if __name__ == "__main__":
    sys.exit(main())
