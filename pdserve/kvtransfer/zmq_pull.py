"""The transport that reaches every peer: ask for the KV with `KVPull`, get it back as raw payload
frames after a `KVData` header, one per rank of ours, scatter frame r into rank r's pool.

    start: KVPull(head ranges of our ranks) ─▶ PENDING
        ─▶ on_data: KVData(ok) + frame r = [num_layers, 2, num_tokens, heads of our rank r, head_dim] ─▶ DONE
                    KVData(ok=False), wrong dtype / shapes / sizes / frame count ──────────────────────▶ FAILED

The pull names each of our ranks' head ranges, so the prefill node, whatever its own TP size,
gathers exactly those heads from the ranks holding them. Every frame is checked before any is
scattered. The payload is token-major, so the two pools may use different block sizes. The peer
answers KVData(ok=False) once it no longer holds the request (lease expired, aborted), which is why
the receiver falls back to this transport when a same-host copy would race the peer's lease.
"""

from __future__ import annotations

from pdserve.kvtransfer.payload import frame_to_tensor, scatter_tokens
from pdserve.kvtransfer.transport import KVTransport, Outcome, Send
from pdserve.protocol.messages import KVData, KVLayout, KVPull, KVReady


class ZmqPullTransport(KVTransport):
    name = "zmq"
    reads_peer_pool = False
    same_host = False

    def open(self, peer_layout: KVLayout, send: Send) -> Send:
        return send  # the handle is the way back to the peer

    def start(self, handle: Send, ready: KVReady, dst_block_ids: list[int], first_block: int = 0) -> Outcome:
        ranges = [[s.head_start, s.head_end] for s in self.shards]
        if not handle(KVPull(ready.request_id, head_ranges=ranges, first_block=first_block)):
            return Outcome.failed("cannot reach the prefill node to pull")
        return Outcome.pending()

    def on_data(self, handle: Send, ready: KVReady, dst_block_ids: list[int], data: KVData, frames: list
                ) -> Outcome:
        if not data.ok:
            return Outcome.failed(f"prefill node refused the pull: {data.error}")
        layout = self.layout
        shapes = [[layout.num_layers, 2, ready.num_tokens, s.num_heads, layout.head_dim] for s in self.shards]
        if data.dtype != layout.dtype or data.shapes != shapes or len(frames) != len(shapes):
            return Outcome.failed(f"bad KV payload: {data.dtype}{data.shapes} in {len(frames)} frame(s), "
                                  f"expected {layout.dtype}{shapes} in {len(shapes)}")
        try:
            payloads = [frame_to_tensor(frame, data.dtype, shape) for frame, shape in zip(frames, shapes)]
            for shard, payload in zip(self.shards, payloads):
                scatter_tokens(shard.tensor, dst_block_ids, payload)
        except ValueError as e:
            return Outcome.failed(f"bad KV payload: {e}")
        rank_bytes = [p.numel() * p.element_size() for p in payloads]
        return Outcome.done(sum(rank_bytes), rank_bytes)
