"""The planner's scalers that act (router/scaling_docker.py, router/scaling_kubernetes.py), against
a fake Docker client and a fake Kubernetes API server; and kubernetes/components/planner renders
and grants just what the Kubernetes scaler calls."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pdserve.router.scaling import make_scaler
from pdserve.router.scaling_docker import (
    NUMBER_LABEL,
    PROJECT_LABEL,
    SERVICE_LABEL,
    DockerScaler,
    DockerScalerError,
    parse_pairs,
)
from pdserve.router.scaling_kubernetes import MERGE_PATCH, KubernetesScaler, KubernetesScalerError
from tests.router.conftest import run

PROJECT = "pd"


# ---- a fake docker.DockerClient -------------------------------------------------------------------
class FakeContainer:
    def __init__(self, client, cid: str, name: str, service: str, number: int, status: str = "running",
                 networks: dict | None = None, project: str = PROJECT) -> None:
        self.client, self.id, self.name, self.status = client, cid, name, status
        labels = {PROJECT_LABEL: project, SERVICE_LABEL: service, NUMBER_LABEL: str(number),
                  "com.docker.compose.config-hash": "abc"}
        self.attrs = {
            "Id": cid, "Name": "/" + name,
            "Config": {"Hostname": cid[:12], "Image": "pdserve:cpu", "Cmd": [service, "--router", "tcp://router:5555"],
                       "Env": ["PDSERVE_CACHE_DIR=/cache"], "Labels": labels, "StopSignal": "SIGTERM"},
            "HostConfig": {"Mounts": [{"Type": "volume", "Source": f"{PROJECT}_model-cache", "Target": "/cache"}],
                           "RestartPolicy": {"Name": "unless-stopped"}, "Init": True},
            "NetworkSettings": {"Networks": networks if networks is not None else
                                {f"{PROJECT}_default": {"Aliases": [name, service, cid[:12]]}}},
        }
        self.stop_timeouts: list[int] = []

    @property
    def labels(self) -> dict:
        return self.attrs["Config"]["Labels"]

    def stop(self, timeout=None):
        self.stop_timeouts.append(timeout)
        self.status = "exited"

    def remove(self):
        self.client.removed.append(self.name)
        self.client.all.remove(self)


class FakeAPI:
    def __init__(self, client) -> None:
        self.client = client
        self.created: list[tuple[str, dict]] = []
        self.connected: list[tuple[str, str, list]] = []
        self.fail_start = False

    def create_container_from_config(self, config, name=None, platform=None):
        if any(c.name == name for c in self.client.all):
            raise RuntimeError(f"409 Conflict: name {name} in use")
        self.created.append((name, config))
        labels = config["Labels"]
        cid = f"{len(self.client.all):02d}" + "f" * 62
        c = FakeContainer(self.client, cid, name, labels[SERVICE_LABEL], int(labels[NUMBER_LABEL]), status="created")
        c.attrs["Config"] = {k: v for k, v in config.items() if k not in ("HostConfig", "NetworkingConfig")}
        self.client.all.append(c)
        return {"Id": cid, "Warnings": []}

    def connect_container_to_network(self, cid, net, aliases=None):
        self.connected.append((cid, net, aliases))

    def start(self, cid):
        if self.fail_start:
            raise RuntimeError("500 Server Error: cannot start")
        next(c for c in self.client.all if c.id == cid).status = "running"

    def remove_container(self, cid, force=False):
        self.client.all[:] = [c for c in self.client.all if c.id != cid]


class FakeContainers:
    def __init__(self, client) -> None:
        self.client = client

    def list(self, all=False, filters=None):
        wanted = dict(f.split("=", 1) for f in (filters or {}).get("label", []))
        return [c for c in self.client.all if (all or c.status == "running")
                and all_labels_match(c.labels, wanted)]

    def get(self, cid):
        for c in self.client.all:
            if c.id.startswith(cid) or c.name == cid:
                return c
        raise KeyError(cid)


def all_labels_match(labels: dict, wanted: dict) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


class FakeDocker:
    def __init__(self) -> None:
        self.all: list[FakeContainer] = []
        self.removed: list[str] = []
        self.api = FakeAPI(self)
        self.containers = FakeContainers(self)

    def add(self, service: str, number: int, status: str = "running", **kw) -> FakeContainer:
        cid = f"{service[:1]}{number:02d}" + "0" * 61
        c = FakeContainer(self, cid, f"{PROJECT}-{service}-{number}", service, number, status, **kw)
        self.all.append(c)
        return c

    def names(self, service: str, status: str = "running") -> list[str]:
        return sorted(c.name for c in self.all if c.labels[SERVICE_LABEL] == service and c.status == status)


def fleet(prefill: int = 1, decode: int = 1) -> FakeDocker:
    client = FakeDocker()
    for i in range(1, prefill + 1):
        client.add("prefill", i)
    for i in range(1, decode + 1):
        client.add("decode", i)
    client.add("router", 1)
    return client


async def apply_and_settle(scaler: DockerScaler, desired: dict) -> None:
    await scaler.apply(desired, "test")
    await scaler.wait_stopped()


# ---- docker -------------------------------------------------------------------------------------
def test_docker_scale_up_clones_an_existing_container():
    client = fleet(prefill=1, decode=1)
    scaler = DockerScaler(client, PROJECT)
    run(apply_and_settle(scaler, {"prefill": 1, "decode": 3}))
    assert client.names("decode") == ["pd-decode-1", "pd-decode-2", "pd-decode-3"]
    assert client.names("prefill") == ["pd-prefill-1"]
    (name, config), _ = client.api.created
    assert name == "pd-decode-2"
    template = client.all[1].attrs  # pd-decode-1
    assert config["Image"] == "pdserve:cpu" and config["Cmd"] == template["Config"]["Cmd"]
    assert config["Env"] == template["Config"]["Env"]
    assert "Hostname" not in config  # its own, not the template's
    assert config["Labels"][NUMBER_LABEL] == "2"
    assert config["Labels"][PROJECT_LABEL] == PROJECT and config["Labels"][SERVICE_LABEL] == "decode"
    assert config["Labels"]["com.docker.compose.config-hash"] == "abc"
    assert config["HostConfig"] == template["HostConfig"]  # volumes, restart policy, init
    endpoints = config["NetworkingConfig"]["EndpointsConfig"]
    assert list(endpoints) == [f"{PROJECT}_default"]
    aliases = endpoints[f"{PROJECT}_default"]["Aliases"]
    assert "decode" in aliases and "pd-decode-2" in aliases  # Prometheus and peers find it by the service name
    assert "pd-decode-1" not in aliases and client.all[1].id[:12] not in aliases
    assert scaler.current() == {"prefill": 1, "decode": 3}


def test_docker_scale_up_joins_every_network_of_the_template():
    client = FakeDocker()
    client.add("decode", 1, networks={"pd_default": {"Aliases": ["decode"]}, "pd_kv": {"Aliases": ["decode"]}})
    run(apply_and_settle(DockerScaler(client, PROJECT), {"decode": 2}))
    (name, config), = client.api.created
    assert list(config["NetworkingConfig"]["EndpointsConfig"]) == ["pd_default"]
    ((cid, net, aliases),) = client.api.connected
    assert net == "pd_kv" and "decode" in aliases and cid == client.all[-1].id


def test_docker_scale_down_stops_the_highest_numbered_with_a_drain_timeout():
    client = fleet(prefill=2, decode=4)
    scaler = DockerScaler(client, PROJECT, stop_timeout_s=45)
    stopped = {c.name: c for c in client.all}
    run(apply_and_settle(scaler, {"prefill": 2, "decode": 2}))
    assert client.names("decode") == ["pd-decode-1", "pd-decode-2"]
    assert sorted(client.removed) == ["pd-decode-3", "pd-decode-4"]
    assert stopped["pd-decode-4"].stop_timeouts == [45] and stopped["pd-decode-3"].stop_timeouts == [45]
    assert stopped["pd-decode-1"].stop_timeouts == []


def test_docker_scale_down_does_not_wait_for_the_drain_and_counts_stopping_nodes_out():
    client = fleet(prefill=1, decode=3)
    release = asyncio.Event()

    async def scenario():
        scaler = DockerScaler(client, PROJECT)
        loop = asyncio.get_running_loop()
        for c in client.all:
            real_stop = c.stop

            def slow_stop(timeout=None, real_stop=real_stop):
                asyncio.run_coroutine_threadsafe(release.wait(), loop).result(5)
                real_stop(timeout)
            c.stop = slow_stop
        await asyncio.wait_for(scaler.apply({"prefill": 1, "decode": 1}, "test"), 2)  # returns while draining
        assert scaler.current() == {"prefill": 1, "decode": 1}
        await scaler.apply({"prefill": 1, "decode": 1}, "again")  # no second stop of the same nodes
        assert len(scaler._stopping) == 2
        release.set()
        await scaler.wait_stopped()

    run(scenario())
    assert sorted(client.removed) == ["pd-decode-2", "pd-decode-3"]


def test_docker_no_op_when_sizes_match():
    client = fleet(prefill=2, decode=2)
    scaler = DockerScaler(client, PROJECT)
    run(apply_and_settle(scaler, {"prefill": 2, "decode": 2}))
    assert client.api.created == [] and client.removed == []
    run(apply_and_settle(scaler, {}))  # nothing asked
    assert client.api.created == [] and client.removed == []


def test_docker_floors_decode_at_one_and_keeps_the_last_prefill_as_template():
    client = fleet(prefill=2, decode=2)
    scaler = DockerScaler(client, PROJECT)
    run(apply_and_settle(scaler, {"prefill": 0, "decode": 0}))
    assert client.names("decode") == ["pd-decode-1"]
    assert client.names("prefill") == [] and client.names("prefill", "exited") == ["pd-prefill-1"]
    assert client.removed == ["pd-prefill-2", "pd-decode-2"]
    # Back up from 0: the stopped one is the template; numbers never collide with it.
    run(apply_and_settle(scaler, {"prefill": 1, "decode": 1}))
    assert client.names("prefill") == ["pd-prefill-2"]
    assert scaler.current() == {"prefill": 1, "decode": 1}


def test_docker_ignores_other_projects_and_one_off_containers_and_counts_only_running():
    client = fleet(prefill=1, decode=1)
    client.add("decode", 7, project="other")
    oneoff = client.add("decode", 9)
    oneoff.labels["com.docker.compose.oneoff"] = "True"
    client.add("decode", 5, status="exited")
    scaler = DockerScaler(client, PROJECT)
    assert scaler.current() == {"prefill": 1, "decode": 1}
    run(apply_and_settle(scaler, {"prefill": 1, "decode": 2}))
    assert client.api.created[0][0] == "pd-decode-6"  # past every number in use, stopped ones too


def test_docker_service_names_come_from_the_mapping():
    client = FakeDocker()
    client.add("gen", 1)
    scaler = DockerScaler(client, PROJECT, {"decode": "gen"})
    run(apply_and_settle(scaler, {"prefill": 3, "decode": 2}))
    assert client.names("gen") == ["pd-gen-1", "pd-gen-2"]


def test_docker_errors_are_raised_for_the_loop_to_log():
    client = FakeDocker()
    client.add("decode", 1)
    scaler = DockerScaler(client, PROJECT)
    with pytest.raises(DockerScalerError, match="no container of service 'prefill'.*--scale prefill=1"):
        run(scaler.apply({"prefill": 1, "decode": 2}, "test"))
    assert client.names("decode") == ["pd-decode-1", "pd-decode-2"]  # the other pool still scaled
    client.api.fail_start = True
    with pytest.raises(DockerScalerError, match="cannot start"):
        run(scaler.apply({"decode": 3}, "test"))
    assert [c.name for c in client.all] == ["pd-decode-1", "pd-decode-2"]  # the half-made one is removed


def test_docker_from_env_finds_the_project_from_its_own_container(monkeypatch):
    client = fleet()
    router = client.all[-1]
    monkeypatch.setattr("socket.gethostname", lambda: router.id[:12])
    monkeypatch.delenv("PDSERVE_COMPOSE_PROJECT", raising=False)
    monkeypatch.setenv("PDSERVE_SCALER_SERVICES", "prefill=p,decode=d")
    monkeypatch.setenv("PDSERVE_SCALER_STOP_TIMEOUT", "90")
    scaler = DockerScaler.from_env(client)
    assert (scaler.project, scaler.services, scaler.stop_timeout_s) == (PROJECT, {"prefill": "p", "decode": "d"}, 90)
    monkeypatch.setenv("PDSERVE_COMPOSE_PROJECT", "elsewhere")
    assert DockerScaler.from_env(client).project == "elsewhere"
    monkeypatch.delenv("PDSERVE_COMPOSE_PROJECT")
    monkeypatch.setattr("socket.gethostname", lambda: "not-a-container")
    with pytest.raises(DockerScalerError, match="PDSERVE_COMPOSE_PROJECT"):
        DockerScaler.from_env(client)


def test_parse_pairs():
    assert parse_pairs(" prefill=a , decode=b,", "X") == {"prefill": "a", "decode": "b"}
    for bad in ("prefill", "=a", "prefill=", ""):
        with pytest.raises(ValueError, match="X"):
            parse_pairs(bad, "X")


# ---- kubernetes ---------------------------------------------------------------------------------
class FakeKubeAPI:
    """The scale subresource of some Deployments; records every call."""

    def __init__(self, replicas: dict[str, int], token: str = "tok", allow: set[str] | None = None) -> None:
        self.replicas, self.token = dict(replicas), token
        self.allow = allow if allow is not None else {"get", "patch"}
        self.calls: list[tuple[str, str, str | None, str | None]] = []

    def app(self) -> web.Application:
        app = web.Application()
        path = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
        app.router.add_get(path, self.handle)
        app.router.add_patch(path, self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.text() if request.method == "PATCH" else None
        self.calls.append((request.method, request.path, request.headers.get("Content-Type"), body))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"kind": "Status", "message": "Unauthorized"}, status=401)
        ns, name = request.match_info["ns"], request.match_info["name"]
        verb = request.method.lower()
        if verb not in self.allow:
            return web.json_response({"kind": "Status", "reason": "Forbidden", "message":
                                      f'deployments.apps "{name}" is forbidden: User "system:serviceaccount:{ns}:'
                                      f'pdserve-router" cannot {verb} resource "deployments/scale"'}, status=403)
        if ns != "pds" or name not in self.replicas:
            return web.json_response({"kind": "Status", "message": "not found"}, status=404)
        if verb == "patch":
            self.replicas[name] = json.loads(body)["spec"]["replicas"]
        return web.json_response({"kind": "Scale", "apiVersion": "autoscaling/v1",
                                  "metadata": {"name": name, "namespace": ns},
                                  "spec": {"replicas": self.replicas[name]}, "status": {"replicas": self.replicas[name]}})


async def with_kube(fake: FakeKubeAPI, tmp_path: Path, scenario):
    token = tmp_path / "token"
    token.write_text(fake.token + "\n")
    server = TestServer(fake.app())
    await server.start_server()
    scaler = KubernetesScaler(str(server.make_url("")), "pds", token_path=str(token), ca_path=None)
    try:
        return await scenario(scaler)
    finally:
        await scaler.close()
        await server.close()


PREFILL_PATH = "/apis/apps/v1/namespaces/pds/deployments/pdserve-prefill/scale"
DECODE_PATH = "/apis/apps/v1/namespaces/pds/deployments/pdserve-decode/scale"


def test_kubernetes_patches_only_what_changed(tmp_path):
    fake = FakeKubeAPI({"pdserve-prefill": 1, "pdserve-decode": 2})
    run(with_kube(fake, tmp_path, lambda s: s.apply({"prefill": 1, "decode": 5}, "test")))
    assert fake.calls == [("GET", PREFILL_PATH, None, None), ("GET", DECODE_PATH, None, None),
                          ("PATCH", DECODE_PATH, MERGE_PATCH, json.dumps({"spec": {"replicas": 5}}))]
    assert fake.replicas == {"pdserve-prefill": 1, "pdserve-decode": 5}
    fake.calls.clear()
    run(with_kube(fake, tmp_path, lambda s: s.apply({"prefill": 1, "decode": 5}, "again")))
    assert [c[0] for c in fake.calls] == ["GET", "GET"]  # no-op


def test_kubernetes_floors_decode_at_one(tmp_path):
    fake = FakeKubeAPI({"pdserve-prefill": 2, "pdserve-decode": 2})
    run(with_kube(fake, tmp_path, lambda s: s.apply({"prefill": 0, "decode": 0}, "idle")))
    assert fake.replicas == {"pdserve-prefill": 0, "pdserve-decode": 1}


def test_kubernetes_forbidden_names_the_missing_permission(tmp_path):
    fake = FakeKubeAPI({"pdserve-prefill": 1, "pdserve-decode": 1}, allow={"get"})
    with pytest.raises(KubernetesScalerError) as e:
        run(with_kube(fake, tmp_path, lambda s: s.apply({"prefill": 2, "decode": 1}, "test")))
    message = str(e.value)
    assert "403" in message and "may not patch deployments/scale" in message
    assert "verbs [get, patch]" in message and "components/planner" in message and "pdserve-router" in message


def test_kubernetes_bad_token_and_missing_deployment(tmp_path):
    fake = FakeKubeAPI({"pdserve-decode": 1})

    async def scenario(s):
        fake.token = "not-the-file's"
        with pytest.raises(KubernetesScalerError, match="401 Unauthorized: the ServiceAccount token"):
            await s.apply({"decode": 2}, "test")
        fake.token = "tok"
        with pytest.raises(KubernetesScalerError, match="404: no Deployment 'pdserve-prefill'"):
            await s.apply({"prefill": 1, "decode": 2}, "test")
        assert fake.replicas["pdserve-decode"] == 2  # the other pool still scaled

    run(with_kube(fake, tmp_path, scenario))


def test_kubernetes_rereads_the_rotated_token(tmp_path):
    fake = FakeKubeAPI({"pdserve-prefill": 1, "pdserve-decode": 1})

    async def scenario(s):
        await s.apply({"decode": 2}, "test")
        Path(s.token_path).write_text("rotated")
        fake.token = "rotated"
        await s.apply({"decode": 3}, "test")

    run(with_kube(fake, tmp_path, scenario))
    assert fake.replicas["pdserve-decode"] == 3


def test_kubernetes_unreachable_api_is_an_error(tmp_path):
    (tmp_path / "token").write_text("t")

    async def scenario():
        s = KubernetesScaler("http://127.0.0.1:9", "pds", token_path=str(tmp_path / "token"), ca_path=None)
        try:
            await s.apply({"decode": 2}, "test")
        finally:
            await s.close()

    with pytest.raises(KubernetesScalerError):
        run(scenario())


def test_kubernetes_from_env(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("t")
    (tmp_path / "namespace").write_text("serving\n")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv("PDSERVE_SCALER_DEPLOYMENTS", "prefill=p,decode=d")
    monkeypatch.delenv("PDSERVE_SCALER_NAMESPACE", raising=False)
    s = KubernetesScaler.from_env(str(tmp_path))
    assert (s.api_url, s.namespace, s.deployments) == ("https://[fd00::1]:6443", "serving", {"prefill": "p", "decode": "d"})
    assert s.scale_path("d") == "/apis/apps/v1/namespaces/serving/deployments/d/scale"
    monkeypatch.setenv("PDSERVE_SCALER_NAMESPACE", "other")
    assert KubernetesScaler.from_env(str(tmp_path)).namespace == "other"
    os.remove(tmp_path / "token")
    with pytest.raises(KubernetesScalerError, match="automountServiceAccountToken"):
        KubernetesScaler.from_env(str(tmp_path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(KubernetesScalerError, match="KUBERNETES_SERVICE_HOST"):
        KubernetesScaler.from_env(str(tmp_path))


def test_make_scaler_reaches_both(monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubernetesScalerError):
        make_scaler("kubernetes")
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(DockerScalerError, match="docker.sock|docker package"):
        make_scaler("docker")


# ---- kubernetes/components/planner --------------------------------------------------------------
def planner_overlay(tmp_path: Path, base: str = "cpu") -> list[dict]:
    from tests.k8s.test_kubernetes import K8S_DIR, render

    rel = os.path.relpath(K8S_DIR / "overlays" / f"{base}-planner", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: serving\n"
        f"resources:\n  - {rel}\n")
    return render(tmp_path)


def test_planner_overlay_grants_scale_to_the_router_only(tmp_path):
    from tests.k8s.test_kubernetes import K8S_DIR, container, objects, parsed_args, pod_spec, render

    objs = render(K8S_DIR / "overlays" / "cpu-planner")
    assert not objects(objs, "HorizontalPodAutoscaler")  # the planner owns the replicas
    (role,) = objects(objs, "Role").values()
    (rule,) = role["rules"]
    assert rule == {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "patch"],
                    "resourceNames": ["pdserve-prefill", "pdserve-decode"]}
    (binding,) = objects(objs, "RoleBinding").values()
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    (subject,) = binding["subjects"]
    assert subject["kind"] == "ServiceAccount" and subject["name"] in objects(objs, "ServiceAccount")
    router = pod_spec(objs, "router")
    assert router["serviceAccountName"] == subject["name"] and router["automountServiceAccountToken"] is True
    assert deployment_replicas(objs, "router") == 1  # one planner: each replica would see only its clients
    for role_name in ("prefill", "decode"):
        assert pod_spec(objs, role_name)["automountServiceAccountToken"] is False
        assert "replicas" not in objects(objs, "Deployment")[f"pdserve-{role_name}"]["spec"]
    args = parsed_args(objs, "router")
    assert args.planner and args.planner_scaler == "kubernetes"
    env = {e["name"]: e.get("value") for e in container(objs, "router")["env"]}
    deployments = parse_pairs(env["PDSERVE_SCALER_DEPLOYMENTS"], "PDSERVE_SCALER_DEPLOYMENTS")
    assert sorted(deployments.values()) == sorted(rule["resourceNames"])
    assert set(deployments.values()) <= set(objects(objs, "Deployment"))
    # In a namespace of the user's, the binding's subject follows it.
    namespaced = planner_overlay(tmp_path)
    (binding,) = objects(namespaced, "RoleBinding").values()
    assert binding["subjects"][0]["namespace"] == "serving"


def deployment_replicas(objs: list[dict], role: str) -> int:
    from tests.k8s.test_kubernetes import deployment

    return deployment(objs, role)["spec"]["replicas"]


def test_planner_overlay_validates_against_the_kubernetes_schemas():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from tests.k8s.test_kubernetes import K8S_DIR, MIN_KUBERNETES, render

    for obj in render(K8S_DIR / "overlays" / "cpu-planner"):
        for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
            kubernetes_validate.validate(obj, version, strict=True)


# ---- docker/docker-compose.planner.yml ----------------------------------------------------------
def test_compose_planner_override_runs_the_base_router_with_the_docker_scaler():
    from pdserve.router.cli import build_parser
    from tests.docker.compose import COMPOSE_FILE, DOCKER_DIR, services

    base = services(COMPOSE_FILE)["router"]
    override = services(DOCKER_DIR / "docker-compose.planner.yml")
    assert set(override) == {"router"}
    router = override["router"]
    assert router["command"] == [*base["command"], "--planner", "--planner-scaler", "docker"]
    args = build_parser().parse_args(router["command"][1:])
    assert args.planner and args.planner_scaler == "docker"
    assert router["volumes"] == ["/var/run/docker.sock:/var/run/docker.sock"]
    stop_timeout = float(router["environment"]["PDSERVE_SCALER_STOP_TIMEOUT"])
    for name in ("prefill", "decode"):  # the scaler gives a node as long to drain as compose does
        assert stop_timeout >= float(services(COMPOSE_FILE)[name]["stop_grace_period"].rstrip("s")), name


def test_compose_planner_override_validates():
    import subprocess

    from benchmarks.harness.compose import compose_command
    from tests.docker.compose import COMPOSE_FILE, DOCKER_DIR

    cmd = compose_command()
    if cmd is None:
        pytest.skip("neither `docker-compose` nor `docker compose` is installed")
    result = subprocess.run([*cmd, "-f", str(COMPOSE_FILE), "-f", str(DOCKER_DIR / "docker-compose.planner.yml"),
                             "config", "-q"], capture_output=True, text=True, timeout=120, cwd=DOCKER_DIR)
    assert result.returncode == 0, result.stderr


# ---- a real Docker engine (slow: needs dockerd and gcc; no registry) ------------------------------
SLEEPER_C = ("#include <signal.h>\n#include <unistd.h>\nstatic void term(int s) { _exit(0); }\n"
             "int main(void) { signal(SIGTERM, term); for (;;) pause(); }\n")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_docker_scaler_against_a_real_engine(tmp_path):
    """Compose-labelled containers of a one-binary image (a static C program that waits for SIGTERM,
    `docker import`ed: no registry needed): up clones with the volume, env, restart policy and the
    service's DNS alias; down to 0 keeps a stopped template; up from 0 clones it."""
    import shutil
    import subprocess
    import tarfile
    import uuid

    docker = pytest.importorskip("docker")
    try:
        client = docker.from_env()
        client.ping()
    except Exception as e:
        pytest.skip(f"no Docker engine: {e}")
    if shutil.which("gcc") is None:
        pytest.skip("no gcc for the test image's static binary")
    (tmp_path / "sleeper.c").write_text(SLEEPER_C)
    subprocess.run(["gcc", "-static", "-O2", "-o", str(tmp_path / "sleeper"), str(tmp_path / "sleeper.c")], check=True)
    with tarfile.open(tmp_path / "root.tar", "w") as tar:
        tar.add(tmp_path / "sleeper", arcname="sleeper")
    project = f"pdtest{uuid.uuid4().hex[:8]}"
    image = f"{project}:latest"
    subprocess.run(["docker", "import", str(tmp_path / "root.tar"), image], check=True, capture_output=True)
    network = client.networks.create(f"{project}_default")
    volume = client.volumes.create(f"{project}_cache")
    try:
        for service in ("prefill", "decode"):
            client.containers.run(image, ["/sleeper"], name=f"{project}-{service}-1", detach=True,
                                  network=network.name, environment={"FOO": "bar"},
                                  volumes={volume.name: {"bind": "/cache", "mode": "rw"}},
                                  restart_policy={"Name": "unless-stopped"},
                                  labels={PROJECT_LABEL: project, SERVICE_LABEL: service, NUMBER_LABEL: "1"})
        network.disconnect(f"{project}-decode-1")  # again, with the alias compose gives: its service name
        network.connect(f"{project}-decode-1", aliases=["decode"])

        async def scenario():
            scaler = DockerScaler(client, project, stop_timeout_s=5)
            await apply_and_settle(scaler, {"prefill": 1, "decode": 3})
            assert scaler.current() == {"prefill": 1, "decode": 3}
            clone = client.containers.get(f"{project}-decode-3")
            assert clone.status == "running" and clone.labels[NUMBER_LABEL] == "3"
            assert clone.attrs["Config"]["Env"] == ["FOO=bar"] and clone.attrs["Config"]["Cmd"] == ["/sleeper"]
            assert [m["Name"] for m in clone.attrs["Mounts"]] == [volume.name]
            assert clone.attrs["HostConfig"]["RestartPolicy"]["Name"] == "unless-stopped"
            assert "decode" in clone.attrs["NetworkSettings"]["Networks"][network.name]["Aliases"]
            await apply_and_settle(scaler, {"prefill": 0, "decode": 0})
            assert scaler.current() == {"prefill": 0, "decode": 1}
            assert client.containers.get(f"{project}-prefill-1").status == "exited"
            await apply_and_settle(scaler, {"prefill": 1, "decode": 1})
            assert scaler.current() == {"prefill": 1, "decode": 1}

        run(scenario(), timeout_s=120)
    finally:
        for c in client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={project}"}):
            c.remove(force=True)
        network.remove()
        volume.remove()
        client.images.remove(image)
