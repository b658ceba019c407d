"""Rank r > 0 of a tensor-parallel node: `python -m pdserve.engine.parallel.worker SPEC_JSON`,
started by the node process (executor.py), never by hand.

    connect   PULL ipc://<dir>/rank<r> (commands from rank 0), PUSH ipc://<dir>/replies; "hello"
    join      the process group (init_tp), then load this rank's shard (ModelRunner); "loaded"
    serve     "profile"  (CUDA) the same profiling forward as rank 0; reply "profiled"
              "allocate" map this rank's KV pool (CPU: the segment rank 0 made; CUDA: allocate on
                         cuda:r and reply with its IPC handle), make the host swap buffer; "allocated"
              "step"     the same block moves and forward as rank 0 (runner.run_step), with the
                         logits' all-gather when rank 0 computes logits; no reply (the collectives
                         keep the ranks in lock step)
              "stop"     leave
    leave     on "stop", when the node process is gone (a watchdog compares the parent pid), on
              SIGTERM (SIGINT is ignored: a terminal's Ctrl-C goes to the node, which drains), or on
              any error (a failed collective included): the error's line goes to rank 0 as
              {"op": "error"} when it still listens, the traceback to this process's log.

Waiting for the next command is a poll on the socket, not a collective: an idle node never times out.
PDSERVE_TP_WORKER_FAULT=exit|hang (tests only) makes every worker exit or hang before "hello".
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback

_POLL_MS = 500
_WATCHDOG_S = 0.5


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the node decides, not us
    _watch_parent(int(spec["parent_pid"]))
    _inject_fault(os.environ.get("PDSERVE_TP_WORKER_FAULT", ""))
    import zmq

    ctx = zmq.Context()
    commands, replies = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (commands, replies):
        sock.setsockopt(zmq.LINGER, 1000)
    replies.setsockopt(zmq.SNDTIMEO, 10_000)  # a reply never blocks the worker for long
    commands.connect("ipc://" + os.path.join(spec["ipc_dir"], f"rank{spec['rank']}"))
    replies.connect("ipc://" + os.path.join(spec["ipc_dir"], "replies"))
    try:
        Worker(spec, commands, replies).serve()
        return 0
    except Exception as e:  # noqa: BLE001 - reported to rank 0 and logged; the exit code says it failed
        traceback.print_exc()
        _reply(replies, spec["rank"], "error", message=" ".join(f"{type(e).__name__}: {e}".split())[:400])
        return 1
    finally:
        from pdserve.engine.parallel import state

        state.destroy_tp()
        commands.close(linger=0)
        replies.close()
        ctx.term()


class Worker:
    def __init__(self, spec: dict, commands, replies) -> None:
        from pdserve.engine.parallel import state

        self.rank = int(spec["rank"])
        self.commands, self.replies = commands, replies
        self.reply("hello")
        state.init_tp(self.rank, int(spec["size"]), spec["init_method"], spec["backend"], float(spec["timeout_s"]))
        self.runner = _load_runner(spec)
        params = self.runner.model.parameters()
        self.reply("loaded", param_bytes=sum(p.numel() * p.element_size() for p in params))

    def reply(self, op: str, **values) -> None:
        _reply(self.replies, self.rank, op, **values)

    def serve(self) -> None:
        from pdserve.engine.parallel.step_wire import decode_message, decode_step

        while True:
            if not self.commands.poll(_POLL_MS):
                continue  # the watchdog ends this process when the node process is gone
            message = decode_message(self.commands.recv())
            op = message["op"]
            if op == "stop":
                return
            if op == "step":
                self.runner.run_step(decode_step(message))
            elif op == "allocate":
                self.allocate(message)
            elif op == "profile":
                num_blocks = self.runner.profile_own_kv_blocks(int(message["bytes_per_block"]),
                                                               float(message["gpu_memory_utilization"]))
                self.reply("profiled", num_blocks=num_blocks)
            else:
                raise ValueError(f"unknown command {op!r}")

    def allocate(self, message: dict) -> None:
        import torch

        from pdserve.kvcache.dtypes import parse_dtype

        shape, dtype = tuple(int(n) for n in message["shape"]), parse_dtype(message["dtype"])
        if tuple(self.runner.kv_shape(shape[2])) != shape or dtype != self.runner.dtype:
            raise ValueError(f"rank {self.rank}: KV pool {dtype}{list(shape)} does not match this rank's "
                             f"{self.runner.dtype}{list(self.runner.kv_shape(shape[2]))}")
        extra = {}
        if self.runner.device.type == "cuda":
            from pdserve.engine.parallel.rank_pools import export_cuda_pool

            pool = torch.zeros(shape, dtype=dtype, device=self.runner.device)
            extra = export_cuda_pool(pool)
        else:
            from pdserve.engine.parallel.rank_pools import map_shm_pool

            pool = map_shm_pool(shape, dtype, message["shm_name"], message["probe_token"])
        self.runner.attach_kv(pool, int(message["num_host_blocks"]))
        self.reply("allocated", **extra)


def _load_runner(spec: dict):
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model_config import ModelConfig
    from pdserve.engine.model_runner import ModelRunner

    config = EngineConfig(**spec["config"])
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    model_config = ModelConfig.from_pretrained(config.model_path)
    return ModelRunner(config, model_config, int(spec["max_model_len"]), tp_rank=int(spec["rank"]))


def _reply(sock, rank: int, op: str, **values) -> None:
    import zmq

    from pdserve.engine.parallel.step_wire import encode_message

    try:
        sock.send(encode_message({"op": op, "rank": rank, **values}))
    except zmq.ZMQError:  # rank 0 is gone or not listening (SNDTIMEO): nothing to tell
        pass


def _watch_parent(parent_pid: int) -> None:
    """Exit at once when the node process is gone (this process was re-parented)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_WATCHDOG_S)
        os._exit(3)

    threading.Thread(target=watch, name="pdserve-tp-parent-watchdog", daemon=True).start()


def _inject_fault(fault: str) -> None:
    if fault == "exit":
        print("PDSERVE_TP_WORKER_FAULT=exit: exiting before start-up", file=sys.stderr, flush=True)
        sys.exit(7)
    if fault == "hang":
        while True:
            time.sleep(60)


if __name__ == "__main__":
    sys.exit(main())
