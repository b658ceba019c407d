"""CURVE on the router's control socket, beyond "only key holders get in": peers refused at the
handshake are counted by reason (`pdserve_auth_refusals_total`), they never receive anything and
nothing they send arrives; a node id is bound to the key it first registered with, so the holder
of another allowed key can neither register under it nor speak for it, while the node itself
keeps working and may come back (same key) as often as it likes."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import zmq
import zmq.auth

from pdserve.protocol.curve import AUTH_REFUSAL_REASONS, CurveKeys, generate_keys
from pdserve.protocol.messages import Heartbeat, Message, Register, Token, TokenBatch
from tests.router.conftest import run, serving, wait_until
from tests.router.test_control import CurveNode

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


Impostor = CurveNode  # another key's process claiming a node id, maybe over its own routing id


def second_client(directory) -> CurveKeys:
    """Another client keypair whose public key is allowed in `directory` (copied in as second.key),
    with the directory's server key: a distinct, admitted identity."""
    _, secret_file = zmq.auth.create_certificates(directory, "second")
    public, secret = zmq.auth.load_certificate(secret_file)
    return dataclasses.replace(CurveKeys.load(directory), client_public=public, client_secret=secret)


def refusals(router) -> dict[str, float]:
    get = router.metrics.registry.get_sample_value
    return {r: get("pdserve_auth_refusals_total", {"reason": r}) for r in AUTH_REFUSAL_REASONS}


def record_messages(router) -> list[tuple[bytes, Message, str]]:
    """Every node message the router receives over CURVE, with its routing id and peer key (the
    identity check sees each one before its handler)."""
    seen: list[tuple[bytes, Message, str]] = []
    check = router.handlers.key_may_speak

    async def recording(identity, msg, peer_key):
        seen.append((identity, msg, peer_key))
        return await check(identity, msg, peer_key)

    router.handlers.key_may_speak = recording
    return seen


def curve_pair(keys: CurveKeys, **kw) -> tuple[CurveNode, CurveNode]:
    cluster: dict = {}
    return (CurveNode("p0", "prefill", cluster=cluster, keys=keys, **kw),
            CurveNode("d0", "decode", cluster=cluster, keys=keys, **kw))


@pytest.mark.timeout(60)
def test_refused_peers_are_counted_by_reason_and_get_nothing(tokenizer, tmp_path):
    keys = CurveKeys.load(generate_keys(tmp_path / "keys"))
    other_dir = CurveKeys.load(generate_keys(tmp_path / "other"))  # another deployment's keys
    unknown = dataclasses.replace(other_dir, server_public=keys.server_public)  # knows our server key

    async def scenario():
        async with serving(tokenizer, *curve_pair(keys), curve=keys) as h:
            seen = record_messages(h.router)
            status, body = await h.post("/v1/completions", BODY)
            assert status == 200, body
            assert refusals(h.router) == dict.fromkeys(AUTH_REFUSAL_REASONS, 0.0)  # legit traffic: none
            assert {key for _, _, key in seen} == {keys.client_public.decode()}

            # One at a time, each with the reasons it may be counted under: a plain peer is no_curve
            # when libzmq's side sees the mechanism mismatch first, handshake when the peer hung up first.
            strangers = {"plain": (None, {"no_curve", "handshake"}), "other-dir": (other_dir, {"handshake"}),
                         "unknown-key": (unknown, {"unknown_key"})}
            for name, (stranger_keys, reasons) in strangers.items():
                before = refusals(h.router)
                node = CurveNode(name, "both", keys=stranger_keys, heartbeat_interval_s=0.02)
                try:
                    await node.start(h.router.control_addr)
                    await node.send(TokenBatch.from_tokens(name, [Token("cmpl-x", 1, 5)]))
                    await wait_until(lambda r=reasons, b=before: any(refusals(h.router)[x] > b[x] for x in r),
                                     what=f"{name} counted as one of {reasons}")
                    status, body = await h.post("/v1/completions", BODY)  # served by the nodes with the keys
                    assert status == 200, body
                    assert set(h.router.registry.nodes) == {"p0", "d0"}
                    assert not node.prefills and not node.aborts and not node.reregisters
                    assert {identity for identity, _, _ in seen} <= {b"p0", b"d0"}  # nothing of theirs arrived
                finally:
                    await node.close()
                await asyncio.sleep(0.3)  # events of attempts still under way when it closed
                counted = {x for x in AUTH_REFUSAL_REASONS if refusals(h.router)[x] > before[x]}
                assert counted <= reasons, (name, counted)
            assert refusals(h.router)["node_id_taken"] == 0
            assert len(h.nodes["p0"].prefills) == 4
            # and /metrics shows them
            text = await (await h.client.get("/metrics")).text()
            assert 'pdserve_auth_refusals_total{reason="unknown_key"}' in text

    run(scenario())


@pytest.mark.timeout(60)
def test_a_node_id_is_bound_to_the_key_it_registered_with(tokenizer, tmp_path):
    keys = CurveKeys.load(generate_keys(tmp_path / "keys"))
    second = second_client(tmp_path / "keys")
    keys = CurveKeys.load(tmp_path / "keys")  # now allowing the second client's key too
    assert second.client_public in keys.allowed_client_keys

    async def scenario():
        async with serving(tokenizer, *curve_pair(keys, token_delay_s=0.05), curve=keys) as h:
            seen = record_messages(h.router)
            p0 = h.nodes["p0"]
            assert h.router.node_keys == {"p0": keys.client_public.decode(), "d0": keys.client_public.decode()}
            # Another allowed key claims p0 over a connection of its own: refused, nothing sent back.
            impostor = Impostor("p0", "prefill", keys=second, routing_id="p0-x", heartbeat_interval_s=0.02)
            # The same, through p0's own routing id while p0 is connected: libzmq ignores it (no handover).
            shadow = Impostor("p0", "prefill", keys=second, heartbeat_interval_s=0.02)
            try:
                task = asyncio.create_task(h.post("/v1/completions", BODY))
                await wait_until(lambda: p0.prefills, what="the request at p0")
                wire_id = p0.prefills[0].request_id
                await impostor.start(h.router.control_addr)
                await shadow.start(h.router.control_addr)
                for node in (impostor, shadow):  # tokens and an error under p0's id, for p0's request
                    await node.send(TokenBatch.from_tokens("p0", [Token(wire_id, 1, 99, finish_reason="stop")]))
                status, body = await task
                assert status == 200, body
                assert 99 not in body["choices"][0].get("token_ids", [])
                assert body["choices"][0]["finish_reason"] == "length"  # the real tokens, to max_tokens
                await wait_until(lambda: refusals(h.router)["node_id_taken"] >= 3,
                                 what="the impostor's Register, tokens and heartbeats refused")
                assert h.router.registry.nodes["p0"].identity == b"p0"
                assert h.router.registry.nodes["p0"].register.pid == p0.pid
                assert h.router.node_keys["p0"] == keys.client_public.decode()
                assert not impostor.prefills and not impostor.reregisters and not impostor.aborts
                assert not shadow.prefills and not shadow.reregisters and not shadow.aborts
                assert not any(identity == b"p0" and key == second.client_public.decode()
                               for identity, _, key in seen)  # the shadow's messages never arrived
                # p0 keeps working
                for _ in range(2):
                    status, body = await h.post("/v1/completions", BODY)
                    assert status == 200, body
                assert len(p0.prefills) == 3
                # A heartbeat under p0's id from the impostor saying "not ready" changes nothing.
                await impostor.send(Heartbeat("p0", 1, 1000, 0, 0, ready=False))
                await wait_until(lambda: any(isinstance(m, Heartbeat) and not m.ready for _, m, _ in seen),
                                 what="the impostor's heartbeat")
                assert h.router.registry.nodes["p0"].ready
            finally:
                for node in (impostor, shadow):
                    await node.close()
            # p0 restarts (a new process, the same key): accepted, and serves.
            await p0.close()
            del h.nodes["p0"]
            await asyncio.sleep(0.2)  # libzmq drops the old connection, so the id is free again
            p0b = CurveNode("p0", "prefill", cluster=h.nodes["d0"].cluster, keys=keys)
            p0b.pid = p0.pid + 1
            await h.add_node(p0b, wait_ready=False)
            await wait_until(lambda: h.router.registry.nodes["p0"].register.pid == p0b.pid
                             and h.router.registry.nodes["p0"].ready, what="p0 back")
            status, body = await h.post("/v1/completions", BODY)
            assert status == 200, body
            assert len(p0b.prefills) == 1
            # and registering again from the same process is fine too
            registered = sum(1 for _, m, _ in seen if isinstance(m, Register))
            await p0b.register()
            await wait_until(lambda: sum(1 for _, m, _ in seen if isinstance(m, Register)) > registered,
                             what="the second Register")
            await wait_until(lambda: h.router.registry.nodes["p0"].ready, what="p0 ready again")
            status, body = await h.post("/v1/completions", BODY)
            assert status == 200, body
            assert len(p0b.prefills) == 2
            assert h.router.handlers.taken_logged == {("p0", second.client_public.decode())}  # logged once

    run(scenario())


@pytest.mark.timeout(60)
def test_a_routing_id_taken_by_another_key_drops_the_node(tokenizer, tmp_path):
    """p0's connection is gone and another allowed key connects with p0's routing id: its Register
    is refused, and p0 is dropped so nothing more is sent through that routing id. When the other
    key's connection goes, p0 comes back with its own key."""
    generate_keys(tmp_path / "keys")
    second = second_client(tmp_path / "keys")
    keys = CurveKeys.load(tmp_path / "keys")

    async def scenario():
        async with serving(tokenizer, *curve_pair(keys), curve=keys, heartbeat_timeout_s=30) as h:
            p0 = h.nodes.pop("p0")
            await p0.close()
            await asyncio.sleep(0.2)
            squatter = Impostor("p0", "prefill", keys=second)
            try:
                await squatter.start(h.router.control_addr)
                await wait_until(lambda: "p0" not in h.router.registry.nodes, what="p0 dropped")
                assert refusals(h.router)["node_id_taken"] >= 1
                status, _ = await h.post("/v1/completions", BODY)
                assert status == 503 and not squatter.prefills
            finally:
                await squatter.close()
            await asyncio.sleep(0.2)
            back = CurveNode("p0", "prefill", cluster=h.nodes["d0"].cluster, keys=keys)
            await h.add_node(back)
            status, body = await h.post("/v1/completions", BODY)
            assert status == 200, body
            assert len(back.prefills) == 1

    run(scenario())
