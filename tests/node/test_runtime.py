"""The start-up wiring every node process shares (`run_node`): the status server answers before
the node is built, turns ready after warm-up, the node registers with its status URL, SIGTERM
drains it, and everything the role opened is closed in reverse order."""

from __future__ import annotations

import argparse
import os
import signal
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import zmq

from pdserve.node.args import add_node_args
from pdserve.node.metrics import NodeMetrics, NodeSnapshot
from pdserve.node.runtime import run_node
from pdserve.protocol.messages import Deregister, Register, decode


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class FakeEngine:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.block_manager = SimpleNamespace(num_blocks=64)
        self.config = SimpleNamespace(block_size=16, max_model_len=1024, max_num_seqs=8)

    def warm_up(self) -> None:
        self.events.append("warm_up")


class FakeNode:
    def __init__(self, engine, link, events: list[str]) -> None:
        self.engine, self.link, self.events = engine, link, events
        self.draining = False
        self.num_steps = 0
        self.metrics = NodeMetrics(link.register_msg.node_id, "test")
        self.metrics.watch(self.metrics_snapshot)

    def run_once(self) -> None:
        self.num_steps += 1
        if self.num_steps == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # what `pdserve serve` sends to stop a node

    def is_idle(self) -> bool:
        return True

    def status(self) -> dict:
        return {"node_id": self.link.register_msg.node_id}

    def metrics_snapshot(self) -> NodeSnapshot:
        return NodeSnapshot(0, 0, 0, 64, 0, 0, 0)


class Closeable:
    def __init__(self, name: str, events: list[str]) -> None:
        self.name, self.events = name, events

    def close(self) -> None:
        self.events.append(f"close {self.name}")


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_run_node_wires_a_node_from_flags_to_exit(restore_signals):
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    addr = router.getsockopt_string(zmq.LAST_ENDPOINT)
    parser = argparse.ArgumentParser()
    parser.set_defaults(role="test")
    add_node_args(parser)
    events: list[str] = []
    seen = {}

    def build(setup):
        seen["setup"] = setup
        seen["health_before"] = _health(setup.status_url)  # up before the model loads
        setup.close_later(Closeable("first", events))
        engine = FakeEngine(events)
        link = setup.router_link(engine, kv_addr="tcp://10.0.0.1:9")
        setup.close_later(Closeable("last", events))
        return FakeNode(engine, link, events)

    try:
        assert run_node(parser, build, ["--router", addr, "--served-model-name", "tiny", "--step-delay-s", "0.01"]) == 0
        messages = []
        while router.poll(500):
            messages.append(decode(router.recv_multipart()[1]))
    finally:
        router.close(0)
    setup = seen["setup"]
    assert seen["health_before"] == 503
    assert setup.node_id.startswith("test-") and setup.served_model_name == "tiny"
    assert setup.faults is not None and setup.faults.step_delay_s == 0.01
    assert events == ["warm_up", "close last", "close first"]
    register = next(m for m in messages if isinstance(m, Register))
    assert register.metrics_url == setup.status_url and register.kv_addr == "tcp://10.0.0.1:9"
    assert register.model == "tiny" and isinstance(messages[-1], Deregister)
    with pytest.raises(urllib.error.URLError):
        _health(setup.status_url)  # the status server is closed too


def test_a_bad_fault_spec_is_a_usage_error(restore_signals):
    parser = argparse.ArgumentParser()
    parser.set_defaults(role="test")
    parser.add_argument("--inject-kv-fault")
    add_node_args(parser)
    with pytest.raises(SystemExit) as e:
        run_node(parser, lambda setup: None, ["--router", "tcp://127.0.0.1:1", "--inject-kv-fault", "drop:x"])
    assert e.value.code == 2
