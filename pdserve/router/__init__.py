"""pdserve.router: the OpenAI-compatible HTTP API, the node registry and the (prefill, decode) routing.

    router.py            Router: control socket, registry, dispatch, token flow, aborts
    registry.py          live nodes and the routing policies
    request_state.py     one request's states, timing and token re-sequencing
    openai_protocol.py   request validation → SamplingParams; OpenAI error bodies
    openai_responses.py  response bodies and stream chunks
    openapi.py           the OpenAPI 3.1 description served at GET /openapi.json
    metrics.py           Prometheus metrics (GET /metrics): TTFT and its stages, TPOT, ITL, counts
    app.py               aiohttp routes (create_app)
    cli.py               main(argv): `pdserve router` / `python -m router`
    launcher.py          `pdserve serve`: router + nodes as supervised local processes
"""

__all__ = ["Router", "create_app", "main"]


def __getattr__(name: str):
    # Lazy: `import router` stays cheap (no zmq, aiohttp or transformers until used).
    if name == "Router":
        from pdserve.router.router import Router

        return Router
    if name == "create_app":
        from pdserve.router.app import create_app

        return create_app
    if name == "main":
        from pdserve.router.cli import main

        return main
    raise AttributeError(name)
