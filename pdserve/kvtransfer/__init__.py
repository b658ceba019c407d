"""pdserve.kvtransfer: the KV hand-off from a prefill node's pool to a decode node's.

The messages it sends and the sockets it sends them on are `pdserve.protocol`'s.
    layout.py     the checks both ends make against a KVLayout (pool shape, KVReady, block ids)
    heads.py      KV heads across tensor-parallel ranks: which peer rank holds which head
    payload.py    gather/scatter/copy a request's tokens; tensors <-> frames (dtype names: kvcache/dtypes.py)
    lease.py      how long the prefill node keeps handed-off blocks pinned
    sender.py     prefill side: KVReady, serve pulls, release on KVDone or lease expiry
    receiver.py   decode side: handshake probes, pull through a transport, KVDone
    transport.py  the transport interface; one file per transport:
                  shm.py ("shm"), cuda_ipc.py ("cuda_ipc"), zmq_pull.py ("zmq")
"""
