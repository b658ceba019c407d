"""pdserve.kvtransfer: the wire between router, prefill and decode nodes (messages, sockets, KV hand-off).

    messages.py   every wire message (msgpack dataclasses), KVLayout included
    sockets.py    the one socket factory (`make_socket`) and typed send/recv
    curve.py      CURVE keys and the ZAP authenticator
    exposure.py   which addresses other machines can reach, and the refusal to expose one without keys
    layout.py     the checks both ends make against a KVLayout (pool shape, KVReady, block ids)
    heads.py      KV heads across tensor-parallel ranks: which peer rank holds which head
    payload.py    gather/scatter/copy a request's tokens; tensors <-> frames (dtype names: engine/dtypes.py)
    lease.py      how long the prefill node keeps handed-off blocks pinned
    sender.py     prefill side: KVReady, serve pulls, release on KVDone or lease expiry
    receiver.py   decode side: handshake probes, pull through a transport, KVDone
    transport.py  the transport interface; one file per transport:
                  shm.py ("shm"), cuda_ipc.py ("cuda_ipc"), zmq_pull.py ("zmq")
"""
