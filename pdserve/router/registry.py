"""Live nodes and the routing policies that pick a (prefill, decode) pair for a request.

A node is live from its `Register` until its `Deregister`, or until it misses heartbeats for
`heartbeat_timeout_s`; it is eligible for new requests only while its last heartbeat says
`ready`. A "both" node counts in the prefill pool and in the decode pool.

Load signals, and why they are mixed the way they are:

- prefill: outstanding prompt tokens. The router's own count (sent, first token not yet back) is
  exact for the requests this router sent; the heartbeat's `num_outstanding_tokens` can only add
  what other routers sent, so the larger of the two is used.
- decode: free KV blocks. The heartbeat is the truth but up to a second old, so the blocks of
  requests dispatched since that heartbeat are subtracted as an estimate (reset on each heartbeat).

Queue limits (overload). A prefill node is saturated when `max_queue` of this router's requests
wait for their first token on it; a decode node when it holds `max_queue` requests beyond its
`max_num_seqs`. With several routers (`--api-server-count`, replicas) a decode node's load is this
router's own requests on it (exact, live) plus the other routers' ones its last heartbeat counted:
`num_running + num_waiting` less the requests the heartbeat lists, which are this router's (a node
lists to each router only its own, node/router_links.py). So two routers cannot each fill the same
node to its limit; what another router sent since that heartbeat (at most a heartbeat's worth)
is not seen yet, and admission stays the node's decision. With one router the heartbeat adds
nothing beyond its own requests. New requests only go to unsaturated nodes; when every ready node of a role is
saturated, `route` raises `OverloadedError` (the client gets 429 + Retry-After). A re-dispatched
request (its node died) ignores the limits: it is already streaming.

Caches (kv_index.py: the exact index the nodes' KVEvents feed). Once some candidate node has
reported its cache, routing reads it:

- prefill node: the least expected time to the first token, `prefill_s(queue + uncached
  tokens)` with each node's fitted speed (the fleet's while its own is unknown; queued and
  uncached tokens when no speed is known yet), so a node holding the prompt's prefix wins
  unless its queue costs more than the prefix saves;
- decode node: among those within `DECODE_SLACK` of the least loaded (running + queued
  requests), the one holding the longest prefix of the prompt, then the most free blocks;
- the path (disagg.py): the decode node prefills the prompt itself when it holds the prefix
  and the rest is short (`cached`, a follow-up turn of a conversation it decoded), so only the
  new tokens are computed and no KV moves.

With no node reporting (prefix caching off everywhere), `--prefix-affinity` is the fallback:
rendezvous hashing of the first 64 prompt tokens.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.protocol.messages import Heartbeat, Register
from pdserve.router.disagg import NodeLoad, PathChoice, PathPolicy
from pdserve.router.kv_index import KVIndex, prompt_keys
from pdserve.router.speed import WINDOW, StepModel

PREFILL_ROLES = ("prefill", "both")
DECODE_ROLES = ("decode", "both")
AFFINITY_PREFIX_LEN = 64  # prompt tokens hashed for prefix affinity
DEFAULT_BLOCK_SIZE = 16  # for the block estimate when a node did not say
DEFAULT_MAX_NUM_SEQS = 256  # a node's running batch, when it did not say
DEFAULT_MAX_QUEUE = 256  # requests queued per node beyond what it runs
DECODE_SLACK = 4  # requests more than the least loaded decode node a node may run and still win by its cache


@dataclass
class NodeInfo:
    register: Register
    identity: bytes  # the ZMQ routing id its frames came from (node_id.encode() by convention)
    last_seen: float  # monotonic time of the last Register or Heartbeat
    heartbeat: Heartbeat | None = None
    # This router's requests on the node, by wire id, for its load; written through the request
    # table (request_table.py), which holds everything else about them.
    outstanding_prompt_tokens: dict[str, int] = field(default_factory=dict)  # waiting for a first token -> prompt len
    blocks_since_heartbeat: int = 0  # estimated blocks of requests dispatched since the last heartbeat
    request_ids: set[str] = field(default_factory=set)  # requests this node holds state for
    speed: StepModel = field(default_factory=StepModel)  # fitted from its heartbeats' step samples
    changing_to: str = ""  # the role a SetRole asked for, until it registers with it

    @property
    def node_id(self) -> str:
        return self.register.node_id

    @property
    def role(self) -> str:
        return self.register.role

    @property
    def ready(self) -> bool:
        # Not ready until the first heartbeat says so: Register comes before the model is warm.
        # Nor once this router asked it to change role: it refuses new requests until it registers
        # again (its heartbeats say so too, within a heartbeat period, to every router).
        return self.heartbeat is not None and self.heartbeat.ready and not self.changing_to

    @property
    def prefill_load(self) -> int:
        own = sum(self.outstanding_prompt_tokens.values())
        return max(own, self.heartbeat.num_outstanding_tokens if self.heartbeat else 0)

    @property
    def free_blocks(self) -> int:
        free = self.heartbeat.num_free_blocks if self.heartbeat else self.register.num_total_blocks
        return free - self.blocks_since_heartbeat

    def load(self, fleet: StepModel | None = None) -> NodeLoad:
        """What the path policy reads (disagg.py): the node's own speed once its steps showed both
        prefill and decode, else the fleet's (`fleet`: every node's steps pooled), since a prefill
        node never decodes and a decode node prefills only what it is given."""
        running = self.decode_load
        last = self.speed.last_decode or (fleet.last_decode if fleet is not None else None)
        context = running * last[1] / last[0] if last and last[0] else 0.0
        speed = self.speed if self.speed.known or fleet is None else fleet
        return NodeLoad(self.node_id, speed, self.prefill_load, running, context)

    def estimate_blocks(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / (self.register.block_size or DEFAULT_BLOCK_SIZE))

    def is_saturated(self, role: str, max_queue: int) -> bool:
        """Past its queue limit in `role` ("prefill" or "decode"; a "both" node is checked for both)."""
        if role == "prefill":
            return len(self.outstanding_prompt_tokens) >= max_queue
        return self.decode_load >= (self.register.max_num_seqs or DEFAULT_MAX_NUM_SEQS) + max_queue

    @property
    def decode_load(self) -> int:
        """Requests on the node as a decode node: this router's, plus other routers' as of the last
        heartbeat (those it counts but does not list to this router)."""
        hb = self.heartbeat
        others = max(0, hb.num_running + hb.num_waiting - len(hb.request_ids)) if hb else 0
        return len(self.request_ids) + others


def node_summary(node: NodeInfo) -> dict:
    hb = node.heartbeat
    return {
        "node_id": node.node_id, "role": node.role, "ready": node.ready, "status_url": node.register.metrics_url,
        "kv_addr": node.register.kv_addr, "num_total_blocks": node.register.num_total_blocks,
        "num_free_blocks": hb.num_free_blocks if hb else None, "num_running": hb.num_running if hb else None,
        "num_waiting": hb.num_waiting if hb else None, "prefill_load": node.prefill_load,
        "seconds_since_heartbeat": round(time.monotonic() - node.last_seen, 3),
        "changing_to": node.changing_to or None, "speed": node.speed.summary(),
    }


@dataclass
class Route:
    """Where a request goes: `decode` is None when the prefill node also decodes it (colocated)."""

    prefill: NodeInfo
    decode: NodeInfo | None
    path: PathChoice | None = None  # how a non-"always" policy chose (None: the classic split, unasked)
    prompt_tokens: int = 0  # the prompt's length, and the leading tokens the index expects cached where it is
    cached_tokens: int = 0  # prefilled (0: nothing known)

    @property
    def local(self) -> bool:
        """Prefilled where it is decoded (a "both" node, or a local prefill on a decode node)."""
        return self.decode is None

    @property
    def node_ids(self) -> list[str]:
        return [self.prefill.node_id] + ([self.decode.node_id] if self.decode else [])


class NoNodeError(LookupError):
    """No ready node of a role: the request gets a 503."""


class OverloadedError(LookupError):
    """Every ready node of a role is past its queue limit: the request gets a 429."""


class Registry:
    def __init__(self, heartbeat_timeout_s: float = 5.0, *, prefix_affinity: bool = False,
                 affinity_slack_tokens: int = 2048, max_queue: int = DEFAULT_MAX_QUEUE,
                 path: PathPolicy | None = None) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.path = path if path is not None else PathPolicy()
        # Every node's steps pooled: the fleet's speed, known once some node prefilled and some
        # node decoded (the nodes run the same model; a node's own fit replaces it once known).
        self.fleet_speed = StepModel(window=4 * WINDOW)
        self.max_queue = max_queue
        self.prefix_affinity = prefix_affinity
        self.affinity_slack_tokens = affinity_slack_tokens  # extra load a node may carry and still win by affinity
        self.nodes: dict[str, NodeInfo] = {}
        self.kv_index = KVIndex()  # what every node's prefix cache holds (their KVEvents)

    # ---- membership -------------------------------------------------------------------------
    def register(self, msg: Register, identity: bytes, now: float | None = None) -> NodeInfo | None:
        """Add or replace a node; returns the entry it replaced, if any."""
        old = self.nodes.get(msg.node_id)
        new = self.nodes[msg.node_id] = NodeInfo(msg, identity, _now(now))
        self.kv_index.reset_node(msg.node_id)  # its snapshot follows the Register
        if old is not None:  # the same machine, whatever became of the process: its speed holds
            new.speed = old.speed
        return old

    def heartbeat(self, msg: Heartbeat, now: float | None = None) -> bool:
        """False when the node is unknown (never registered, or already dropped)."""
        node = self.nodes.get(msg.node_id)
        if node is None:
            return False
        node.heartbeat, node.last_seen, node.blocks_since_heartbeat = msg, _now(now), 0
        node.speed.add(msg.step_samples)
        self.fleet_speed.add(msg.step_samples)
        return True

    def keep_requests(self, old: NodeInfo) -> None:
        """`old`'s process reconnected (same pid): the requests it held are its new entry's."""
        new = self.nodes[old.node_id]
        new.request_ids, new.outstanding_prompt_tokens = old.request_ids, old.outstanding_prompt_tokens

    def remove(self, node_id: str) -> NodeInfo | None:
        self.kv_index.drop(node_id)
        return self.nodes.pop(node_id, None)

    def expire(self, now: float | None = None) -> list[NodeInfo]:
        """Drop and return the nodes that missed heartbeats for longer than the timeout."""
        deadline = _now(now) - self.heartbeat_timeout_s
        dead = [n for n in self.nodes.values() if n.last_seen < deadline]
        for node in dead:
            del self.nodes[node.node_id]
            self.kv_index.drop(node.node_id)
        return dead

    def ready_nodes(self, roles: Sequence[str]) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if n.ready and n.role in roles]

    def is_healthy(self) -> bool:
        """A request can be served: a ready decode node, and a ready prefill node unless decode
        nodes may prefill themselves (any policy but `always`)."""
        if not self.ready_nodes(DECODE_ROLES):
            return False
        return self.path.policy != "always" or bool(self.ready_nodes(PREFILL_ROLES))

    def max_model_len(self) -> int | None:
        """The smallest max_model_len any ready node declared (None when none did)."""
        lens = [n.register.max_model_len for n in self.nodes.values() if n.ready and n.register.max_model_len > 0]
        return min(lens) if lens else None

    # ---- routing ------------------------------------------------------------------------------
    def route(self, prompt_token_ids: Sequence[int], max_tokens: int, *, ignore_limits: bool = False) -> Route:
        """Pick the nodes for a request; raises NoNodeError or OverloadedError naming the role.

        A "both" node chosen for prefill decodes the request too: moving KV off a node that can
        decode it itself only costs a transfer. Otherwise the decode node is the one with the most
        free blocks (ties: fewest running, then node id, so the choice is deterministic); once the
        nodes report their caches, `pick_prefill`, `pick_decode` and the cached path read them
        (module docstring).

        Under `--disagg-policy never|auto` the decode node is picked first, and the path policy
        (disagg.py) says whether it prefills the request itself (`Route(decode, None)`) or a
        prefill node does."""
        hits = PromptHits(self.kv_index, prompt_token_ids)
        if self.path.policy != "always":
            route = self._route_by_path(prompt_token_ids, ignore_limits, hits)
        else:
            route = self._route_split(prompt_token_ids, ignore_limits, hits)
        route.prompt_tokens = len(prompt_token_ids)
        if self.kv_index.knows((route.prefill.node_id,)):
            route.cached_tokens = hits.tokens_on(route.prefill)
        return route

    def _route_split(self, prompt_token_ids: Sequence[int], ignore_limits: bool, hits: PromptHits) -> Route:
        prefill = self.pick_prefill(prompt_token_ids, ignore_limits=ignore_limits, hits=hits)
        if prefill.role == "both":
            return Route(prefill, None)
        decode = self.pick_decode(ignore_limits, hits)
        if decode.role == "decode" and self.kv_index.knows((decode.node_id,)):
            # A follow-up turn whose history the decode node holds: prefill only the rest there.
            choice = self.path.choose_cached(len(prompt_token_ids), hits.tokens_on(decode),
                                             not ignore_limits and decode.is_saturated("prefill", self.max_queue))
            if choice is not None:
                return Route(decode, None, choice)
        return Route(prefill, decode)

    def _route_by_path(self, prompt_token_ids: Sequence[int], ignore_limits: bool, hits: PromptHits) -> Route:
        decode = self.pick_decode(ignore_limits, hits)
        if decode.role == "both":
            return Route(decode, None)
        try:
            prefill = self.pick_prefill(prompt_token_ids, ignore_limits=ignore_limits, roles=("prefill",), hits=hits)
        except (NoNodeError, OverloadedError):  # none, or all full: the decode node prefills it
            prefill = None
        if prefill is not None and not ignore_limits and decode.is_saturated("prefill", self.max_queue):
            return Route(prefill, decode)  # the decode node's own prefill queue is full
        fleet = self.fleet_speed
        choice = self.path.choose(len(prompt_token_ids), decode.load(fleet), prefill.load(fleet) if prefill else None,
                                  decode_cached=hits.tokens_on(decode),
                                  prefill_cached=hits.tokens_on(prefill) if prefill else 0)
        return Route(decode, None, choice) if choice.local else Route(prefill, decode, choice)

    def pick_decode(self, ignore_limits: bool = False, hits: PromptHits | None = None) -> NodeInfo:
        """The decode node: the most free blocks (ties: fewest running, then node id); once the
        caches are known, the longest cached prefix among those within DECODE_SLACK requests of
        the least loaded, then the most free blocks."""
        decoders = self._candidates(DECODE_ROLES, "decode", ignore_limits)
        if hits is None or len(decoders) == 1 or not self.kv_index.knows(n.node_id for n in decoders):
            return min(decoders, key=lambda n: (-n.free_blocks, _num_running(n), n.node_id))
        least = min(n.decode_load for n in decoders)
        near = [n for n in decoders if n.decode_load <= least + DECODE_SLACK]
        return min(near, key=lambda n: (-hits.tokens_on(n), -n.free_blocks, _num_running(n), n.node_id))

    def pick_prefill(self, prompt_token_ids: Sequence[int], *, ignore_limits: bool = False,
                     roles: Sequence[str] = PREFILL_ROLES, hits: PromptHits | None = None) -> NodeInfo:
        candidates = self._candidates(roles, "prefill", ignore_limits)
        if hits is not None and len(candidates) > 1 and self.kv_index.knows(n.node_id for n in candidates):
            return self._least_ttft(candidates, len(prompt_token_ids), hits)
        least = min(n.prefill_load for n in candidates)
        if not self.prefix_affinity:
            return min(candidates, key=lambda n: (n.prefill_load, n.node_id))
        # Rendezvous hashing among the nodes within the slack: the same prefix keeps landing on the
        # same node (its prefix cache), and only the prefixes of a node that leaves move elsewhere.
        near = [n for n in candidates if n.prefill_load <= least + self.affinity_slack_tokens]
        prefix = bytes(str(list(prompt_token_ids[:AFFINITY_PREFIX_LEN])), "ascii")
        return max(near, key=lambda n: hashlib.blake2b(prefix + n.node_id.encode(), digest_size=8).digest())

    def _least_ttft(self, candidates: list[NodeInfo], prompt_len: int, hits: PromptHits) -> NodeInfo:
        """The least expected time to the first token: queued + uncached tokens at each node's
        speed (the fleet's while its own is unknown); in tokens while no speed is known."""
        fleet = self.fleet_speed
        speeds = [n.speed if n.speed.known else fleet for n in candidates]
        timed = all(s.known for s in speeds)

        def cost(i: int) -> float:
            node = candidates[i]
            tokens = node.prefill_load + prompt_len - hits.tokens_on(node)
            return speeds[i].prefill_s(tokens) if timed and tokens > 0 else float(tokens)

        best = min(range(len(candidates)), key=lambda i: (cost(i), candidates[i].prefill_load, candidates[i].node_id))
        return candidates[best]

    def _candidates(self, roles: Sequence[str], role: str, ignore_limits: bool) -> list[NodeInfo]:
        ready = self.ready_nodes(roles)
        if not ready:
            raise NoNodeError(role)
        if ignore_limits:
            return ready
        # A "both" node prefills and decodes what it takes: both of its queues must have room.
        checks = ("prefill", "decode") if role == "prefill" else ("decode",)
        free = [n for n in ready if not any(n.is_saturated(c, self.max_queue)
                                            for c in checks if n.role in (c, "both"))]
        if not free:
            raise OverloadedError(role)
        return free

    # ---- per-request accounting (called by the request table) -------------------------------
    def add_request(self, route: Route, request_id: str, prompt_len: int, max_tokens: int) -> None:
        route.prefill.outstanding_prompt_tokens[request_id] = prompt_len
        decode = route.decode or route.prefill
        decode.blocks_since_heartbeat += decode.estimate_blocks(prompt_len + max_tokens)
        for node in (route.prefill, decode):
            node.request_ids.add(request_id)

    def first_token(self, node_id: str, request_id: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None:
            node.outstanding_prompt_tokens.pop(request_id, None)

    def release_request(self, node_ids: Sequence[str], request_id: str) -> None:
        for node_id in node_ids:
            node = self.nodes.get(node_id)
            if node is not None:
                node.outstanding_prompt_tokens.pop(request_id, None)
                node.request_ids.discard(request_id)


class PromptHits:
    """One request's view of the index: its cached prefix on each node, keys hashed once per
    block size, looked up once per node."""

    def __init__(self, index: KVIndex, token_ids: Sequence[int]) -> None:
        self.index = index
        self.token_ids = token_ids
        self._keys: dict[int, list[int]] = {}
        self._tokens: dict[str, int] = {}

    def tokens_on(self, node: NodeInfo) -> int:
        """Leading prompt tokens `node` holds in its caches (0 when it reported nothing)."""
        n = self._tokens.get(node.node_id)
        if n is None:
            bs = node.register.block_size or DEFAULT_BLOCK_SIZE
            keys = self._keys.get(bs)
            if keys is None:
                keys = self._keys[bs] = prompt_keys(self.token_ids, bs)
            n = self._tokens[node.node_id] = self.index.cached_tokens(node.node_id, keys, bs)
        return n


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now


def _num_running(node: NodeInfo) -> int:
    return node.heartbeat.num_running if node.heartbeat else 0

