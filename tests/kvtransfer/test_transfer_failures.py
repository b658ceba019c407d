"""Every way a hand-off can end early (lease expiry, abort, release, a peer that never answers,
misuse) still ends with the prefill node's blocks released exactly once."""

import time

import pytest
import torch
import zmq

from pdserve.kvtransfer import sender as sender_module
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.protocol.curve import CurveKeys, generate_keys
from pdserve.protocol.messages import Handshake, HandshakeAck, KVDone, KVPull
from pdserve.protocol.sockets import make_socket, recv_msg, send_msg

from .conftest import (
    EveryNthPull,
    FakeClock,
    ReleaseLog,
    kinds,
    make_layout,
    make_pool,
    make_ready,
    pump,
    recv_msg_within,
    reference_tokens,
)


@pytest.mark.parametrize("shm", [False, True])
def test_expiry_releases_once_and_a_late_pull_fails(make_pair, shm):
    clock = FakeClock()
    pair = make_pair(clock=clock, shm=shm)
    pair.send("r1", [0, 1], 20, lease_s=10.0)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    clock.advance(10.5)
    pair.sender.poll(0)
    assert pair.sender.num_held == 0 and [rid for rid, _ in pair.errors] == ["r1"]
    assert "expired" in pair.errors[0][1]
    pair.receiver.pull("r1", [2, 3])  # even same-host: our lease estimate is past, so ask over ZMQ
    events = pair.pump(lambda ev: "r1" in kinds(ev, "failed"))
    assert "no longer holds" in events[-1].error and pair.receiver.num_shm_copies == 0
    for _ in range(20):  # the receiver's KVDone(ok=False) arrives: no second release
        pair.sender.poll(1)
    pair.released.assert_released_once(["r1"])


def test_renewal_prevents_expiry(make_pair):
    clock = FakeClock()
    pair = make_pair(clock=clock, shm=True)
    pair.send("r1", [4, 5], 20, lease_s=10.0)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    for _ in range(3):  # 24 s in all, well past the 10 s lease
        clock.advance(8)
        old = pair.sender.lease_deadline("r1")
        pair.receiver.renew("r1")
        pair.pump(lambda _, old=old: pair.sender.lease_deadline("r1") > old)
    assert pair.sender.num_held == 1 and not pair.errors
    pair.receiver.pull("r1", [0, 1])
    assert kinds(pair.pump(lambda ev: "r1" in kinds(ev, "done")), "done") == ["r1"]
    assert pair.receiver.num_shm_copies == 1  # renewed: the fast path is still safe
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_abort_releases_once(make_pair):
    pair = make_pair()
    pair.send("r1", [0], 8)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    assert pair.sender.abort("r1") and not pair.sender.abort("r1")
    pair.receiver.pull("r1", [1])
    events = pair.pump(lambda ev: "r1" in kinds(ev, "failed"))
    assert "aborted" in events[-1].error
    for _ in range(20):
        pair.sender.poll(1)
    assert not pair.errors  # an abort is not a hand-off failure to report
    pair.released.assert_released_once(["r1"])


def test_receiver_release_frees_the_senders_blocks(make_pair):
    pair = make_pair()
    pair.send("r1", [0], 8)
    pair.send("r2", [1], 8)
    pair.pump(lambda ev: len(kinds(ev, "ready")) == 2)
    pair.receiver.release("r1", error="aborted")
    pair.receiver.release("r1")  # twice: no-op
    pair.pump(lambda _: pair.sender.num_held == 1)
    assert pair.sender.held_request_ids == ["r2"]
    pair.receiver.close()  # shutting down releases what it still announced
    for _ in range(500):
        if pair.sender.num_held == 0:
            break
        pair.sender.poll(5)
    pair.released.assert_released_once(["r1", "r2"])


@pytest.fixture
def fake_prefill(closing):
    """A raw DEALER playing a prefill node that never answers a pull."""
    def connect(receiver):
        sock = make_socket(zmq.DEALER, connect=receiver.kv_addr, identity=b"fake-prefill")
        closing(type("Closer", (), {"close": lambda self: sock.close(0)})())
        return sock
    return connect


def test_pull_that_never_answers_times_out(make_pair, fake_prefill):
    clock = FakeClock()
    pair = make_pair(clock=clock, pull_timeout_s=5.0)
    prefill = fake_prefill(pair.receiver)
    send_msg(prefill, Handshake("fake", make_layout()))
    send_msg(prefill, make_ready("r1", [0], 8, 16))
    events, deadline = [], time.monotonic() + 5
    while "r1" not in kinds(events, "ready"):
        assert time.monotonic() < deadline, "no ready event"
        events += pair.receiver.poll(10)
    assert recv_msg_within(prefill) == HandshakeAck("d0", ok=True, same_host=False)
    pair.receiver.pull("r1", [3])
    assert recv_msg_within(prefill) == KVPull("r1", head_ranges=[[0, 2]])  # every head, for our one rank
    clock.advance(4)
    assert not pair.receiver.poll(0)
    clock.advance(2)
    (event,) = pair.receiver.poll(0)
    assert event.kind == "failed" and "no KV data" in event.error
    done = recv_msg_within(prefill)
    assert isinstance(done, KVDone) and not done.ok


def test_kv_ready_before_handshake_is_refused(make_pair, fake_prefill):
    pair = make_pair()
    prefill = fake_prefill(pair.receiver)
    send_msg(prefill, make_ready("r1", [0], 8, 16))
    ack = _recv_after_polls(pair.receiver, prefill)
    assert isinstance(ack, HandshakeAck) and not ack.ok


def _recv_after_polls(receiver, sock):
    for _ in range(200):
        assert not receiver.poll(5)
        if sock.poll(0):
            return recv_msg(sock, zmq.NOBLOCK)[1]
    raise AssertionError("no answer")


def test_bad_kv_ready_fails_and_releases(make_pair, monkeypatch):
    pair = make_pair()
    ready = make_ready("r1", [0], 8, 16)
    ready.block_ids = [99]  # outside the sender's pool: the sender would refuse, so go around it
    monkeypatch.setattr(sender_module, "ready_error", lambda ready, layout: None)
    pair.sender.send("d0", pair.receiver.kv_addr, ready)
    events = pair.pump(lambda ev: "r1" in kinds(ev, "failed"))
    assert "out of the peer's range" in events[-1].error
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_misuse_raises_without_taking_ownership(make_pair):
    pair = make_pair()
    with pytest.raises(ValueError, match="block_size"):
        pair.sender.send("d0", pair.receiver.kv_addr, make_ready("r0", [0], 8, block_size=8))
    with pytest.raises(ValueError, match="cannot hold"):
        pair.sender.send("d0", pair.receiver.kv_addr, make_ready("r0", [0], 17, 16))
    pair.send("r1", [0], 8)
    with pytest.raises(ValueError, match="already"):
        pair.send("r1", [1], 8)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    with pytest.raises(KeyError):
        pair.receiver.pull("nope", [0])
    with pytest.raises(ValueError, match="cannot hold"):
        pair.receiver.pull("r1", [])
    pair.receiver.pull("r1", [2])
    with pytest.raises(ValueError, match="already"):
        pair.receiver.pull("r1", [3])
    pair.pump(lambda ev: "r1" in kinds(ev, "done"))
    pair.pump(lambda _: pair.sender.num_held == 0)
    pair.released.assert_released_once(["r1"])


def test_bad_decode_address_fails_and_releases(make_pair):
    pair = make_pair()
    pair.sender.send("d9", "not-an-endpoint", make_ready("r1", [0], 8, 16))
    assert pair.sender.num_held == 0 and pair.errors[0][0] == "r1" and "cannot connect" in pair.errors[0][1]
    pair.released.assert_released_once(["r1"])


@pytest.mark.parametrize("kind, pull_timeout_s, error", [
    ("corrupt", 30.0, "bad KV payload"),  # one byte short: refused on arrival
    ("drop", 0.3, "no KV data"),  # never sent: the pull times out
])
def test_injected_kv_faults_fail_the_pull_and_release_once(make_pair, kind, pull_timeout_s, error):
    faults = EveryNthPull(kind, every=2)
    pair = make_pair(pull_timeout_s=pull_timeout_s, faults=faults)
    assert kinds(pair.transfer("r0", [4], [5], 8), "done") == ["r0"]  # pull 1: untouched
    pair.send("r1", [0, 1], 20)
    pair.pump(lambda ev: "r1" in kinds(ev, "ready"))
    pair.receiver.pull("r1", [2, 3])  # pull 2: spoiled
    events = pair.pump(lambda ev: "r1" in kinds(ev, "failed"))
    assert error in events[-1].error and faults.num_pulls == 2
    pair.pump(lambda _: pair.sender.num_held == 0)
    assert pair.sender.num_pulls_served == (1 if kind == "drop" else 2)
    pair.released.assert_released_once(["r0", "r1"])


# ---- no KV in clear beyond loopback (protocol.exposure) ---------------------------------------
def _sender(closing, released, errors, **kw) -> KVSender:
    layout = make_layout()
    sender = KVSender("p0", layout, make_pool(layout), released, on_error=lambda rid, msg: errors.append((rid, msg)),
                      **kw)
    closing(sender)
    return sender


@pytest.mark.parametrize("addr", ["tcp://10.1.2.3:9200", "tcp://decode-1:9200", "tcp://0.0.0.0:9200"])
def test_exposed_decode_address_without_keys_is_refused_and_releases(closing, addr):
    """Without CURVE keys (and without --insecure) the sender never opens a plain connection to a
    decode node beyond loopback: the hand-off fails as for an unreachable node (blocks released
    once, the error reported so the router re-dispatches), naming the fix."""
    released, errors = ReleaseLog(), []
    sender = _sender(closing, released, errors)
    sender.send("d9", addr, make_ready("r1", [0], 8, 16))
    released.assert_released_once(["r1"])
    assert sender.num_held == 0 and not sender._peers  # no socket was opened
    (rid, msg), = errors
    assert rid == "r1" and msg.startswith(f"refusing to connect to the KV socket of a decode node at {addr} ")
    assert "pdserve keys" in msg and "--insecure" in msg
    sender.send("d9", addr, make_ready("r2", [1], 8, 16))  # every hand-off, not only the first
    released.assert_released_once(["r1", "r2"])


def _exposed_transfer(closing, *, sender_curve=None, receiver_curve=None, insecure=False) -> tuple[list, ReleaseLog]:
    """A full hand-off to a receiver bound on 0.0.0.0, addressed as tcp://0.0.0.0:PORT (exposed by
    the rule, yet reachable from here: Linux connects 0.0.0.0 to this machine)."""
    released, errors = ReleaseLog(), []
    sender = _sender(closing, released, errors, curve=sender_curve, insecure=insecure)
    layout = make_layout()
    receiver = KVReceiver("d0", layout, make_pool(layout, seed=None), bind_addr="tcp://0.0.0.0:0",
                          curve=receiver_curve)
    closing(receiver)
    closing(sender)  # closed first
    addr = receiver.kv_addr
    assert addr.startswith("tcp://0.0.0.0:")
    sender.send("d0", addr, make_ready("r1", [0, 1], 20, 16))
    pump(sender, receiver, lambda ev: "r1" in kinds(ev, "ready"))
    receiver.pull("r1", [2, 3])
    pump(sender, receiver, lambda ev: "r1" in kinds(ev, "done"))
    pump(sender, receiver, lambda _: sender.num_held == 0)
    released.assert_released_once(["r1"])
    assert torch.equal(reference_tokens(receiver.kv_buffer, [2, 3], 20), reference_tokens(sender.kv_buffer, [0, 1], 20))
    return errors, released


def test_exposed_decode_address_with_insecure_is_allowed(closing, caplog):
    with caplog.at_level("WARNING", logger="pdserve.kvtransfer.sender"):
        errors, _ = _exposed_transfer(closing, insecure=True)
    assert not errors
    warnings = [r.getMessage() for r in caplog.records if r.name == "pdserve.kvtransfer.sender"]
    assert len(warnings) == 1 and "without CURVE" in warnings[0] and "tcp://0.0.0.0:" in warnings[0]


def test_exposed_decode_address_with_curve_keys_is_allowed(closing, tmp_path):
    keys = CurveKeys.load(generate_keys(tmp_path / "keys"))
    errors, _ = _exposed_transfer(closing, sender_curve=keys, receiver_curve=keys)
    assert not errors


# ---- decode nodes that go away --------------------------------------------------------------------
def test_a_decode_node_replaced_at_the_same_address(closing):
    """A new decode node bound where a dead one was (a container given a dead one's IP): the
    sender's old connection reconnects to it as well, yet the new node's answers reach the new
    connection (one identity per connection), and hand-offs to it complete."""
    released, errors = ReleaseLog(), []
    sender = _sender(closing, released, errors)
    layout = make_layout()
    first = KVReceiver("dA", layout, make_pool(layout, seed=None))
    addr = first.kv_addr
    sender.send("dA", addr, make_ready("r1", [0, 1], 20, 16))
    pump(sender, first, lambda ev: "r1" in kinds(ev, "ready"))
    first.pull("r1", [2, 3])
    pump(sender, first, lambda ev: "r1" in kinds(ev, "done"))
    first.close()
    deadline = time.monotonic() + 5
    while True:  # the first one's socket closes in libzmq's I/O thread: its port frees soon after
        try:
            second = KVReceiver("dB", layout, make_pool(layout, seed=None), bind_addr=addr)
            break
        except zmq.ZMQError:
            assert time.monotonic() < deadline, f"{addr} never came free"
            time.sleep(0.05)
    closing(second)
    closing(sender)  # closed first
    for _ in range(30):  # the old connection finds the new node at the old address
        sender.poll(10)
    for k in range(5):
        rid = f"s{k}"
        sender.send("dB", addr, make_ready(rid, [k], 8, 16))
        pump(sender, second, lambda ev, rid=rid: rid in kinds(ev, "ready"))
        second.pull(rid, [k + 4])
        pump(sender, second, lambda ev, rid=rid: rid in kinds(ev, "done"))
        for _ in range(20):  # a reconnect of the old connection in between must not matter
            sender.poll(5)
    pump(sender, second, lambda _: sender.num_held == 0)
    assert not errors
    released.assert_released_once(["r1", "s0", "s1", "s2", "s3", "s4"])
    # Whichever of the two connections libzmq's handover gives the shared address to last, the new
    # node's answers must go to the new connection: they never share an identity.
    identities = [peer.sock.getsockopt(zmq.IDENTITY) for peer in sender._peers.values()]
    assert len(identities) == 2 and len(set(identities)) == 2


def test_idle_connections_are_closed_and_reopened(make_pair):
    """No socket outlives its use by PEER_IDLE_S (a scaled-down decode node leaves nothing
    reconnecting forever); the next hand-off opens a fresh connection, and the receiver keeps one
    entry per prefill node, not one per connection it ever had."""
    clock = FakeClock()
    pair = make_pair(clock=clock, shm=True)
    for k in range(3):
        rid = f"r{k}"
        assert kinds(pair.transfer(rid, [k], [k + 4], 8), "done") == [rid]
        pair.pump(lambda _: pair.sender.num_held == 0)
        assert len(pair.sender._peers) == 1
        clock.advance(sender_module.PEER_IDLE_S + 1)
        pair.sender.poll(0)
        assert not pair.sender._peers  # closed while idle
    assert len(pair.receiver._peers) == 1  # the last connection only
    pair.released.assert_released_once(["r0", "r1", "r2"])
    assert not pair.errors
