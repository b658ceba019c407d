"""Reading docker/: the compose files, Prometheus config and Grafana dashboard, for tests that run
without a Docker engine."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
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
    return load_yaml(path)["services"]


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value after `flag` in an argv list (None when absent)."""
    return argv[argv.index(flag) + 1] if flag in argv else None


def compose_command() -> list[str] | None:
    """`docker-compose` (v1, Debian's package) or `docker compose` (v2 plugin), whichever works."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


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
