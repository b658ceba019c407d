"""pdserve.protocol: what crosses a socket between router, prefill and decode nodes, apart from KV.

    messages.py   every wire message (msgpack dataclasses): control (Register, Heartbeat,
                  PrefillRequest, TokenBatch...) and the KV hand-off's (KVLayout, KVReady, KVPull...)
    sockets.py    the one socket factory (`make_socket`) and typed send/recv
    curve.py      CURVE keys and the ZAP authenticator
    exposure.py   which addresses other machines can reach, and the refusal to expose one without keys

Nothing here imports torch or the engine: the router speaks this package and never `kvtransfer`.
"""
