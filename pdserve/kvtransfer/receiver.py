"""Decode side of the KV hand-off: accept announcements, pull the blocks in, ack.

One ROUTER socket; every prefill node connects to it and opens with a `Handshake`, which is when
the transports (kvtransfer.transport) probe the peer, in `TRANSPORTS` order. A request announced
by `KVReady` goes through (event kinds are `KVEventKind`):

    KVReady ─▶ READY ─▶ (node allocates blocks; renew() while it waits) ─▶ pull(blocks)
       "shm" / "cuda_ipc":  copy straight out of the peer's mapped pool ─▶ KVDone ─▶ DONE
       "zmq":               KVPull ─▶ KVData + payload frame ─▶ scatter ─▶ KVDone ─▶ DONE
       KVData(ok=False), a bad payload, a failed copy, or no answer in pull_timeout_s ─▶ KVDone(ok=False) ─▶ FAILED
       release() (abort, the node gives up) ─▶ KVDone(ok=False), no event

Tensor parallelism: our pool is a list of shards, one per rank, each holding its KV heads (the
same block ids on every rank); the peer's handshake names its own ranks' heads. A transfer fills
every shard with exactly its heads (kvtransfer.heads) and is DONE, with one KVDone, only once
every shard has its part; `num_bytes_by_rank` counts what each rank received.

Ownership: the decode node allocates and frees its own blocks; this class only fills them.
Every request it announced ends with exactly one KVDone to the prefill node (ok or not), which is
what lets the prefill node free its blocks early instead of waiting out the lease.
Same host is proved per peer at handshake time (the probes: segment size and probe token, or a
CUDA IPC handle that opens). A transport that reads the peer's pool is only used while our
estimate of the peer's lease is comfortably alive (the peer frees its blocks when the lease runs
out); past that we pull over ZMQ, where the peer answers "no longer held" instead of letting us
copy reused blocks.
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from pdserve.kvcache.shard import KVShard
from pdserve.kvtransfer.cuda_ipc import CudaIpcTransport
from pdserve.kvtransfer.heads import as_shards, check_shards, ranks_error, with_ranks
from pdserve.kvtransfer.layout import blocks_error, ready_error
from pdserve.kvtransfer.shm import SharedMemoryTransport
from pdserve.kvtransfer.transport import KVTransport, Outcome, TransferState
from pdserve.kvtransfer.zmq_pull import ZmqPullTransport
from pdserve.protocol.curve import (
    SOCKET_REFUSAL_REASONS,
    CurveKeys,
    HandshakeFailures,
    close_server,
    monitor_handshakes,
)
from pdserve.protocol.messages import (
    Handshake,
    HandshakeAck,
    KVData,
    KVDone,
    KVLayout,
    KVRank,
    KVReady,
    LeaseRenew,
    Message,
    MessageError,
)
from pdserve.protocol.sockets import KV_MAX_BYTES, drain, endpoint, make_socket, send_msg

log = logging.getLogger(__name__)

SHM_LEASE_MARGIN_S = 2.0  # copy from a peer's pool only if its lease has this much left
# Tried in this order at every handshake; ZMQ, last, reaches every peer. A new backend: one entry.
TRANSPORTS: tuple[type[KVTransport], ...] = (SharedMemoryTransport, CudaIpcTransport, ZmqPullTransport)
SAME_HOST_TRANSPORTS = ("shm", "cuda_ipc")  # what `num_shm_copies` counts


class KVEventKind(str, enum.Enum):  # a str, so `event.kind == "ready"` holds too
    READY = "ready"
    DONE = "done"
    FAILED = "failed"


@dataclass
class KVEvent:
    kind: KVEventKind
    request_id: str
    ready: KVReady | None = None
    error: str = ""
    num_bytes: int = 0  # DONE: the KV bytes moved into our pool


@dataclass
class _Link:
    """A transport that accepted a peer at handshake, with the handle its probe returned."""

    transport: KVTransport
    handle: Any


@dataclass
class _PrefillPeer:
    """A prefill node connected to our ROUTER (one per connection identity)."""

    node_id: str
    layout: KVLayout
    ok: bool  # the handshake passed
    links: list[_Link] = field(default_factory=list)  # in TRANSPORTS order; the last does not read the peer's pool


@dataclass
class _Incoming:
    identity: bytes  # the prefill node's connection
    ready: KVReady
    lease_deadline: float  # our (conservative) estimate of when the peer frees the blocks
    dst_block_ids: list[int] | None = None  # set by pull(): the blocks the transfer fills
    part: KVReady | None = None  # set by pull(): what is moved (the KVReady less the blocks held here already)
    link: _Link | None = None  # the transport pull() chose
    pulled_at: float | None = None  # a transfer is PENDING since (its data comes as a message)


class KVReceiver:
    def __init__(self, node_id: str, layout: KVLayout, kv: Sequence[KVShard] | torch.Tensor, *,
                 bind_addr: str = "tcp://127.0.0.1:0", pull_timeout_s: float = 30.0, enable_shm: bool = True,
                 max_frame_bytes: int = KV_MAX_BYTES, clock: Callable[[], float] = time.monotonic,
                 curve: CurveKeys | None = None, transports: tuple[type[KVTransport], ...] = TRANSPORTS):
        """`kv`: every rank's pool (`KVShard`s, rank order); a plain tensor is one pool holding every head."""
        shards = as_shards(kv, layout.num_kv_heads)
        check_shards(layout, shards)
        layout = with_ranks(layout, [KVRank(s.head_start, s.head_end) for s in shards])
        self.node_id = node_id
        self.layout = layout
        self.shards = shards
        self.pull_timeout_s = pull_timeout_s
        self.clock = clock
        # enable_shm=False keeps only the transports that do not read a peer's pool (ZMQ).
        self.transports = [t(layout, shards) for t in transports if enable_shm or not t.reads_peer_pool]
        self._refusals: Counter[str] = Counter({reason: 0 for reason in SOCKET_REFUSAL_REASONS})
        self._refusals_lock = threading.Lock()  # the ZAP thread counts too
        self._monitor: zmq.Socket | None = None
        self.sock = self._bind(bind_addr, max_frame_bytes, curve)
        self.kv_addr = endpoint(self.sock)
        self.num_transfers: Counter[str] = Counter()  # transfers done, by transport name
        self.num_bytes: Counter[str] = Counter()  # KV bytes moved into our pool, by transport name
        self.num_bytes_by_rank = [0] * len(shards)  # KV bytes moved into rank r's pool, at r
        self._peers: dict[bytes, _PrefillPeer] = {}
        self._incoming: dict[str, _Incoming] = {}
        self._events: list[KVEvent] = []  # produced outside poll(), reported by the next poll()

    def _bind(self, bind_addr: str, max_frame_bytes: int, curve: CurveKeys | None) -> zmq.Socket:
        """The ROUTER socket, bound; with `curve` a CURVE server whose refused keys are counted here,
        and a monitor for the handshakes libzmq fails without asking ZAP."""
        sock = make_socket(zmq.ROUTER, bind=bind_addr, max_msg_bytes=max_frame_bytes, curve=curve,
                           on_refused=self._count_refusal if curve is not None else None)
        if curve is not None:
            self._handshakes = HandshakeFailures(f"decode node {self.node_id} KV socket", self._count_refusal)
            self._monitor = monitor_handshakes(sock)
        return sock

    def _count_refusal(self, reason: str, peer: str) -> None:
        with self._refusals_lock:
            self._refusals[reason] += 1

    @property
    def auth_refusals(self) -> dict[str, int]:
        """Peers refused on the KV socket, by reason: handshake attempts (a refused peer retries about
        every 100 ms). Safe to read from another thread; monitor events count once `poll` ran."""
        with self._refusals_lock:
            return dict(self._refusals)

    def _poll_monitor(self, limit: int = 1000) -> None:
        """Count the failed handshakes the monitor reported (never blocks; the node loop's thread)."""
        if self._monitor is None:
            return
        for _ in range(limit):
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handshakes.on_event(event)

    def _close_socket(self, sock: zmq.Socket) -> None:
        close_server(sock, self._monitor, linger=500)  # let goodbyes out; close() itself does not wait
        self._monitor = None

    @property
    def kv_buffer(self) -> torch.Tensor:
        """Rank 0's pool (the whole pool without tensor parallelism)."""
        return self.shards[0].tensor

    @property
    def num_shm_copies(self) -> int:
        """Transfers done by a same-host copy (shared memory or CUDA IPC)."""
        return sum(self.num_transfers[name] for name in SAME_HOST_TRANSPORTS)

    @property
    def num_zmq_pulls(self) -> int:
        return self.num_transfers["zmq"]

    @property
    def num_bytes_received(self) -> int:
        """KV bytes moved into our pool, by every transport."""
        return sum(self.num_bytes.values())

    # ---- the node's calls ---------------------------------------------------------------
    def poll(self, timeout_ms: int = 0) -> list[KVEvent]:
        self._poll_monitor()
        events, self._events = self._events, []
        if self.sock.poll(0 if events else timeout_ms):
            for identity, msg, frames in drain(self.sock):
                if isinstance(msg, MessageError):
                    log.warning("dropped a malformed KV message: %s", msg)
                    continue
                event = self._handle(identity, msg, frames)
                if event is not None:
                    events.append(event)
        events.extend(self._check_timeouts())
        return events

    def pull(self, request_id: str, dst_block_ids: list[int], first_block: int = 0) -> None:
        """Fill `dst_block_ids` (ours, allocated by the node) with the request's KV. The outcome
        is a DONE or FAILED event from a later poll(). `first_block`: the first blocks of
        `dst_block_ids` hold the prompt's prefix already (this node's prefix cache): only the
        tokens from that block on are moved."""
        inc = self._incoming.get(request_id)
        if inc is None:
            raise KeyError(f"no announced request {request_id!r}")
        if inc.dst_block_ids is not None:
            raise ValueError(f"request {request_id!r} is already being pulled")
        error = blocks_error(dst_block_ids, inc.ready.num_tokens, self.layout)
        if error is None and not 0 <= first_block * self.layout.block_size < inc.ready.num_tokens:
            error = f"first_block {first_block} is past the request's {inc.ready.num_tokens} tokens"
        if error is None and first_block and inc.ready.block_size != self.layout.block_size:
            error = f"first_block needs the sender's block size ({inc.ready.block_size}) to be ours"
        if error is not None:
            raise ValueError(error)
        ready = inc.ready
        inc.part = ready if not first_block else replace(
            ready, block_ids=ready.block_ids[first_block:], num_tokens=ready.num_tokens - first_block * ready.block_size)
        inc.dst_block_ids = list(dst_block_ids[first_block:])
        inc.link = self._choose_link(inc)
        if inc.link is None:
            self._events.append(self._fail(request_id, "no transport reaches the prefill node"))
            return
        outcome = inc.link.transport.start(inc.link.handle, inc.part, inc.dst_block_ids, first_block=first_block)
        if outcome.state is TransferState.PENDING:
            inc.pulled_at = self.clock()
        else:
            self._events.append(self._finish(request_id, outcome))

    def renew(self, request_id: str) -> None:
        """Ask the prefill node to keep the blocks pinned longer (we are waiting for room)."""
        inc = self._incoming.get(request_id)
        if inc is not None and self._send(inc.identity, LeaseRenew(request_id)):
            inc.lease_deadline = self.clock() + inc.ready.lease_s

    def release(self, request_id: str, error: str = "") -> None:
        """Give the request up: the prefill node frees its blocks. No event follows."""
        inc = self._incoming.pop(request_id, None)
        if inc is not None:
            self._send(inc.identity, KVDone(request_id, ok=False, error=error or "released by the decode node"))

    def close(self) -> None:
        for request_id in list(self._incoming):
            self.release(request_id, "decode node shutting down")
        self._peers.clear()
        self._close_socket(self.sock)

    # ---- incoming -------------------------------------------------------------------------
    def _handle(self, identity: bytes, msg: Message, frames: list) -> KVEvent | None:
        if isinstance(msg, Handshake):
            self._on_handshake(identity, msg)
        elif isinstance(msg, KVReady):
            return self._on_ready(identity, msg)
        elif isinstance(msg, KVData):
            return self._on_data(identity, msg, frames)
        else:
            log.warning("dropped an unexpected %s on the KV socket", msg.TYPE)
        return None

    def _on_handshake(self, identity: bytes, hs: Handshake) -> None:
        error = self.layout.incompatibility(hs.layout)
        if error is None and (hs.layout.block_size <= 0 or hs.layout.num_blocks <= 0):
            error = f"bad pool geometry: {hs.layout.num_blocks} blocks of {hs.layout.block_size}"
        if error is None and (ranks := ranks_error(hs.layout)) is not None:
            error = f"bad tensor-parallel layout: {ranks}"
        if error is not None:
            error = f"decode node {self.node_id} cannot take KV from {hs.node_id}: {error}"
            log.error(error)
            self._peers[identity] = _PrefillPeer(hs.node_id, hs.layout, ok=False)
            self._send(identity, HandshakeAck(self.node_id, ok=False, error=error))
            return
        links = self._open_links(identity, hs.layout)
        self._forget_connections_of(hs.node_id)
        self._peers[identity] = _PrefillPeer(hs.node_id, hs.layout, ok=True, links=links)
        log.info("prefill node %s connected (%s)", hs.node_id, ", then ".join(link.transport.name for link in links))
        same_host = bool(links) and links[0].transport.same_host
        self._send(identity, HandshakeAck(self.node_id, ok=True, same_host=same_host))

    def _forget_connections_of(self, prefill_node_id: str) -> None:
        """A prefill node opens one connection to us at a time (it closes idle ones and reconnects
        with a new identity): its earlier connections that hold no request are gone, so their
        entries, and the mappings of its pool they hold, are dropped."""
        busy = {inc.identity for inc in self._incoming.values()}
        for identity, peer in list(self._peers.items()):
            if peer.node_id == prefill_node_id and identity not in busy:
                del self._peers[identity]

    def _open_links(self, identity: bytes, peer_layout: KVLayout) -> list[_Link]:
        """Probe the transports in order; stop after the first one that is safe past the peer's
        lease (it does not read the peer's pool): the fallback for late pulls."""
        send = functools.partial(self._send, identity)
        links = []
        for transport in self.transports:
            handle = transport.open(peer_layout, send)
            if handle is not None:
                links.append(_Link(transport, handle))
                if not transport.reads_peer_pool:
                    break
        return links

    def _choose_link(self, inc: _Incoming) -> _Link | None:
        lease_alive = self.clock() < inc.lease_deadline - SHM_LEASE_MARGIN_S
        links = self._peers[inc.identity].links
        return next((link for link in links if lease_alive or not link.transport.reads_peer_pool), None)

    def _on_ready(self, identity: bytes, ready: KVReady) -> KVEvent | None:
        peer = self._peers.get(identity)
        if peer is None:  # e.g. we restarted and the peer's connection came back: redo the handshake
            self._send(identity, HandshakeAck(self.node_id, ok=False, error="KVReady before a handshake"))
            return None
        if not peer.ok:
            return None  # refused at handshake; the peer releases on our ack
        rid = ready.request_id
        if rid in self._incoming:
            log.warning("duplicate KVReady for %s from %s: dropped", rid, peer.node_id)
            self._send(identity, KVDone(rid, ok=False, error="duplicate request id at the decode node"))
            return None
        error = ready_error(ready, peer.layout, whose="the peer's")
        if error is not None:
            self._send(identity, KVDone(rid, ok=False, error=error))
            return KVEvent(KVEventKind.FAILED, rid, ready, error)
        self._incoming[rid] = _Incoming(identity, ready, self.clock() + ready.lease_s)
        return KVEvent(KVEventKind.READY, rid, ready)

    def _on_data(self, identity: bytes, data: KVData, frames: list) -> KVEvent | None:
        inc = self._incoming.get(data.request_id)
        if inc is None or inc.identity != identity or inc.pulled_at is None:
            log.warning("dropped KVData for %s: not being pulled from that peer", data.request_id)
            return None
        outcome = inc.link.transport.on_data(inc.link.handle, inc.part, inc.dst_block_ids, data, frames)
        return self._finish(data.request_id, outcome)

    # ---- outcomes -------------------------------------------------------------------------
    def _finish(self, request_id: str, outcome: Outcome) -> KVEvent:
        if outcome.state is not TransferState.DONE:
            return self._fail(request_id, outcome.error or f"transfer ended {outcome.state.value}")
        inc = self._incoming.pop(request_id)
        name = inc.link.transport.name
        self.num_transfers[name] += 1
        self.num_bytes[name] += outcome.num_bytes
        for rank, num_bytes in enumerate(outcome.rank_bytes or [outcome.num_bytes]):
            self.num_bytes_by_rank[rank] += num_bytes
        self._send(inc.identity, KVDone(request_id, ok=True))
        return KVEvent(KVEventKind.DONE, request_id, inc.ready, num_bytes=outcome.num_bytes)

    def _fail(self, request_id: str, error: str) -> KVEvent:
        inc = self._incoming.pop(request_id)
        log.warning("KV transfer of %s failed: %s", request_id, error)
        self._send(inc.identity, KVDone(request_id, ok=False, error=error))
        return KVEvent(KVEventKind.FAILED, request_id, inc.ready, error)

    def _check_timeouts(self) -> list[KVEvent]:
        now = self.clock()
        late = [rid for rid, inc in self._incoming.items()
                if inc.pulled_at is not None and now - inc.pulled_at > self.pull_timeout_s]
        return [self._fail(rid, f"no KV data within {self.pull_timeout_s:g} s") for rid in late]

    def _send(self, identity: bytes, msg: Message) -> bool:
        try:
            send_msg(self.sock, msg, identity=identity)
            return True
        except zmq.ZMQError as e:
            log.warning("send %s to prefill connection %r failed: %s", msg.TYPE, identity, e)
            return False
