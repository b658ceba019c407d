"""Resizing the pools: the port through which the planner (planner_loop.py) asks for more or
fewer prefill and decode nodes. `apply(desired, reason)` is called after every planner tick with
the pool sizes it wants ({"prefill": p, "decode": d}); an implementation acts only on a change.

    none        no scaler: the planner moves roles among the nodes there are
    export      nothing acts here: `pdserve_planner_desired_replicas{pool}` (router/metrics.py) is
                the output, for a Kubernetes HPA or KEDA to scale on
    serve       `pdserve serve` starts and stops node processes: it reads GET /planner's `desired`
                (cli/serve.py); the router only publishes
    docker      the compose project's prefill and decode services, through the Docker Engine API
                (scaling_docker.py)
    kubernetes  the prefill and decode Deployments' replicas, through the API server
                (scaling_kubernetes.py)
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SCALERS = ("none", "export", "serve", "docker", "kubernetes")


class PublishOnly:
    """`export` and `serve`: remember what is wanted, for /metrics and GET /planner; others act."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.desired: dict[str, int] = {}

    async def apply(self, desired: dict[str, int], reason: str) -> None:
        if desired != self.desired:
            logger.info("planner wants %s (%s)", desired, reason)
            self.desired = dict(desired)


def make_scaler(name: str):
    """The scaler `--planner-scaler NAME` names (None for none); ValueError for an unknown one."""
    if name == "none":
        return None
    if name in ("export", "serve"):
        return PublishOnly(name)
    if name == "docker":
        from pdserve.router.scaling_docker import DockerScaler

        return DockerScaler.from_env()
    if name == "kubernetes":
        from pdserve.router.scaling_kubernetes import KubernetesScaler

        return KubernetesScaler.from_env()
    raise ValueError(f"--planner-scaler must be one of {', '.join(SCALERS)}, got {name!r}")
