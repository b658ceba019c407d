"""CUDA graphs for decode steps: one captured forward per batch-size bucket.

A decode step runs one token per request, so on a fast GPU a small model's step time is mostly
the launch overhead of its few hundred small kernels. A CUDA graph records those launches once
and replays them with one call. A graph replays the addresses and shapes it was captured with,
so a decode batch of n requests runs through static buffers:

    rows:    0 .. n-1            n .. B-1                  (B = the smallest bucket >= n)
             the real requests   padding requests: token 0 at position 0, slot -1 (the K/V
                                 write is skipped), seq_len 1 over block 0 (attention reads
                                 valid memory); their outputs are discarded

The host ints that size kernel launches are fixed at capture: max_query_len 1 and max_seq_len =
max_model_len. Both are upper bounds to the kernels, which walk each request's own seq_len. The
Triton decode plans its split from max_seq_len, so it gets partitions past every sequence that
read nothing (tests/kernels checks the result is unchanged); the cost is that a small batch of
short sequences may use fewer busy partitions than eager would plan. query_start_loc never changes
(one query per row) and is written once.

On the CPU nothing is captured: init_decode_graphs (the engine calls it only on CUDA, tests call
it on the CPU) runs the same padded forward eagerly, so CPU tests cover the padding and the
buffers; only capture and replay need a GPU. Logits and sampling stay outside, on the first n rows.
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.engine.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# Larger decode batches are compute-bound enough that launch overhead no longer matters (vLLM's
# default cap too); they run eagerly, and their buffers would cost memory for nothing.
_MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch buckets: 1, 2, 4, 8, then multiples of 8, and the largest batch itself, so every
    batch up to min(max_num_seqs, 512) pads to a bucket less than 8 rows larger."""
    largest = min(max_num_seqs, _MAX_CAPTURE_SIZE)
    return [s for s in (1, 2, 4, *range(8, largest, 8)) if s < largest] + [largest]


class DecodeGraphs:
    """Static decode buffers, the captured graphs (CUDA only) and how to run a batch through them."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], *,
                 max_num_seqs: int, max_model_len: int, block_size: int, device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches  # the graphs bake in these addresses: the pool must never move
        self.batch_sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.device = device
        max_batch = self.batch_sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        i32 = {"dtype": torch.int32, "device": device}
        # Every row starts as padding; run() overwrites the first n rows and re-pads up to B.
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [max_batch]
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)  # [max_batch]
        self.query_start_loc = torch.arange(max_batch + 1, **i32)  # [max_batch + 1]: row s is request s
        self.seq_lens = torch.ones(max_batch, **i32)  # [max_batch]
        self.block_tables = torch.zeros(max_batch, self.max_blocks, **i32)  # [max_batch, max_blocks]
        self.slot_mapping = torch.full((max_batch,), -1, **i32)  # [max_batch]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> its graph's hidden states [B, hidden]
        self.num_replays = 0

    def bucket(self, num_seqs: int) -> int:
        """The smallest batch size >= num_seqs that has buffers (and on CUDA a graph)."""
        return next(size for size in self.batch_sizes if size >= num_seqs)

    def can_run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Pure decode (one token per request: T == S and no query longer than 1) that fits."""
        num_seqs, width = meta.block_tables.shape
        return (input_ids.shape[0] == num_seqs <= self.batch_sizes[-1] and meta.max_query_len == 1
                and width <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode batch of n requests (check can_run first).

        On CUDA the result is a view of the graph's output, valid until the next run."""
        num_seqs = input_ids.shape[0]
        size = self.bucket(num_seqs)
        self._load(input_ids, positions, meta, size)
        graph = self.graphs.get(size)
        if graph is None:
            return self._forward(size)[:num_seqs]
        graph.replay()
        self.num_replays += 1
        return self.outputs[size][:num_seqs]

    def _load(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy the batch into rows :n and make rows n:size padding. Device-side copies only.

        Block table columns past the batch's width keep older values: no kernel reads a row past
        its seq_len, and each row's seq_len is rewritten here."""
        n, width = meta.block_tables.shape
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.seq_lens[n:size].fill_(1)
        self.slot_mapping[n:size].fill_(-1)  # a stale slot here would overwrite a live request's K/V
        self.block_tables[n:size, 0].zero_()

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` rows of the buffers: what a graph records."""
        meta = AttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
        )
        return self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)

    def capture(self) -> None:
        """One graph per bucket, largest first so the smaller ones fit in the memory pool it grew.

        Every row is padding while capturing (slot -1), so capture writes no K/V."""
        start = time.perf_counter()
        with torch.cuda.device(self.device):
            pool = torch.cuda.graph_pool_handle()  # shared: only one graph runs at a time
            for size in reversed(self.batch_sizes):
                self._forward(size)  # warm-up: Triton compiles and the allocator grows outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
            torch.cuda.synchronize()
        logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.graphs), _short(self.batch_sizes), time.perf_counter() - start)


def _short(sizes: list[int]) -> str:
    return ", ".join(map(str, sizes)) if len(sizes) <= 6 else f"{sizes[0]}, {sizes[1]}, ..., {sizes[-1]}"
