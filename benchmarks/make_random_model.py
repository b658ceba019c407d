"""Write a random-weight model of a known shape as a Hugging Face folder (safetensors), for
machines that cannot receive real weights (the GPU check).

    python benchmarks/make_random_model.py --shape llama-1b --dtype bfloat16 --out /tmp/llama1b
"""

from __future__ import annotations

import argparse
import sys

SHAPES = {
    # Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads, intermediate 8192, vocab 128256, tied embeddings.
    "llama-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     max_position_embeddings=4096, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001),
    # SmolLM2-135M: hidden 576, 30 layers, 9/3 heads, intermediate 1536, vocab 49152, tied embeddings.
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, bos_token_id=1,
                    eos_token_id=2),
}


def make(shape: str, out: str, dtype: str = "bfloat16", seed: int = 0) -> None:
    import torch
    import transformers

    config = transformers.LlamaConfig(**SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make(args.shape, args.out, args.dtype, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
