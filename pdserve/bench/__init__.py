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
- The prefix-cache workloads: `conversations.py` runs multi-turn conversations (`--dataset-name
  conversation`: each turn's prompt is the previous prompt, its reply and a new user message, in token
  ids, with a think time between turns), `datasets.py` builds `system-prompt` (a few long system
  prompts shared by many users). `prefix_metrics.py` adds their figures to the summary: the prefix hit
  rate the server reports (`usage.prompt_tokens_details.cached_tokens`), the oracle's
  (`prefix_oracle.py`: the run's exact token ids replayed through one pooled LRU prefix cache the size
  of the fleet's KV pools), recomputed tokens and KV bytes received per request (`fleet_probe.py`
  reads the router's `GET /nodes` and the nodes' Prometheus counters), TTFT of first vs follow-up turns.

The harness that starts a local stack or the compose stack for the benchmarks and the end-to-end
tests is not installed with the package: `benchmarks/harness/`.
"""
