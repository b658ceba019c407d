"""Tensor parallelism: one node, N model ranks in N processes (engine/parallel/).

    state.py      the process group of this rank: rank, size, collectives with timeouts
    sharding.py   which heads, rows and vocab ids each rank holds (pure functions)
    layers.py     Megatron's column/row-parallel linears, vocab-parallel embedding and LM head
    executor.py   the node process's side: starts, feeds and supervises ranks 1..N-1
    worker.py     a rank > 0: `python -m pdserve.engine.parallel.worker`
    step_wire.py  what rank 0 sends the workers each step (msgpack, no pickle)
    rank_pools.py every rank's KV pool (a kvcache.KVShard each): placed and mapped (shared memory / CUDA IPC)
    errors.py     TPWorkerError / TPStartupError
"""
