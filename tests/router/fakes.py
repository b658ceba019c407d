"""Stand-ins for the router's parts, for testing one part alone: each records what it was asked
to do (`calls`) and does nothing else unless told to."""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.protocol.messages import Heartbeat, Register
from pdserve.router.registry import NoNodeError, Registry, Route
from pdserve.router.request_state import RouterRequest


def add_node(reg: Registry, node_id: str, role: str, *, ready: bool = True, pid: int = 1, now: float | None = None,
             free: int = 100) -> None:
    reg.register(Register(node_id, role, "m", kv_addr=f"tcp://{node_id}", num_total_blocks=100, block_size=16,
                          pid=pid), node_id.encode(), now=now)
    reg.heartbeat(Heartbeat(node_id, free, 100, 0, 0, ready=ready), now=now)


def make_request(tokenizer, request_id: str = "r", *, prompt=(1, 2, 3), max_tokens: int = 8,
                 deadline: float | None = None) -> RouterRequest:
    return RouterRequest(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         tokenizer, deadline=deadline)


class FakeSend:
    """ControlSocket.send: records (node id, message); `reachable` False makes every send fail."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.reachable = True

    async def __call__(self, identity: bytes, node_id: str, msg) -> bool:
        self.sent.append((node_id, msg))
        return self.reachable


class FakeDispatcher:
    """Dispatcher: dispatch enters the request in the table (as the real one does) and reports
    `reachable`; the outcomes are recorded; `reroute` routes on the registry, or raises NoNodeError
    when `no_node` is set."""

    def __init__(self, table=None, registry: Registry | None = None) -> None:
        self.table, self.registry = table, registry
        self.calls: list[tuple] = []
        self.reachable = True
        self.no_node: str | None = None

    def reroute(self, req: RouterRequest) -> Route:
        if self.no_node:
            raise NoNodeError(self.no_node)
        return self.registry.route(req.attempt_prompt_ids, req.attempt_sampling.max_tokens, ignore_limits=True)

    async def dispatch(self, req: RouterRequest, route: Route) -> bool:
        self.calls.append(("dispatch", req.wire_id, route.node_ids))
        self.table.dispatched(req, route, len(req.attempt_prompt_ids))
        return self.reachable

    async def send(self, node, msg) -> bool:
        self.calls.append(("send", node.node_id, msg))
        return self.reachable

    async def deliver(self, req, token) -> None:
        self.calls.append(("deliver", req.wire_id, token.index))

    async def delivered(self, req, delta) -> None:
        self.calls.append(("delivered", req.wire_id, delta.token_ids))

    async def fail(self, req, error) -> None:
        self.calls.append(("fail", req.request_id, error.status))
        if req.fail(error) is not None:
            self.table.forget(req)

    async def abort_nodes(self, req, reason: str) -> None:
        self.calls.append(("abort_nodes", req.wire_id, req.node_ids))

    async def abort_on(self, node_ids, wire_id: str, reason: str) -> None:
        self.calls.append(("abort_on", wire_id, list(node_ids)))

    async def release(self, req, reason: str = "client disconnected") -> None:
        self.calls.append(("release", req.request_id))
        req.abort()
        self.table.forget(req)

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


class FakeRedispatcher:
    """Redispatcher: records what it was asked to re-dispatch, and lost nodes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    async def redispatch(self, req, reason: str) -> None:
        self.calls.append(("redispatch", req.request_id, reason))

    async def node_lost(self, node, reason: str) -> None:
        self.calls.append(("node_lost", node.node_id, reason))

    async def unpark(self) -> None:
        self.calls.append(("unpark",))

    async def start(self, req, route) -> None:
        self.calls.append(("start", req.request_id, route.node_ids))
