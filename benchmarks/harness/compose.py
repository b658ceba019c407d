"""Drive the docker-compose stack (docker/docker-compose.yml) on a real Docker engine: bring it up
with pools of a given size, scale them, query the router, the nodes and Prometheus, take it down.

Used by the live compose tests (tests/docker/test_compose_live.py) and the container benchmark
(benchmarks/containers.py). It needs a source checkout (docker/ is not installed with the package),
a Docker engine and the images `make image` builds. Every call has a timeout.

Each stack is a compose project of its own (`-p NAME`): its containers, network and volumes are
named after it, so stacks never share state, and `down(volumes=True)` removes every trace.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.harness.stack import PACKAGE_PARENT, HttpClient
from pdserve.utils.processes import free_port

DOCKER_DIR = PACKAGE_PARENT / "docker"
COMPOSE_FILE = DOCKER_DIR / "docker-compose.yml"
BUILD_SCRIPT = DOCKER_DIR / "build.sh"
IMAGES = ("pdserve:cpu", "pdserve-prometheus:latest")


class EngineUnavailable(RuntimeError):
    """No Docker engine, compose or images here (the message says which)."""


def compose_command() -> list[str] | None:
    """`docker-compose` (v1, Debian's package) or `docker compose` (the v2 plugin), whichever works."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def docker(*args: str, timeout: float = 120, check: bool = True) -> str:
    """`docker ARGS`, its stdout; CalledProcessError (with stderr) when check and it fails."""
    result = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
    return result.stdout


def check_engine() -> list[str]:
    """The compose command, once an engine answers; EngineUnavailable saying what is missing."""
    if not shutil.which("docker"):
        raise EngineUnavailable("no docker client on PATH (Debian: apt-get install docker.io)")
    try:
        docker("info", timeout=30)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        raise EngineUnavailable(f"no Docker engine answers ({str(getattr(e, 'stderr', '') or e).strip()[:200]})") from e
    command = compose_command()
    if command is None:
        raise EngineUnavailable("neither docker-compose nor the docker compose plugin is installed")
    return command


def build_images(python: str | None = None, timeout: float = 2400) -> None:
    """`make image`'s script (cached: seconds when nothing changed); RuntimeError with its output."""
    env = dict(os.environ, **({"PYTHON": python} if python else {}))
    result = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"docker/build.sh failed ({result.returncode}):\n{result.stderr[-3000:]}")


def write_override(path: Path, services: dict[str, dict]) -> Path:
    """A compose override file (merged over the base with a second -f) for these services."""
    path.write_text(yaml.safe_dump({"version": "3.8", "services": services}, sort_keys=False))
    return path


def own_shm_override(path: Path) -> Path:
    """An override giving the decode nodes a /dev/shm of their own (not the shared `kv-shm`), as if
    on another host: KV then goes over TCP between the containers."""
    return write_override(path, {"decode": {"volumes": [
        "model-cache:/cache", "curve-keys:/keys:ro", {"type": "tmpfs", "target": "/dev/shm"}]}})


def base_command(service: str) -> list[str]:
    """The service's command in docker-compose.yml, as written (variables not yet substituted)."""
    return list(yaml.safe_load(COMPOSE_FILE.read_text())["services"][service]["command"])


class ComposeStack(HttpClient):
    """One compose project of the stack. The router's published port and Prometheus' are free ports
    of this machine; nodes run `--dtype float32` with one torch thread each unless `env` says
    otherwise. Nothing starts until `up()`."""

    def __init__(self, project: str, *, files: list[Path] = (), env: dict[str, str] | None = None) -> None:
        self.command = check_engine()
        self.project = project
        self.files = [COMPOSE_FILE, *files]
        self.port, self.prometheus_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prometheus_url = f"http://127.0.0.1:{self.prometheus_port}"
        self.env = {**os.environ, "PDSERVE_PORT": str(self.port), "PROMETHEUS_PORT": str(self.prometheus_port),
                    "PDSERVE_DTYPE": "float32", "OMP_NUM_THREADS": "1", **(env or {})}
        self.scale: dict[str, int] = {}

    # --- compose ------------------------------------------------------------------------------------
    def compose(self, *args: str, files: list[Path] | None = None, timeout: float = 600) -> str:
        argv = [*self.command, "-p", self.project]
        for f in files if files is not None else self.files:
            argv += ["-f", str(f)]
        result = subprocess.run([*argv, *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        if result.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[len(self.command):])} {' '.join(args)} failed "
                               f"({result.returncode}):\n{result.stderr[-3000:]}")
        return result.stdout

    def up(self, *, files: list[Path] | None = None, services: tuple[str, ...] = (), no_deps: bool = False,
           **scale: int) -> None:
        """`up -d` with every pool at its size (compose v1 resets a pool not named to one replica, so
        the sizes given before are passed again)."""
        self.scale.update(scale)
        args = ["up", "-d", *(["--no-deps"] if no_deps else [])]
        for service, n in self.scale.items():
            args += ["--scale", f"{service}={n}"]
        self.compose(*args, *services, files=files)

    def down(self, volumes: bool = False) -> None:
        self.compose("down", "--remove-orphans", *(["-v"] if volumes else []), timeout=300)

    def close(self) -> None:
        """Take the whole project down, volumes included (best effort: never raises)."""
        try:
            self.down(volumes=True)
        except (RuntimeError, subprocess.TimeoutExpired, OSError):
            pass

    # --- docker objects -------------------------------------------------------------------------------
    def _filter(self, service: str | None) -> list[str]:
        args = ["--filter", f"label=com.docker.compose.project={self.project}"]
        return args + (["--filter", f"label=com.docker.compose.service={service}"] if service else [])

    def containers(self, service: str | None = None, stopped: bool = False) -> list[str]:
        """Names of the project's running containers (and stopped ones too), of one service or all."""
        out = docker("ps", *(["-a"] if stopped else []), *self._filter(service), "--format", "{{.Names}}")
        return sorted(out.split())

    def networks(self) -> list[str]:
        return docker("network", "ls", "--filter", f"label=com.docker.compose.project={self.project}",
                      "--format", "{{.Name}}").split()

    def volumes(self) -> list[str]:
        return docker("volume", "ls", "--filter", f"label=com.docker.compose.project={self.project}",
                      "--format", "{{.Name}}").split()

    @property
    def network(self) -> str:
        return f"{self.project}_default"

    def inspect(self, container: str, template: str) -> str:
        return docker("inspect", "-f", template, container).strip()

    def logs(self, container: str) -> str:
        result = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
        return result.stdout + result.stderr

    # --- the stack's state ---------------------------------------------------------------------------
    def ready_nodes(self, role: str) -> list[dict]:
        try:
            return [n for n in self.nodes() if n["role"] == role and n["ready"]]
        except (OSError, ValueError, urllib.error.URLError):
            return []  # the router is (re)starting

    def wait(self, predicate, timeout: float, what: str, every: float = 1.0):
        """Poll until predicate() is truthy (returns it) or raise TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = predicate()
            except (OSError, ValueError, urllib.error.URLError):
                value = None
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(every)

    def wait_pools(self, timeout: float = 600, **sizes: int) -> None:
        """Until the router lists exactly `sizes[role]` ready nodes of each role named."""
        def ok():
            return all(len(self.ready_nodes(role)) == n for role, n in sizes.items())
        self.wait(ok, timeout, f"ready pools {sizes} (now: "
                  f"{ {r: len(self.ready_nodes(r)) for r in sizes} })")

    def node_metrics(self, role: str) -> dict[str, dict[tuple, float]]:
        """node_id -> {(sample name, sorted labels): value} from each ready node's /metrics."""
        out = {}
        for node in self.ready_nodes(role):
            with urllib.request.urlopen(node["status_url"] + "/metrics", timeout=10) as r:
                out[node["node_id"]] = parse_metrics(r.read().decode())
        return out

    def router_metrics(self) -> dict[tuple, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def promql(self, query: str) -> list[dict]:
        """An instant query's result vector from the stack's Prometheus."""
        url = self.prometheus_url + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
        body = self.get_url(url)
        if body.get("status") != "success":
            raise RuntimeError(f"Prometheus refused {query!r}: {body}")
        return body["data"]["result"]


def parse_metrics(text: str) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric_sum(samples: dict[tuple, float], name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels`."""
    return sum(v for (n, ls), v in samples.items() if n == name and labels.items() <= dict(ls).items())

