"""Role changes and the per-request path through the whole router (real ZMQ, fake nodes):
POST /nodes/{id}/role, SetRole, the node registering again, GET /nodes and /planner, and
decode-only fleets under --disagg-policy never."""

from __future__ import annotations

import asyncio

from pdserve.router.disagg import PathPolicy
from pdserve.router.planner import Planner, PlannerConfig
from tests.router.conftest import run, serving, split_pair, wait_until
from tests.router.fake_node import FakeNode
from tests.router.test_metrics import scrape, value


def test_a_node_changes_role_over_http_and_registers_again(tokenizer):
    async def scenario():
        prefill, decode = split_pair()
        other = FakeNode("d1", "decode", cluster=prefill.cluster)
        async with serving(tokenizer, prefill, decode, other, path=PathPolicy("auto")) as h:
            resp = await h.client.post("/nodes/d1/role", json={"role": "prefill"})
            assert resp.status == 202, await resp.text()
            await wait_until(lambda: other.set_roles, what="SetRole delivered")
            assert other.set_roles[0].role == "prefill"
            await wait_until(lambda: h.router.registry.nodes["d1"].role == "prefill", what="registered again")
            nodes = {n["node_id"]: n for n in (await (await h.client.get("/nodes")).json())["nodes"]}
            assert nodes["d1"]["role"] == "prefill" and nodes["d1"]["changing_to"] is None
            assert value(await scrape(h), "pdserve_router_node_role_changes_total",
                         from_role="decode", to_role="prefill") == 1
            status, body = await h.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4})
            assert status == 200, body

    run(scenario())


def test_role_change_refusals_are_clear_http_errors(tokenizer):
    async def scenario():
        prefill, decode = split_pair()
        both = FakeNode("b0", "both")
        async with serving(tokenizer, prefill, decode, both) as h:
            cases = [("/nodes/nope/role", {"role": "decode"}, 404, "no node"),
                     ("/nodes/d0/role", {"role": "chef"}, 400, "role"),
                     ("/nodes/d0/role", ["decode"], 400, "role"),
                     ("/nodes/d0/role", {"role": "decode"}, 409, "already serves decode"),
                     ("/nodes/b0/role", {"role": "decode"}, 409, "only prefill and decode")]
            for path, body, status, words in cases:
                resp = await h.client.post(path, json=body)
                err = (await resp.json())["error"]
                assert resp.status == status and words in err["message"] and err["code"] == status, (path, err)
            bad = await h.client.post("/nodes/d0/role", data=b"{not json", headers={"Content-Type": "application/json"})
            assert bad.status == 400
            await both.close()
            h.router.registry.remove("b0")
            for node, role, words in (("d0", "prefill", "last decode node"), ("p0", "decode", "last prefill node")):
                resp = await h.client.post(f"/nodes/{node}/role", json={"role": role})
                assert resp.status == 409 and words in (await resp.json())["error"]["message"]
            assert not decode.set_roles and not prefill.set_roles

    run(scenario())


def test_a_decode_only_fleet_serves_every_request_locally_under_policy_never(tokenizer):
    async def scenario():
        decode = FakeNode("d0", "decode")
        async with serving(tokenizer, decode, path=PathPolicy("never")) as h:
            health = await h.client.get("/health")
            assert health.status == 200
            status, body = await h.post("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 5,
                                                            "ignore_eos": True})
            assert status == 200 and body["usage"]["completion_tokens"] == 5, body
            assert decode.prefills and decode.prefills[0].decode_node_id == ""  # prefilled where it is decoded
            assert value(await scrape(h), "pdserve_router_prefill_path_total", path="local",
                         reason="no_prefill_node") == 1

    run(scenario())


def test_planner_endpoint_needs_the_planner_and_shows_its_decision(tokenizer):
    async def scenario():
        prefill, decode = split_pair()
        async with serving(tokenizer, prefill, decode) as h:
            resp = await h.client.get("/planner")
            assert resp.status == 404 and "--planner" in (await resp.json())["error"]["message"]
        prefill, decode = split_pair()
        planner = Planner(PlannerConfig(interval_s=0.05, slo_ttft_s=1.0, slo_tpot_s=0.05))
        async with serving(tokenizer, prefill, decode, path=PathPolicy("auto"), planner=planner) as h:
            await wait_until(lambda: h.router.planner.last is not None, what="a planner tick")
            body = await (await h.client.get("/planner")).json()
            assert body["split"] == [1, 1] and "speed" in body["reason"]  # no node reported steps: it holds
            assert value(await scrape(h), "pdserve_planner_decisions_total", action="hold") >= 1

    run(scenario())


def test_a_local_stream_whose_node_dies_continues_exactly_on_another_path(tokenizer):
    """Prefilled and decoded on d0 (policy never), d0 dies mid-stream: the continuation (prompt +
    tokens streamed) goes to the surviving node, locally again, and the text is the undisturbed one."""
    async def scenario():
        shared: dict = {}
        d0 = FakeNode("d0", "decode", cluster=shared, token_delay_s=0.02)
        d1 = FakeNode("d1", "decode", cluster=shared, token_delay_s=0.02)
        body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True, "temperature": 0}
        async with serving(tokenizer, d0, d1, path=PathPolicy("never"), heartbeat_timeout_s=0.3) as h:
            status, expected = await h.post("/v1/completions", body)
            assert status == 200
            victim = {}

            async def kill_when_streaming():
                await wait_until(lambda: d0.tasks or d1.tasks, what="decoding")
                await asyncio.sleep(0.2)
                node = d0 if d0.tasks else d1
                node.heartbeating = False  # dead to the router
                victim["node"] = node

            killer = asyncio.create_task(kill_when_streaming())
            events = await h.stream("/v1/completions", body)
            await killer
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
            assert text == expected["choices"][0]["text"]
            survivor = d1 if victim["node"] is d0 else d0
            retried = [p for p in survivor.prefills if "~1" in p.request_id]
            assert len(retried) == 1 and retried[0].decode_node_id == ""  # local again, on the survivor
            assert retried[0].num_prior_output_tokens > 0

    run(scenario())
