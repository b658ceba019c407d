"""pdserve.router: the OpenAI-compatible HTTP API, the node registry and the (prefill, decode) routing.

    router.py            Router: the composition root app.py and the tests hold; builds the parts
                         below, runs their loops, and answers the HTTP side's calls
    request_table.py     RequestTable: every request the router holds, by request id (in flight,
                         parked, n > 1 groups); `forget` drops one from every part at once
    dispatcher.py        Dispatcher: admission (429, 503), sending attempts, a request's outcomes
    redispatch.py        Redispatcher: re-dispatch of a request whose node died, parking until a
                         node is ready
    choices.py           ChoiceGroups: n > 1 requests (one prefill, n choices)
    choice_group.py      ChoiceGroup: a request's choices as the HTTP side waits for them
    handlers.py          NodeMessages: one handler per node message (Register, ..., Error), and
                         the CURVE identity binding
    monitor.py           Monitor: periodic checks (heartbeat expiry, deadlines, lost requests)
    control.py           the ZMQ control socket nodes connect to: receive loop and sends
    saturation.py        the router's own load (loop lag, control backlog) and shedding it with 429s
    registry.py          live nodes and the routing policies
    request_state.py     one request's states (RouterRequestStatus), timing, token re-sequencing,
                         a step's tokens at once (receive_batch), the outbox the HTTP side reads
    openai_protocol.py   request validation → SamplingParams
    openai_errors.py     OpenAI error bodies and ProtocolError
    openai_responses.py  response bodies and stream chunks
    openapi.py           the OpenAPI 3.1 description served at GET /openapi.json
    metrics.py           Prometheus metrics (GET /metrics): TTFT and its stages, TPOT, ITL, counts
    app.py               aiohttp routes (create_app)
    ports.py             whether the HTTP port is free, before any process starts
    access_log.py        the HTTP access log, with /health and /metrics polls at DEBUG
    cli.py               main(argv): `pdserve router` / `python -m pdserve.router`
    api_servers.py       --api-server-count N: N router processes on one port, supervised

`pdserve serve` (router + nodes as supervised local processes) is pdserve/cli/serve.py.
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
