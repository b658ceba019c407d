"""The AMX GEMM's kernels at a base commit against the tree's, both compiled modules loaded in one
process and taking turns (issue 13, thirteenth part: the epilogue stored during the next block's
tile steps).

    python benchmarks/results/thirteenth/tiles_ab.py BASE gemm 512,16          one call per shape
    python benchmarks/results/thirteenth/tiles_ab.py BASE decode BATCH CONTEXT  engine steps, 5 a turn
    python benchmarks/results/thirteenth/tiles_ab.py BASE prefill TOKENS ROUNDS one prefill step a turn

BASE: a commit (fa8e394 for the thirteenth part, 4371e2f for the fourteenth), or COMMIT:FLAGS, the
sources built with those preprocessor flags (tree:-DPDSERVE_NO_Y_PREFETCH: the tree without one
part). Prints base and tree medians and tree / base.
"""

import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load as load_extension

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # the repository root: benchmarks
from benchmarks.decoding import start_decodes  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.parallel.layers import Tiles  # noqa: E402
from pdserve.kernels import cpu_native  # noqa: E402


def build_at(spec: str):
    """The compiled module from the kernel sources at a commit, under another module name. `spec`:
    COMMIT, or COMMIT:FLAG,FLAG with preprocessor flags to build it with (tree: the working tree's
    sources), e.g. tree:-DPDSERVE_NO_Y_PREFETCH."""
    commit, _, flags = spec.partition(":")
    work = Path(tempfile.mkdtemp(prefix="tiles_ab_"))
    for name in ("cpu_decode.cpp", "cpu_amx.cpp", "cpu_amx.h", "cpu_lanes.h", "cpu_amx_tiles.h", "cpu_amx_attention.cpp"):
        if commit == "tree":
            source = (ROOT / "pdserve" / "kernels" / name).read_bytes()
        else:
            source = subprocess.check_output(["git", "-C", str(ROOT), "show", f"{commit}:pdserve/kernels/{name}"])
        (work / name).write_bytes(source)
    sources = [str(work / Path(p).name) for p in cpu_native.cpp_sources()]
    return load_extension("tiles_ab_base", sources, extra_cflags=cpu_native.compile_flags() + [f for f in flags.split(",") if f],
                          extra_ldflags=["-fopenmp"], build_directory=str(work), verbose=False)


mods = {"base": build_at(sys.argv[1]), "tree": cpu_native.load()}
mode = sys.argv[2]
torch.set_num_threads(2)
torch.manual_seed(0)
times: dict[str, list[float]] = {k: [] for k in mods}

if mode == "gemm":
    for M in (int(x) for x in sys.argv[3].split(",")):
        for K, N, silu in ((576, 960, False), (576, 576, False), (576, 3072, True), (1536, 576, False)):
            w = torch.randn(N, K, dtype=torch.bfloat16) * 0.05
            tiles = Tiles(mods["tree"], w, silu=silu).tiles
            x = torch.randn(M, K, dtype=torch.bfloat16)
            calls = {k: (lambda m=m, x=x, tiles=tiles, N=N: m.gemm_tiles_silu(x, tiles, N)) if silu else
                     (lambda m=m, x=x, tiles=tiles, N=N: m.gemm_tiles(x, tiles, N, None, True)) for k, m in mods.items()}
            assert torch.equal(calls["base"](), calls["tree"]()), "the same bits"
            spent = {k: [] for k in mods}
            for r in range(40):
                for k in ("base", "tree") if r % 2 else ("tree", "base"):
                    start = time.perf_counter()
                    calls[k]()
                    spent[k].append(time.perf_counter() - start)
            b, t = (1e6 * statistics.median(spent[k]) for k in ("base", "tree"))
            print(f"M {M} K {K} N {N}{' (SiLU x up)' if silu else ''}: base {b:.0f} us, tree {t:.0f} us, tree / base {t / b:.3f}")
    sys.exit(0)

n = int(sys.argv[3])
if mode == "decode":
    batch = n
    ctx = int(sys.argv[4])
    llm = LLM("smollm2", dtype="bfloat16", num_threads=2, block_size=16, skip_tokenizer_init=True, max_num_seqs=batch,
              num_kv_blocks=batch * (ctx // 16 + 30), max_model_len=ctx + 450)
else:
    llm = LLM("smollm2", dtype="bfloat16", num_threads=2, max_num_seqs=1, block_size=16, num_kv_blocks=n // 16 + 8,
              max_num_batched_tokens=n, skip_tokenizer_init=True, max_model_len=n + 2)
engine = llm.engine
every_tiles = [o for o in gc.get_objects() if isinstance(o, Tiles)]


def use(name: str) -> None:
    """The layers' GEMMs (their Tiles) and the compiled decode loop from module `name`."""
    module = mods[name]
    cpu_native._state["module"] = module
    for t in every_tiles:
        t.gemm = module.gemm_tiles_silu if t.silu else module.gemm_tiles
    engine.runner.model.forget_direct_gemms()


try:
    if mode == "decode":
        start_decodes(engine, batch, ctx, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        for i in range(300):
            name = ("base", "tree")[(i // 5) % 2]
            if i % 5 == 0:
                use(name)
            start = time.perf_counter()
            engine.step()
            if i % 5:  # the first step after a switch is left out
                times[name].append(time.perf_counter() - start)
        label = f"decode batch {batch} context {ctx}"
    else:
        g = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for r in range(int(sys.argv[4])):
            for name in ("base", "tree") if r % 2 else ("tree", "base"):
                use(name)
                engine.add_request(torch.randint(engine.model_config.vocab_size, (n,), generator=g).tolist(), params)
                start = time.perf_counter()
                engine.step()
                assert not engine.has_unfinished(), "the prompt is prefilled in one step"
                if r:  # the first round is left out
                    times[name].append(time.perf_counter() - start)
        label = f"prefill {n}"
finally:
    llm.close()
b, t = (1e3 * statistics.median(times[k]) for k in ("base", "tree"))
print(f"{label}: base {b:.2f} ms, tree {t:.2f} ms, tree / base {t / b:.3f}")
