"""PDSERVE_API_SERVERS: the router container runs that many router processes and every node, in
the CPU and the GPU file, is told the same count, so it registers with all of their control ports."""

from __future__ import annotations

import re

import pytest

from pdserve.node.router_discovery import parse_router_specs
from pdserve.router.api_servers import control_addresses
from tests.docker.compose import (
    COMPOSE_FILE,
    GPU_COMPOSE_FILE,
    NODE_SERVICES,
    flag_value,
    load_yaml,
)


def raw_services(path):
    return load_yaml(path)["services"]


@pytest.mark.parametrize("path", [COMPOSE_FILE, GPU_COMPOSE_FILE], ids=["cpu", "gpu"])
def test_router_and_nodes_take_the_same_count(path):
    base = raw_services(COMPOSE_FILE)
    svc = raw_services(path)
    router = svc.get("router", {}).get("command") or base["router"]["command"]
    assert flag_value(router, "--api-server-count") == "${PDSERVE_API_SERVERS:-1}"
    for name in NODE_SERVICES:
        assert flag_value(svc[name]["command"], "--api-server-count") == "${PDSERVE_API_SERVERS:-1}", name


def test_with_three_api_servers_the_nodes_find_every_control_port():
    svc = raw_services(COMPOSE_FILE)
    set_three = re.compile(r"\$\{PDSERVE_API_SERVERS:-1\}")
    router = [set_three.sub("3", a) for a in svc["router"]["command"]]
    n = int(flag_value(router, "--api-server-count"))
    bound = control_addresses(flag_value(router, "--control-addr"), n)
    for name in NODE_SERVICES:
        argv = [set_three.sub("3", a) for a in svc[name]["command"]]
        found = parse_router_specs(flag_value(argv, "--router"), int(flag_value(argv, "--api-server-count")))
        assert [a.rsplit(":", 1)[1] for a in found] == [a.rsplit(":", 1)[1] for a in bound], name
