"""pdserve.kvcache: the KV pool's memory and types, below the engine and the hand-off that share them.

    dtypes.py     the one dtype table (names on the wire, parsing flags)
    shard.py      KVShard: one tensor-parallel rank's part of a node's pool
    shm_pool.py   a pool in a shared-memory segment (/dev/shm), created, named, mapped by name
    cuda_pool.py  a CUDA pool exported and mapped through CUDA IPC handles
"""
