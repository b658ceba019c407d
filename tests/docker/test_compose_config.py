"""docker/ without a Docker engine: the compose files validate (`docker-compose config`, Debian's
`docker-compose` package), and the settings that make scaled replicas work hang together."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.docker.compose import (
    COMPOSE_FILE,
    DASHBOARD_FILE,
    DOCKER_DIR,
    GPU_COMPOSE_FILE,
    NODE_SERVICES,
    PROMETHEUS_FILE,
    compose_command,
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
        assert "kv-shm:/dev/shm" in service["volumes"], name  # the same-host shared-memory KV path
    assert flag_value(svc["decode"]["command"], "--kv-port") == "9200"
    assert flag_value(svc["router"]["command"], "--control-addr") == "tcp://0.0.0.0:5555"


def test_every_long_running_service_has_a_health_check():
    for name, service in services().items():
        if name != "model-init":
            assert "healthcheck" in service, name
    init = services()["model-init"]
    for name in ("router", *NODE_SERVICES):
        assert services()[name]["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert init["restart"] == "no"


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
