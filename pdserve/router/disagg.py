"""Per request: prefill on a prefill node and hand the KV over, or prefill on the decode node itself.

`--disagg-policy`:

    always   every request goes prefill node → decode node (the classic split; a "both" node
             chosen for prefill decodes it too, as before)
    never    every request is prefilled on the decode node that decodes it (colocated per
             request); prefill-role nodes get nothing, so the planner should move them to decode
    auto     per request, from the cost model below; `--local-prefill-max-tokens N` overrides
             it with a length rule: at most N prompt tokens local, longer ones remote

The cost model (auto). The decode node D is picked first, by load, as for any request. Then,
for a prompt of P tokens (all counted as uncached: the router does not see the caches yet), with
each node's step time fitted online from its heartbeats (router/speed.py):

    remote TTFT = prefill_s on the prefill node of (its outstanding prompt tokens + P)
                  (the first token comes from the prefill node, before the KV moves)
    handoff     = the KV transfer the second token waits for: P tokens at the measured rate
    local TTFT  = prefill_s on D of (its outstanding prompt tokens + P), chunked, each chunk
                  sharing its step with D's running batch
    local stall = how much longer each of D's decode steps takes while the chunks run: the
                  running requests' TPOT pays it

Local wins when its TTFT is lower than remote TTFT plus the handoff (both must include the
queue the request joins), and, when a TPOT SLO is set (`--slo-tpot-ms` with `--planner`), the
running requests' TPOT with the prompt's chunks in D's steps (each chunk step slower by the
chunk's cost, spread over a request's expected output tokens) stays within it. Past that the
request goes remote, unless remote would miss the TTFT SLO for sure while local meets it
("ttft_slo": a request whose first token is late misses the SLOs anyway). A node whose speed is not yet known (fewer steps seen than
speed.MIN_SAMPLES) is never chosen for a local prefill by auto: the classic split is the safe
default until there is data. With no ready prefill node at all, a request is prefilled on its
decode node whatever the policy but `always`, which answers 503 as before.

Cached prefixes (router/kv_index.py). Token counts above are the tokens each node has to
compute: the prompt less the prefix that node's cache holds. And whatever the policy, a prompt
whose prefix the chosen decode node holds, with at most `--cached-prefill-max-tokens` tokens
(default 256) left to compute, is prefilled there (`choose_cached`, reason "cached"): a
conversation's next turn computes only its new tokens, on the node that holds the history, and
no KV moves. 0 turns that off.

`choose` is a pure function of the node views it is given, so the fleet simulator
(benchmarks/fleet_sim.py) runs exactly this code.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.router.speed import StepModel

POLICIES = ("always", "never", "auto")
DEFAULT_CACHED_PREFILL_MAX_TOKENS = 256
DEFAULT_HANDOFF_S_PER_TOKEN = 2e-6  # before any hand-off was measured: a same-host copy of a small model's KV


@dataclass(frozen=True)
class NodeLoad:
    """What the cost model reads about one node."""

    node_id: str
    speed: StepModel
    outstanding_prompt_tokens: int  # queued or being prefilled there
    running: int  # decode sequences it runs
    context_tokens: float  # their context, total


@dataclass(frozen=True)
class PathChoice:
    local: bool
    reason: str  # for the log and the metrics' label: "policy", "length", "cost", "tpot_slo", "ttft_slo",
    # "no_prefill_node", "unknown_speed", "cached"
    remote_ttft_s: float | None = None
    local_ttft_s: float | None = None


@dataclass
class PathPolicy:
    policy: str = "always"
    local_prefill_max_tokens: int | None = None
    slo_tpot_s: float | None = None
    slo_ttft_s: float | None = None
    handoff_s_per_token: float = DEFAULT_HANDOFF_S_PER_TOKEN
    expected_output_tokens: float = 128.0  # a request's output, for the TPOT cost; the planner keeps it current
    cached_prefill_max_tokens: int = DEFAULT_CACHED_PREFILL_MAX_TOKENS

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--disagg-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.local_prefill_max_tokens is not None and self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if self.cached_prefill_max_tokens < 0:
            raise ValueError(f"--cached-prefill-max-tokens must be >= 0, got {self.cached_prefill_max_tokens}")

    def choose_cached(self, prompt_tokens: int, decode_cached: int, decode_queue_full: bool = False) -> PathChoice | None:
        """Local ("cached") when the decode node holds a prefix of the prompt and at most
        `cached_prefill_max_tokens` are left to compute there; None: no opinion."""
        if decode_queue_full or decode_cached <= 0 or self.cached_prefill_max_tokens <= 0:
            return None
        if prompt_tokens - decode_cached > self.cached_prefill_max_tokens:
            return None
        return PathChoice(True, "cached")

    def choose(self, prompt_tokens: int, decode: NodeLoad, prefill: NodeLoad | None, *,
               decode_cached: int = 0, prefill_cached: int = 0) -> PathChoice:
        """Local (prefill on `decode`) or remote (on `prefill`; None: no ready prefill node).
        `decode_cached`/`prefill_cached`: leading prompt tokens each node's cache holds."""
        if prefill is None:
            return PathChoice(True, "no_prefill_node")
        if self.policy == "never":
            return PathChoice(True, "policy")
        cached = self.choose_cached(prompt_tokens, decode_cached)
        if cached is not None:
            return cached
        if self.policy == "always":
            return PathChoice(False, "policy")
        local_tokens, remote_tokens = prompt_tokens - decode_cached, prompt_tokens - prefill_cached
        if self.local_prefill_max_tokens is not None:
            return PathChoice(local_tokens <= self.local_prefill_max_tokens, "length")
        if not decode.speed.known:
            return PathChoice(False, "unknown_speed")
        remote = prefill.speed.prefill_s(prefill.outstanding_prompt_tokens + remote_tokens)
        handoff = self.handoff_s_per_token * prompt_tokens  # the whole prompt's KV moves
        d = decode.speed
        local = d.prefill_s(decode.outstanding_prompt_tokens + local_tokens, decode_seqs=decode.running,
                            context_tokens=decode.context_tokens)
        if self.slo_tpot_s is not None and decode.running > 0:
            # The running requests' TPOT with this prompt's chunks in D's steps: each chunk step is
            # slower by (mixed - base), spread over a request's output tokens.
            base = d.decode_step_s(decode.running, decode.context_tokens)
            mixed = d.step_s(min(local_tokens, d.chunk), decode.running, decode.context_tokens)
            chunks = -(-(decode.outstanding_prompt_tokens + local_tokens) // max(1, d.chunk))
            tpot = base + chunks * (mixed - base) / max(1.0, self.expected_output_tokens)
            rescue = (self.slo_ttft_s is not None and remote > self.slo_ttft_s >= local)
            if tpot > self.slo_tpot_s and not rescue:
                return PathChoice(False, "tpot_slo", remote, local)
            if tpot > self.slo_tpot_s:  # remote would miss its TTFT target for sure: local may not
                return PathChoice(True, "ttft_slo", remote, local)
        return PathChoice(local < remote + handoff, "cost", remote, local)

    def observe_handoff(self, prompt_tokens: int, seconds: float) -> None:
        """A measured hand-off (first token sent → KV in the decode node's pool): moves the estimate."""
        if prompt_tokens > 0 and 0 < seconds < 60:
            self.handoff_s_per_token += 0.1 * (seconds / prompt_tokens - self.handoff_s_per_token)
