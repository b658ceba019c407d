"""kubernetes/ without a cluster: the Kustomize overlays render (`kubectl kustomize`, or a standalone
`kustomize`), every object validates against the Kubernetes OpenAPI schemas (kubernetes_validate,
1.30 and the newest it ships), the pods run what docker/docker-compose.yml runs, and the settings
that make pools scale, drain, autoscale and stay private hang together."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.docker.compose import COMPOSE_FILE, DOCKER_DIR, GPU_COMPOSE_FILE, flag_value, services

REPO = Path(__file__).resolve().parents[2]
K8S_DIR = REPO / "kubernetes"
OVERLAYS = ("cpu", "gpu")
MONITORING = K8S_DIR / "monitoring"
ADAPTER_VALUES = MONITORING / "prometheus-adapter-values.yaml"
ROLES = ("router", "prefill", "decode")
NODE_ROLES = ("prefill", "decode")
MIN_KUBERNETES = "1.30"
ROUTER_SERVICE = "pdserve-router"  # clients (HTTP), spread over the router replicas
ROUTER_NODES_SERVICE = "pdserve-router-nodes"  # headless: nodes find every router replica (control)
CURVE_SECRET = "pdserve-curve-keys"
POD_IP = "10.0.0.7"  # stands for $(POD_IP) where args are parsed
# Flags of the k8s pods that differ from compose on purpose (each said in the manifests' comments):
# the router's address is its Service's name; the GPU overlay gives each pod a whole GPU.
GPU_MEMORY_UTILIZATION = "0.9"


# ---- rendering -----------------------------------------------------------------------------------
def kustomize_command() -> list[str] | None:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


@functools.cache
def _render(path: str) -> tuple[dict, ...]:
    cmd = kustomize_command()
    result = subprocess.run([*cmd, path], capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, f"{' '.join(cmd)} {path} failed:\n{result.stderr}"
    return tuple(obj for obj in yaml.safe_load_all(result.stdout) if obj)


def render(path: Path) -> list[dict]:
    if kustomize_command() is None:
        pytest.skip("neither `kubectl` (with its built-in kustomize) nor `kustomize` is on PATH")
    return [dict(obj) for obj in _render(str(path))]


def overlay(name: str) -> list[dict]:
    return render(K8S_DIR / "overlays" / name)


def objects(objs: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def deployment(objs: list[dict], role: str) -> dict:
    return objects(objs, "Deployment")[f"pdserve-{role}"]


def pod_spec(objs: list[dict], role: str) -> dict:
    return deployment(objs, role)["spec"]["template"]["spec"]


def container(objs: list[dict], role: str) -> dict:
    (c,) = [c for c in pod_spec(objs, role)["containers"] if c["name"] == role]
    return c


def env_map(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def compose_services(name: str) -> dict[str, dict]:
    """The compose services an overlay corresponds to, interpolated: the base file, with the GPU
    file's overrides (image, node commands) for `gpu`."""
    svc = services(COMPOSE_FILE)
    if name == "gpu":
        for key, override in services(GPU_COMPOSE_FILE).items():
            svc[key] = {**svc[key], **override}
    return svc


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": labels.get(key) in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def pod_labels(objs: list[dict], role: str) -> dict:
    return deployment(objs, role)["spec"]["template"]["metadata"]["labels"]


# ---- 1, 2: render and validate ------------------------------------------------------------------
@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_renders_every_part(name):
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in overlay(name))
    assert kinds == sorted([
        ("Deployment", "pdserve-router"), ("Service", "pdserve-router"), ("Service", "pdserve-router-nodes"),
        ("PodDisruptionBudget", "pdserve-router"),
        ("Deployment", "pdserve-prefill"), ("Deployment", "pdserve-decode"),
        ("PodDisruptionBudget", "pdserve-prefill"), ("PodDisruptionBudget", "pdserve-decode"),
        ("HorizontalPodAutoscaler", "pdserve-prefill"), ("HorizontalPodAutoscaler", "pdserve-decode"),
        ("NetworkPolicy", "pdserve-router"), ("NetworkPolicy", "pdserve-nodes"),
    ])


@pytest.mark.parametrize("target", [*(f"overlays/{n}" for n in OVERLAYS), "monitoring"])
def test_every_object_validates_against_the_kubernetes_schemas(target):
    """Strict: an unknown field fails as a wrong type does. No custom resources: each kind has a
    schema among the built-in APIs (SchemaNotFoundError otherwise)."""
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objs = render(K8S_DIR / target)
    assert objs
    for version in (MIN_KUBERNETES, kubernetes_validate.latest_version()):
        for obj in objs:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{target}: {obj['kind']}/{obj['metadata']['name']} invalid for {version}: {e.message}")


def test_no_secret_is_rendered():
    """The CURVE keys Secret is created out of band (`pdserve keys` + `kubectl create secret`):
    nothing under kubernetes/ carries key material or generates a Secret."""
    for name in OVERLAYS:
        assert not objects(overlay(name), "Secret"), name
    for path in K8S_DIR.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert "secretGenerator" not in text and "secret-key" not in text, path  # pyzmq's key file field


# ---- 3: the same roles, flags, ports and environment as compose ----------------------------------
def normalized_args(role: str, argv: list[str], name: str) -> list[str]:
    """The k8s args with their intended differences from compose undone."""
    argv = list(argv)
    if role in NODE_ROLES:
        i = argv.index("--advertise-host")
        assert argv[i + 1] == "$(POD_IP)", role
        del argv[i:i + 2]
        router = flag_value(argv, "--router")
        assert router == f"tcp://{ROUTER_NODES_SERVICE}:5555", role
        argv[argv.index("--router") + 1] = "tcp://router:5555"  # compose's service name
        if name == "gpu":
            assert flag_value(argv, "--gpu-memory-utilization") == GPU_MEMORY_UTILIZATION, role
            compose_value = flag_value(compose_services("gpu")[role]["command"], "--gpu-memory-utilization")
            argv[argv.index("--gpu-memory-utilization") + 1] = compose_value
    return argv


@pytest.mark.parametrize("name", OVERLAYS)
def test_role_commands_match_compose(name):
    objs, svc = overlay(name), compose_services(name)
    for role in ROLES:
        argv = container(objs, role)["args"]
        assert argv[0] == role
        assert normalized_args(role, argv, name) == svc[role]["command"], role
        assert "command" not in container(objs, role), role  # the image's entrypoint: pdserve


@pytest.mark.parametrize("name", OVERLAYS)
def test_images_match_compose(name):
    objs, svc = overlay(name), compose_services(name)
    for role in ROLES:
        spec = pod_spec(objs, role)
        for c in spec["containers"] + spec.get("initContainers", []):
            assert c["image"] == svc[role]["image"], (role, c["name"])


def container_port_numbers(c: dict) -> set[int]:
    return {p["containerPort"] for p in c.get("ports", [])}


@pytest.mark.parametrize("name", OVERLAYS)
def test_ports_match_compose(name):
    objs, svc = overlay(name), compose_services(name)
    router_cmd = svc["router"]["command"]
    http = int(flag_value(router_cmd, "--port"))
    control = int(flag_value(router_cmd, "--control-addr").rsplit(":", 1)[1])
    assert [p.split(":")[-1] for p in svc["router"]["ports"]] == [str(http)]
    assert container_port_numbers(container(objs, "router")) == {http, control}
    named = {p["name"]: p["containerPort"] for p in container(objs, "router")["ports"]}
    for name_, ports in ((ROUTER_SERVICE, {(http, http)}), (ROUTER_NODES_SERVICE, {(control, control)})):
        service = objects(objs, "Service")[name_]
        assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(objs, "router"))
        assert {(p["port"], named.get(p["targetPort"], p["targetPort"])) for p in service["spec"]["ports"]} == ports
    expected = {"prefill": {"--status-port"}, "decode": {"--status-port", "--kv-port"}}
    for role, flags in expected.items():
        ports = {int(flag_value(svc[role]["command"], f)) for f in flags}
        assert container_port_numbers(container(objs, role)) == ports, role


@pytest.mark.parametrize("name", OVERLAYS)
def test_environment_matches_compose(name):
    objs, svc = overlay(name), compose_services(name)
    for role in ROLES:
        env, compose_env = env_map(container(objs, role)), svc[role]["environment"]
        extra = {"POD_IP"} if role in NODE_ROLES else set()
        assert set(env) == set(compose_env) | extra, role
        for key, value in compose_env.items():
            if key == "PDSERVE_API_KEY":  # compose: ${PDSERVE_API_KEY:-}, unset = open; here an optional Secret
                ref = env[key]["valueFrom"]["secretKeyRef"]
                assert ref["optional"] is True, role
            else:
                assert env[key].get("value") == str(value), (role, key)
        if role in NODE_ROLES:
            assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", role


@pytest.mark.parametrize("name", OVERLAYS)
def test_mounts_match_compose(name):
    """Every path compose mounts into a role's container is mounted here too, read-only where
    compose says `:ro` (named volumes become emptyDirs, the keys volume the CURVE Secret)."""
    objs, svc = overlay(name), compose_services(name)
    for role in ROLES:
        mounts = {m["mountPath"]: m for m in container(objs, role)["volumeMounts"]}
        for volume in svc[role]["volumes"]:
            _, path, *options = volume.split(":")
            assert path in mounts, (role, path)
            assert bool(mounts[path].get("readOnly")) == ("ro" in options), (role, path)


@pytest.mark.parametrize("name", OVERLAYS)
def test_model_is_fetched_by_an_init_container_as_compose_does(name):
    """compose's one-shot `model-init` becomes an initContainer per pod, converting the model into
    the /cache volume that the role's container then reads."""
    objs, model_init = overlay(name), compose_services(name)["model-init"]
    for role in ROLES:
        spec = pod_spec(objs, role)
        (init,) = spec["initContainers"]
        assert init["command"] == model_init["entrypoint"] and init["args"] == model_init["command"], role
        assert {e["name"]: e["value"] for e in init["env"]} == {k: str(v) for k, v in model_init["environment"].items()}
        init_cache = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}["/cache"]
        main_cache = {m["mountPath"]: m["name"] for m in container(objs, role)["volumeMounts"]}["/cache"]
        assert init_cache == main_cache, role
        assert flag_value(container(objs, role)["args"], "--model") == model_init["command"][0], role


def role_parsers():
    from pdserve.decode_node.__main__ import build_parser as decode_parser
    from pdserve.prefill_node.__main__ import build_parser as prefill_parser
    from pdserve.router.cli import build_parser as router_parser

    return {"router": router_parser, "prefill": prefill_parser, "decode": decode_parser}


def parsed_args(objs: list[dict], role: str):
    _, *argv = [a.replace("$(POD_IP)", POD_IP) for a in container(objs, role)["args"]]
    return role_parsers()[role]().parse_args(argv)


@pytest.mark.parametrize("name", OVERLAYS)
def test_args_parse_and_pass_the_exposure_check(name):
    """The roles' own parsers take the args, and pdserve's start-up check passes them only because
    of the keys: each binds 0.0.0.0 or connects to the router's Service."""
    from pdserve.protocol.exposure import InsecureExposureError, check_sockets, node_sockets, router_sockets

    objs = overlay(name)
    for role in ROLES:
        args = parsed_args(objs, role)
        sockets = router_sockets if role == "router" else node_sockets
        assert not args.insecure, role
        check_sockets(sockets(args), args.zmq_curve_keys, args.insecure)
        with pytest.raises(InsecureExposureError):
            check_sockets(sockets(args), None, False)
        if role in NODE_ROLES:
            assert args.host == "0.0.0.0" and args.advertise_host == POD_IP, role


# ---- 4: probes, drain, disruption budgets --------------------------------------------------------
def resolve_port(c: dict, port) -> int:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}.get(port, port)


def prestop_seconds(c: dict) -> float:
    pre = c["lifecycle"]["preStop"]
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    cmd = pre["exec"]["command"]
    assert cmd[0] == "sleep" and len(cmd) == 2, cmd
    return float(cmd[1])


@pytest.mark.parametrize("name", OVERLAYS)
def test_nodes_are_probed_on_health_and_drain_within_the_grace_period(name):
    objs = overlay(name)
    for role in NODE_ROLES:
        c, args = container(objs, role), parsed_args(objs, role)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c[probe]["httpGet"]
            assert get["path"] == "/health", (role, probe)
            assert resolve_port(c, get["port"]) == args.status_port, (role, probe)
        # The startup probe covers the model load and warm-up (compose: start_period 600 s).
        startup = c["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, role
        grace = pod_spec(objs, role)["terminationGracePeriodSeconds"]
        assert grace > prestop_seconds(c) + args.drain_timeout, role


@pytest.mark.parametrize("name", OVERLAYS)
def test_router_is_probed_without_waiting_for_nodes(name):
    """Clients reach a router through its Service, which lists only ready pods: a readiness probe
    on /health (200 once nodes registered) would keep a replica the nodes have not found yet out."""
    objs = overlay(name)
    c, args = container(objs, "router"), parsed_args(objs, "router")
    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] != "/health", probe
        assert resolve_port(c, get["port"]) == args.port, probe


@pytest.mark.parametrize("name", OVERLAYS)
def test_router_replicas_are_all_found_by_every_node(name):
    """Router scale-out: several replicas, one process each (--api-server-count 1, scraped one by
    one); the nodes name the headless Service, whose DNS name resolves to every router pod, ready
    or not (a router is healthy only once nodes registered with it), so each node registers with
    each replica; rolling updates bring the new replica up before an old one stops."""
    objs = overlay(name)
    router = deployment(objs, "router")["spec"]
    assert router["replicas"] >= 2
    assert router["strategy"]["type"] == "RollingUpdate" and router["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert parsed_args(objs, "router").api_server_count == 1
    headless = objects(objs, "Service")[ROUTER_NODES_SERVICE]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    for role in NODE_ROLES:
        args = parsed_args(objs, role)
        assert args.router == [f"tcp://{ROUTER_NODES_SERVICE}:5555"] and args.api_server_count == 1, role
        assert args.router_refresh_s > 0, role  # replicas that come later are found
    (pdb,) = [p for p in objects(objs, "PodDisruptionBudget").values()
              if selects(p["spec"]["selector"], pod_labels(objs, "router"))]
    assert pdb["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("name", OVERLAYS)
def test_each_pool_has_a_disruption_budget(name):
    objs = overlay(name)
    pdbs = objects(objs, "PodDisruptionBudget").values()
    for role in NODE_ROLES:
        matching = [p for p in pdbs if selects(p["spec"]["selector"], pod_labels(objs, role))]
        assert len(matching) == 1, role
        for other in ROLES:
            if other != role:
                assert not selects(matching[0]["spec"]["selector"], pod_labels(objs, other)), (role, other)


@pytest.mark.parametrize("name", OVERLAYS)
def test_pool_sizes_are_left_to_scaling(name):
    """No `replicas` in the pool Deployments: re-applying the manifests must not reset what the HPA
    or `kubectl scale` set."""
    objs = overlay(name)
    for role in NODE_ROLES:
        assert "replicas" not in deployment(objs, role)["spec"], role


# ---- 4: autoscaling and the Prometheus Adapter rules ---------------------------------------------
def adapter_config() -> dict:
    (cm,) = objects(render(MONITORING), "ConfigMap").values()
    return yaml.safe_load(cm["data"]["config.yaml"])


def served_metrics(config: dict) -> tuple[set[str], set[str]]:
    """(custom Pods metric names, external metric names) that the adapter's rules expose."""
    custom = {r["name"]["as"] for r in config.get("rules", [])}
    external = {r["name"]["as"] for r in config.get("externalRules", [])}
    return custom, external


def test_adapter_helm_values_carry_the_same_rules():
    values = yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]
    config = adapter_config()
    assert values["custom"] == config["rules"]
    assert values["external"] == config["externalRules"]


def test_pods_rules_map_series_to_pods():
    config = adapter_config()
    for rule in config["rules"]:
        overrides = rule["resources"]["overrides"]
        assert overrides["pod"] == {"resource": "pod"} and overrides["namespace"] == {"resource": "namespace"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
    for rule in config["externalRules"]:
        assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]


_SERIES_RE = re.compile(r"\bpdserve_[A-Za-z0-9_]+")
_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")


@functools.lru_cache(maxsize=1)
def exported_metric_names() -> frozenset[str]:
    """Every quoted "pdserve_..." string in pdserve/ (metric families are declared by name)."""
    names: set[str] = set()
    for path in (REPO / "pdserve").rglob("*.py"):
        names.update(re.findall(r"[\"'](pdserve_[A-Za-z0-9_]+)[\"']", path.read_text()))
    return frozenset(names)


def family(series: str) -> str:
    for suffix in _SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def test_adapter_rules_read_metrics_the_code_exports():
    config = adapter_config()
    rules = config["rules"] + config["externalRules"]
    assert rules
    for rule in rules:
        series = set(_SERIES_RE.findall(rule["seriesQuery"]))
        assert len(series) == 1, rule["seriesQuery"]
        (name,) = series
        assert family(name) in exported_metric_names(), f"{name}: no such metric in pdserve/"
        assert re.fullmatch(rule["name"]["matches"], name), rule["name"]


@pytest.mark.parametrize("name", OVERLAYS)
def test_each_pool_autoscales_on_metrics_the_adapter_serves(name):
    objs = overlay(name)
    custom, external = served_metrics(adapter_config())
    hpas = objects(objs, "HorizontalPodAutoscaler")
    wanted = {"prefill": {"pdserve_num_prompt_tokens_outstanding", "pdserve_num_requests_waiting", "pdserve_ttft_prefill_queue_seconds_p90"},
              "decode": {"pdserve_kv_cache_usage_perc", "pdserve_num_requests_running"}}
    for role in NODE_ROLES:
        (hpa,) = [h for h in hpas.values() if h["spec"]["scaleTargetRef"]["name"] == f"pdserve-{role}"]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
        assert 1 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"], role
        names = set()
        for metric in hpa["spec"]["metrics"]:
            kind = metric["type"]
            assert kind in ("Pods", "External"), (role, kind)
            metric_name = metric[kind.lower()]["metric"]["name"]
            assert metric_name in (custom if kind == "Pods" else external), (role, metric_name)
            names.add(metric_name)
        assert names == wanted[role], role


@pytest.mark.parametrize("name", OVERLAYS)
def test_pods_are_annotated_for_scraping_their_metrics_port(name):
    """The adapter rules need series with `pod` and `namespace` labels: the `kubernetes-pods`
    Prometheus job scrapes pods annotated this way and adds them."""
    objs = overlay(name)
    for role in ROLES:
        annotations = deployment(objs, role)["spec"]["template"]["metadata"]["annotations"]
        args = parsed_args(objs, role)
        port = args.port if role == "router" else args.status_port
        assert annotations["prometheus.io/scrape"] == "true", role
        assert annotations["prometheus.io/port"] == str(port) and annotations["prometheus.io/path"] == "/metrics"


# ---- 4: shared memory, GPU overlay ---------------------------------------------------------------
def shm_volume(objs: list[dict], role: str) -> dict | None:
    mounts = {m["mountPath"]: m["name"] for m in container(objs, role).get("volumeMounts", [])}
    if "/dev/shm" not in mounts:
        return None
    return {v["name"]: v for v in pod_spec(objs, role)["volumes"]}[mounts["/dev/shm"]]


@pytest.mark.parametrize("name", OVERLAYS)
def test_nodes_have_memory_backed_shm(name):
    """/dev/shm as memory, not the runtime's 64 MiB default: the CPU prefill pool lives there, and
    torch/NCCL use it on GPUs."""
    objs = overlay(name)
    for role in NODE_ROLES:
        volume = shm_volume(objs, role)
        assert volume is not None and volume["emptyDir"].get("medium") == "Memory", role
        assert volume["emptyDir"].get("sizeLimit"), role  # else it may grow to the node's memory
    args = parsed_args(objs, "prefill")
    if args.device == "cpu":  # the pool (--kv-cache-memory-gb) fits
        limit = shm_volume(objs, "prefill")["emptyDir"]["sizeLimit"]
        assert limit.endswith("Gi") and float(limit[:-2]) > args.kv_cache_memory_gb, limit


def test_gpu_overlay_requests_gpus():
    objs = overlay("gpu")
    for role in NODE_ROLES:
        c = container(objs, role)
        resources = c["resources"]
        assert int(resources["limits"]["nvidia.com/gpu"]) >= 1, role
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"], role
        assert flag_value(c["args"], "--device") == "cuda", role
    assert "nvidia.com/gpu" not in str(container(objs, "router")["resources"])
    cpu = overlay("cpu")
    for role in ROLES:
        assert "nvidia.com/gpu" not in str(container(cpu, role).get("resources")), role
        assert flag_value(container(cpu, role)["args"], "--device") in (None, "cpu"), role


# ---- 4: security: CURVE keys, NetworkPolicy ------------------------------------------------------
def image_uid() -> int:
    uids = {int(u) for f in ("Dockerfile", "Dockerfile.cuda")
            for u in re.findall(r"useradd [^\n]*--uid (\d+)", (DOCKER_DIR / f).read_text())}
    assert len(uids) == 1, uids
    return uids.pop()


@pytest.mark.parametrize("name", OVERLAYS)
def test_every_role_mounts_the_curve_secret_read_only(name):
    """The Secret's files are mounted 0400 and, through fsGroup, group-readable by the image's
    user (kubelet adds group read for fsGroup); nobody else can read the secret keys."""
    objs = overlay(name)
    uid = image_uid()
    for role in ROLES:
        spec, c = pod_spec(objs, role), container(objs, role)
        assert flag_value(c["args"], "--zmq-curve-keys") == "/keys", role
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/keys"]
        assert mount.get("readOnly") is True, role
        volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
        assert volume["secret"]["secretName"] == CURVE_SECRET, role
        mode = volume["secret"]["defaultMode"]
        assert mode & 0o077 == 0 and mode & 0o400, (role, oct(mode))
        security = spec["securityContext"]
        assert security["runAsUser"] == uid and security["fsGroup"] == uid and security["runAsNonRoot"], role


def policy_rules(objs: list[dict], role: str) -> list[dict]:
    """The ingress rules of every NetworkPolicy that selects `role`'s pods."""
    labels = pod_labels(objs, role)
    rules = []
    for policy in objects(objs, "NetworkPolicy").values():
        if selects(policy["spec"]["podSelector"], labels):
            assert "Ingress" in policy["spec"]["policyTypes"]
            rules.extend(policy["spec"].get("ingress", []))
    return rules


def allowed_peers(objs: list[dict], role: str, port: int) -> list[dict]:
    peers = []
    for rule in policy_rules(objs, role):
        assert rule.get("from"), f"{role}: a rule open to everyone"
        assert rule.get("ports"), f"{role}: a rule open on every port"
        if any(p["port"] == port for p in rule["ports"]):
            peers.extend(rule["from"])
    return peers


def only_pdserve_pods(objs: list[dict], peers: list[dict]) -> bool:
    """Each peer is a same-namespace pod selector that matches pdserve pods and nothing broader."""
    return all(set(p) == {"podSelector"} and p["podSelector"] and selects(p["podSelector"], pod_labels(objs, "router"))
               and not selects(p["podSelector"], {"app.kubernetes.io/name": "other"}) for p in peers)


@pytest.mark.parametrize("name", OVERLAYS)
def test_network_policy_keeps_the_ports_private(name):
    objs = overlay(name)
    router = parsed_args(objs, "router")
    control = int(router.control_addr.rsplit(":", 1)[1])
    decode = parsed_args(objs, "decode")
    # Every port a pod listens on is covered by a rule (a selected pod is default-deny otherwise).
    for role in ROLES:
        for port in container_port_numbers(container(objs, role)):
            assert allowed_peers(objs, role, port), (role, port)
    # Control and KV: pdserve pods only.
    for role, port in (("router", control), ("decode", decode.kv_port)):
        peers = allowed_peers(objs, role, port)
        assert only_pdserve_pods(objs, peers), (role, port, peers)
    # Status/metrics: pdserve pods and a monitoring namespace.
    for role in NODE_ROLES:
        peers = allowed_peers(objs, role, parsed_args(objs, role).status_port)
        assert only_pdserve_pods(objs, [p for p in peers if "podSelector" in p and "namespaceSelector" not in p])
        namespaces = [p for p in peers if "namespaceSelector" in p]
        assert namespaces and all(p["namespaceSelector"].get("matchLabels") for p in namespaces), role
    # The router's HTTP port: other namespaces by label (ingress controller, Prometheus), no pod peer.
    peers = allowed_peers(objs, "router", router.port)
    assert peers and all(set(p) == {"namespaceSelector"} and p["namespaceSelector"].get("matchLabels")
                         for p in peers), peers
    # Nodes are not reachable on the router's ports and vice versa through a catch-all.
    assert not allowed_peers(objs, "prefill", router.port)


@pytest.mark.parametrize("name", OVERLAYS)
def test_pods_meet_the_restricted_pod_security_standard(name):
    """Non-root (the images' user), no privilege escalation, no capabilities, the runtime's seccomp
    profile, no host namespaces, only emptyDir and Secret volumes."""
    objs = overlay(name)
    for role in ROLES:
        spec = pod_spec(objs, role)
        assert spec["securityContext"]["runAsNonRoot"] is True, role
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", role
        assert not any(spec.get(k) for k in ("hostIPC", "hostPID", "hostNetwork")), role
        assert spec["automountServiceAccountToken"] is False, role
        for c in spec["containers"] + spec.get("initContainers", []):
            security = c["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, (role, c["name"])
            assert security["capabilities"]["drop"] == ["ALL"], (role, c["name"])
        for volume in spec["volumes"]:
            assert set(volume) - {"name"} <= {"emptyDir", "secret"}, (role, volume)


@pytest.mark.parametrize("name", OVERLAYS)
def test_tensor_parallel_component_sets_the_prefill_pool_only(name, tmp_path):
    """components/tensor-parallel on either overlay: prefill pods parse to TP 2, decode pods stay at 1
    (its JSON patch checks the flag's position, so a moved flag fails the render instead of
    replacing another value)."""
    def rel(path: Path) -> str:  # kustomize refuses absolute paths
        return os.path.relpath(path, tmp_path)

    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {rel(K8S_DIR / 'overlays' / name)}\n"
        f"components:\n  - {rel(K8S_DIR / 'components' / 'tensor-parallel')}\n")
    objs = render(tmp_path)
    assert parsed_args(objs, "prefill").tensor_parallel_size == 2
    assert parsed_args(objs, "decode").tensor_parallel_size == 1
    assert parsed_args(overlay(name), "prefill").tensor_parallel_size == 1
