"""The transport that reaches every peer: ask for the KV with `KVPull`, get it back as one raw
payload frame after a `KVData` header, scatter it into our blocks.

    start: KVPull ─▶ PENDING ─▶ on_data: KVData(ok) + [num_layers, 2, num_tokens, kv_heads, head_dim] frame ─▶ DONE
                                          KVData(ok=False), wrong dtype/shape/size ─────────────────────▶ FAILED

The payload is token-major, so the two pools may use different block sizes. The peer answers
KVData(ok=False) once it no longer holds the request (lease expired, aborted), which is why the
receiver falls back to this transport when a same-host copy would race the peer's lease.
"""

from __future__ import annotations

from pdserve.kvtransfer.messages import KVData, KVLayout, KVPull, KVReady
from pdserve.kvtransfer.payload import frame_to_tensor, scatter_tokens
from pdserve.kvtransfer.transport import KVTransport, Outcome, Send


class ZmqPullTransport(KVTransport):
    name = "zmq"
    reads_peer_pool = False
    same_host = False

    def open(self, peer_layout: KVLayout, send: Send) -> Send:
        return send  # the handle is the way back to the peer

    def start(self, handle: Send, ready: KVReady, dst_block_ids: list[int]) -> Outcome:
        if not handle(KVPull(ready.request_id)):
            return Outcome.failed("cannot reach the prefill node to pull")
        return Outcome.pending()

    def on_data(self, handle: Send, ready: KVReady, dst_block_ids: list[int], data: KVData, frames: list
                ) -> Outcome:
        if not data.ok:
            return Outcome.failed(f"prefill node refused the pull: {data.error}")
        layout = self.layout
        shape = [layout.num_layers, 2, ready.num_tokens, layout.num_kv_heads, layout.head_dim]
        if data.dtype != layout.dtype or data.shape != shape or len(frames) != 1:
            return Outcome.failed(f"bad KV payload: {data.dtype}{data.shape} in {len(frames)} frame(s), "
                                  f"expected {layout.dtype}{shape} in 1")
        try:
            payload = frame_to_tensor(frames[0], data.dtype, shape)
            scatter_tokens(self.kv_buffer, dst_block_ids, payload)
        except ValueError as e:
            return Outcome.failed(f"bad KV payload: {e}")
        return Outcome.done(payload.numel() * payload.element_size())
