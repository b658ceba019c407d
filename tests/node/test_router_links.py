"""A node with several routers (node/router_links.py, node/router_discovery.py): it registers with
each, every token and error goes back to the router its request came from, each heartbeat lists
only that router's requests, a router that dies gets its requests aborted on the node (the
others' go on), and routers that appear in DNS later are found."""

from __future__ import annotations

import time

import pytest
import zmq

from pdserve.node.router_discovery import RouterDiscovery, parse_router_specs, resolve
from pdserve.node.router_links import ROUTER_GONE, RouterLinks
from pdserve.protocol.messages import (
    Error,
    FirstToken,
    Heartbeat,
    PrefillRequest,
    Register,
    Token,
    TokenBatch,
    decode,
)
from pdserve.protocol.sockets import endpoint, make_socket


class FakeRouter:
    """A bound ROUTER socket that records what the node sent it."""

    def __init__(self, addr: str = "tcp://127.0.0.1:0") -> None:
        self.sock = make_socket(zmq.ROUTER, bind=addr)
        self.addr = endpoint(self.sock)
        self.received: list = []

    def recv_all(self, wait_s: float = 0.3) -> list:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            self._recv(20)
        return self.received

    def wait_for(self, *kinds: type, timeout_s: float = 5.0) -> bool:
        """Receive until a message of each of `kinds` has arrived (now or before); False at the deadline."""
        deadline = time.monotonic() + timeout_s
        while not all(any(isinstance(m, kind) for m in self.received) for kind in kinds):
            if time.monotonic() >= deadline:
                return False
            self._recv(20)
        return True

    def _recv(self, timeout_ms: int) -> None:
        if self.sock.poll(timeout_ms):
            self.received.append(decode(self.sock.recv_multipart()[1]))

    def send(self, msg) -> None:
        self.sock.send_multipart([b"n0", msg.encode()])

    def close(self) -> None:
        self.sock.close(0)


def make_links(addrs, **kw) -> RouterLinks:
    register = Register(node_id="n0", role="both", model="tiny", pid=1)
    return RouterLinks(RouterDiscovery(list(addrs), refresh_s=0), register, heartbeat_s=0.1, **kw)


def prefill_request(rid: str) -> PrefillRequest:
    return PrefillRequest(rid, [1, 2, 3], {})


def poll_until(links: RouterLinks, n: int, timeout_s: float = 5.0) -> list:
    got, deadline = [], time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += links.poll(20)
    return got


def heartbeat(request_ids) -> Heartbeat:
    return Heartbeat(node_id="n0", num_free_blocks=7, num_total_blocks=9, num_running=1, num_waiting=0,
                     request_ids=list(request_ids))


@pytest.fixture
def two_routers():
    routers = [FakeRouter(), FakeRouter()]
    links = make_links([r.addr for r in routers])
    links.register()
    # Connected both ways before a test starts: a router's send to a node it has not yet heard
    # from raises (ROUTER_MANDATORY), and a router that closes before the node's link saw it
    # connect is never reported lost.
    assert all(r.wait_for(Register) for r in routers)
    deadline = time.monotonic() + 5
    while any(link.connected is not True for link in links.links.values()) and time.monotonic() < deadline:
        links.poll(20)
    yield routers, links
    links.close()
    for r in routers:
        r.close()


def test_each_router_gets_its_own_tokens_errors_and_heartbeat_lists(two_routers):
    (a, b), links = two_routers
    assert all(isinstance(r.recv_all()[0], Register) for r in (a, b))  # registered with both
    a.send(prefill_request("ra"))
    b.send(prefill_request("rb"))
    assert sorted(m.request_id for m in poll_until(links, 2)) == ["ra", "rb"]
    assert links.origin("ra") == a.addr and links.origin("rb") == b.addr
    links.send(TokenBatch.from_tokens("n0", [Token("ra", 1, 11), Token("rb", 1, 21), Token("ra", 2, 12)]))
    links.send(FirstToken("rb", 20))
    links.send(Error("ra", "n0", "boom", retryable=True))
    links.maybe_heartbeat(lambda: heartbeat(["ra", "rb"]))
    assert a.wait_for(TokenBatch, Error, Heartbeat) and b.wait_for(TokenBatch, FirstToken, Heartbeat)
    got_a, got_b = a.recv_all(), b.recv_all()  # and a few heartbeat periods more
    batches_a = [m for m in got_a if isinstance(m, TokenBatch)]
    batches_b = [m for m in got_b if isinstance(m, TokenBatch)]
    assert [(t.request_id, t.token_id) for m in batches_a for t in m.tokens()] == [("ra", 11), ("ra", 12)]
    assert [(t.request_id, t.token_id) for m in batches_b for t in m.tokens()] == [("rb", 21)]
    assert [m.request_id for m in got_a if isinstance(m, (Error, FirstToken))] == ["ra"]
    assert [m.request_id for m in got_b if isinstance(m, (Error, FirstToken))] == ["rb"]
    hb_a = [m for m in got_a if isinstance(m, Heartbeat)]
    hb_b = [m for m in got_b if isinstance(m, Heartbeat)]
    assert hb_a and hb_b
    assert all(m.request_ids == ["ra"] and m.num_free_blocks == 7 for m in hb_a)  # load: the whole node's
    assert all(m.request_ids == ["rb"] and m.num_free_blocks == 7 for m in hb_b)


def test_a_batch_of_one_routers_tokens_goes_out_unchanged(two_routers):
    (a, b), links = two_routers
    a.send(prefill_request("ra"))
    poll_until(links, 1)
    batch = TokenBatch.from_tokens("n0", [Token("ra", 1, 11)])
    assert links._split(batch) == [(links.links[a.addr], batch)]


def test_a_dead_router_gets_only_its_requests_aborted(two_routers):
    (a, b), links = two_routers
    a.send(prefill_request("ra1"))
    a.send(prefill_request("ra2"))
    b.send(prefill_request("rb"))
    poll_until(links, 3)
    a.close()  # the process died: the kernel closes its connections
    aborts = poll_until(links, 2)
    assert sorted(m.request_id for m in aborts) == ["ra1", "ra2"] and all(m.reason == ROUTER_GONE for m in aborts)
    assert links.origin("rb") == b.addr and links.origin("ra1") == ""
    assert poll_until(links, 1, timeout_s=0.5) == []  # once only


def test_a_decode_node_learns_the_router_from_the_kv_ready(two_routers):
    (a, b), links = two_routers
    links.adopt("rb", b.addr)
    links.send(TokenBatch.from_tokens("n0", [Token("rb", 1, 21)]))
    assert b.wait_for(TokenBatch)
    assert not any(isinstance(m, TokenBatch) for m in a.recv_all())
    assert [t.request_id for m in b.recv_all() if isinstance(m, TokenBatch) for t in m.tokens()] == ["rb"]


def test_a_request_of_no_known_router_goes_to_every_router(two_routers):
    (a, b), links = two_routers
    links.adopt("rx", "tcp://10.9.9.9:1")  # a peer naming a router this node does not know
    links.send(TokenBatch.from_tokens("n0", [Token("rx", 1, 5)]))
    assert a.wait_for(TokenBatch) and b.wait_for(TokenBatch)
    for r in (a, b):
        assert [t.request_id for m in r.recv_all() if isinstance(m, TokenBatch) for t in m.tokens()] == ["rx"]


def test_an_origin_lives_in_the_request_table_and_goes_with_the_request(two_routers):
    (a, b), links = two_routers
    a.send(prefill_request("ra"))
    poll_until(links, 1)
    assert links.requests.origin("ra") == a.addr and links.requests.held_ids() == []  # noted, not yet taken
    links.requests.forget_unadmitted("ra")  # the node refused it
    assert links.origin("ra") == "" and len(links.requests) == 0


def test_routers_found_later_in_dns_are_registered_with():
    # Two routers on one port of two loopback addresses: a DNS name that resolves to one, then both.
    first = FakeRouter("tcp://127.0.0.2:0")
    port = int(first.addr.rsplit(":", 1)[1])
    later = FakeRouter(f"tcp://127.0.0.3:{port}")
    answers = {"routers": ["127.0.0.2"]}
    discovery = RouterDiscovery([f"tcp://routers:{port}"], refresh_s=0, resolver=lambda host, p: answers[host])
    links = RouterLinks(discovery, Register(node_id="n0", role="decode", model="tiny", pid=1), heartbeat_s=0.1)
    try:
        links.register()
        assert list(links.links) == [first.addr]
        answers["routers"] = ["127.0.0.2", "127.0.0.3"]
        discovery.resolve_now()
        links.poll(0)
        assert list(links.links) == [first.addr, later.addr]
        assert later.wait_for(Register)
        answers["routers"] = ["127.0.0.3"]
        discovery.resolve_now()
        first.close()  # gone from DNS and disconnected: dropped
        deadline = time.monotonic() + 5
        while first.addr in links.links and time.monotonic() < deadline:
            links.poll(20)
        assert list(links.links) == [later.addr]
    finally:
        links.close()
        later.close()


def test_names_resolve_to_every_address_and_keep_the_last_answer_on_failure():
    answers = {"routers": ["10.0.0.2", "10.0.0.1"], "v6": ["fd00::1"]}

    def resolver(host, port):
        if host not in answers:
            raise OSError("Name or service not known")
        return sorted(answers[host])

    assert resolve("tcp://routers:5555", resolver) == ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"]
    assert resolve("tcp://v6:5555", resolver) == ["tcp://[fd00::1]:5555"]
    assert resolve("ipc:///tmp/r", resolver) == ["ipc:///tmp/r"]
    d = RouterDiscovery(["tcp://routers:5555", "tcp://later:5555"], refresh_s=0, resolver=resolver)
    assert d.addresses == ("tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555")
    answers["later"] = ["10.0.0.3"]
    del answers["routers"]  # a failed lookup keeps what the name resolved to
    assert d.resolve_now() == ("tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555", "tcp://10.0.0.3:5555")


def test_router_flag_values():
    assert parse_router_specs(["tcp://a:1,tcp://b:2", "tcp://a:1", " ipc:///tmp/x "]) == [
        "tcp://a:1", "tcp://b:2", "ipc:///tmp/x"]
    for bad in (["a:1"], ["tcp://a"], ["tcp://a:0"], [","], ["tcp://:5"]):
        with pytest.raises(ValueError, match="--router"):
            parse_router_specs(bad)
    # Routers started with --api-server-count 3: each tcp address is the first of 3 ports.
    assert parse_router_specs(["tcp://router:5555", "ipc:///tmp/x"], 3) == [
        "tcp://router:5555", "tcp://router:5556", "tcp://router:5557", "ipc:///tmp/x"]
    with pytest.raises(ValueError, match="do not all exist"):
        parse_router_specs(["tcp://router:65535"], 2)


def test_no_router_at_all_drops_sends_without_blocking():
    links = make_links([])
    try:
        assert links.send(FirstToken("r", 1)) is False and links.num_dropped == 1
        start = time.monotonic()
        assert links.poll(50) == [] and time.monotonic() - start < 1
    finally:
        links.close()


def test_every_router_address_passes_the_exposure_check():
    """Each --router address is checked at start: one beyond loopback needs CURVE keys."""
    from pdserve.decode_node.__main__ import build_parser
    from pdserve.protocol.exposure import InsecureExposureError, check_sockets, node_sockets

    local = build_parser().parse_args(["--router", "tcp://127.0.0.1:1,tcp://localhost:2", "--router", "ipc:///tmp/r"])
    assert [s[0] for s in node_sockets(local)][:3] == ["tcp://127.0.0.1:1", "tcp://localhost:2", "ipc:///tmp/r"]
    check_sockets(node_sockets(local), None, False)
    mixed = build_parser().parse_args(["--router", "tcp://127.0.0.1:1,tcp://routers:5555"])
    with pytest.raises(InsecureExposureError, match="tcp://routers:5555"):
        check_sockets(node_sockets(mixed), None, False)


def test_a_request_adopted_from_a_dead_router_is_aborted(two_routers):
    """A KVReady that was on its way when its router died: the decode node frees it at once."""
    (a, b), links = two_routers
    a.close()  # the fixture saw it connect, so its closing is seen
    deadline = time.monotonic() + 5
    while links.links[a.addr].connected is not False and time.monotonic() < deadline:
        links.poll(20)
    links.adopt("late", a.addr)
    links.adopt("fine", b.addr)
    assert [(m.request_id, m.reason) for m in poll_until(links, 1)] == [("late", ROUTER_GONE)]
    assert links.origin("fine") == b.addr
