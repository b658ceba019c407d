"""The engine loop shared by the offline API and the nodes: schedule, run, postprocess.

    step():  out = scheduler.schedule()          # which tokens of which requests, which blocks
             sampled = runner.execute(out)       # one forward over the flattened batch + sampling
             finished = scheduler.postprocess()  # append tokens, stop checks, release blocks
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from time import perf_counter

import torch

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.kv_tier import BlockTier, KVTier, make_tier
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import FINISHED, Request, RequestStatus
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.scheduler_output import SchedulerOutput
from pdserve.engine.step_timings import StepTimings

logger = logging.getLogger(__name__)
_GIB = 1 << 30


@dataclass
class CompletionOutput:
    """One output sequence of a request (vLLM's name): choice `index` of its n."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # ends with the EOS / stop token that ended the request, as transformers' generate
    text: str  # without special tokens and stop strings
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = None  # one {token_id: logprob} per output token
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt: str | None = None
    metrics: dict = field(default_factory=dict)
    # Every choice, index i at i (vLLM's RequestOutput.outputs); the fields above are choice 0's.
    outputs: list[CompletionOutput] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.token_ids, self.text, self.finish_reason, self.logprobs)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer=None, kv_allocator=None) -> None:
        """`kv_allocator(shape, dtype, device) -> Tensor | SharedKVPool` places the KV pool (a
        prefill node puts it in shared memory so a decode node on the same host can map it);
        default torch.zeros. With tensor_parallel_size > 1 this process is rank 0 and starts the
        other ranks; `close()` stops them (so does interpreter exit)."""
        self.config = config
        self.tokenizer = tokenizer
        threads = config.num_threads
        if config.tensor_parallel_size > 1:
            from pdserve.engine.parallel.executor import threads_per_rank

            threads = threads_per_rank(config)  # --num-threads is per rank; default: the CPUs split
        if threads:
            torch.set_num_threads(threads)
        self.model_config = ModelConfig.from_pretrained(config.model_path)
        self.runner = ModelRunner(config, self.model_config, self._model_len_limit())
        self.timings: StepTimings = self.runner.timings  # the last step's phases (engine/step_timings.py)
        self.last_output: SchedulerOutput | None = None  # the last step's schedule (step_requests)
        try:
            num_blocks, num_host_blocks = self._start_pools(kv_allocator)
        except BaseException:
            self.runner.close()
            raise
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            num_host_blocks=num_host_blocks,
        )
        # The tier below the pool (--kv-offload): its counters are `kv_tier`'s (engine/kv_tier.py).
        self.kv_tier: KVTier | None = None
        try:
            self._start_tier()
        except BaseException:
            self.close()
            raise
        sched_config = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            scheduling_policy=config.scheduling_policy,
            sjf_length_factor=config.sjf_length_factor,
            sjf_aging_s=config.sjf_aging_s,
            num_lookahead_tokens=config.speculative_config.num_speculative_tokens if self.proposer else 0,
        )
        self.scheduler = Scheduler(sched_config, self.block_manager, self.model_config.eos_token_ids)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._ids = itertools.count()
        logger.info("engine ready: %d KV blocks of %d tokens, %d host blocks, dtype %s, max_model_len %d, "
                    "tensor parallel size %d", num_blocks, config.block_size, num_host_blocks, config.torch_dtype,
                    config.max_model_len, config.tensor_parallel_size)

    def _start_tier(self) -> None:
        """--kv-offload: a host or disk tier of `kv_offload_gb` for blocks evicted from the pool
        (and a draft model's pool: the same block ids), attached to the block manager."""
        config = self.config
        if config.kv_offload == "none":
            return
        pools = [self.runner.kv_buffer]
        draft = getattr(self.proposer, "runner", None)  # a draft model's runner (ngram has none)
        if draft is not None:
            pools.append(draft.kv_buffer)
        tier = make_tier(config.kv_offload, BlockTier.block_bytes(pools), config.kv_offload_gb,
                         directory=config.kv_offload_dir, pin_memory=self.runner.device.type == "cuda")
        self.kv_tier = tier
        self.block_manager.attach_tier(BlockTier(tier, pools))
        logger.info("KV tier: %s, %d blocks of %d bytes (%.2f GiB)%s", config.kv_offload, tier.capacity,
                    tier.block_bytes, tier.capacity_bytes / _GIB,
                    f" in {tier.directory}" if config.kv_offload == "disk" else "")

    def _start_pools(self, kv_allocator) -> tuple[int, int]:
        """The proposer, the KV pools (every rank's) and, on CUDA, the decode graphs."""
        config = self.config
        self.proposer = self._make_proposer()  # speculative decoding's proposer, or None
        num_blocks, num_host_blocks = self._size_pools()
        # A lone request must always fit the pool, or preemption could never make room for it.
        config.max_model_len = min(self.runner.max_model_len, num_blocks * config.block_size)
        self.runner.allocate_kv(num_blocks, num_host_blocks, kv_allocator)
        if self.proposer is not None:
            self.proposer.allocate_kv(num_blocks)  # a draft model's pool: the same block ids
        if config.use_cuda_graphs:  # at start-up, not on the first request; logs the capture time
            self.runner.init_decode_graphs(config.max_model_len)
        return num_blocks, num_host_blocks

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks and leave their process group, and delete a disk
        KV tier's file (idempotent). A second engine in this process can start after it."""
        self.runner.close()
        tier = getattr(self, "kv_tier", None)
        if tier is not None:
            tier.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _size_pools(self) -> tuple[int, int]:
        """(device KV blocks, host swap blocks): as asked, else from the memory settings. On CUDA
        each rank's device holds its own pool, so the profile sizes one rank's; on the CPU the
        ranks share the host's memory, so kv_cache_memory_gb and swap_space_gb hold every rank's."""
        cfg = self.config
        bytes_per_block = self.runner.kv_bytes_per_block()  # one rank's pool
        if self.proposer is not None:  # a draft model's KV sits in blocks of the same ids
            bytes_per_block += self.proposer.kv_bytes_per_block()
        node_bytes_per_block = bytes_per_block * cfg.tensor_parallel_size
        num_blocks = cfg.num_kv_blocks
        if num_blocks is None and cfg.device.startswith("cuda"):
            num_blocks = self.runner.profile_num_kv_blocks(bytes_per_block, cfg.gpu_memory_utilization)
        elif num_blocks is None:
            num_blocks = max(1, int(cfg.kv_cache_memory_gb * _GIB // node_bytes_per_block))
        return num_blocks, int(cfg.swap_space_gb * _GIB // node_bytes_per_block)

    def _model_len_limit(self) -> int:
        """The longest sequence this model serves here (before the pool size caps it)."""
        mc, cfg = self.model_config, self.config
        limit = mc.max_position_embeddings
        if mc.sliding_window:
            limit = min(limit, mc.sliding_window)  # no sliding-window attention: stay inside the window
        if cfg.max_model_len is not None and cfg.max_model_len > limit:
            raise ValueError(f"max_model_len={cfg.max_model_len} exceeds the model's limit of {limit} tokens")
        return cfg.max_model_len or limit

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str | None = None,
                    priority: int = 0, num_prior_output_tokens: int = 0) -> str:
        """Queue a request; `num_prior_output_tokens` > 0 continues one: the prompt's last n tokens
        were generated by an earlier attempt (seeded draws and penalties go on from there)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise ValueError(f"request {request_id}: prompt token ids must be in [0, {vocab})")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"request {request_id}: n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        request = Request(request_id, list(prompt_token_ids), params, priority=priority,
                          num_prior_output_tokens=num_prior_output_tokens)
        self.scheduler.add_request(request)
        if self.tokenizer is not None:
            self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop)
        return request_id

    def abort(self, request_id: str) -> list[Request]:
        """Abort a request (an n > 1 request: every choice still held); returns those aborted."""
        aborted = self.scheduler.abort(request_id)
        for request in aborted:
            self.detokenizers.pop(request.request_id, None)
        self.detokenizers.pop(request_id, None)
        return aborted

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def warm_up(self) -> None:
        """Run one tiny request (a prefill and a decode step) so that lazy start-up costs (allocator
        growth, kernel compilation, a CUDA context) do not land on the first real request. The
        counters it moved are put back, so metrics show real traffic only."""
        bm, sched = self.block_manager, self.scheduler
        saved = (bm.num_prefix_queries, bm.num_prefix_hits, sched.num_preemptions, sched.num_prompt_tokens_computed,
                 sched.num_tokens_sampled)
        self.add_request([0, 1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                         request_id="pdserve-warm-up")
        while self.has_unfinished():
            self.step_requests()
        (bm.num_prefix_queries, bm.num_prefix_hits, sched.num_preemptions, sched.num_prompt_tokens_computed,
         sched.num_tokens_sampled) = saved

    # ---- one iteration ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs for requests that finished in it."""
        stepped = self.step_requests()
        start = perf_counter()
        if self.detokenizers:  # stop strings need text; without a tokenizer there is none
            for request in stepped:
                # Finished ones too: their last tokens' text (and a stop string in it) counts.
                if self._hit_stop_string(request):
                    if request.is_finished:  # by length or a stop token, blocks already released
                        request.status = RequestStatus.FINISHED_STOPPED
                    else:
                        self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        outputs = [self._output(r) for r in stepped if r.status in FINISHED]
        spent = perf_counter() - start
        self.timings.output += spent
        self.timings.total += spent
        return outputs

    def step_requests(self) -> list[Request]:
        """Run one iteration; returns every request that got a new token in it (finished ones
        included, their blocks already released). The nodes stream from this. `timings` says
        where the time went."""
        timings = self.timings
        start = perf_counter()
        out = self.scheduler.schedule()
        if self.proposer is not None:
            self.proposer.propose(out)  # draft tokens into the lookahead slots the scheduler gave
        timings.schedule = perf_counter() - start
        sampled = self.runner.execute(out)  # fills timings.prepare, .forward, .sample
        executed = perf_counter()
        self.scheduler.postprocess(out, sampled)
        for parent_id, children in out.forked.items():  # n > 1 requests forked: the choices stream from now on
            self._fork_detokenizers(parent_id, children)
        end = perf_counter()
        timings.output = end - executed
        timings.total = end - start
        self.last_output = out  # what the step ran (the nodes' step samples read it)
        return out.stepped

    def _fork_detokenizers(self, parent_id: str, children: list[Request]) -> None:
        parent = self.detokenizers.pop(parent_id, None)
        if parent is not None:
            for child in children:
                self.detokenizers[child.request_id] = IncrementalDetokenizer(
                    self.tokenizer, child.prompt_token_ids, child.params.stop)

    def _hit_stop_string(self, request: Request) -> bool:
        detok = self.detokenizers.get(request.request_id)
        if detok is None or not detok.stop:
            return False
        new = request.output_token_ids[len(request.output_token_ids) - max(1, request.num_new_output_tokens):]
        for i, token_id in enumerate(new):  # one at a time: a speculative step may append several
            detok.add_tokens([token_id])
            if detok.stopped:
                request.drop_last_outputs(len(new) - i - 1)  # as without speculation: end at the stop
                return True
        return False

    def _make_proposer(self):
        spec = self.config.speculative_config
        if spec is None:
            return None
        from pdserve.engine.spec_decode import make_proposer

        return make_proposer(spec, self.config, self.model_config, self.runner.max_model_len)

    @property
    def spec_stats(self):
        """Speculative decoding's counters (SpecDecodeStats): drafts, accepted, per position."""
        return self.scheduler.spec_stats

    def _output(self, request: Request) -> RequestOutput:
        detok = self.detokenizers.pop(request.request_id, None)
        text = ""
        if detok is not None:
            # Without stop strings nothing was decoded per step: decode once now.
            detok.add_tokens([] if detok.stop else request.output_token_ids, final=True)
            text = detok.text
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            finish_reason=request.finish_reason,
            logprobs=request.output_logprobs if request.params.logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            metrics={"num_preemptions": request.num_preemptions},
        )
