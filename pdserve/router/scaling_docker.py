"""`--planner-scaler docker`: the planner resizes a docker compose project's prefill and decode
services through the Docker Engine API (the `docker` package: `pip install 'pdserve[planner]'`).

Compose labels every container it creates with its project and service
(`com.docker.compose.project`, `com.docker.compose.service`) and a replica number
(`com.docker.compose.container-number`); this scaler finds a pool's containers by those labels.

    up      a new container cloned from one of the service's (same image, command, environment,
            volumes, networks with the service's DNS alias, restart policy, health check, labels
            with the next replica number), named `<project>-<service>-<n>` as compose names them,
            then started; `docker compose ps` lists it with the others
    down    the highest-numbered running containers are stopped (SIGTERM: the node drains, for at
            most `stop_timeout` seconds, default 60, compose's stop_grace_period, more than the
            nodes' --drain-timeout) and removed, in the background (the planner's tick does not
            wait for the drain); the last container of a pool scaled to 0 is stopped but kept, as
            the template the next scale-up clones

A pool goes to 0 only when the planner asks for 0, decode never below 1. Only running (or
restarting) containers count, less the ones being stopped; `apply` acts only when that count
differs from what is wanted.

Configuration (environment of the router):
    PDSERVE_COMPOSE_PROJECT     the compose project (default: the router container's own project
                                label, found through its hostname, the container id)
    PDSERVE_SCALER_SERVICES     pool=service pairs (default: prefill=prefill,decode=decode)
    PDSERVE_SCALER_STOP_TIMEOUT seconds a stopping node gets to drain before SIGKILL (default: 60)
    DOCKER_HOST etc.            as the docker CLI reads them (default: unix:///var/run/docker.sock)

Privilege: the router must reach the Docker socket (docker/docker-compose.planner.yml mounts
/var/run/docker.sock). Access to that socket is root-equivalent on the host: whoever controls the
router process can start any container. Use it on a host dedicated to this stack.

A later `docker compose up` (without --scale) reconciles the services back to the counts it was
given, removing or adding replicas; the planner then scales again on its next tick.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import socket

logger = logging.getLogger(__name__)

PROJECT_LABEL = "com.docker.compose.project"
SERVICE_LABEL = "com.docker.compose.service"
NUMBER_LABEL = "com.docker.compose.container-number"
ONEOFF_LABEL = "com.docker.compose.oneoff"
DEFAULT_SERVICES = {"prefill": "prefill", "decode": "decode"}
DEFAULT_STOP_TIMEOUT_S = 60.0
LIVE = ("running", "restarting")
MIN_REPLICAS = {"decode": 1}  # the router needs a decode node to serve anything


class DockerScalerError(RuntimeError):
    pass


def parse_pairs(value: str, env_name: str) -> dict[str, str]:
    """`prefill=a,decode=b` as {"prefill": "a", "decode": "b"}; ValueError naming `env_name`."""
    out = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        pool, sep, target = item.partition("=")
        if not sep or not pool.strip() or not target.strip():
            raise ValueError(f"{env_name}: {item!r} is not pool=name (e.g. prefill=prefill,decode=decode)")
        out[pool.strip()] = target.strip()
    if not out:
        raise ValueError(f"{env_name} names no pool")
    return out


def target_size(pool: str, desired: int) -> int:
    return max(int(desired), MIN_REPLICAS.get(pool, 0))


def container_number(c) -> int:
    try:
        return int(c.labels.get(NUMBER_LABEL, "0"))
    except ValueError:
        return 0


class DockerScaler:
    name = "docker"

    def __init__(self, client, project: str, services: dict[str, str] | None = None, *,
                 stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S) -> None:
        self.client = client  # docker.DockerClient (tests: a fake with the same few methods)
        self.project = project
        self.services = dict(services or DEFAULT_SERVICES)
        self.stop_timeout_s = stop_timeout_s
        self._stopping: dict[str, asyncio.Task] = {}  # container id -> its stop-and-remove task
        self._lock = asyncio.Lock()

    @classmethod
    def from_env(cls, client=None) -> DockerScaler:
        if client is None:
            try:
                import docker
            except ImportError as e:
                raise DockerScalerError("--planner-scaler docker needs the docker package: "
                                        "pip install 'pdserve[planner]'") from e
            try:
                client = docker.from_env()
                client.ping()
            except Exception as e:
                raise DockerScalerError(
                    f"--planner-scaler docker: cannot reach the Docker Engine ({e}); mount the socket into "
                    "the router container (-v /var/run/docker.sock:/var/run/docker.sock, "
                    "docker/docker-compose.planner.yml) or set DOCKER_HOST") from e
        services = parse_pairs(os.environ["PDSERVE_SCALER_SERVICES"], "PDSERVE_SCALER_SERVICES") \
            if os.environ.get("PDSERVE_SCALER_SERVICES") else DEFAULT_SERVICES
        project = os.environ.get("PDSERVE_COMPOSE_PROJECT") or own_project(client)
        if not project:
            raise DockerScalerError("--planner-scaler docker: no compose project: set PDSERVE_COMPOSE_PROJECT "
                                    "(the router is not in a compose container, or its label is missing)")
        stop_timeout = float(os.environ.get("PDSERVE_SCALER_STOP_TIMEOUT") or DEFAULT_STOP_TIMEOUT_S)
        logger.info("docker scaler: project %s, services %s", project, services)
        return cls(client, project, services, stop_timeout_s=stop_timeout)

    # ---- reading ----------------------------------------------------------------------------
    def containers(self, service: str) -> list:
        """Every container of the service, stopped ones too, lowest replica number first."""
        found = self.client.containers.list(all=True, filters={"label": [f"{PROJECT_LABEL}={self.project}",
                                                                        f"{SERVICE_LABEL}={service}"]})
        found = [c for c in found if c.labels.get(ONEOFF_LABEL, "False") != "True"]  # `compose run`
        return sorted(found, key=container_number)

    def live(self, containers: list) -> list:
        return [c for c in containers if c.status in LIVE and c.id not in self._stopping]

    def current(self) -> dict[str, int]:
        """Pool sizes as this scaler counts them (running, not being stopped)."""
        return {pool: len(self.live(self.containers(svc))) for pool, svc in self.services.items()}

    # ---- acting ------------------------------------------------------------------------------
    async def apply(self, desired: dict[str, int], reason: str) -> None:
        async with self._lock:
            errors = []
            for pool, service in self.services.items():
                if pool not in desired:
                    continue
                try:
                    await self._scale(pool, service, target_size(pool, desired[pool]), reason)
                except Exception as e:  # the other pool is still worth trying
                    errors.append(f"{service}: {e}")
            if errors:
                raise DockerScalerError("; ".join(errors))

    async def _scale(self, pool: str, service: str, want: int, reason: str) -> None:
        everything = await asyncio.to_thread(self.containers, service)
        live = self.live(everything)
        if want == len(live):
            return
        logger.info("docker scaler: %s %d -> %d (%s)", service, len(live), want, reason)
        if want > len(live):
            if not everything:
                raise DockerScalerError(
                    f"no container of service {service!r} in project {self.project!r} to clone; "
                    f"start one (docker compose up -d --scale {service}=1)")
            template = live[0] if live else everything[-1]
            numbers = {container_number(c) for c in everything}
            for _ in range(want - len(live)):
                number = max(numbers, default=0) + 1
                numbers.add(number)
                await asyncio.to_thread(self._clone, template, service, number)
            return
        victims = sorted(live, key=container_number)[want:]
        keep_stopped = want == 0  # the last one stays, stopped: the template of the next scale-up
        for i, c in enumerate(reversed(victims)):
            remove = not (keep_stopped and i == len(victims) - 1)
            self._stopping[c.id] = asyncio.create_task(self._stop(c, remove))

    def _clone(self, template, service: str, number: int) -> str:
        """Create and start a copy of `template` as replica `number`; returns the new container's id."""
        attrs = template.attrs
        config = copy.deepcopy(attrs["Config"])
        old_name = attrs.get("Name", "").lstrip("/")
        name = f"{self.project}-{service}-{number}"
        for key in ("Hostname",):  # the new container gets its own (its id)
            config.pop(key, None)
        config["Labels"] = {**(config.get("Labels") or {}), NUMBER_LABEL: str(number)}
        host_config = copy.deepcopy(attrs.get("HostConfig") or {})
        networks = attrs.get("NetworkSettings", {}).get("Networks") or {}
        endpoints = {}
        for net, settings in networks.items():
            old = set(settings.get("Aliases") or [])
            old_ids = {attrs.get("Id", ""), attrs.get("Id", "")[:12]}
            aliases = sorted((old - {old_name} - old_ids) | {service, name})
            endpoints[net] = {"Aliases": aliases}
        first = dict(list(endpoints.items())[:1])  # older engines take one network at create
        config["HostConfig"] = host_config
        config["NetworkingConfig"] = {"EndpointsConfig": first}
        created = self.client.api.create_container_from_config(config, name=name)
        new_id = created["Id"] if isinstance(created, dict) else created
        try:
            for net, endpoint in list(endpoints.items())[1:]:
                self.client.api.connect_container_to_network(new_id, net, aliases=endpoint["Aliases"])
            self.client.api.start(new_id)
        except Exception:
            try:
                self.client.api.remove_container(new_id, force=True)
            except Exception as e:  # the error that matters is the first
                logger.warning("docker scaler: could not remove %s after a failed start: %s", name, e)
            raise
        logger.info("docker scaler: started %s (cloned from %s)", name, old_name or template.id[:12])
        return new_id

    async def _stop(self, container, remove: bool) -> None:
        name = getattr(container, "name", container.id[:12])
        try:
            await asyncio.to_thread(container.stop, timeout=int(self.stop_timeout_s))
            if remove:
                await asyncio.to_thread(container.remove)
            logger.info("docker scaler: %s %s", "removed" if remove else "stopped (kept as template)", name)
        except Exception as e:
            logger.warning("docker scaler: stopping %s failed: %s", name, e)
        finally:
            self._stopping.pop(container.id, None)

    async def wait_stopped(self) -> None:
        """Until every stop this scaler began has ended (tests; shutdown)."""
        while self._stopping:
            await asyncio.gather(*list(self._stopping.values()), return_exceptions=True)


def own_project(client) -> str | None:
    """The compose project of the container this process runs in (its hostname is its id)."""
    try:
        return client.containers.get(socket.gethostname()).labels.get(PROJECT_LABEL)
    except Exception:
        return None
