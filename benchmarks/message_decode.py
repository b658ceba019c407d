"""Wire-message decode cost per streamed token: a `TokenBatch` of N tokens, msgpack bytes to a
validated message, as the router decodes every batch a decode node sends (the fast path: msgspec
on the columnar batch; `--slow` times the pure-Python validator that judges what msgspec refuses).
Median of 5 runs.

    python -m benchmarks.message_decode --tokens-per-batch 64 --batches 300
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from pdserve.bench.json_out import report
from pdserve.protocol.messages import Token, TokenBatch, _decode_slow, decode, encode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens-per-batch", type=int, default=64)
    p.add_argument("--batches", type=int, default=300, help="batches decoded per run")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--slow", action="store_true", help="time the pure-Python validator instead")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    n = args.tokens_per_batch
    batch = TokenBatch.from_tokens("d0", [Token(request_id=f"cmpl-{i}", index=i, token_id=i, logprobs=None,
                                                finish_reason=None) for i in range(n)])
    data = encode(batch)
    decode_fn = _decode_slow if args.slow else decode
    per_token = []
    for _ in range(args.runs):
        start = time.perf_counter()
        for _ in range(args.batches):
            decode_fn(data)
        per_token.append((time.perf_counter() - start) / (args.batches * n))
    result = {"tokens_per_batch": n, "bytes_per_batch": len(data), "decode_us_per_token": statistics.median(per_token) * 1e6,
              "runs_us_per_token": [t * 1e6 for t in per_token], "args": vars(args)}
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
