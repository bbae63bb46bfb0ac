"""Attention ops over the paged KV cache: plain-torch references, a fused C++ CPU decode kernel, and
Triton kernels (GPU).

Which path a model takes is resolved once (backend.py: 'triton', 'cpu' or 'torch', from the device and
FERRY_ATTENTION or EngineConfig.attention) and set on its attention layers; FERRY_ATTENTION=triton runs
the kernels on the CPU only together with TRITON_INTERPRET=1, which the tests use to run the whole model
through them. The Triton modules are imported only when used. On the 'cpu' path, decode attention
runs the fused C++ kernel (cpu_decode.py, compiled and cached on first use), and so do prefill chunks
of up to CHUNK_MAX_TOKENS tokens on a cached context, unless it cannot be built; then (and always on the
'torch' path, which FERRY_CPU_KERNELS=0 resolves to on the CPU) the plain-torch reference in
attention_ref.py runs. Longer chunks on a cached context (a new turn on a conversation's history) take
attention_ref.chunk_attention up to CHUNK_MATMUL_MAX_TOKENS tokens, then gather + SDPA. A whole new prompt
takes the C++ prefill kernel (cpu_prefill.py) where it applies (no window, fp32/bf16), else SDPA.
The same build holds the step's small fused ops (cpu_layers.py: RMSNorm, SiLU-and-mul, rotary, the
K/V write, the greedy argmax), which fall back to plain torch the same way; write_kv exported here is
that dispatching one.
"""

from ferry.kernels.attention_ref import (
    CHUNK_MATMUL_MAX_TOKENS,
    causal_mask,
    chunk_attention,
    decode_plan,
    gather_seq,
    paged_decode_attention,
    prefill_attention,
)
from ferry.kernels.backend import ATTENTION_BACKENDS, resolve_attention
from ferry.kernels.cpu_decode import (
    CHUNK_MAX_TOKENS,
    cpu_kernels_enabled,
    fused_chunk_attention,
    fused_decode_enabled,
    fused_paged_decode_attention,
    kernel_built,
)
from ferry.kernels.cpu_layers import rms_norm, rotary_, silu_and_mul, write_kv

__all__ = [
    "ATTENTION_BACKENDS",
    "CHUNK_MATMUL_MAX_TOKENS",
    "CHUNK_MAX_TOKENS",
    "causal_mask",
    "chunk_attention",
    "cpu_kernels_enabled",
    "decode_plan",
    "fused_chunk_attention",
    "fused_decode_enabled",
    "fused_paged_decode_attention",
    "gather_seq",
    "kernel_built",
    "paged_decode_attention",
    "prefill_attention",
    "resolve_attention",
    "rms_norm",
    "rotary_",
    "silu_and_mul",
    "write_kv",
]
