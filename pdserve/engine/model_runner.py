"""Turns a `SchedulerOutput` into one forward pass and the sampled tokens.

Owns the model weights (this rank's shard) and the KV pool: one backing buffer per rank,
``[num_layers, 2, num_blocks, block_size, num_kv_heads_per_rank, head_dim]``, so a peer on the same
host can map a whole pool with one handle; per-layer K and V are views into it. With swap space, a
host buffer of the same layout holds preempted requests' blocks.

Tensor parallelism (engine/parallel/): with `tensor_parallel_size` N > 1 the runner of the node
process is rank 0. It starts ranks 1..N-1 (`TPExecutor`), and each step it sends them the step
(`Step`: the batch's host tensors and the block moves) before running the same forward itself;
only rank 0 samples. `kv_shards` lists every rank's pool as the node process sees it (one shard
covering every KV head without TP); `kv_buffer` stays rank 0's. A worker rank runs `run_step`.

A step's host batch is built from a few flat columns (engine/host_batch.py) and block tables kept
across steps (engine/input_batch.py), so its cost does not grow with the sequences; an all-greedy
batch samples with one argmax. `timings` (engine/step_timings.py) records each step's phases.

Decode-only steps can run through `DecodeGraphs` (engine/cuda_graphs.py): CUDA graphs on static,
padded buffers. On CUDA a step's host tensors are staged in pinned memory and copied without
blocking, so building a step costs no host-device sync; for greedy rows without logprobs,
reading the sampled tokens back is the step's only one.
"""

from __future__ import annotations

import logging
import math
from itertools import chain, repeat
from time import perf_counter

import torch

from pdserve.engine.attention_metadata import AttentionMetadata, BatchChunk
from pdserve.engine.config import EngineConfig, cpu_has_native_bf16
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.decode_batch import DecodeStep
from pdserve.engine.host_batch import build_host_batch, pad_tables
from pdserve.engine.input_batch import PersistentBlockTables
from pdserve.engine.loader import iter_safetensors
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import LlamaForCausalLM
from pdserve.engine.models.cpu_bf16 import use_fp32_gemms_for_bf16
from pdserve.engine.ops.linear import pack_cpu_linears
from pdserve.engine.parallel import state
from pdserve.engine.parallel.sharding import check_tp, num_kv_heads_per_rank
from pdserve.engine.parallel.step_wire import HostBatch, Step
from pdserve.engine.rejection_sampler import verify_drafts
from pdserve.engine.sampler import Sampler, SamplingInput, argmax_rows
from pdserve.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from pdserve.engine.step_timings import StepTimings
from pdserve.kernels import cpu_native
from pdserve.kvcache.shard import KVShard

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int, *, tp_rank: int = 0):
        """`tp_rank` > 0: a worker rank's runner (its process group is already joined). Rank 0 of
        a TP > 1 node starts the workers here, before it loads its own shard."""
        self.config = config
        self.model_config = model_config
        self.tp_size = config.tensor_parallel_size
        self.tp_rank = tp_rank
        on_cuda = config.device.startswith("cuda")
        self.device = torch.device("cuda", tp_rank) if on_cuda and self.tp_size > 1 else torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        self.max_model_len = max_model_len  # sizes the RoPE tables
        self.kv_buffer: torch.Tensor | None = None  # this rank's pool
        self.kv_shards: list[KVShard] = []  # every rank's pool, as the node process maps them
        self.host_buffer: torch.Tensor | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.executor = None  # TPExecutor: rank 0 of a TP > 1 node
        self.timings = StepTimings()  # execute() fills prepare, forward and sample; the engine the rest
        self.block_tables = PersistentBlockTables(config.max_num_seqs)  # rows kept across steps
        check_tp(model_config, self.tp_size)
        if self.tp_size == 1 and state.tp_size() != 1:
            raise RuntimeError(f"this process already runs a tensor-parallel group of {state.tp_size()} ranks: "
                               "close that engine first")
        if self.tp_size > 1 and tp_rank == 0:
            from pdserve.engine.parallel.executor import TPExecutor

            self.executor = TPExecutor(config, max_model_len)
        try:
            self.model = self._load_model()
            if self.device.type == "cpu":
                cpu_native.load()  # the decode kernel: built (or loaded from disk) now, not in the first step
            self.sampler = Sampler(seed=config.seed)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the worker ranks and leave the process group (idempotent; a no-op without TP)."""
        if self.executor is not None:
            self.executor.close()

    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        """One rank's pool (every rank's has this shape)."""
        mc = self.model_config
        heads = num_kv_heads_per_rank(mc, self.tp_size)
        return (mc.num_layers, 2, num_blocks, self.block_size, heads, mc.head_dim)

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block in one rank's pool."""
        return math.prod(self.kv_shape(1)) * self.dtype.itemsize

    def allocate_kv(self, num_blocks: int, num_host_blocks: int, kv_allocator=None) -> None:
        """The KV pools (one buffer per rank, per-layer views) and this rank's host swap buffer.
        Without TP `kv_allocator(shape, dtype, device)` places the pool and may return a tensor or
        a `SharedKVPool` (then `kv_shards[0].shm` is it). With TP the executor places every rank's
        pool (on the CPU each in its own shared-memory segment) and `kv_allocator` is not used."""
        shape = self.kv_shape(num_blocks)
        if self.executor is not None:
            self.kv_shards = self.executor.allocate_kv(shape, self.dtype, self.device, num_host_blocks,
                                                       self.model_config.num_kv_heads)
        else:
            allocate = kv_allocator or (lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device))
            pool = allocate(shape, self.dtype, self.device)
            shm = None
            if not isinstance(pool, torch.Tensor):  # a SharedKVPool
                shm, pool = pool, pool.tensor
            self.kv_shards = [KVShard(0, 0, self.model_config.num_kv_heads, pool, shm)]
        self.attach_kv(self.kv_shards[0].tensor, num_host_blocks)

    def attach_kv(self, kv_buffer: torch.Tensor, num_host_blocks: int) -> None:
        """Use `kv_buffer` as this rank's pool; a host swap buffer of `num_host_blocks` blocks."""
        self.kv_buffer = kv_buffer
        self.kv_caches = [(kv_buffer[i, 0], kv_buffer[i, 1]) for i in range(self.model_config.num_layers)]
        if num_host_blocks:
            self.host_buffer = torch.zeros(self.kv_shape(num_host_blocks), dtype=self.dtype, device="cpu")

    @torch.inference_mode()
    def init_decode_graphs(self, max_model_len: int) -> None:
        """Route decode-only steps through static padded buffers and, on CUDA, capture one graph
        per batch bucket. Call after allocate_kv: the graphs bake in the pool's addresses. On the
        CPU nothing is captured and the padded path runs eagerly (how the tests exercise it)."""
        self.decode_graphs = DecodeGraphs(
            self.model, self.kv_caches, max_num_seqs=self.config.max_num_seqs, max_model_len=max_model_len,
            block_size=self.block_size, device=self.device,
        )
        if self.device.type == "cuda":
            self.decode_graphs.capture()

    def profile_num_kv_blocks(self, bytes_per_block: int, gpu_memory_utilization: float) -> int:
        """CUDA: the KV blocks that fit every rank's device (`bytes_per_block`: one rank's block).
        With TP every rank runs the profiling forward (its collectives need them all)."""
        if self.executor is not None:
            self.executor.broadcast({"op": "profile", "bytes_per_block": bytes_per_block,
                                     "gpu_memory_utilization": gpu_memory_utilization})
        own = self.profile_own_kv_blocks(bytes_per_block, gpu_memory_utilization)
        if self.executor is None:
            return own
        return min(own, *self.executor.gather("profiled", "num_blocks", phase="profiling its memory"))

    @torch.inference_mode()
    def profile_own_kv_blocks(self, bytes_per_block: int, gpu_memory_utilization: float) -> int:
        """CUDA: run one forward at the full token budget with a scratch pool, then give the KV
        pool what is left of `gpu_memory_utilization` of the device after the peak it reached."""
        num_tokens = self.config.max_num_batched_tokens
        scratch_blocks = -(-num_tokens // self.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        scratch = torch.zeros(self.kv_shape(scratch_blocks), dtype=self.dtype, device=self.device)
        caches = [(scratch[i, 0], scratch[i, 1]) for i in range(self.model_config.num_layers)]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            block_tables=torch.arange(scratch_blocks, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(num_tokens, dtype=torch.int32, device=dev),
            max_query_len=num_tokens, max_seq_len=num_tokens,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
        hidden = self.model(ids, torch.arange(num_tokens, device=dev), meta, caches)
        self.model.compute_logits(hidden[-min(num_tokens, self.config.max_num_seqs):]).float()  # the Sampler's copy
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - scratch.numel() * scratch.element_size()
        del scratch, caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(dev).total_memory
        budget = total * gpu_memory_utilization - peak
        if budget < bytes_per_block:
            raise ValueError(f"no room for a KV cache: the model peaks at {peak / 2**30:.1f} GiB of "
                             f"{total / 2**30:.1f} GiB; raise gpu_memory_utilization ({gpu_memory_utilization})")
        return int(budget // bytes_per_block)

    def _load_model(self) -> LlamaForCausalLM:
        torch.manual_seed(self.config.seed)
        with torch.device("meta"):
            model = LlamaForCausalLM(self.model_config, self.max_model_len)
        model = model.to_empty(device=self.device)
        if self.model_config.tie_word_embeddings:  # to_empty gives each name its own storage
            model.lm_head.weight = model.embed_tokens.weight
        model.rotary = model.rotary.__class__(self.model_config, self.max_model_len).to(self.device)
        model.load_weights(iter_safetensors(self.config.model_path))
        model.to(self.dtype)
        model.rotary.float()  # RoPE tables stay float32, as in transformers
        if self.device.type == "cpu" and (self.dtype == torch.float32
                                          or (self.dtype == torch.bfloat16 and cpu_has_native_bf16())):
            pack_cpu_linears(model)  # oneDNN copies of fp32 weights, AMX tiles of bf16 ones (ops/linear.py)
            model.fuse_silu()  # with AMX tiles: each MLP's SiLU x up in its gate_up GEMM (models/llama.py)
        if self.dtype == torch.bfloat16 and self.device.type == "cpu" and not cpu_has_native_bf16():
            num = use_fp32_gemms_for_bf16(model)
            logger.info("no native bf16 on this CPU: %d bf16 linear layers run as fp32 GEMMs on bf16 values", num)
        return model.eval()

    # ---- one step -------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, dict[int, float] | None] | list] | tuple:
        """Run the step. A decode step (`out.decode`) returns (token ids, logprobs or None), in
        batch order. Otherwise request id → (sampled token, logprobs) for requests that sample,
        or, for a request that had draft tokens to verify, the list of such pairs it emits
        (the accepted drafts, then the target's own token: engine/rejection_sampler.py); an n > 1
        request about to fork gets one pair per choice, under the choices' ids. Fills
        `timings.prepare`, `.forward` and `.sample`."""
        start = perf_counter()
        decode = out.decode  # a decode step, as columns (engine/decode_batch.py): all sample
        sampling = decode if decode is not None else [s for s in out.scheduled if s.samples]
        step = Step(None if out.is_empty else self.prepare_host_batch(out), bool(sampling),
                    out.blocks_to_swap_out, out.blocks_to_copy, out.blocks_to_swap_in)
        if self.executor is None:
            logits = self.run_step(step, start)
        else:
            with self.executor.step_guard():  # a dead worker or a failed collective: TPWorkerError
                if not step.is_noop:
                    self.executor.send_step(step)
                logits = self.run_step(step, start)
        sample_start = perf_counter()
        if decode is not None:
            sampled = self._sample_decode(logits, decode)
        else:
            sampled = {} if logits is None else self._sample(logits, sampling)
        self.timings.sample = perf_counter() - sample_start
        return sampled

    def _sample_decode(self, logits: torch.Tensor, decode: DecodeStep) -> tuple:
        """A decode step's draws: (token ids, logprobs or None) in batch order."""
        if decode.batch.all_plain_greedy:
            return argmax_rows(logits).cpu().numpy(), None  # the scheduler keeps the array as the next step's input
        rows = [SamplingInput(r.params, *r.sampling_view()) for r in decode.requests]
        result = self.sampler(logits, rows)
        return result.token_ids, result.logprobs

    def _sample(self, logits: torch.Tensor, sampling: list[ScheduledRequest]) -> dict:
        plain_ids = [s.request.request_id for s in sampling if s.request.is_plain_greedy and not s.spec_token_ids]
        if len(plain_ids) == len(sampling):
            # The common serving batch: one argmax and one read-back, no per-row sampler inputs.
            return dict(zip(plain_ids, zip(argmax_rows(logits).tolist(), repeat(None))))
        if any(s.spec_token_ids or s.request.forks for s in sampling):  # drafts to verify or choices to draw
            return verify_drafts(self.sampler, logits, sampling)
        rows = [SamplingInput(s.request.params, *s.request.sampling_view()) for s in sampling]
        result = self.sampler(logits, rows)
        return {s.request.request_id: (tok, lp) for s, tok, lp in zip(sampling, result.token_ids, result.logprobs)}

    @torch.inference_mode()
    def run_step(self, step: Step, start: float | None = None) -> torch.Tensor | None:
        """What every rank does with a step: move blocks, run the forward, and compute the logits
        when `step.compute_logits` (full-vocab [S, vocab] in the lm_head's dtype on every rank; rank 0 samples).
        Records `timings.prepare` (since `start`, default now) and `timings.forward`."""
        start = perf_counter() if start is None else start
        inputs = self.load_step(step)
        loaded = perf_counter()
        self.timings.prepare = loaded - start
        logits = None if inputs is None else self.forward(step, inputs)
        self.timings.forward = perf_counter() - loaded
        return logits

    def load_step(self, step: Step) -> tuple | None:
        """Move the step's blocks; its batch on the device (None: a step without a batch)."""
        self._swap(step)
        return None if step.batch is None else self.upload_batch(step.batch)

    def forward(self, step: Step, inputs: tuple) -> torch.Tensor | None:
        """The model over the uploaded batch; the logits when `step.compute_logits`."""
        input_ids, positions, meta, logits_indices = inputs
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(input_ids, meta):
            hidden = graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
        if not step.compute_logits:
            return None
        return self.model.compute_logits(hidden[logits_indices])

    def prepare_batch(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """(input ids [T], positions [T], metadata, logits indices) of the scheduled chunks, on the device."""
        return self.upload_batch(self.prepare_host_batch(out))

    def prepare_host_batch(self, out: SchedulerOutput) -> HostBatch:
        """Flatten the scheduled chunks into `[T]` tokens plus the metadata of DESIGN.md. A request
        with draft tokens feeds them after its last token (query length 1 + k) and wants the
        logits of all 1 + k positions. A decode step (`out.decode`) is its columns: no
        per-request object is read."""
        if out.decode is not None:
            decode = out.decode
            tables = self.block_tables.gather_decode(decode)
            return build_host_batch(decode.token_ids, decode.positions, tables, self.block_size)
        scheduled = out.scheduled
        starts = [s.num_computed_tokens for s in scheduled]
        tables = self.block_tables.gather(scheduled)
        token_ids, query_lens, num_logits = [], [], []
        for s in scheduled:
            start, spec = s.num_computed_tokens, s.spec_token_ids
            token_ids += s.request.all_token_ids[start : start + s.num_new_tokens]
            token_ids += spec
            query_lens.append(s.num_new_tokens + len(spec))
            num_logits.append(1 + len(spec) if s.samples else 0)
        return build_host_batch(token_ids, starts, tables, self.block_size, query_lens, num_logits)

    def prepare_chunks(self, chunks: list[BatchChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata,
                                                                torch.Tensor]:
        """(input ids [T], positions [T], metadata, logits indices) of one flattened batch."""
        return self.upload_batch(self.host_chunks(chunks))

    def host_chunks(self, chunks: list[BatchChunk]) -> HostBatch:
        """One flattened batch's tensors, on the host."""
        return build_host_batch(
            list(chain.from_iterable(c.token_ids for c in chunks)), [c.start for c in chunks],
            pad_tables([c.block_ids for c in chunks]), self.block_size, [len(c.token_ids) for c in chunks],
            [c.num_logits for c in chunks],
        )

    def upload_batch(self, b: HostBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        upload = self._upload
        meta = AttentionMetadata(
            query_start_loc=upload(b.query_start_loc), seq_lens=upload(b.seq_lens),
            block_tables=upload(b.block_tables), slot_mapping=upload(b.slot_mapping),
            max_query_len=b.max_query_len, max_seq_len=b.max_seq_len,
        )
        return upload(b.input_ids), upload(b.positions), meta, upload(b.logits_indices)

    @torch.inference_mode()
    def greedy_next(self, chunks: list[BatchChunk]) -> list[int]:
        """One forward over `chunks` (each wanting one logit row, its last token's); the argmax of
        each. The draft proposer's step: it writes this runner's own KV pool."""
        input_ids, positions, meta, logits_indices = self.prepare_chunks(chunks)
        hidden = self.model(input_ids, positions, meta, self.kv_caches)
        return argmax_rows(self.model.compute_logits(hidden[logits_indices])).tolist()

    def _upload(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runner's device. On CUDA: staged in pinned memory and copied with
        non_blocking, so the host goes on building the step while the copy runs (the caching host
        allocator keeps the staging buffer until the copy is done). On the CPU: the tensor itself."""
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _swap(self, out: SchedulerOutput | Step) -> None:
        """Swap-outs first: a device block freed by a swap-out may be swapped into this step.
        Copy-on-writes next: their sources are read before any swap-in can reuse a freed one."""
        if out.blocks_to_swap_out:
            dev_ids, host_ids = _split_pairs(out.blocks_to_swap_out)
            self.host_buffer[:, :, host_ids] = self.kv_buffer[:, :, dev_ids.to(self.device)].cpu()
        if out.blocks_to_copy:
            src_ids, dst_ids = _split_pairs(out.blocks_to_copy)
            self.kv_buffer[:, :, dst_ids.to(self.device)] = self.kv_buffer[:, :, src_ids.to(self.device)]
        if out.blocks_to_swap_in:
            host_ids, dev_ids = _split_pairs(out.blocks_to_swap_in)
            self.kv_buffer[:, :, dev_ids.to(self.device)] = self.host_buffer[:, :, host_ids].to(self.device)


def _split_pairs(pairs: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src, dst = zip(*pairs)
    return torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64)
