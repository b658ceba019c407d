"""A node's links to all its routers: one `RouterLink` per router address (router_discovery.py),
and which router each request came from, so that its tokens go back there.

Several router processes may serve one endpoint (`pdserve router --api-server-count N`, or a
router Deployment with replicas): a node registers and heartbeats with every one of them, each
router dispatches its own clients' requests, and each must only ever hear about its own:

    origin     a PrefillRequest's router is the link it came in on; a decode node learns it from
               the KVReady (`KVReady.router`, the address the prefill node knows it by, see
               `adopt`). Requests whose router is unknown (a peer that named none) are treated
               as every router's.
    sends      FirstToken and Error go to the request's router; a TokenBatch is split into one
               batch per router (`TokenBatch.from_tokens`); Register, Deregister to all.
    heartbeat  the load figures go to every router (each sees the node's whole load), but
               `request_ids` lists only that router's requests: a router aborts any request a
               heartbeat lists that it did not place on the node.
    loss       when a router's connection closes (its process died) or its address leaves the
               DNS name, `poll` hands the node one `Abort` per request of that router, so it frees
               them; the other routers' requests go on. A router that comes back at the address
               gets Register again on its first Reregister, like a restarted router always has.

Origins live in the node's request table (`requests`, node/requests.py): a request's origin goes
when the node forgets the request.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import zmq

from pdserve.node.requests import NodeRequests
from pdserve.node.router_discovery import RouterDiscovery
from pdserve.node.router_link import RouterLink
from pdserve.node.step_samples import StepSamples
from pdserve.protocol.messages import Abort, Heartbeat, Message, PrefillRequest, Register, TokenBatch

logger = logging.getLogger(__name__)

ROUTER_GONE = "the router that sent it is gone"


class RouterLinks:
    """Duck-types `RouterLink` for the nodes and the runtime (register, deregister, send, poll,
    maybe_heartbeat, close, register_msg) plus `origin`/`adopt`, and `requests`: the node's
    request table, where the origins are kept (the node takes it from here)."""

    def __init__(self, discovery: RouterDiscovery, register: Register, *, heartbeat_s: float = 1.0,
                 ctx: zmq.Context | None = None, curve=None,
                 make_link: Callable[[str], RouterLink] | None = None,
                 requests: NodeRequests | None = None) -> None:
        self.discovery = discovery
        self.register_msg = register
        self.heartbeat_s = heartbeat_s
        self.step_samples = StepSamples()  # the node's engine steps: every router's heartbeats carry them
        self._make_link = make_link or (lambda addr: RouterLink(addr, register, heartbeat_s=heartbeat_s, ctx=ctx,
                                                                curve=curve))
        self.links: dict[str, RouterLink] = {}  # router address → link
        self.requests = requests if requests is not None else NodeRequests()  # the node's: each request's router
        self._last_refresh = 0.0
        self._pending: list[Message] = []  # Aborts for the requests of routers that are gone
        self._poller: zmq.Poller | None = None
        self._synced: tuple[str, ...] = ()  # the discovery's addresses the links were last synced to
        self.registered = False
        self.num_dropped = 0  # messages for no router at all
        self._sync_links()

    @property
    def router_addr(self) -> str:
        """For logs: the router addresses as given."""
        return ",".join(self.discovery.specs)

    # ---- membership -------------------------------------------------------------------------
    def _sync_links(self) -> None:
        """Open links to new router addresses; close those whose address left the DNS name once
        they are not connected (a router that is shutting down still streams to its clients)."""
        wanted = self._synced = self.discovery.addresses
        self._poller = None
        for addr in [a for a, link in self.links.items() if a not in wanted and link.connected is not True]:
            logger.info("router %s left: dropping its link", addr)
            self._router_gone(addr)
            self.links.pop(addr).close()
        for addr in wanted:
            if addr not in self.links:
                link = self.links[addr] = self._make_link(addr)
                link.step_samples = self.step_samples
                if self.registered:
                    link.register()

    def _router_gone(self, addr: str) -> None:
        gone = self.requests.orphan(addr)  # once: their origin is unknown from now on
        if gone:
            logger.warning("router %s is gone: aborting its %d request(s)", addr, len(gone))
        self._pending.extend(Abort(rid, ROUTER_GONE) for rid in gone)

    def register(self) -> None:
        self.registered = True
        for link in self.links.values():
            link.register()

    def deregister(self) -> None:
        self.registered = False
        for link in self.links.values():
            link.deregister()

    def each(self) -> list[RouterLink]:
        """The link to each router."""
        return list(self.links.values())

    # ---- origins ----------------------------------------------------------------------------
    def origin(self, request_id: str) -> str:
        """The address of the router `request_id` came from ("" when unknown)."""
        return self.requests.origin(request_id)

    def adopt(self, request_id: str, router_addr: str) -> None:
        """Note that `request_id` came from `router_addr` (a decode node, from a KVReady)."""
        link = self.links.get(router_addr)
        if link is not None:
            self.requests.set_origin(request_id, router_addr)
            if link.connected is False:  # that router died while the KV was on its way
                self._router_gone(router_addr)
        elif router_addr and len(self.links) > 1:
            logger.warning("request %s names router %s, which this node does not know (nodes must name their "
                           "routers alike): its tokens go to every router", request_id, router_addr)

    def _owner(self, request_id: str) -> str | None:
        """The address of the request's router, if it is one this node links to (None: every router's)."""
        addr = self.requests.origin(request_id)
        return addr if addr in self.links else None

    def _links_for(self, request_id: str) -> list[RouterLink]:
        owner = self._owner(request_id)
        return [self.links[owner]] if owner is not None else list(self.links.values())

    # ---- sends ------------------------------------------------------------------------------
    def send(self, msg: Message) -> bool:
        """Queue `msg` for the router(s) it concerns; False when any send dropped it."""
        if not self.links:
            self.num_dropped += 1
            return False
        if len(self.links) == 1:
            return next(iter(self.links.values())).send(msg)
        if isinstance(msg, TokenBatch):
            return all([link.send(batch) for link, batch in self._split(msg)])
        request_id = getattr(msg, "request_id", None)
        targets = self._links_for(request_id) if isinstance(request_id, str) else list(self.links.values())
        return all([link.send(msg) for link in targets])

    def _split(self, batch: TokenBatch) -> list[tuple[RouterLink, TokenBatch]]:
        """One batch per router; a batch whose tokens all have one router goes out unchanged."""
        owners = {self._owner(rid) for rid in batch.request_ids}
        if len(owners) == 1 and (owner := owners.pop()) is not None:
            return [(self.links[owner], batch)]
        rows: dict[str, list] = {addr: [] for addr in self.links}
        for token in batch.tokens():
            owner = self._owner(token.request_id)
            for addr in rows if owner is None else (owner,):
                rows[addr].append(token)
        return [(self.links[addr], TokenBatch.from_tokens(batch.node_id, tokens))
                for addr, tokens in rows.items() if tokens]

    maybe_heartbeat = RouterLink.maybe_heartbeat  # the same throttle (`_last_refresh`), calling the set_heartbeat below

    def set_heartbeat(self, heartbeat: Heartbeat) -> None:
        """What each router's heartbeat thread sends from now on: `heartbeat` (the node's load),
        listing only that router's requests (and those of no known router)."""
        if len(self.links) == 1:
            next(iter(self.links.values())).set_heartbeat(heartbeat)
            return
        for addr, link in self.links.items():
            mine = [rid for rid in heartbeat.request_ids if self._owner(rid) in (addr, None)]
            link.set_heartbeat(dataclasses.replace(heartbeat, request_ids=mine))

    # ---- receive ----------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 0) -> list[Message]:
        """Messages from every router (a PrefillRequest's origin noted), then an Abort for each
        request of a router that went away since the last call."""
        if self.discovery.addresses is not self._synced:  # a new resolution (a new tuple each time)
            self._sync_links()
        out, self._pending = self._pending, []
        if not self.links:
            if timeout_ms:
                time.sleep(timeout_ms / 1000)
            return out
        if not out and timeout_ms and not self._any_ready(timeout_ms):
            return out
        lost = False
        for addr, link in self.links.items():
            admitted = False
            for msg in link.poll(0):
                if isinstance(msg, PrefillRequest):
                    self.requests.set_origin(msg.request_id, addr)
                    admitted = True
                out.append(msg)
            if link.connection_lost():
                logger.warning("lost the connection to router %s", addr)
                self._router_gone(addr)
                lost = True
            elif admitted and link.connected is False:  # sent just before that router died
                self._router_gone(addr)
        if lost and self.discovery.addresses != tuple(self.links):
            self._sync_links()  # a router that left the DNS name and is now gone
        out += self._pending
        self._pending = []
        return out

    def _any_ready(self, timeout_ms: int) -> bool:
        if self._poller is None:  # rebuilt whenever the links change
            self._poller = zmq.Poller()
            for link in self.links.values():
                for sock in link.pollables():
                    self._poller.register(sock, zmq.POLLIN)
        return bool(self._poller.poll(timeout_ms))

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links.clear()
        self.discovery.close()
