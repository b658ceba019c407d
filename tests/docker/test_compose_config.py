"""docker/ without a Docker engine: the compose files validate (`docker-compose config`, Debian's
`docker-compose` package), and the settings that make scaled replicas work hang together."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.harness.compose import compose_command
from tests.docker.compose import (
    COMPOSE_FILE,
    DASHBOARD_FILE,
    DOCKER_DIR,
    GPU_COMPOSE_FILE,
    NODE_SERVICES,
    PROMETHEUS_FILE,
    flag_value,
    load_yaml,
    services,
)

STATUS_PORT = "9100"


@pytest.mark.parametrize("files", [[COMPOSE_FILE], [COMPOSE_FILE, GPU_COMPOSE_FILE]], ids=["cpu", "gpu"])
def test_compose_config_validates(files):
    cmd = compose_command()
    if cmd is None:
        pytest.skip("neither `docker-compose` (apt package docker-compose) nor `docker compose` is installed")
    args = [*cmd, *[a for f in files for a in ("-f", str(f))], "config", "-q"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=DOCKER_DIR)
    assert result.returncode == 0, result.stderr


def test_nodes_can_scale():
    """Replicas must differ: no fixed name, id or published port; each binds 0.0.0.0 and so
    advertises its own container address; fixed in-container ports for Prometheus and KV."""
    svc = services()
    for name in NODE_SERVICES:
        service, argv = svc[name], svc[name]["command"]
        assert "container_name" not in service and "ports" not in service, name
        assert flag_value(argv, "--host") == "0.0.0.0", name
        assert flag_value(argv, "--node-id") is None and flag_value(argv, "--advertise-host") is None, name
        assert flag_value(argv, "--status-port") == STATUS_PORT, name
        assert flag_value(argv, "--router") == "tcp://router:5555", name
        assert "kv-shm:/dev/shm:nocopy" in service["volumes"], name  # the same-host shared-memory KV path
    assert flag_value(svc["decode"]["command"], "--kv-port") == "9200"
    assert flag_value(svc["router"]["command"], "--control-addr") == "tcp://0.0.0.0:5555"


def test_every_long_running_service_has_a_health_check():
    one_shot = ("model-init", "keys")
    for name, service in services().items():
        if name not in one_shot:
            assert "healthcheck" in service, name
    for name in ("router", *NODE_SERVICES):
        for init in one_shot:
            assert services()[name]["depends_on"][init]["condition"] == "service_completed_successfully", (name, init)
    for init in one_shot:
        assert services()[init]["restart"] == "no", init


def test_keys_service_creates_the_curve_keys_once():
    """`keys` writes them into the named volume unless they are there; router and nodes mount it
    read-only and use it; the images own /keys so a fresh volume inherits that ownership."""
    svc = services()
    keys = svc["keys"]
    script = keys["entrypoint"][-1]
    assert keys["entrypoint"][:2] == ["sh", "-c"]
    assert "test -f /keys/server.key_secret" in script and "pdserve keys /keys" in script
    assert "curve-keys:/keys" in keys["volumes"]
    assert "curve-keys" in load_yaml(COMPOSE_FILE)["volumes"]
    for name in ("router", *NODE_SERVICES):
        assert "curve-keys:/keys:ro" in svc[name]["volumes"], name
        assert flag_value(svc[name]["command"], "--zmq-curve-keys") == "/keys", name
    for dockerfile in ("Dockerfile", "Dockerfile.cuda"):
        text = (DOCKER_DIR / dockerfile).read_text()
        assert "mkdir -p /cache /keys" in text and "chown pdserve /cache /keys" in text, dockerfile


def exposed(argv: list[str]) -> bool:
    """A compose command that binds 0.0.0.0 or connects to the router by its service name."""
    return "0.0.0.0" in argv or any(a.startswith("tcp://0.0.0.0") for a in argv) or "tcp://router:5555" in argv


@pytest.mark.parametrize("path", [COMPOSE_FILE, GPU_COMPOSE_FILE], ids=["cpu", "gpu"])
def test_every_exposed_service_has_curve_keys(path):
    """Every pdserve command reachable beyond its container's loopback runs with --zmq-curve-keys
    (or --insecure, said out loud): otherwise pdserve itself would refuse to start it."""
    checked = []
    for name, service in services(path).items():
        argv = service.get("command") or []
        if isinstance(argv, list) and exposed(argv):
            assert "--zmq-curve-keys" in argv or "--insecure" in argv, name
            checked.append(name)
    assert set(NODE_SERVICES) <= set(checked)
    if path == COMPOSE_FILE:
        assert "router" in checked


def test_compose_commands_pass_the_exposure_check():
    """The same check the processes make at start (pdserve.protocol.exposure), on the commands
    as written: they bind 0.0.0.0 and connect to tcp://router:5555, so only their keys let them
    start; without `--zmq-curve-keys` each would be refused."""
    from pdserve.decode_node.__main__ import build_parser as decode_parser
    from pdserve.prefill_node.__main__ import build_parser as prefill_parser
    from pdserve.protocol.exposure import InsecureExposureError, check_sockets, node_sockets, router_sockets
    from pdserve.router.cli import build_parser as router_parser

    roles = {"router": (router_parser, router_sockets), "prefill": (prefill_parser, node_sockets),
             "decode": (decode_parser, node_sockets)}
    for path in (COMPOSE_FILE, GPU_COMPOSE_FILE):
        for name, service in services(path).items():
            if name not in roles or "command" not in service:  # the GPU file keeps the base file's router
                continue
            make_parser, sockets = roles[name]
            role, *argv = service["command"]
            assert role == name
            args = make_parser().parse_args(argv)
            check_sockets(sockets(args), args.zmq_curve_keys, args.insecure)
            args.zmq_curve_keys = None
            with pytest.raises(InsecureExposureError):
                check_sockets(sockets(args), None, False)


def test_gpu_override_targets_cuda():
    gpu = services(GPU_COMPOSE_FILE)
    for name in NODE_SERVICES:
        assert flag_value(gpu[name]["command"], "--device") == "cuda", name
        assert gpu[name]["ipc"] == "host", name
        assert gpu[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
        assert gpu[name]["build"]["dockerfile"] == "docker/Dockerfile.cuda"


def test_prometheus_discovers_node_replicas_by_dns():
    jobs = {job["job_name"]: job for job in load_yaml(PROMETHEUS_FILE)["scrape_configs"]}
    assert jobs["router"]["static_configs"][0]["targets"] == ["router:8000"]
    for name in NODE_SERVICES:
        sd = jobs[name]["dns_sd_configs"][0]
        assert sd["names"] == [name] and sd["type"] == "A" and str(sd["port"]) == STATUS_PORT


def test_grafana_provisioning_points_at_prometheus():
    ds = load_yaml(DOCKER_DIR / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"][0]
    assert ds["url"] == "http://prometheus:9090"
    dashboard = json.loads(DASHBOARD_FILE.read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p.get("targets", [])}
    assert uids == {ds["uid"]}
