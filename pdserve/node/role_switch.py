"""One node process that serves "prefill" or "decode" and changes role on a router's `SetRole`,
model still loaded (`RoleSwitcher`). The runtime serves it as it would serve a node; the role
objects themselves (PrefillNode, DecodeNode) are built by the cli layer's factory, which alone
may import both roles (`pdserve/cli/node.py`).

    serving R ──SetRole(R')──▶ SWITCHING: heartbeats ready=False, new PrefillRequests refused
        (retryable: the router sends them elsewhere); what the node holds finishes as usual: a
        prefill node prefills its queue and hands off (idle once the decode nodes' KVDone or the
        lease expiry released every lease), a decode node decodes its running requests to the
        end (local prefills, and requests still waiting for KV: pulled, then decoded)
        ├─ idle ─▶ the engine is checked (no request, every block free), a node of role R' is
        │          built around the SAME engine, router links, request table and metrics; the
        │          Register (role, and kv_addr: a decode node's KV socket, a prefill node none)
        │          goes again to every router (same node_id and pid: the same process, a new role)
        └─ `timeout_s` passed first ─▶ `give_up`: each request left is aborted and its router told
                   (retryable Error: it re-dispatches with the tokens already streamed), then as idle
    SetRole(R) while switching away from R: the switch is called off (ready again).
    SetRole to the role it serves, to or from "both", or while draining: logged and ignored.
    SIGTERM while switching: the change is called off; the runtime drains and deregisters as ever.

Both KV endpoints live for the whole process, built once at start whatever the first role: the
KVSender (`SenderSlot`: its lease table's callbacks reach whichever prefill node serves now) and
the KVReceiver (its socket stays bound; while the node serves prefill, a KVReady that still
reaches it, from a prefill node with a stale view, is refused as a decode node would refuse it:
KVDone(ok=false) to that prefill node, a retryable Error to the router).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.kvtransfer.receiver import KVEventKind
from pdserve.protocol.messages import Error, SetRole

logger = logging.getLogger(__name__)

SWITCHABLE_ROLES = ("prefill", "decode")


class SenderSlot:
    """A `make_sender` for every PrefillNode the process builds: the KVSender is built once (at
    start, `build()`), and each PrefillNode that asks for it re-points its release and error
    callbacks to itself. Between prefill roles no lease is held, so no callback is lost."""

    def __init__(self, build: Callable[[Callable[[str], None], Callable[[str, str], None]], object]) -> None:
        self._release: Callable[[str], None] | None = None
        self._on_error: Callable[[str, str], None] | None = None
        self.sender = build(self._released, self._failed)

    def __call__(self, release: Callable[[str], None], on_error: Callable[[str, str], None]):
        self._release, self._on_error = release, on_error
        return self.sender

    def _released(self, request_id: str) -> None:
        if self._release is None:  # no prefill node ever served: nothing was handed off
            logger.error("KV sender released %s, but no prefill node holds it", request_id)
            return
        self._release(request_id)

    def _failed(self, request_id: str, message: str) -> None:
        if self._on_error is not None:
            self._on_error(request_id, message)


class RoleSwitcher:
    """Duck-types the runtime's `Node` (engine, link, metrics, draining, run_once, is_idle,
    status, metrics_snapshot) around the role object serving now (`node`). `build(role)` makes a
    role object around the shared engine, link, request table and metrics; `kv_addr` is what a
    decode node advertises (its receiver's address); `receiver` is the KVReceiver."""

    def __init__(self, build: Callable[[str], object], role: str, *, kv_addr: str, receiver=None, sender=None,
                 timeout_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if role not in SWITCHABLE_ROLES:
            raise ValueError(f"a node changes role between {SWITCHABLE_ROLES}, not {role!r}")
        self._build = build
        self.kv_addr = kv_addr
        self.receiver = receiver
        self.sender = sender  # the KVSender: polled here while the node serves decode (idle peers closed)
        self.timeout_s = timeout_s
        self._clock = clock
        self.target: str | None = None  # the role it is switching to
        self.reason = ""
        self.deadline = 0.0
        self.num_changes = 0
        self.node = self._install(build(role))
        self.engine = self.node.engine
        self.link = self.node.link
        self.metrics = self.node.metrics
        self.node_id = self.node.node_id
        self._draining = False
        self.link.register_msg.role = role
        self.link.register_msg.kv_addr = kv_addr if role == "decode" else ""

    def _install(self, node):
        node.on_set_role = self.on_set_role
        return node

    # ---- the runtime's Node ---------------------------------------------------------------------
    @property
    def role(self) -> str:
        return self.node.role

    @property
    def draining(self) -> bool:
        return self._draining

    @draining.setter
    def draining(self, value: bool) -> None:
        """The runtime drains (SIGTERM): a pending change is called off, the node leaves once idle."""
        self._draining = value
        self.node.draining = value
        if value and self.target is not None:
            logger.info("%s: draining: the change to %s is called off", self.node_id, self.target)
            self.target = None
            self.node.switching = False

    @property
    def requests(self):
        return self.node.requests

    def run_once(self) -> None:
        self.node.run_once()
        if self.node.role == "prefill" and self.receiver is not None:
            self._refuse_kv()
        elif self.node.role == "decode" and self.sender is not None:
            self.sender.poll(0)  # no lease is held: late peer messages dropped, idle connections closed
        if self.target is not None:
            self._progress()

    def is_idle(self) -> bool:
        return self.node.is_idle()

    def heartbeat(self):
        return self.node.heartbeat()

    def status(self) -> dict:
        status = self.node.status()
        status.update(role_changes=self.num_changes, switching_to=self.target)
        return status

    def metrics_snapshot(self):
        return self.node.metrics_snapshot()

    # ---- SetRole --------------------------------------------------------------------------------
    def on_set_role(self, msg: SetRole) -> None:
        """A router asks for another role (the node's `handle` calls this)."""
        role, current = msg.role, self.node.role
        if role not in SWITCHABLE_ROLES:
            logger.warning("%s: SetRole(%r) ignored: a node switches between %s only", self.node_id, role,
                           " and ".join(SWITCHABLE_ROLES))
        elif self.draining:
            logger.info("%s: SetRole(%s) ignored: draining (leaving)", self.node_id, role)
        elif role == current:
            if self.target is not None:
                logger.info("%s: SetRole(%s): the change to %s is called off (%s)", self.node_id, role, self.target,
                            msg.reason or "no reason given")
                self.target = None
                self.node.switching = False
                self.link.set_heartbeat(self.node.heartbeat())
            else:
                logger.info("%s: SetRole(%s) ignored: serving %s already", self.node_id, role, role)
        elif role == self.target:
            logger.info("%s: SetRole(%s) ignored: switching to it already", self.node_id, role)
        else:
            self.target, self.reason = role, msg.reason
            self.deadline = self._clock() + self.timeout_s
            self.node.switching = True
            self.link.set_heartbeat(self.node.heartbeat())  # ready=False at the next beat
            logger.info("%s: %s → %s (%s): finishing %d held request(s) first (at most %.0f s)", self.node_id,
                        current, role, msg.reason or "no reason given", len(self.node.requests.held_ids()),
                        self.timeout_s)

    def _progress(self) -> None:
        if not self.node.is_idle():
            if self._clock() < self.deadline:
                return
            held = self.node.requests.held_ids()
            logger.warning("%s: the change to %s timed out after %.0f s: giving up %d request(s) (the router "
                           "re-dispatches them)", self.node_id, self.target, self.timeout_s, len(held))
            self.node.give_up(f"node {self.node_id} is changing role to {self.target}")
            if not self.node.is_idle():  # only what was never taken may remain (an origin noted)
                return
        self._switch()

    def _switch(self) -> None:
        old, role = self.node, self.target
        engine = self.engine
        bm = engine.block_manager
        if engine.has_unfinished() or bm.num_free_blocks != bm.num_blocks:
            raise RuntimeError(f"{self.node_id}: idle for a role change, but the engine holds requests "
                               f"({engine.has_unfinished()}) or blocks ({bm.num_used_blocks} of {bm.num_blocks} used)")
        logger.info("%s: idle, every block free (%d of %d): now serving %s", self.node_id, bm.num_free_blocks,
                    bm.num_blocks, role)
        old.switching = False
        old.on_set_role = None
        self.target = None
        self.metrics.set_role(role)
        register = self.link.register_msg  # the links' own (shared by every router's link): changed in place
        register.role = role
        register.kv_addr = self.kv_addr if role == "decode" else ""
        self.node = self._install(self._build(role))
        self.node.draining = self._draining
        self.num_changes += 1
        self.link.register()  # with every router: the same node id and pid, a new role
        self.link.set_heartbeat(self.node.heartbeat())

    def _refuse_kv(self) -> None:
        """Serving prefill: a KVReady that still reached the KV socket is refused (see module doc)."""
        for event in self.receiver.poll(0):
            if event.kind != KVEventKind.READY:
                logger.warning("%s serves prefill: KV event %s for %s ignored", self.node_id, event.kind,
                               event.request_id)
                continue
            rid = event.request_id
            self.link.adopt(rid, event.ready.router)
            error = f"{self.node_id} serves prefill now, not decode"
            self.receiver.release(rid, error=error)
            self.link.send(Error(request_id=rid, node_id=self.node_id, message=error, retryable=True))
            self.node.requests.forget_unadmitted(rid)
