"""`pdserve bench serve`: a load generator for any OpenAI-compatible endpoint, after `vllm bench serve`.

One paragraph per module:

- `datasets.py` builds the `SampleRequest`s: random token ids (or random text for chat) with vLLM's
  length semantics, or the first human turn of each ShareGPT conversation.
- `arrivals.py` turns a request rate and a burstiness into arrival offsets (gamma-distributed gaps;
  burstiness 1 is a Poisson process, `inf` sends everything at once).
- `client.py` sends one streaming request and measures it into a `RequestRecord`
  (`request_record.py`): TTFT, the inter-token gaps (a chunk of k tokens gives k), end-to-end
  latency, output tokens.
- `runner.py` releases the requests at their arrival offsets under a concurrency cap, with warm-ups,
  a progress bar, and Ctrl-C keeping what finished.
- `metrics.py` reduces the records to the summary (throughputs, mean/median/std/percentiles, goodput
  under SLOs); `report.py` prints it as vLLM's table and writes the JSON; `plots.py` draws CDFs and
  sweep curves with matplotlib's Agg backend (the `pdserve[bench]` extra).
- `hf_static.py` measures transformers' static batching into the same records, the floor that
  `benchmarks/compare.py` sets beside the disaggregated and colocated stacks.
- `chaos.py` kills or freezes random nodes during a run (`--chaos-interval`) and reports every
  request's fate; `json_out.py` writes strict JSON.

The harness that starts a local stack or the compose stack for the benchmarks and the end-to-end
tests is not installed with the package: `benchmarks/harness/`.
"""
