"""What the router does with each message a node sends on the control socket (router/control.py):

    Register    add the node (replace an entry with the same node_id; if its pid changed the old
                process is gone, so its requests are re-dispatched). Eligible once a heartbeat says ready.
    Heartbeat   refresh liveness and load (free blocks, outstanding prompt tokens, ready), and
                reconcile: a request the node lists that the router does not place there is
                aborted on it; a heartbeat from a node the router does not know gets Reregister
    Deregister  drop the node (it drained first); anything it still held is re-dispatched
    KVEvents    what the node's prefix cache stored and evicted: into the index (kv_index.py); a
                gap in its sequence gets KVResync (the node answers with a snapshot)
    FirstToken  output index 0 of a request: ends the prompt-token accounting on the prefill node
    TokenBatch  tokens with index >= 1 of requests the sending node holds (others are dropped);
                a token with finish_reason ends the request
    Error       retryable (a KV transfer failed, a node is full): the request is re-dispatched;
                otherwise it fails (500, or an error event once streaming)
    anything else, garbage, wrong frame count: logged and dropped (control.py)

Identity binding (CURVE only; without keys there is nothing to bind). control.py hands every
message over with `peer_key`, the z85 public key its connection authenticated with. The first
Register of a node id binds that id to its key, in `NodeMessages.node_keys`, for the router's lifetime:
the binding follows the key, not the process, so a node that restarts with the same key gets its
id back (a new pid re-dispatches what the old process held, as without keys). A message claiming
a node id bound to another key is dropped, logged at WARNING once per (node id, key) and counted
as `pdserve_auth_refusals_total{reason="node_id_taken"}`, before any handler runs:

    Register, Heartbeat, Deregister, TokenBatch, Error   claim their `node_id`
    FirstToken                                            claims the request's prefill node

so a refused Register is not registered and gets no answer, and nothing else sent under that id
(heartbeats, tokens, errors, a Deregister) has any effect. A TokenBatch only counts for requests
its node holds (with or without keys), so a node cannot push tokens into another node's requests
under its own id. If the message came through the routing id the registered node was reached by
(its connection is gone and another key's took the id), the node is dropped as lost, so nothing
more is sent there. The limit: the key is the identity. Nodes that share one client key (the
default `pdserve keys` layout: every node gets client.key_secret) are one trust domain, any of
them may speak for any of their ids; binding tells apart nodes with distinct keys (each node its
own keypair, every public `.key` copied into the router's key directory).
"""

from __future__ import annotations

import logging
import time

from pdserve.protocol.messages import (
    Abort,
    Deregister,
    Error,
    FirstToken,
    Heartbeat,
    KVEvents,
    KVResync,
    Message,
    MessageError,
    Register,
    Reregister,
    Token,
    TokenBatch,
)
from pdserve.router.choices import ChoiceGroups
from pdserve.router.control import ControlSocket
from pdserve.router.dispatcher import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.redispatch import Redispatcher
from pdserve.router.registry import Registry
from pdserve.router.request_state import RouterError, receive_batch
from pdserve.router.request_table import RequestTable

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "both")


class NodeMessages:
    """One handler per node message (the table above), and the CURVE identity binding."""

    def __init__(self, served_model_name: str, registry: Registry, table: RequestTable, control: ControlSocket,
                 metrics: RouterMetrics, dispatcher: Dispatcher, redispatcher: Redispatcher,
                 groups: ChoiceGroups) -> None:
        self.served_model_name = served_model_name
        self.registry = registry
        self.table = table
        self.control = control
        self.metrics = metrics
        self.dispatcher = dispatcher
        self.redispatcher = redispatcher
        self.groups = groups
        self.node_keys: dict[str, str] = {}  # CURVE only: node id → the z85 public key it registered with
        self.taken_logged: set[tuple[str, str]] = set()  # (node id, key) whose node_id_taken refusal was logged
        self._reregister_sent: dict[str, float] = {}  # node id → when we last asked it to register

    _HANDLERS = {Register: "on_register", Heartbeat: "on_heartbeat", Deregister: "on_deregister",
                 KVEvents: "on_kv_events", FirstToken: "on_first_token", TokenBatch: "on_token_batch", Error: "on_error"}

    async def on_message(self, identity: bytes, msg: Message, peer_key: str | None = None) -> None:
        name = self._HANDLERS.get(type(msg))
        if name is None:
            raise MessageError(f"a {msg.TYPE} message is not for the router")
        if peer_key is not None and not await self.key_may_speak(identity, msg, peer_key):
            return
        await getattr(self, name)(identity, msg)

    def _claimed_node_id(self, msg: Message) -> str | None:
        if isinstance(msg, FirstToken):
            req = self.table.attempt(msg.request_id)
            return req.prefill_node_id if req is not None else None  # unknown: dropped by its handler
        return msg.node_id

    async def key_may_speak(self, identity: bytes, msg: Message, peer_key: str) -> bool:
        """Identity binding (module docstring): bind on a first Register; False (counted, logged
        once per (node id, key)) when the node id is bound to another key."""
        node_id = self._claimed_node_id(msg)
        if node_id is None:
            return True
        bound = self.node_keys.get(node_id)
        if bound is None:
            if isinstance(msg, Register):
                self.node_keys[node_id] = peer_key
                logger.info("node id %s bound to CURVE key %s", node_id, peer_key)
            return True
        if bound == peer_key:
            return True
        self.metrics.observe_auth_refusal("node_id_taken")
        if (node_id, peer_key) not in self.taken_logged:
            self.taken_logged.add((node_id, peer_key))
            logger.warning("refused %s for node %s from CURVE key %s: that node id is bound to key %s "
                           "(logged once per node id and key)", msg.TYPE, node_id, peer_key, bound)
        node = self.registry.nodes.get(node_id)
        if node is not None and node.identity == identity:
            # The node's own connection is gone and another key's took its routing id: whatever the
            # router sends to the node would go there.
            self.registry.remove(node_id)
            logger.warning("node %s dropped: its routing id is held by a connection with another key", node_id)
            await self.redispatcher.node_lost(node, f"node {node_id}'s connection was taken over")
        return False

    async def on_register(self, identity: bytes, msg: Register) -> None:
        if msg.role not in ROLES:
            raise MessageError(f"register: unknown role {msg.role!r}")
        if msg.model and msg.model != self.served_model_name:
            logger.warning("node %s serves %r, the router serves %r", msg.node_id, msg.model, self.served_model_name)
        old = self.registry.register(msg, identity)
        self._reregister_sent.pop(msg.node_id, None)
        logger.info("node %s registered (role %s, pid %d%s)", msg.node_id, msg.role, msg.pid,
                    ", replacing" if old else "")
        if old is None:
            return
        if old.role != msg.role:
            self.metrics.observe_role_change(old.role, msg.role)
            logger.info("node %s now serves %s (was %s)", msg.node_id, msg.role, old.role)
        if old.register.pid == msg.pid:  # the same process reconnected: its requests live on
            self.registry.keep_requests(old)
        else:
            await self.redispatcher.node_lost(old, f"node {msg.node_id} restarted")

    async def on_heartbeat(self, identity: bytes, msg: Heartbeat) -> None:
        node = self.registry.nodes.get(msg.node_id)
        if node is None:
            await self._ask_to_register(msg.node_id)
            return
        self.registry.heartbeat(msg)
        if self.table.parked and node.ready:
            await self.redispatcher.unpark()
        now = time.monotonic()
        for wire_id in msg.request_ids:
            req = self.table.attempt(wire_id)
            if req is not None and wire_id in node.request_ids:
                req.last_listed = now
            elif req is None and self.groups.listed(node.node_id, wire_id, now):
                pass  # an n > 1 request before its fork stands for its choices (choices.py)
            elif req is None or node.node_id not in req.node_ids:
                # Ended, re-dispatched, or from before a router restart: nobody wants its tokens.
                await self.dispatcher.send(node, Abort(wire_id, "unknown to the router"))

    async def _ask_to_register(self, node_id: str) -> None:
        """A heartbeat from a node the router does not know: it was dropped (missed heartbeats) or
        the router restarted. Ask it to register again (at most once per heartbeat timeout)."""
        now = time.monotonic()
        if now - self._reregister_sent.get(node_id, -1e9) < self.registry.heartbeat_timeout_s:
            return
        self._reregister_sent[node_id] = now
        logger.info("heartbeat from unknown node %s: asking it to register", node_id)
        # By convention a node's main socket has its id as identity. If it is not connected (yet),
        # the send fails and a later heartbeat asks again.
        await self.control.send(node_id.encode(), node_id, Reregister("unknown node"), log_level=logging.INFO)

    async def on_deregister(self, identity: bytes, msg: Deregister) -> None:
        node = self.registry.remove(msg.node_id)
        if node is not None:
            logger.info("node %s deregistered", msg.node_id)
            await self.redispatcher.node_lost(node, f"node {msg.node_id} left")

    async def on_kv_events(self, identity: bytes, msg: KVEvents) -> None:
        node = self.registry.nodes.get(msg.node_id)
        if node is None:
            return  # not registered (its Register is on the way, or it was dropped): a snapshot follows a Register
        seq = self.registry.kv_index.nodes[msg.node_id].seq
        if self.registry.kv_index.apply(msg):
            self.metrics.observe_kv_events(msg)
            return
        logger.info("node %s: a gap in its KV events (seq %d after %d): asking for a snapshot", msg.node_id,
                    msg.prev_seq, seq)
        self.metrics.observe_resync()
        await self.dispatcher.send(node, KVResync("a gap in the KV events"))

    async def on_first_token(self, identity: bytes, msg: FirstToken) -> None:
        req = self.table.attempt(msg.request_id)
        if req is None:
            return  # aborted or ended already: a late token is expected, not an error
        self.table.first_token(req)
        req.timing.prefill_queued_s, req.timing.prefill_s = msg.queued_s, msg.prefill_s
        req.timing.num_cached_tokens = msg.num_cached_tokens
        self.metrics.observe_cached(msg.num_cached_tokens)
        delivered_before = req.timing.first_token is not None  # a duplicate FirstToken is dropped
        await self.dispatcher.deliver(req, Token(msg.request_id, 0, msg.token_id, msg.logprobs, msg.finish_reason))
        if not delivered_before and req.timing.first_token is not None:
            self.metrics.observe_first_token(req)

    async def on_token_batch(self, identity: bytes, msg: TokenBatch) -> None:
        node_id, attempt, arrivals = msg.node_id, self.table.attempt, []
        logprobs = msg.logprobs or None
        for i, wire_id in enumerate(msg.request_ids):
            req = attempt(wire_id)
            if req is None:
                continue
            if node_id != req.decode_node_id and node_id != req.prefill_node_id:
                continue  # not this node's request: a stranger's, or another key's (module docstring)
            arrivals.append((req, Token(wire_id, msg.indexes[i], msg.token_ids[i],
                                        logprobs[i] if logprobs else None, msg.finish_reasons[i])))
        if not arrivals:
            return
        start = time.perf_counter()
        deltas = receive_batch(arrivals)
        self.metrics.add_stage("detokenize", time.perf_counter() - start, len(arrivals))
        for req, delta in deltas.items():
            await self.dispatcher.delivered(req, delta)

    async def on_error(self, identity: bytes, msg: Error) -> None:
        req = self.table.attempt(msg.request_id)
        if req is None and await self.groups.on_error(msg):  # an n > 1 request's: each choice (choices.py)
            return
        if req is None or msg.node_id not in req.node_ids:
            return  # an earlier attempt's, or a stranger's
        if msg.retryable:
            await self.redispatcher.redispatch(req, f"node {msg.node_id}: {msg.message}")
        else:
            await self.dispatcher.fail(req, RouterError(f"node {msg.node_id}: {msg.message}", 500, "InternalServerError"))
