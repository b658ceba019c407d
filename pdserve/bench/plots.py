"""PNG plots: latency CDFs, metrics against request rate, and per-system bars.

Figures are built with `matplotlib.figure.Figure` and saved through the Agg canvas, never pyplot,
so plotting needs no display and touches no global backend state. Every function takes labelled
series (one run, the rates of a sweep, or the systems of a comparison) and overlays them.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from pdserve.bench.metrics import METRICS, metric_values
from pdserve.bench.request_record import RequestRecord

_CDF_TITLES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "E2E latency"}


def plot_cdfs(series: dict[str, list[RequestRecord]], out_dir: str | Path) -> list[Path]:
    """One PNG per metric (`ttft_cdf.png`, `tpot_cdf.png`, `itl_cdf.png`, `e2el_cdf.png`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    values = {label: metric_values(records) for label, records in series.items()}
    paths = []
    for name in METRICS:
        fig = Figure(figsize=(6, 4), layout="constrained")
        ax = fig.add_subplot()
        for label, per_metric in values.items():
            xs = np.sort(np.asarray(per_metric[name]) * 1000.0)
            if xs.size:
                ax.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=label)
        ax.set(xlabel=f"{_CDF_TITLES[name]} (ms)", ylabel="fraction of requests" if name != "itl" else "fraction of gaps",
               title=f"{_CDF_TITLES[name]} CDF", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        if len(series) > 1:
            ax.legend()
        paths.append(out_dir / f"{name}_cdf.png")
        fig.savefig(paths[-1], dpi=110)
    return paths


def rate_positions(rates: list[float]) -> tuple[list[float], list[str]]:
    """x positions and tick labels for request rates; `inf` sits one step past the largest finite rate."""
    finite = [r for r in rates if not math.isinf(r)]
    top = max(finite) * 1.5 if finite else 1.0
    return [top if math.isinf(r) else r for r in rates], ["inf" if math.isinf(r) else f"{r:g}" for r in rates]


_SWEEP_PANELS = (("output_throughput", "output throughput (tok/s)"),
                 ("request_goodput", "goodput (req/s)"),
                 ("p99_ttft_ms", "TTFT p99 (ms)"),
                 ("p99_tpot_ms", "TPOT p99 (ms)"))


def plot_sweep(series: dict[str, list[tuple[float, dict]]], out_path: str | Path) -> Path:
    """A 2x2 grid against request rate: output throughput, goodput (request throughput, dashed, when
    no SLO was given: then every successful request counts), TTFT p99 and TPOT p99."""
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, (key, title) in zip(axes, _SWEEP_PANELS):
        for label, points in series.items():
            xs, ticks = rate_positions([rate for rate, _ in points])
            ys, no_slo = _sweep_values(points, key)
            ax.plot(xs, ys, "o--" if no_slo else "o-", label=f"{label} (no SLO: all ok req/s)" if no_slo else label)
            ax.set_xticks(xs, ticks)
        ax.set(xlabel="request rate (req/s)", ylabel=title, title=title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    return out_path


def _sweep_values(points: list[tuple[float, dict]], key: str) -> tuple[list[float], bool]:
    """The values to plot, and whether goodput fell back to request throughput (no SLO given)."""
    if key == "request_goodput" and any(s.get(key) is None for _, s in points):
        return [s["request_throughput"] for _, s in points], True
    return [s.get(key, float("nan")) for _, s in points], False


def plot_bars(systems: dict[str, dict], out_path: str | Path) -> Path:
    """Per system: output tok/s, and TTFT p50 / p99 side by side."""
    names = list(systems)
    xs = np.arange(len(names))
    fig = Figure(figsize=(10, 4), layout="constrained")
    tput, ttft = fig.subplots(1, 2)
    tput.bar(xs, [systems[n]["output_throughput"] for n in names], color="tab:blue")
    tput.set(ylabel="output tok/s", title="output throughput")
    ttft.bar(xs - 0.2, [systems[n]["median_ttft_ms"] for n in names], 0.4, label="p50")
    ttft.bar(xs + 0.2, [systems[n].get("p99_ttft_ms", float("nan")) for n in names], 0.4, label="p99")
    ttft.set(ylabel="ms", title="time to first token")
    ttft.legend()
    for ax in (tput, ttft):
        ax.set_xticks(xs, names)
        ax.grid(axis="y", alpha=0.3)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    return out_path
