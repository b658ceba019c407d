"""Reading docker/: the compose files, Prometheus config and Grafana dashboard, for tests that run
without a Docker engine."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DOCKER_DIR = Path(__file__).resolve().parents[2] / "docker"
COMPOSE_FILE = DOCKER_DIR / "docker-compose.yml"
GPU_COMPOSE_FILE = DOCKER_DIR / "docker-compose.gpu.yml"
PROMETHEUS_FILE = DOCKER_DIR / "prometheus.yml"
DASHBOARD_FILE = DOCKER_DIR / "grafana" / "dashboards" / "pdserve.json"
NODE_SERVICES = ("prefill", "decode")


def load_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def services(path: Path = COMPOSE_FILE) -> dict[str, dict]:
    """The file's services as compose resolves them with none of its variables set."""
    return interpolated(load_yaml(path)["services"])


_VARIABLE_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}")


def interpolated(value):
    """A compose value as compose resolves it with none of its variables set: `${X:-default}` is
    the default, `${X}` empty (every value a string, as compose passes them)."""
    if isinstance(value, dict):
        return {k: interpolated(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolated(v) for v in value]
    if isinstance(value, str):
        return _VARIABLE_RE.sub(lambda m: m.group(2) or "", value)
    return value


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value after `flag` in an argv list (None when absent)."""
    return argv[argv.index(flag) + 1] if flag in argv else None


def dashboard_exprs(path: Path = DASHBOARD_FILE) -> list[str]:
    """Every PromQL expression of the dashboard's panels (rows included)."""
    def walk(panels: list[dict]):
        for panel in panels:
            yield from (t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            yield from walk(panel.get("panels", []))

    return list(walk(json.loads(path.read_text())["panels"]))


_METRIC_RE = re.compile(r"\bpdserve_[A-Za-z0-9_]+")  # digits too: pdserve_e2e_...


def metric_names(expr: str) -> set[str]:
    return set(_METRIC_RE.findall(expr))
