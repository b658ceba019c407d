"""The model's ops, each dispatched by device (custom_op.CustomOp: forward_native, the torch
reference; forward_cpu, the compiled CPU kernels of kernels/cpu_native.py; forward_cuda), and the
choice of GEMM a linear layer runs (linear.py).

    layer_ops.py  AddRMSNorm (residual add + RMSNorm), SiluMul (SiLU x up)
    rotary.py     the RoPE tables and rows; RopeStoreKV (RoPE on q and k, k and v into the KV cache)
    argmax.py     ArgmaxRows (greedy sampling)
    linear.py     PackedLinear and cpu_linear: F.linear, oneDNN, the panels' or the AMX tiles' GEMM

Attention has its own dispatch below this package (kernels/dispatch.py: paged_attention by device);
the compiled decode step through a model's layers is dispatched in one place (models/llama.py:
LlamaForCausalLM.decode_rest).
"""
