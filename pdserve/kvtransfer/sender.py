"""Prefill side of the KV hand-off: announce a request's blocks, serve pulls, free on the ack.

One DEALER socket per decode node, opened on the first `send` to it; the first message on it is
our `Handshake`: the pool layout, and per tensor-parallel rank its KV heads and what each same-host
transport's probe needs (the rank's shared-memory segment and its probe token, or its CUDA IPC
handle; kvtransfer.transport, kvtransfer.heads). A KVPull names head ranges (one per decode rank):
each is gathered from our ranks holding those heads and sent as one frame, in order.
A request handed to `send` is held under a lease from that moment:

    send() ─KVReady─▶ HELD ─KVPull─▶ KVData sent (lease renewed) ─KVDone─▶ released
                       ├─ the decode node copies out of our pool (same host) ─KVDone─▶ released
                       │  LeaseRenew: deadline pushed back
                       ├─ KVPull, and `faults` drops the payload: the decode node times out ─KVDone(ok=False)─▶ released
                       ├─ lease expires ──────────────────────────────▶ released + on_error
                       ├─ abort() / close() ─────────────────────────▶ released
                       └─ HandshakeAck(ok=False) from its decode node ─▶ released + on_error
    send() to an address that cannot be connected, or beyond loopback without CURVE keys (and
    without `insecure`) ────────────────────────────────────────────────▶ released + on_error

Ownership: the prefill node's block manager allocated the blocks; from `send` on, this class owns
them and calls `release(request_id)` exactly once per request (the `LeaseTable` guarantees it),
after which the node frees them (or keeps them as prefix cache). A failed hand-off is reported
(`on_error`) before it is released, while the node still holds the request. Same-host peers copy straight
out of our pool and then ack with KVDone, so the blocks stay pinned until that ack too.
Nothing here blocks: the node's loop calls `poll()`. Fault injection (chaos runs, tests) goes
through a `faults` object that may drop or spoil a pull's payload frame (`PayloadFaults`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import zmq

from pdserve.kvcache.shard import KVShard
from pdserve.kvcache.shm_pool import SharedKVPool
from pdserve.kvtransfer import cuda_ipc
from pdserve.kvtransfer.heads import as_shards, check_shards, gather_heads, ranges_error, with_ranks
from pdserve.kvtransfer.layout import ready_error
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.payload import tensor_to_frame
from pdserve.protocol.curve import CurveKeys
from pdserve.protocol.exposure import exposure_message, is_local
from pdserve.protocol.messages import (
    Handshake,
    HandshakeAck,
    KVData,
    KVDone,
    KVLayout,
    KVPull,
    KVRank,
    KVReady,
    LeaseRenew,
    Message,
    MessageError,
)
from pdserve.protocol.sockets import CONTROL_MAX_BYTES, drain, make_socket, send_msg

log = logging.getLogger(__name__)

PEER_IDLE_S = 60.0  # a decode connection with no request for this long is closed (reopened on demand)


class PayloadFaults(Protocol):
    """Fault injection on the pull path (pdserve.node.faults.FaultInjection in a node)."""

    def spoil_payload(self, frame: memoryview) -> memoryview | None:
        """Called once per pull about to be answered: None drops the payload (nothing is sent, the
        decode node times out); otherwise the returned frame is sent in place of `frame`."""


@dataclass
class _DecodePeer:
    """A decode node we hand requests to, over one DEALER connection."""

    node_id: str
    addr: str
    sock: zmq.Socket
    acked: bool = False  # HandshakeAck(ok=True) arrived
    same_host: bool = False  # it mapped our pool (shared memory or CUDA IPC)
    request_ids: set[str] = field(default_factory=set)
    idle_since: float | None = None  # when its last request was released (None: it holds some)


class KVSender:
    def __init__(self, node_id: str, layout: KVLayout, kv: Sequence[KVShard] | torch.Tensor,
                 release: Callable[[str], None], *, lease_s: float = 30.0, shm_pool: SharedKVPool | None = None,
                 clock: Callable[[], float] = time.monotonic, curve: CurveKeys | None = None,
                 faults: PayloadFaults | None = None, on_error: Callable[[str, str], None] | None = None,
                 insecure: bool = False):
        """`kv`: every rank's pool (`KVShard`s, rank order); a plain tensor is one pool holding
        every head, in `shm_pool` when it is one (the CPU same-host path). A shard with `shm` set is
        announced to same-host peers by its segment, a CUDA one by its IPC handle."""
        shards = as_shards(kv, layout.num_kv_heads, shm_pool)
        check_shards(layout, shards)
        ranks = [cuda_ipc.advertise(KVRank(s.head_start, s.head_end, shm_name=s.shm.name if s.shm else "",
                                           probe_token=s.shm.probe_token if s.shm else ""), s) for s in shards]
        layout = with_ranks(layout, ranks)
        self.shards = shards
        self.node_id = node_id
        self.layout = layout
        self.lease_s = lease_s  # what the node puts in KVReady.lease_s
        self.on_error = on_error  # (request_id, message): a hand-off failed after send() took it
        self.num_pulls_served = 0
        self.num_bytes_sent = 0
        self._release_cb = release
        self._curve = curve  # CURVE client keys for the connections to decode nodes
        self._insecure = insecure  # --insecure: plain TCP to decode nodes beyond loopback allowed
        self._clock = clock
        self._leases = LeaseTable(self._released, lease_s, clock)
        self._requests: dict[str, tuple[_DecodePeer, KVReady]] = {}
        self._peers: dict[tuple[str, str], _DecodePeer] = {}  # (decode node id, kv addr) → peer
        self._poller = zmq.Poller()
        # A fresh identity per connection: a restarted prefill node is a new peer to the decode node
        # (new handshake), a TCP reconnect of one connection keeps its identity, and two of our
        # connections never share one. That matters when a decode node is replaced by another at
        # the same address (a new container given a dead one's IP): the old connection reconnects
        # to the new node too, and with a shared identity the new node's answers could go to it.
        self._identity_prefix = f"{node_id}/{secrets.token_hex(4)}"
        self._num_connections = 0
        self._faults = faults

    @property
    def kv_buffer(self) -> torch.Tensor:
        """Rank 0's pool (the whole pool without tensor parallelism)."""
        return self.shards[0].tensor

    # ---- the node's calls ---------------------------------------------------------------
    def send(self, decode_node_id: str, decode_kv_addr: str, ready: KVReady) -> None:
        """Hand a request's blocks to a decode node. From here on the blocks are ours until we call
        release(request_id). Raises ValueError (taking no ownership) for a malformed `ready`."""
        if ready.request_id in self._requests:
            raise ValueError(f"request {ready.request_id!r} is already handed off")
        error = ready_error(ready, self.layout)
        if error is not None:
            raise ValueError(error)
        refusal = self._exposure_error(decode_kv_addr)
        if refusal is not None:  # prompts and KV in clear beyond this machine: refused like an unreachable node
            log.error("KV hand-off of %s to decode node %s refused: %s", ready.request_id, decode_node_id, refusal)
            self._report(ready.request_id, refusal)
            self._release_cb(ready.request_id)
            return
        try:
            peer = self._peer(decode_node_id, decode_kv_addr)
        except zmq.ZMQError as e:  # a bad address from the router: the hand-off fails, we still own the blocks
            self._report(ready.request_id, f"cannot connect to decode node {decode_node_id} at {decode_kv_addr!r}: {e}")
            self._release_cb(ready.request_id)
            return
        self._leases.hold(ready.request_id, ready.lease_s)
        self._requests[ready.request_id] = (peer, ready)
        peer.request_ids.add(ready.request_id)
        peer.idle_since = None
        if not self._send(peer, ready):
            self._fail(ready.request_id, f"cannot send KVReady to decode node {decode_node_id}")

    def poll(self, timeout_ms: int = 0) -> None:
        """Handle every message the decode nodes sent, then expire overdue leases."""
        if self._peers:
            for sock, _ in self._poller.poll(timeout_ms):
                self._drain(sock)
        elif timeout_ms > 0:
            time.sleep(timeout_ms / 1000)
        for request_id in self._leases.overdue():
            self._fail(request_id, "KV lease expired before the decode node took the blocks")
        self._close_idle_peers()

    def abort(self, request_id: str) -> bool:
        """Release a request now (router abort); False if it was not held."""
        return self._leases.release(request_id)

    @property
    def held_request_ids(self) -> list[str]:
        return self._leases.held_ids

    @property
    def num_held(self) -> int:
        return len(self._leases)

    def lease_deadline(self, request_id: str) -> float | None:
        return self._leases.deadline(request_id)

    def is_same_host(self, decode_node_id: str) -> bool:
        return any(p.same_host for p in self._peers.values() if p.node_id == decode_node_id)

    def close(self) -> None:
        """Release every held request and close the sockets."""
        for request_id in self._leases.held_ids:
            self._leases.release(request_id)
        for peer in list(self._peers.values()):
            self._drop_peer(peer)

    # ---- peers ----------------------------------------------------------------------------
    def _exposure_error(self, addr: str) -> str | None:
        """Defence in depth (the node's start-up check covers its own flags, not the addresses the
        router sends later): without CURVE keys or --insecure, no KV to a decode node beyond
        loopback. An address that is not a ZMQ endpoint at all is left to the connect to refuse."""
        if self._curve is not None or self._insecure or "://" not in addr or is_local(addr):
            return None
        return exposure_message(addr, "KV socket of a decode node", connect=True)

    def _peer(self, decode_node_id: str, addr: str) -> _DecodePeer:
        peer = self._peers.get((decode_node_id, addr))
        if peer is None:
            self._num_connections += 1
            identity = f"{self._identity_prefix}/{self._num_connections}".encode()
            sock = make_socket(zmq.DEALER, connect=addr, identity=identity, max_msg_bytes=CONTROL_MAX_BYTES,
                               curve=self._curve)
            if self._curve is None and not is_local(addr):  # only with insecure (see _exposure_error)
                log.warning("KV to decode node %s at %s without CURVE authentication or encryption (--insecure)",
                            decode_node_id, addr)
            peer = _DecodePeer(decode_node_id, addr, sock)
            self._peers[(decode_node_id, addr)] = peer
            self._poller.register(sock, zmq.POLLIN)
            self._send(peer, Handshake(self.node_id, self.layout))
        return peer

    def _close_idle_peers(self) -> None:
        """Close the connections that held nothing for PEER_IDLE_S: a decode node that went away
        (scaled down, replaced) leaves no socket reconnecting to its address forever; a live one
        gets a fresh connection and handshake on its next request."""
        now = self._clock()
        for peer in list(self._peers.values()):
            if peer.idle_since is not None and now - peer.idle_since > PEER_IDLE_S:
                log.debug("closing the idle KV connection to decode node %s", peer.node_id)
                self._drop_peer(peer)

    def _drop_peer(self, peer: _DecodePeer) -> None:
        self._poller.unregister(peer.sock)
        peer.sock.close(0)
        self._peers.pop((peer.node_id, peer.addr), None)

    def _send(self, peer: _DecodePeer, msg: Message, *frames) -> bool:
        try:
            send_msg(peer.sock, msg, *frames)
            return True
        except zmq.ZMQError as e:
            log.warning("send %s to decode node %s failed: %s", msg.TYPE, peer.node_id, e)
            return False

    # ---- incoming -------------------------------------------------------------------------
    def _drain(self, sock: zmq.Socket) -> None:
        peer = next((p for p in self._peers.values() if p.sock is sock), None)
        if peer is None:
            return
        for _, msg, _ in drain(sock):
            if isinstance(msg, MessageError):
                log.warning("dropped a malformed message from decode node %s: %s", peer.node_id, msg)
            elif isinstance(msg, HandshakeAck):
                self._on_ack(peer, msg)
                if peer.sock.closed:
                    return  # refused: the connection is gone
            elif isinstance(msg, KVPull):
                self._on_pull(peer, msg)
            elif isinstance(msg, LeaseRenew):
                if self._holds(peer, msg.request_id):
                    self._leases.renew(msg.request_id)
            elif isinstance(msg, KVDone):
                self._on_done(peer, msg)
            else:
                log.warning("dropped an unexpected %s from decode node %s", msg.TYPE, peer.node_id)

    def _on_ack(self, peer: _DecodePeer, ack: HandshakeAck) -> None:
        if ack.ok:
            peer.acked, peer.same_host = True, ack.same_host
            log.info("decode node %s accepted our KV (%s)", peer.node_id, "same host" if ack.same_host else "zmq")
            return
        error = f"decode node {peer.node_id} refused the KV hand-off: {ack.error}"
        log.error(error)
        self._drop_peer(peer)  # the next send() to it opens a fresh connection and handshake
        for request_id in list(peer.request_ids):
            self._fail(request_id, error)

    def _on_pull(self, peer: _DecodePeer, pull: KVPull) -> None:
        request_id = pull.request_id
        if not self._holds(peer, request_id):
            self._send(peer, KVData(request_id, ok=False,
                                    error=f"prefill node {self.node_id} no longer holds the request "
                                          "(lease expired or aborted)"))
            return
        ranges = pull.head_ranges or [[0, self.layout.num_kv_heads]]
        error = ranges_error(ranges, self.layout.num_kv_heads, cover_all=False)
        if error is not None:  # the decode node fails the request and acks: released then
            self._send(peer, KVData(request_id, ok=False, error=f"bad KVPull: {error}"))
            return
        ready = self._requests[request_id][1]
        first = pull.first_block
        if first and first * ready.block_size >= ready.num_tokens:
            self._send(peer, KVData(request_id, ok=False, error=f"bad KVPull: first_block {first} is past the "
                                                              f"request's {ready.num_tokens} tokens"))
            return
        self._leases.renew(request_id)
        block_ids, num_tokens = ready.block_ids[first:], ready.num_tokens - first * ready.block_size
        payloads = [gather_heads(self.shards, start, end, block_ids, num_tokens) for start, end in ranges]
        header = KVData(request_id, ok=True, dtype=self.layout.dtype, shapes=[list(p.shape) for p in payloads])
        frames = [tensor_to_frame(p) for p in payloads]
        if self._faults is not None:  # one spoiled frame fails the whole pull: the last one
            spoiled = self._faults.spoil_payload(frames[-1])
            if spoiled is not frames[-1]:  # the faults object logs the injection; this names the request
                log.info("fault injection %s the KV payload of %s", "dropped" if spoiled is None else "altered",
                         request_id)
            if spoiled is None:
                return
            frames[-1] = spoiled
        if self._send(peer, header, *frames):
            self.num_pulls_served += 1
            self.num_bytes_sent += sum(p.numel() * p.element_size() for p in payloads)

    def _on_done(self, peer: _DecodePeer, done: KVDone) -> None:
        if not self._holds(peer, done.request_id):
            return  # already released (expired, aborted): never twice
        if not done.ok:
            log.info("decode node %s gave up on %s: %s", peer.node_id, done.request_id, done.error)
        self._leases.release(done.request_id)

    def _holds(self, peer: _DecodePeer, request_id: str) -> bool:
        entry = self._requests.get(request_id)
        return entry is not None and entry[0] is peer

    # ---- release --------------------------------------------------------------------------
    def _released(self, request_id: str) -> None:
        """The LeaseTable's callback: runs exactly once per held request."""
        peer, _ = self._requests.pop(request_id)
        peer.request_ids.discard(request_id)
        if not peer.request_ids:
            peer.idle_since = self._clock()
        self._release_cb(request_id)

    def _fail(self, request_id: str, error: str) -> None:
        """Report the failure while the request is still held (the node still knows its router), then release it."""
        if request_id in self._leases:
            self._report(request_id, error)
            self._leases.release(request_id)

    def _report(self, request_id: str, error: str) -> None:
        if self.on_error is not None:
            self.on_error(request_id, error)
