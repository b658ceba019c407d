"""The node process's side of tensor parallelism: it is rank 0 and runs ranks 1..N-1 as worker
processes (`python -m pdserve.engine.parallel.worker`, worker.py), which it starts, feeds and stops.

    start     a private ipc:// dir; one PUSH socket per worker (commands, steps), one PULL (replies)
              Popen each worker (its spec as JSON on the command line; stdout+stderr to a log file)
              wait for every "hello", then join the process group as rank 0 in a thread;
              the workers load their shard ("loaded") while rank 0 loads its own
    KV pool   allocate_kv: on the CPU every rank's pool is a SharedKVPool made here, which worker r
              maps by name; on CUDA worker r allocates on cuda:r and sends a CUDA IPC handle
    steps     send_step: the Step as msgpack (step_wire.py), then rank 0 runs the same forward
    faults    every wait polls the processes: a worker that exits fails start-up at once
              (TPStartupError naming the rank and the tail of its log), a phase that takes longer
              than tp_startup_timeout_s fails it too; during steps, a worker that exited or a
              collective that failed turns into TPWorkerError (step_guard), the workers left are
              stopped, and every later step raises the same error
    close     "stop", then SIGTERM / SIGKILL whoever is left, reap; sockets, ipc dir, shared
              pools, destroy_tp. Idempotent; also at interpreter exit (atexit)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch
import zmq

from pdserve.engine.config import EngineConfig
from pdserve.engine.parallel import state
from pdserve.engine.parallel.errors import TPStartupError, TPWorkerError
from pdserve.engine.parallel.rank_pools import create_shm_pool, map_cuda_pool
from pdserve.engine.parallel.sharding import kv_head_range
from pdserve.engine.parallel.step_wire import Step, decode_message, encode_message, encode_step
from pdserve.kvcache.dtypes import dtype_name
from pdserve.kvcache.shard import KVShard
from pdserve.utils.processes import free_port, stop_processes

logger = logging.getLogger(__name__)
_POLL_MS = 100
_EXIT_GRACE_S = 2.0  # a collective failed: how long a dead worker may take to show as exited
_STOP_GRACE_S = 3.0  # close: how long workers get to exit on "stop" before SIGTERM / SIGKILL


def threads_per_rank(config: EngineConfig) -> int | None:
    """--num-threads, which is per rank; without it, on the CPU with TP > 1, the CPUs this process
    may use divided among the ranks (None: torch's own choice)."""
    if config.num_threads or config.tensor_parallel_size == 1 or config.device != "cpu":
        return config.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)


class TPExecutor:
    def __init__(self, config: EngineConfig, max_model_len: int) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.on_cuda = config.device.startswith("cuda")
        self.procs: list[subprocess.Popen] = []  # rank r at r - 1
        self.pools: list = []  # the SharedKVPools made here (CPU)
        self._error: TPWorkerError | None = None
        self._joined = False
        self._loaded = False
        self.worker_param_bytes: list[int] = []  # rank r's weight bytes at r - 1, once loaded
        self._closed = False
        self._dir = tempfile.mkdtemp(prefix="pdserve-tp-")
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._commands: list[zmq.Socket] = []  # rank r's at r - 1
        atexit.register(self.close)
        try:
            self._start(max_model_len)
        except BaseException:
            self.close()
            raise

    # ---- start-up ---------------------------------------------------------------------------
    def _start(self, max_model_len: int) -> None:
        if self.on_cuda and torch.cuda.device_count() < self.size:
            raise ValueError(f"tensor_parallel_size {self.size} needs {self.size} CUDA devices, "
                             f"{torch.cuda.device_count()} visible")
        self._replies = self._bind(zmq.PULL, "replies")
        self._commands = [self._bind(zmq.PUSH, f"rank{r}") for r in range(1, self.size)]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        backend = "nccl" if self.on_cuda else "gloo"
        for rank in range(1, self.size):
            spec = {"rank": rank, "size": self.size, "init_method": init_method, "backend": backend,
                    "timeout_s": self.config.tp_timeout_s, "ipc_dir": self._dir, "parent_pid": os.getpid(),
                    "max_model_len": max_model_len, "config": self._worker_config()}
            with open(self._log_path(rank), "wb") as log:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "pdserve.engine.parallel.worker", json.dumps(spec)],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
        self.gather("hello", phase="starting up")
        self._join(init_method, backend)
        logger.info("tensor parallelism: %d ranks joined (%s)", self.size, backend)

    def _worker_config(self) -> dict:
        cfg = self.config
        values = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        values.update(model_path=str(cfg.model_path), speculative_config=None, dtype=dtype_name(cfg.torch_dtype),
                      num_threads=threads_per_rank(cfg))  # the runner puts rank r on cuda:r
        return values

    def _join(self, init_method: str, backend: str) -> None:
        """Join the group as rank 0 in a thread, so a worker that dies meanwhile fails start-up now."""
        errors: list[BaseException] = []

        def join() -> None:
            try:
                state.init_tp(0, self.size, init_method, backend, self.config.tp_timeout_s)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                errors.append(e)

        thread = threading.Thread(target=join, name="pdserve-tp-join", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.config.tp_startup_timeout_s
        while thread.is_alive():
            self._check_alive("joining the process group")
            if time.monotonic() > deadline:
                raise TPStartupError(f"tensor-parallel start-up: the ranks did not join the process group within "
                                     f"{self.config.tp_startup_timeout_s:g} s (--tp-startup-timeout-s)")
            thread.join(_POLL_MS / 1000)
        if errors:
            raise TPStartupError(f"tensor-parallel start-up: rank 0 could not join the group: {errors[0]}") from errors[0]
        self._joined = True

    def _await_loaded(self) -> None:
        if not self._loaded:
            self.worker_param_bytes = self.gather("loaded", "param_bytes", phase="loading the model")
            self._loaded = True

    # ---- commands -----------------------------------------------------------------------------
    def broadcast(self, message: dict) -> None:
        """Send `message` to every worker (once they have loaded their shard)."""
        self._await_loaded()
        self._send(encode_message(message))

    def gather(self, op: str, key: str | None = None, *, phase: str | None = None) -> list:
        """Every worker's reply `op` (rank order), or its `key`. Polls the processes while waiting:
        one that exits (or replies "error") fails at once; so does `tp_startup_timeout_s` passing."""
        phase = phase or op
        timeout_s = self.config.tp_startup_timeout_s
        deadline = time.monotonic() + timeout_s
        got: dict[int, dict] = {}
        while len(got) < self.size - 1:
            self._check_alive(phase)
            left = deadline - time.monotonic()
            if left <= 0:
                rank = min(r for r in range(1, self.size) if r not in got)
                raise TPStartupError(f"tensor-parallel rank {rank} did not finish {phase} within {timeout_s:g} s "
                                     f"(--tp-startup-timeout-s); its log ends: {self._tail(rank)}", rank)
            if self._replies.poll(min(_POLL_MS, max(1, int(left * 1000)))):
                message = decode_message(self._replies.recv())
                rank = int(message.get("rank", -1))
                if message["op"] == "error":
                    raise TPStartupError(f"tensor-parallel rank {rank} failed {phase}: {message.get('message')}", rank)
                if message["op"] != op or not 0 < rank < self.size:
                    raise TPStartupError(f"tensor-parallel start-up: unexpected reply {message['op']!r} from rank "
                                         f"{rank} while waiting for {op!r}")
                got[rank] = message
        replies = [got[r] for r in sorted(got)]
        return [m.get(key) for m in replies] if key else replies

    def allocate_kv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, num_host_blocks: int,
                    num_kv_heads: int) -> list[KVShard]:
        """Every rank's pool of `shape` (one rank's; the model has `num_kv_heads`), as KVShards
        mapped in this process. Each worker also makes its own host swap buffer."""
        self._await_loaded()
        message = {"op": "allocate", "shape": list(shape), "dtype": dtype_name(dtype),
                   "num_host_blocks": num_host_blocks}
        if self.on_cuda:
            self.broadcast(message)
            tensors, shms = [torch.zeros(shape, dtype=dtype, device=device)], [None]
            replies = self.gather("allocated", phase="allocating its KV pool")
            for rank, reply in enumerate(replies, start=1):
                tensors.append(map_cuda_pool(rank, reply, shape, dtype))
                shms.append(None)
        else:
            from pdserve.kvcache.shm_pool import cleanup_stale_segments

            cleanup_stale_segments()  # a TP node killed with -9 left its ranks' pools behind
            self.pools = [create_shm_pool(rank, shape, dtype) for rank in range(self.size)]
            tensors, shms = [p.tensor for p in self.pools], list(self.pools)
            for rank in range(1, self.size):
                self._commands[rank - 1].send(encode_message(
                    {**message, "shm_name": self.pools[rank].name, "probe_token": self.pools[rank].probe_token}))
            self.gather("allocated", phase="mapping its KV pool")
        shards = [KVShard(r, *kv_head_range(r, self.size, num_kv_heads), tensors[r], shms[r]) for r in range(self.size)]
        if self.on_cuda:  # CUDA cannot re-export imported memory: a peer maps rank r by the worker's own handle
            for shard, reply in zip(shards[1:], replies):
                shard.cuda_ipc = reply.get("cuda_ipc")
        return shards

    # ---- steps ------------------------------------------------------------------------------------
    def send_step(self, step: Step) -> None:
        self._check_alive(None)
        self._send(encode_step(step))

    @contextlib.contextmanager
    def step_guard(self):
        """Around one step at rank 0: a worker that exited or a collective that failed becomes
        TPWorkerError; the ranks are out of step from then on, so the workers are stopped and every
        later step raises the same error."""
        if self._error is not None:
            raise self._error
        try:
            yield
        except BaseException as e:
            error = e if isinstance(e, TPWorkerError) else self._dead_worker_error(wait_s=_EXIT_GRACE_S)
            if error is None:
                error = TPWorkerError(f"tensor-parallel ranks out of step after a failed step: "
                                      f"{_one_line(str(e)) or type(e).__name__}")
            self._error = error
            self._stop_workers()
            if error is e or not isinstance(e, Exception):
                raise
            raise error from e

    def _check_alive(self, phase: str | None) -> None:
        error = self._dead_worker_error(phase=phase)
        if error is not None:
            raise error

    def _dead_worker_error(self, *, phase: str | None = None, wait_s: float = 0.0) -> TPWorkerError | None:
        deadline = time.monotonic() + wait_s
        while True:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None:
                    if phase is not None:
                        return TPStartupError(f"tensor-parallel rank {rank} exited with code {code} while "
                                              f"{phase}; its log ends: {self._tail(rank)}", rank, code)
                    return TPWorkerError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}; "
                                         f"its log ends: {self._tail(rank)}", rank, code)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    # ---- plumbing -----------------------------------------------------------------------------------
    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{os.path.join(self._dir, name)}")
        self._sockets.append(sock)
        return sock

    def _send(self, data: bytes) -> None:
        for sock in self._commands:
            sock.send(data, copy=False)

    def _log_path(self, rank: int) -> str:
        return os.path.join(self._dir, f"rank{rank}.log")

    def _tail(self, rank: int) -> str:
        """The last lines of rank's stdout+stderr, on one line."""
        try:
            with open(self._log_path(rank), "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - 4096))
                lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return _one_line(" | ".join(lines[-3:])) or "(empty)"

    def _stop_workers(self) -> None:
        for sock in self._commands:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(encode_message({"op": "stop"}), zmq.NOBLOCK)
        deadline = time.monotonic() + _STOP_GRACE_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        stop_processes(self.procs, _STOP_GRACE_S)  # SIGTERM, then SIGKILL; reaps every one

    def close(self) -> None:
        """Stop and reap the workers, close the sockets, leave the group, drop the pools (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._stop_workers()
        finally:
            for sock in self._sockets:
                sock.close(linger=0)
            self._ctx.term()
            if self._joined:
                state.destroy_tp()
            for pool in self.pools:
                pool.close()
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> TPExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _one_line(text: str, limit: int = 400) -> str:
    return " ".join(text.split())[:limit]
