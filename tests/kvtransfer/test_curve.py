"""CURVE keys and sockets: key files, an encrypted exchange, peers without the right keys getting
nothing through (plain, or a key the ZAP authenticator does not know), the router's asyncio
context, and a KV hand-off with CURVE on both ends, or on one end only (the lease runs out)."""

import asyncio
import dataclasses
import shutil
import stat
import threading
import time

import pytest
import zmq
import zmq.asyncio
import zmq.auth
from zmq.auth.thread import AuthenticationThread
from zmq.utils.monitor import recv_monitor_message

from pdserve.kvtransfer.payload import gather_tokens
from pdserve.kvtransfer.receiver import KVReceiver
from pdserve.kvtransfer.sender import KVSender
from pdserve.protocol.curve import (
    CurveKeys,
    apply_client,
    apply_server,
    generate_keys,
    keys_main,
    start_authenticator,
    stop_authenticator,
)
from pdserve.protocol.messages import MAX_MESSAGE_BYTES, Heartbeat, Register
from pdserve.protocol.sockets import context, endpoint, make_socket, recv_msg, send_msg

from .conftest import (
    FakeClock,
    Pair,
    ReleaseLog,
    kinds,
    make_layout,
    make_pool,
    recv_within,
    same_bytes,
    send_within,
)

KEY_FILES = ["server.key", "server.key_secret", "client.key", "client.key_secret"]


def make_keys(directory) -> CurveKeys:
    generate_keys(directory)
    return CurveKeys.load(directory)


@pytest.fixture
def keys(tmp_path) -> CurveKeys:
    return make_keys(tmp_path / "keys")


@pytest.fixture
def foreign_keys(keys, tmp_path) -> CurveKeys:
    """Another deployment's client keys, plus our server's public key (which is no secret)."""
    return dataclasses.replace(make_keys(tmp_path / "other"), server_public=keys.server_public)


@pytest.fixture(autouse=True)
def stop_zap():
    yield  # runs after the tests' sockets are closed (autouse fixtures are torn down last)
    stop_authenticator(context())
    assert not [t for t in threading.enumerate() if isinstance(t, AuthenticationThread)], "a ZAP thread leaked"


def curve_pair(client_keys, server_keys) -> tuple[zmq.Socket, zmq.Socket]:
    server = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0", curve=server_keys)
    client = make_socket(zmq.DEALER, connect=endpoint(server), identity=b"c1", curve=client_keys)
    return server, client


def saw_event(monitor: zmq.Socket, event: int, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while monitor.poll(max(0, int((deadline - time.monotonic()) * 1000))):
        if recv_monitor_message(monitor, zmq.NOBLOCK)["event"] == event:
            return True
    return False


# ---- keys ---------------------------------------------------------------------------------------
def test_generate_keys_writes_private_pyzmq_certificates(tmp_path):
    directory = generate_keys(tmp_path / "a" / "keys")
    assert sorted(p.name for p in directory.iterdir()) == sorted(KEY_FILES)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for name in ("server", "client"):
        assert stat.S_IMODE((directory / f"{name}.key_secret").stat().st_mode) == 0o600
        public, secret = zmq.auth.load_certificate(directory / f"{name}.key_secret")
        assert zmq.auth.load_certificate(directory / f"{name}.key") == (public, None) and len(secret) == 40
    keys = CurveKeys.load(directory)
    assert keys.allowed_client_keys == {keys.server_public, keys.client_public}
    assert keys.server_public != keys.client_public


def test_generate_keys_refuses_to_overwrite(tmp_path, capsys):
    old = make_keys(tmp_path / "k")
    with pytest.raises(FileExistsError, match="force"):
        generate_keys(tmp_path / "k")
    assert CurveKeys.load(tmp_path / "k") == old
    generate_keys(tmp_path / "k", force=True)
    assert CurveKeys.load(tmp_path / "k").server_secret != old.server_secret
    assert keys_main([str(tmp_path / "k")]) == 1 and "force" in capsys.readouterr().err
    assert keys_main([str(tmp_path / "new")]) == 0 and str(tmp_path / "new") in capsys.readouterr().out
    CurveKeys.load(tmp_path / "new")


def test_load_names_the_missing_file(tmp_path, keys):
    with pytest.raises(FileNotFoundError, match=r"server\.key_secret.*pdserve keys"):
        CurveKeys.load(tmp_path / "nowhere")
    (tmp_path / "keys" / "client.key_secret").unlink()
    with pytest.raises(FileNotFoundError, match=r"client\.key_secret.*pdserve keys"):
        CurveKeys.load(tmp_path / "keys")
    shutil.copy(tmp_path / "keys" / "client.key", tmp_path / "keys" / "client.key_secret")  # public only
    with pytest.raises(ValueError, match="no secret-key"):
        CurveKeys.load(tmp_path / "keys")


# ---- sockets ------------------------------------------------------------------------------------
def test_curve_client_and_server_exchange(keys):
    server, client = curve_pair(keys, keys)
    assert server.getsockopt(zmq.MECHANISM) == zmq.CURVE and client.getsockopt(zmq.MECHANISM) == zmq.CURVE
    assert send_within(client, b"ping")
    identity, body = recv_within(server)
    assert (identity, body) == (b"c1", b"ping")
    assert send_within(server, identity, b"pong")
    assert recv_within(client) == [b"pong"]
    # plain sockets of the same process are not subject to the authenticator
    plain_server, plain_client = curve_pair(None, None)
    assert send_within(plain_client, b"plain")
    assert recv_within(plain_server)[1] == b"plain"
    for sock in (server, client, plain_server, plain_client):
        sock.close(0)


@pytest.mark.parametrize("client", ["plain", "foreign"])
def test_client_without_our_keys_gets_nothing_through(keys, foreign_keys, client):
    server = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0", curve=keys)
    monitor = server.get_monitor_socket()
    stranger = make_socket(zmq.DEALER, connect=endpoint(server), curve=None if client == "plain" else foreign_keys)
    # Queued, or refused for want of a peer once the handshake has failed: never a blocking send,
    # which would wait forever for a connection that never comes.
    send_within(stranger, b"let me in", timeout_s=0.5)
    refusal = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL if client == "plain" else zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert saw_event(monitor, refusal)  # plain: mechanism mismatch; foreign key: ZAP said no
    assert not server.poll(300)
    server.disable_monitor()
    for sock in (monitor, stranger, server):
        sock.close(0)


def test_a_dropped_in_public_key_is_admitted(keys, tmp_path):
    other = make_keys(tmp_path / "other")
    shutil.copy(tmp_path / "other" / "client.key", tmp_path / "keys" / "extra.key")
    keys = CurveKeys.load(tmp_path / "keys")
    assert other.client_public in keys.allowed_client_keys
    server, client = curve_pair(dataclasses.replace(other, server_public=keys.server_public), keys)
    assert send_within(client, b"hi")
    assert recv_within(server)[1] == b"hi"
    server.close(0)
    client.close(0)


def test_authenticator_is_one_per_context(keys, foreign_keys):
    auth = start_authenticator(context(), keys)
    assert start_authenticator(context(), keys) is auth
    with pytest.raises(ValueError, match="other allowed keys"):
        start_authenticator(context(), foreign_keys)
    stop_authenticator(context())
    assert not auth.is_alive()
    stop_authenticator(context())  # no-op


def test_router_asyncio_context(keys):
    """The router's ROUTER lives on its own zmq.asyncio.Context: apply_server starts a
    ThreadAuthenticator on that context, and stop_authenticator lets ctx.term() return."""

    async def exchange(ctx: zmq.asyncio.Context) -> list[bytes]:
        router = ctx.socket(zmq.ROUTER)
        apply_server(router, keys)
        router.bind("tcp://127.0.0.1:*")
        node = context().socket(zmq.DEALER)
        apply_client(node, keys)
        node.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        assert send_within(node, b"register")
        try:
            return await asyncio.wait_for(router.recv_multipart(), 3)
        finally:
            node.close(0)
            router.close(0)

    ctx = zmq.asyncio.Context()
    assert asyncio.run(exchange(ctx))[1] == b"register"
    stop_authenticator(ctx)
    ctx.term()


def test_make_socket_builds_the_router_and_node_link_sockets(keys):
    """The control plane from the one factory: the router's asyncio ROUTER (CURVE server, frames up
    to MAX_MESSAGE_BYTES + 64 KiB, libzmq's default queues) and a node's DEALER link (identity,
    SNDHWM 100000, CURVE client), exchanging a Register and an answer."""

    async def exchange(ctx: zmq.asyncio.Context) -> None:
        router = make_socket(zmq.ROUTER, bind="tcp://127.0.0.1:0", max_msg_bytes=MAX_MESSAGE_BYTES + (64 << 10),
                             hwm=None, curve=keys, ctx=ctx)
        link = make_socket(zmq.DEALER, connect=endpoint(router), identity=b"d0", hwm=None, send_hwm=100_000,
                           curve=keys)
        try:
            assert isinstance(router, zmq.asyncio.Socket) and router.getsockopt(zmq.CURVE_SERVER) == 1
            assert router.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES + (64 << 10)
            assert router.getsockopt(zmq.SNDHWM) == router.getsockopt(zmq.RCVHWM) == 1000
            assert link.getsockopt(zmq.IDENTITY) == b"d0" and link.getsockopt(zmq.SNDHWM) == 100_000
            assert link.getsockopt(zmq.RCVHWM) == 1000 and link.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
            assert link.getsockopt(zmq.MECHANISM) == zmq.CURVE and link.getsockopt(zmq.LINGER) == 0
            send_msg(link, Register(node_id="d0", role="decode", model="tiny"))
            identity, frame = await asyncio.wait_for(router.recv_multipart(), 3)
            assert identity == b"d0" and Register.TYPE.encode() in frame
            await router.send_multipart([identity, Heartbeat("d0", 1, 2, 0, 0).encode()], zmq.NOBLOCK)
            assert link.poll(3000)
            assert recv_msg(link, zmq.NOBLOCK)[1] == Heartbeat("d0", 1, 2, 0, 0)
            with pytest.raises(zmq.ZMQError):  # MANDATORY: an unknown peer raises instead of a silent drop
                await router.send_multipart([b"nobody", b"x"], zmq.NOBLOCK)
        finally:
            link.close(0)
            router.close(0)

    ctx = zmq.asyncio.Context()
    asyncio.run(exchange(ctx))
    stop_authenticator(ctx)
    ctx.term()


def test_curve_socket_must_bind_or_connect(keys):
    with pytest.raises(ValueError, match="either binds"):
        make_socket(zmq.DEALER, curve=keys)


# ---- the KV hand-off ----------------------------------------------------------------------------
@pytest.fixture
def make_curve_pair(closing):
    def make(sender_keys, receiver_keys, clock=None) -> Pair:
        layout = make_layout()
        released, errors = ReleaseLog(), []
        kw = {} if clock is None else {"clock": clock}
        sender = KVSender("p0", layout, make_pool(layout), released, curve=sender_keys,
                          on_error=lambda rid, msg: errors.append((rid, msg)), **kw)
        receiver = KVReceiver("d0", layout, make_pool(layout, seed=None), curve=receiver_keys, **kw)
        closing(receiver)
        closing(sender)
        return Pair(sender, receiver, released, errors)
    return make


def test_kv_transfer_with_curve_on_both_ends(make_curve_pair, keys):
    pair = make_curve_pair(keys, keys)
    events = pair.transfer("r1", [5, 2, 9], [3, 1, 6], 37)
    assert kinds(events, "done") == ["r1"] and pair.receiver.num_zmq_pulls == 1
    assert same_bytes(gather_tokens(pair.dst, [3, 1, 6], 37), gather_tokens(pair.src, [5, 2, 9], 37))
    pair.pump(lambda _: pair.sender.num_held == 0)
    assert not pair.errors
    pair.released.assert_released_once(["r1"])


@pytest.mark.parametrize("ends", ["sender only", "receiver only", "foreign sender"])
def test_kv_hand_off_without_matching_keys_expires(make_curve_pair, keys, foreign_keys, ends):
    sender_keys = {"sender only": keys, "receiver only": None, "foreign sender": foreign_keys}[ends]
    clock = FakeClock()
    pair = make_curve_pair(sender_keys, None if ends == "sender only" else keys, clock=clock)
    pair.send("r1", [0, 1], 20, lease_s=10.0)
    deadline = time.monotonic() + 0.5
    while time.monotonic() < deadline:  # the KVReady never arrives
        pair.sender.poll(10)
        assert not pair.receiver.poll(10)
    # Usually the KVReady sits queued on the sender's side until the lease runs out. When libzmq
    # has already failed the handshake and dropped the connection's queue (a loaded machine lets
    # its I/O thread get there before our first send), the send is refused and the hand-off
    # fails at once instead. Either way: nothing got through, released once, one error.
    if pair.sender.num_held:
        assert not pair.released.calls
        clock.advance(10.5)
        pair.sender.poll()
        expected = "expired"
    else:
        expected = "cannot send KVReady"
    pair.released.assert_released_once(["r1"])
    assert [(rid, expected in msg) for rid, msg in pair.errors] == [("r1", True)]


@pytest.mark.timeout(30)
def test_the_kv_socket_counts_refused_peers_by_reason(make_curve_pair, keys, foreign_keys, tmp_path):
    """A decode node's KV socket counts the prefill peers it refuses: a plain one (no_curve), one
    with another key directory's keys (handshake: its HELLO is not for our server key) and one
    whose client key the ZAP handler does not know (unknown_key). A hand-off between key holders
    counts nothing. The decode node exports the counts (pdserve_auth_refusals_total)."""
    from pdserve.node.metrics import NodeMetrics, NodeSnapshot

    pair = make_curve_pair(keys, keys)
    assert kinds(pair.transfer("r1", [5, 2, 9], [3, 1, 6], 37), "done") == ["r1"]
    assert pair.receiver.auth_refusals == {"unknown_key": 0, "no_curve": 0, "handshake": 0}
    other_dir = make_keys(tmp_path / "other-dir")
    # a plain peer is no_curve, or handshake when its side hung up first (a race in libzmq)
    strangers = {"plain": (None, {"no_curve", "handshake"}), "other-dir": (other_dir, {"handshake"}),
                 "unknown-key": (foreign_keys, {"unknown_key"})}
    for name, (stranger_keys, reasons) in strangers.items():
        before = pair.receiver.auth_refusals
        sock = make_socket(zmq.DEALER, connect=pair.receiver.kv_addr, identity=name.encode(), curve=stranger_keys)
        try:
            send_within(sock, Register(name, "prefill", "tiny").encode(), timeout_s=0.2)
            deadline = time.monotonic() + 5
            while not any(pair.receiver.auth_refusals[r] > before[r] for r in reasons):
                assert time.monotonic() < deadline, f"{name} not counted: {pair.receiver.auth_refusals}"
                assert not pair.receiver.poll(20)  # nothing of theirs arrives
        finally:
            sock.close(0)
        settle = time.monotonic() + 0.3  # events of attempts still under way when it closed
        while time.monotonic() < settle:
            pair.receiver.poll(20)
        after = pair.receiver.auth_refusals
        assert {r for r in after if after[r] > before[r]} <= reasons, (name, before, after)
    metrics = NodeMetrics("d0", "decode")
    metrics.watch(lambda: NodeSnapshot(0, 0, 0, 1, 0, 0, 0, auth_refusals=pair.receiver.auth_refusals))
    text = metrics.render().decode()
    for reason in ("unknown_key", "handshake"):
        count = pair.receiver.auth_refusals[reason]
        assert f'pdserve_auth_refusals_total{{node_id="d0",reason="{reason}",role="decode"}} {count:.1f}' in text


def test_handshake_failures_map_events_to_reasons_and_log_once_a_minute(caplog):
    from pdserve.protocol.curve import HandshakeFailures

    clock, counted = FakeClock(), []
    failures = HandshakeFailures("test socket", lambda reason, peer: counted.append(reason), clock=clock)
    mismatch = {"event": zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "value": zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH}
    crypto = {"event": zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, "value": zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC}
    hung_up = {"event": zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, "value": 32}
    zap_said_no = {"event": zmq.EVENT_HANDSHAKE_FAILED_AUTH, "value": 400}  # counted by the ZAP callback
    with caplog.at_level("WARNING", logger="pdserve.protocol.curve"):
        assert [failures.on_event(e) for e in (mismatch, crypto, hung_up, zap_said_no)] == \
            ["no_curve", "handshake", "handshake", None]
        assert counted == ["no_curve", "handshake", "handshake"]
        assert len(caplog.records) == 1  # the first; the rest within the minute are only counted
        clock.advance(61)
        failures.on_event(mismatch)
        assert len(caplog.records) == 2 and "3 more" in caplog.records[1].getMessage()
