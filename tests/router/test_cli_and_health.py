"""`pdserve router`'s flags and wiring, GET /health's instance id, and the access log that keeps
/health and /metrics polls at DEBUG."""

from __future__ import annotations

import logging
import re
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from pdserve.engine.loader import served_model_name
from pdserve.protocol.curve import CurveKeys, generate_keys
from pdserve.router import cli
from pdserve.router.access_log import RouterAccessLogger
from pdserve.router.app import INSTANCE_ID_KEY, ROUTER_KEY, create_app
from pdserve.router.openapi import openapi_spec
from pdserve.router.router import Router
from pdserve.router.saturation import DEFAULT_MAX_LAG_S
from tests.router.conftest import MODEL, run, serving
from tests.router.fake_node import FakeNode


# ---- GET /health ---------------------------------------------------------------------------------
def test_health_answers_the_instance_id_healthy_or_not(tokenizer):
    async def scenario():
        async with serving(tokenizer) as h:
            resp = await h.client.get("/health")
            body = await resp.json()
            assert resp.status == 503 and body["status"] == "no ready prefill and decode nodes"
            assert re.fullmatch(r"[0-9a-f]{32}", body["instance_id"])  # a random uuid4 hex by default
            await h.add_node(FakeNode("n0"))
            resp = await h.client.get("/health")
            assert resp.status == 200 and await resp.json() == {"status": "ok", "instance_id": body["instance_id"]}
        client = TestClient(TestServer(create_app(Router(tokenizer, MODEL), instance_id="launcher-7")))
        await client.start_server()
        try:
            assert (await (await client.get("/health")).json())["instance_id"] == "launcher-7"
        finally:
            await client.close()

    run(scenario())


def test_two_apps_get_different_instance_ids(tokenizer):
    ids = {create_app(Router(tokenizer, MODEL))[INSTANCE_ID_KEY] for _ in range(2)}
    assert len(ids) == 2


def test_openapi_describes_the_health_body():
    responses = openapi_spec()["paths"]["/health"]["get"]["responses"]
    for status in ("200", "503"):
        schema = responses[status]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == {"status", "instance_id"} and "instance_id" in schema["required"]


# ---- the access log ------------------------------------------------------------------------------
def get_with_access_log(tokenizer, paths) -> None:
    """GET each path from an app served with the router's access logger."""
    async def scenario():
        server = TestServer(create_app(Router(tokenizer, MODEL)))
        await server.start_server(access_log_class=RouterAccessLogger)
        client = TestClient(server)
        try:
            for path in paths:
                await (await client.get(path)).read()
        finally:
            await client.close()

    run(scenario())


def test_health_and_metrics_polls_are_logged_at_debug(tokenizer, caplog):
    with caplog.at_level(logging.DEBUG, logger="aiohttp.access"):
        get_with_access_log(tokenizer, ("/health", "/metrics", "/v1/models", "/nothing"))
    levels = {}
    for record in caplog.records:
        if record.name == "aiohttp.access":
            path = next(p for p in ("/health", "/metrics", "/v1/models", "/nothing") if p in record.getMessage())
            levels[path] = record.levelno
    assert levels == {"/health": logging.DEBUG, "/metrics": logging.DEBUG, "/v1/models": logging.INFO,
                      "/nothing": logging.INFO}


def test_at_info_polls_are_not_logged(tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="aiohttp.access"):
        get_with_access_log(tokenizer, ("/health", "/v1/models"))
    messages = [r.getMessage() for r in caplog.records if r.name == "aiohttp.access"]
    assert len(messages) == 1 and '"GET /v1/models HTTP/1.1" 200' in messages[0]  # aiohttp's own format


# ---- the command line ----------------------------------------------------------------------------
def test_every_flag_has_help_with_its_default(monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "s3cret-from-env")
    parser = cli.build_parser()
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and "(default:" in action.help, action.option_strings
    text = parser.format_help()
    assert "(default: 8000)" in text and "(default: tcp://127.0.0.1:0)" in text
    assert "s3cret-from-env" not in text  # the key from the environment is not echoed
    assert "--instance-id" in text


def test_main_wires_name_instance_id_and_access_log(tokenizer, monkeypatch, tmp_path):
    seen = {}

    def fake_run_app(app, **kw):
        seen["app"], seen["kw"] = app, kw

    monkeypatch.setattr(cli, "load_tokenizer", lambda model: tokenizer)
    monkeypatch.setattr(web, "run_app", fake_run_app)
    gguf = tmp_path / "Tiny-Model.Q4.GGUF"
    assert cli.main(["--model", str(gguf), "--instance-id", "abc123", "--port", "0"]) == 0
    app, kw = seen["app"], seen["kw"]
    assert app[INSTANCE_ID_KEY] == "abc123" and kw["access_log_class"] is RouterAccessLogger
    assert app[ROUTER_KEY].served_model_name == served_model_name(gguf) == "Tiny-Model.Q4"
    assert app[ROUTER_KEY].curve is None
    keys = generate_keys(tmp_path / "keys")
    cli.main(["--model", str(gguf), "--served-model-name", "mine", "--zmq-curve-keys", str(keys)])
    router = seen["app"][ROUTER_KEY]
    assert router.served_model_name == "mine" and router.curve == CurveKeys.load(keys)
    assert re.fullmatch(r"[0-9a-f]{32}", seen["app"][INSTANCE_ID_KEY])


def test_max_lag_reaches_the_router_and_zero_never_sheds(tokenizer, monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "load_tokenizer", lambda model: tokenizer)
    monkeypatch.setattr(web, "run_app", lambda app, **kw: seen.update(app=app))
    assert cli.main(["--port", "0"]) == 0
    assert seen["app"][ROUTER_KEY].saturation.max_lag_s == DEFAULT_MAX_LAG_S == 0.1
    for flag, max_lag_s, sheds in (("0.25", 0.25, "loop_lag"), ("0", None, None)):
        assert cli.main(["--port", "0", "--max-lag", flag]) == 0
        saturation = seen["app"][ROUTER_KEY].saturation
        assert saturation.max_lag_s == max_lag_s
        for _ in range(5):  # a loop 5 s late, probe after probe: shed, unless 0 says never
            saturation.record(time.monotonic(), 5.0)
        assert saturation.admit(10) == sheds


@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_max_lag_refuses_what_is_not_seconds(value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--max-lag", value])
    assert e.value.code == 2
    assert f"argument --max-lag: {value!r} is not a number of seconds" in capsys.readouterr().err
