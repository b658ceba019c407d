import os
import subprocess
import sys
import time

import torch

from pdserve.kvcache.shm_pool import (
    PROBE_BYTES,
    SHM_DIR,
    SharedKVPool,
    _pid_namespace,
    cleanup_stale_segments,
)
from pdserve.kvtransfer.shm import open_peer_pool

from .conftest import make_layout


def _layout_for(pool: SharedKVPool, probe_token: str | None = None, **kw):
    return make_layout(block_size=8, num_blocks=4, dtype="bfloat16", shm_name=pool.name,
                       probe_token=pool.probe_token if probe_token is None else probe_token, **kw)


def _create() -> SharedKVPool:
    return SharedKVPool.create("test", (2, 2, 4, 8, 2, 16), torch.bfloat16)


def test_create_map_and_close():
    pool = _create()
    try:
        assert os.path.exists(pool.path) and str(os.getpid()) in pool.name
        assert pool.tensor.shape == (2, 2, 4, 8, 2, 16) and not pool.tensor.any()
        peer = open_peer_pool(_layout_for(pool))
        assert peer is not None
        pool.tensor[1, 0, 3, 7] = 2.5  # the peer sees the same memory
        assert peer[1, 0, 3, 7].eq(2.5).all()
    finally:
        pool.close()
    assert not os.path.exists(pool.path)
    pool.close()  # idempotent
    assert peer[1, 0, 3, 7].eq(2.5).all()  # an open mapping outlives the unlink


def test_open_peer_pool_refuses_mismatches():
    pool = _create()
    try:
        token = pool.probe_token
        assert open_peer_pool(_layout_for(pool, os.urandom(PROBE_BYTES).hex())) is None  # wrong probe
        assert open_peer_pool(_layout_for(pool, "not hex")) is None
        assert open_peer_pool(_layout_for(pool, num_layers=3)) is None  # wrong size
        assert open_peer_pool(make_layout(shm_name="../../etc/passwd", probe_token=token)) is None
        assert open_peer_pool(make_layout(shm_name=pool.name + "0", probe_token=token)) is None  # missing
        assert open_peer_pool(make_layout(probe_token=token)) is None  # no segment announced
        assert open_peer_pool(_layout_for(pool), rank=1) is None  # no such rank
        assert not os.path.exists(os.path.join(SHM_DIR, pool.name + "0")), "probing must not create files"
    finally:
        pool.close()


def test_fake_segment_with_the_right_name_and_size_is_rejected():
    """A same-named file of the right size (another host, a stale copy) fails the probe."""
    pool = _create()
    token, size = pool.probe_token, os.path.getsize(pool.path)
    pool.close()
    with open(pool.path, "wb") as f:  # an impostor at the same path
        f.write(os.urandom(size))
    try:
        assert open_peer_pool(_layout_for(pool, token)) is None
    finally:
        os.unlink(pool.path)


def test_cleanup_removes_segments_whose_owner_died_in_any_pid_namespace():
    """Liveness is the owner's flock, which the kernel drops when the process dies however it dies:
    a segment left by a process killed without cleanup goes, from our pid namespace or another
    (containers sharing one /dev/shm volume); a live owner's and a brand-new one's stay."""
    code = ("import os; from pdserve.kvcache.shm_pool import SharedKVPool; "
            "p = SharedKVPool.create('dead', (4, 16), __import__('torch').float32); print(p.name, flush=True); "
            "os._exit(0)")  # no atexit: the segment stays, as after kill -9
    dead = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    foreign_ns = "pdserve-test-1-12345-abc124"  # another container's pid namespace, owner gone
    young = f"pdserve-test-{_pid_namespace()}-12345-abc125"  # just created: its owner may be about to lock it
    for name in (foreign_ns, young):
        open(os.path.join(SHM_DIR, name), "wb").close()
    live = _create()
    old = time.time() - 3600
    for name in (dead, foreign_ns, live.name):
        os.utime(os.path.join(SHM_DIR, name), (old, old))
    try:
        removed = cleanup_stale_segments()
        assert dead in removed and foreign_ns in removed
        assert live.name not in removed and young not in removed
        assert os.path.exists(live.path) and os.path.exists(os.path.join(SHM_DIR, young))
        assert not os.path.exists(os.path.join(SHM_DIR, dead))
    finally:
        live.close()
        for name in (dead, foreign_ns, young):
            if os.path.exists(os.path.join(SHM_DIR, name)):
                os.unlink(os.path.join(SHM_DIR, name))
