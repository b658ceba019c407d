"""`--planner-scaler kubernetes`: the planner sets the prefill and decode Deployments' replicas
through the API server, on their `scale` subresource:

    GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale    the current spec.replicas
    PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale    {"spec": {"replicas": N}}
          (Content-Type: application/merge-patch+json), only when N differs

Kubernetes then stops the pods it removes with SIGTERM (the nodes drain within the pods'
terminationGracePeriodSeconds) or schedules new ones. A pool goes to 0 only when the planner asks
for 0, decode never below 1.

It authenticates as the pod's ServiceAccount (in-cluster): the token at
/var/run/secrets/kubernetes.io/serviceaccount/token (read again at every call: kubelet rotates
it), the cluster CA next to it, the namespace from the `namespace` file, the API server from
KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT. That ServiceAccount needs `get` and `patch` on
`deployments/scale` for the two Deployments: kubernetes/components/planner (Role pdserve-planner,
RoleBinding to the router's ServiceAccount pdserve-router, the token mounted into the router pod).

Configuration (environment of the router):
    PDSERVE_SCALER_DEPLOYMENTS  pool=deployment pairs (default: prefill=pdserve-prefill,decode=pdserve-decode)
    PDSERVE_SCALER_NAMESPACE    the namespace (default: the ServiceAccount's)

Do not combine it with a HorizontalPodAutoscaler on the same Deployments
(components/autoscaling): both would set the replicas.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl

import aiohttp

from pdserve.router.scaling_docker import parse_pairs, target_size

logger = logging.getLogger(__name__)

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_DEPLOYMENTS = {"prefill": "pdserve-prefill", "decode": "pdserve-decode"}
MERGE_PATCH = "application/merge-patch+json"
TIMEOUT_S = 10.0


class KubernetesScalerError(RuntimeError):
    pass


class KubernetesScaler:
    name = "kubernetes"

    def __init__(self, api_url: str, namespace: str, deployments: dict[str, str] | None = None, *,
                 token_path: str = f"{SA_DIR}/token", ca_path: str | None = f"{SA_DIR}/ca.crt") -> None:
        self.api_url = api_url.rstrip("/")
        self.namespace = namespace
        self.deployments = dict(deployments or DEFAULT_DEPLOYMENTS)
        self.token_path = token_path
        self.ca_path = ca_path
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_env(cls, sa_dir: str = SA_DIR) -> KubernetesScaler:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise KubernetesScalerError("--planner-scaler kubernetes: KUBERNETES_SERVICE_HOST is not set "
                                        "(the router runs outside a Kubernetes pod)")
        token = os.path.join(sa_dir, "token")
        if not os.path.exists(token):
            raise KubernetesScalerError(
                f"--planner-scaler kubernetes: no ServiceAccount token at {token}: the router pod needs "
                "automountServiceAccountToken: true and a ServiceAccount bound to the pdserve-planner Role "
                "(kubernetes/components/planner)")
        namespace = os.environ.get("PDSERVE_SCALER_NAMESPACE") or _read(os.path.join(sa_dir, "namespace")).strip()
        deployments = parse_pairs(os.environ["PDSERVE_SCALER_DEPLOYMENTS"], "PDSERVE_SCALER_DEPLOYMENTS") \
            if os.environ.get("PDSERVE_SCALER_DEPLOYMENTS") else DEFAULT_DEPLOYMENTS
        host = f"[{host}]" if ":" in host else host  # an IPv6 address
        logger.info("kubernetes scaler: namespace %s, deployments %s", namespace, deployments)
        return cls(f"https://{host}:{port}", namespace, deployments, token_path=token,
                   ca_path=os.path.join(sa_dir, "ca.crt"))

    def scale_path(self, deployment: str) -> str:
        return f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{deployment}/scale"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            ssl_context: ssl.SSLContext | bool = True
            if self.api_url.startswith("https://") and self.ca_path and os.path.exists(self.ca_path):
                ssl_context = ssl.create_default_context(cafile=self.ca_path)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=ssl_context),
                timeout=aiohttp.ClientTimeout(total=TIMEOUT_S))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _call(self, method: str, deployment: str, body: dict | None = None) -> dict:
        headers = {"Authorization": f"Bearer {_read(self.token_path).strip()}", "Accept": "application/json"}
        data = None
        if body is not None:
            headers["Content-Type"] = MERGE_PATCH
            data = json.dumps(body)
        path = self.scale_path(deployment)
        verb = {"GET": "get", "PATCH": "patch"}[method]
        async with self._client().request(method, self.api_url + path, headers=headers, data=data) as r:
            text = await r.text()
            if r.status == 200:
                return json.loads(text)
            message = _status_message(text)
            if r.status == 403:
                raise KubernetesScalerError(
                    f"{method} {path}: 403 Forbidden: the router's ServiceAccount may not {verb} deployments/scale "
                    f"({deployment!r} in namespace {self.namespace!r}); it needs a Role with apiGroups [apps], "
                    f"resources [deployments/scale], verbs [get, patch] bound to it "
                    f"(kubernetes/components/planner). API server: {message}")
            if r.status == 401:
                raise KubernetesScalerError(f"{method} {path}: 401 Unauthorized: the ServiceAccount token at "
                                            f"{self.token_path} was refused. API server: {message}")
            if r.status == 404:
                raise KubernetesScalerError(f"{method} {path}: 404: no Deployment {deployment!r} in namespace "
                                            f"{self.namespace!r} (PDSERVE_SCALER_DEPLOYMENTS). API server: {message}")
            raise KubernetesScalerError(f"{method} {path}: HTTP {r.status}: {message}")

    async def replicas(self, deployment: str) -> int:
        scale = await self._call("GET", deployment)
        return int((scale.get("spec") or {}).get("replicas") or 0)

    async def apply(self, desired: dict[str, int], reason: str) -> None:
        errors = []
        for pool, deployment in self.deployments.items():
            if pool not in desired:
                continue
            want = target_size(pool, desired[pool])
            try:
                have = await self.replicas(deployment)
                if have == want:
                    continue
                logger.info("kubernetes scaler: %s replicas %d -> %d (%s)", deployment, have, want, reason)
                await self._call("PATCH", deployment, {"spec": {"replicas": want}})
            except (aiohttp.ClientError, asyncio.TimeoutError, KubernetesScalerError) as e:
                errors.append(str(e) or type(e).__name__)
        if errors:
            raise KubernetesScalerError("; ".join(errors))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _status_message(text: str) -> str:
    """The `message` of a Kubernetes Status body, else the body (cut short)."""
    try:
        return str(json.loads(text).get("message") or text[:300])
    except (ValueError, AttributeError):
        return text[:300]
