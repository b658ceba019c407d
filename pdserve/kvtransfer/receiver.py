"""Decode side of the KV hand-off: accept announcements, pull the blocks in, ack.

One ROUTER socket; every prefill node connects to it and opens with a `Handshake`. A request
announced by `KVReady` goes through:

    KVReady ─▶ event "ready" ─▶ (node allocates blocks; renew() while it waits) ─▶ pull(blocks)
       same host:  copy straight out of the peer's mapped pool ─▶ KVDone ─▶ event "done"
       otherwise:  KVPull ─▶ KVData + payload frame ─▶ scatter ─▶ KVDone ─▶ event "done"
       KVData(ok=False), a bad payload, or no answer in pull_timeout_s ─▶ KVDone(ok=False) ─▶ "failed"
       release() (abort, the node gives up) ─▶ KVDone(ok=False)

Ownership: the decode node allocates and frees its own blocks; this class only fills them.
Every request it announced ends with exactly one KVDone to the prefill node (ok or not), which is
what lets the prefill node free its blocks early instead of waiting out the lease.
Same host is proved per peer at handshake time (`open_peer_pool`: segment size and probe token).
The shared-memory path is only used while our estimate of the peer's lease is comfortably alive
(the peer frees its blocks when the lease runs out); past that we pull over ZMQ, where the peer
answers "no longer held" instead of letting us copy reused blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from pdserve.kvtransfer import cuda_ipc
from pdserve.kvtransfer.curve import CurveKeys
from pdserve.kvtransfer.messages import (
    Handshake,
    HandshakeAck,
    KVData,
    KVDone,
    KVLayout,
    KVPull,
    KVReady,
    LeaseRenew,
    Message,
    MessageError,
)
from pdserve.kvtransfer.payload import copy_tokens, dtype_name, frame_to_tensor, scatter_tokens
from pdserve.kvtransfer.shm import layout_shape, open_peer_pool
from pdserve.kvtransfer.sockets import KV_MAX_BYTES, drain, endpoint, make_socket, send_msg

log = logging.getLogger(__name__)

SHM_LEASE_MARGIN_S = 2.0  # copy from a peer's pool only if its lease has this much left


@dataclass
class KVEvent:
    kind: str  # "ready" | "done" | "failed"
    request_id: str
    ready: KVReady | None = None
    error: str = ""


@dataclass
class _Peer:
    node_id: str
    layout: KVLayout
    ok: bool  # the handshake passed
    pool: torch.Tensor | None = None  # the peer's pool, mapped (same host)


@dataclass
class _Incoming:
    identity: bytes  # the prefill node's connection
    ready: KVReady
    lease_deadline: float  # our (conservative) estimate of when the peer frees the blocks
    dst_block_ids: list[int] | None = None  # set by pull()
    pulled_at: float | None = None  # a KVPull is in flight since


class KVReceiver:
    def __init__(self, node_id: str, layout: KVLayout, kv_buffer: torch.Tensor, *,
                 bind_addr: str = "tcp://127.0.0.1:0", pull_timeout_s: float = 30.0, enable_shm: bool = True,
                 max_frame_bytes: int = KV_MAX_BYTES, clock: Callable[[], float] = time.monotonic,
                 curve: CurveKeys | None = None):
        if tuple(kv_buffer.shape) != layout_shape(layout) or dtype_name(kv_buffer.dtype) != layout.dtype:
            raise ValueError(f"kv_buffer {kv_buffer.dtype}{tuple(kv_buffer.shape)} does not match {layout}")
        self.node_id = node_id
        self.layout = layout
        self.kv_buffer = kv_buffer
        self.pull_timeout_s = pull_timeout_s
        self.enable_shm = enable_shm
        self.clock = clock
        self.sock = make_socket(zmq.ROUTER, bind=bind_addr, max_msg_bytes=max_frame_bytes, curve=curve)
        self.kv_addr = endpoint(self.sock)
        self.num_shm_copies = 0
        self.num_zmq_pulls = 0
        self.num_bytes_received = 0
        self._peers: dict[bytes, _Peer] = {}
        self._incoming: dict[str, _Incoming] = {}
        self._events: list[KVEvent] = []  # produced outside poll(), reported by the next poll()

    # ---- the node's calls ---------------------------------------------------------------
    def poll(self, timeout_ms: int = 0) -> list[KVEvent]:
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

    def pull(self, request_id: str, dst_block_ids: list[int]) -> None:
        """Fill `dst_block_ids` (ours, allocated by the node) with the request's KV. The outcome
        is a "done" or "failed" event from a later poll()."""
        inc = self._incoming.get(request_id)
        if inc is None:
            raise KeyError(f"no announced request {request_id!r}")
        if inc.dst_block_ids is not None:
            raise ValueError(f"request {request_id!r} is already being pulled")
        if inc.ready.num_tokens > len(dst_block_ids) * self.layout.block_size:
            raise ValueError(f"{len(dst_block_ids)} blocks cannot hold {inc.ready.num_tokens} tokens")
        if any(not 0 <= b < self.layout.num_blocks for b in dst_block_ids):
            raise ValueError(f"block ids out of range [0, {self.layout.num_blocks})")
        inc.dst_block_ids = list(dst_block_ids)
        peer = self._peers[inc.identity]
        if peer.pool is not None and self.clock() < inc.lease_deadline - SHM_LEASE_MARGIN_S:
            self._copy_same_host(request_id, inc, peer)
            return
        inc.pulled_at = self.clock()
        if not self._send(inc.identity, KVPull(request_id)):
            self._events.append(self._fail(request_id, "cannot reach the prefill node to pull"))

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

    @property
    def pending_request_ids(self) -> list[str]:
        return list(self._incoming)

    def close(self) -> None:
        for request_id in list(self._incoming):
            self.release(request_id, "decode node shutting down")
        self._peers.clear()
        self.sock.close(linger=500)  # let those goodbyes out; close() itself does not wait

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
        if error is not None:
            error = f"decode node {self.node_id} cannot take KV from {hs.node_id}: {error}"
            log.error(error)
            self._peers[identity] = _Peer(hs.node_id, hs.layout, ok=False)
            self._send(identity, HandshakeAck(self.node_id, ok=False, error=error))
            return
        pool = None
        if self.enable_shm:
            pool = open_peer_pool(hs.layout, hs.layout.probe_token)  # CPU: shared memory
            if pool is None:
                pool = cuda_ipc.open_peer_pool(hs.layout)  # GPU: CUDA IPC
        self._peers[identity] = _Peer(hs.node_id, hs.layout, ok=True, pool=pool)
        log.info("prefill node %s connected (%s)", hs.node_id, "same host, shared memory" if pool is not None else "zmq")
        self._send(identity, HandshakeAck(self.node_id, ok=True, same_host=pool is not None))

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
        error = self._check_ready(peer, ready)
        if error is not None:
            self._send(identity, KVDone(rid, ok=False, error=error))
            return KVEvent("failed", rid, ready, error)
        self._incoming[rid] = _Incoming(identity, ready, self.clock() + ready.lease_s)
        return KVEvent("ready", rid, ready)

    @staticmethod
    def _check_ready(peer: _Peer, ready: KVReady) -> str | None:
        if ready.block_size != peer.layout.block_size:
            return f"KVReady block_size {ready.block_size} != handshake block_size {peer.layout.block_size}"
        if ready.num_tokens <= 0 or ready.num_tokens > len(ready.block_ids) * ready.block_size:
            return f"{len(ready.block_ids)} blocks of {ready.block_size} cannot hold {ready.num_tokens} tokens"
        if any(not 0 <= b < peer.layout.num_blocks for b in ready.block_ids):
            return f"block ids out of the peer's range [0, {peer.layout.num_blocks})"
        return None

    def _on_data(self, identity: bytes, data: KVData, frames: list) -> KVEvent | None:
        inc = self._incoming.get(data.request_id)
        if inc is None or inc.identity != identity or inc.pulled_at is None:
            log.warning("dropped KVData for %s: not being pulled from that peer", data.request_id)
            return None
        if not data.ok:
            return self._fail(data.request_id, f"prefill node refused the pull: {data.error}")
        n = inc.ready.num_tokens
        shape = [self.layout.num_layers, 2, n, self.layout.num_kv_heads, self.layout.head_dim]
        if data.dtype != self.layout.dtype or data.shape != shape or len(frames) != 1:
            return self._fail(data.request_id, f"bad KV payload: {data.dtype}{data.shape} in {len(frames)} "
                                               f"frame(s), expected {self.layout.dtype}{shape} in 1")
        try:
            payload = frame_to_tensor(frames[0], data.dtype, shape)
            scatter_tokens(self.kv_buffer, inc.dst_block_ids, payload)
        except ValueError as e:
            return self._fail(data.request_id, f"bad KV payload: {e}")
        self.num_zmq_pulls += 1
        self.num_bytes_received += payload.numel() * payload.element_size()
        return self._succeed(data.request_id)

    def _copy_same_host(self, request_id: str, inc: _Incoming, peer: _Peer) -> None:
        try:
            copy_tokens(peer.pool, inc.ready.block_ids, self.kv_buffer, inc.dst_block_ids, inc.ready.num_tokens)
        except (ValueError, RuntimeError) as e:
            self._events.append(self._fail(request_id, f"same-host copy failed: {e}"))
            return
        self.num_shm_copies += 1
        self._events.append(self._succeed(request_id))

    # ---- outcomes -------------------------------------------------------------------------
    def _succeed(self, request_id: str) -> KVEvent:
        inc = self._incoming.pop(request_id)
        self._send(inc.identity, KVDone(request_id, ok=True))
        return KVEvent("done", request_id, inc.ready)

    def _fail(self, request_id: str, error: str) -> KVEvent:
        inc = self._incoming.pop(request_id)
        log.warning("KV transfer of %s failed: %s", request_id, error)
        self._send(inc.identity, KVDone(request_id, ok=False, error=error))
        return KVEvent("failed", request_id, inc.ready, error)

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
