"""The layers of a pure-decode CPU step (small batches and, on AMX, bf16-copy ones), every kernel call bound once.

At batch 1-8 a SmolLM2 decode step spent ~5 ms of its 15.5 ms (batch 1, 1 thread, 2-core Xeon) outside the
kernels: nn.Module calls, the per-call checks of each wrapper (dtype, device, strides, which matmul path),
views and splits, ~32 Python-level calls and ~960 torch ops per step. A step whose every row decodes one
token (no prefill rows) with int4/int8 weights that multiply through the int8-activation kernel
(QuantLinear.dot_call) needs none of those decisions per call: they are taken once here, when the model is
first stepped, into a LayerCalls per layer (the ops and their bound arguments), and run() hands the whole
loop to one C++ op (csrc/decode_layers.cpp; CPP_LOOP) or, with FERRY_DECODE_CPP_LOOP=0, calls the ops from
Python. The ops and their order are exactly those of CausalLM._cpu_layers, so the results are identical
(tests/unit/test_decode_calls.py compares them bit for bit). Measured in one call, alternating
(ops/bench/throughput/reports/20261205x-xeon-step-host): the step at batch 1 / 4 / 8 went from 15.5 / 21.6 /
28.8 ms to 10.7 / 16.6 / 23.6 ms, of which ~10.2 / 16.4 / 23.7 ms (profiled) is now inside the kernels.

Steps of BF16_COPY_FROM_ROWS+ rows (16+ on AMX by default), whose matmuls go through each QuantLinear's bf16 copy
(ferry_cpu::bf16_amx_linear, or without AMX ferry_cpu::bf16_dot_linear: quant_linear.copy_op), run the same way
with the copy variant of each matmul, picked per step (the row count
decides, as in QuantLinear.forward): q/k/v and o_proj hand fp32 rows on, and with quant_linear.BF16_ACTIVATIONS
gate/up -> SiLU-and-mul -> down stays bf16 as in GatedMLP.forward (else fp32), so those steps' logits are the general
path's bit for bit too. They were ~48% of the SmolLM2 burst's engine time (126 steps of ~36 ms, ~8 ms of it host);
measured in one call, alternating (ops/bench/throughput/reports/20261205x-xeon-step-host-large, 1 thread), the step at
batch 16 / 32 / 48 went from 40.6 / 54.4 / 67.9 ms to 33.2 / 46.2 / 59.3 ms (profiled kernel time ~33 / 47 / 62 ms
either way: what went is host time), and `ferry up` on the 48 burst from 475 / 492 to 527 / 548 output tok/s (two
calls, +11%), 0.78 -> 0.86-0.87 of the in-process engine's.

decode_calls() returns None, and the model keeps its general path, for anything else: float weights, biases,
MoE/MLA layers, a backend other than 'cpu', or a kernel build that failed; takes() refuses caches of other dtypes,
batches that the per-call bf16 matmul would multiply (BF16_FROM_ROWS, 512+ rows on AMX, where there is no copy), and
batches of BF16_COPY_FROM_ROWS+ rows unless every projection holds a copy packed for our kernels (not one packed
for oneDNN, FERRY_QUANT_BF16_AMX=0 or FERRY_QUANT_BF16_DOT_GEMM=0, nor a model past FERRY_QUANT_BF16_COPY_MAX_MB
whose later layers hold none).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import torch

from ferry.kernels import cpu_decode
from ferry.kernels import quant_linear as qkernels
from ferry.kernels.cpu_decode import SUPPORTED_CACHE_DTYPES, kernel_built
from ferry.model.attention_meta import AttentionMetadata
from ferry.model.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from ferry.model.causal_lm import CausalLM, DecoderLayer


@dataclass(frozen=True, slots=True)
class LayerCalls:
    layer: int
    qkv: tuple
    """(op, arguments after x) of the fused q/k/v projection; likewise o, gate_up, down."""
    o: tuple
    gate_up: tuple
    down: tuple
    post_norm: tuple[torch.Tensor, float]
    """(weight, eps) of post_attention_layernorm."""
    next_norm: tuple[torch.Tensor, float]
    """(weight, eps) of the next layer's input_layernorm, or of the final norm after the last layer."""
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    window: int
    copies: tuple[torch.Tensor, ...] | None = None
    """The bf16 copies (QuantLinear.bf16_copy, packed for csrc/bf16_amx.h and csrc/bf16_dot.h: 6-D) of qkv, o,
    gate_up, down, where all four hold one in that layout, else None."""


CPP_LOOP = os.environ.get("FERRY_DECODE_CPP_LOOP", "1") != "0"
"""run() hands the whole layer loop to one C++ op (csrc/decode_layers.cpp: the same ops through the dispatcher, no
GIL held); FERRY_DECODE_CPP_LOOP=0 (read once at import) keeps the loop in Python, calling the same ops one by one."""


@dataclass(frozen=True, slots=True)
class DecodeCalls:
    first_norm: tuple[torch.Tensor, float]
    layers: tuple[LayerCalls, ...]
    has_bf16_copy: bool
    """Some projection holds a bf16 copy (QuantLinear.bf16_copy), which multiplies BF16_COPY_FROM_ROWS+ rows."""
    copies: list[torch.Tensor] = field(default_factory=list)
    """Every layer's LayerCalls.copies in order (the C++ loop's copy list; 4 a layer), or [] unless every projection
    holds an AMX-packed copy."""
    flat: dict = field(default_factory=dict)
    """flat_arguments' lists, made once per KV cache storage: {id of kv.data: (kv.data, tensors, ints, floats)}."""

    def takes(self, num_rows: int, kv: PagedKVCache) -> bool:
        """Whether every projection multiplies num_rows rows through its dot_call (what QuantLinear.forward
        decides per call; the thresholds are read per step, as tests change them) and the cache takes the
        fused K/V write."""
        if kv.dtype not in SUPPORTED_CACHE_DTYPES:
            return False
        if self.copy_multiplies(num_rows):  # every projection's copy multiplies, or (some lack one) refused
            return bool(self.copies)
        bf16_rows = qkernels.BF16_FROM_ROWS
        return not (bf16_rows and num_rows >= bf16_rows)

    def copy_multiplies(self, num_rows: int) -> bool:
        """Whether QuantLinear.forward multiplies num_rows fp32 rows through the bf16 copies (BF16_COPY_FROM_ROWS,
        read per step)."""
        return self.has_bf16_copy and 0 < qkernels.BF16_COPY_FROM_ROWS <= num_rows


def _dot(linear: object) -> tuple | None:
    """(op, arguments) of a QuantLinear without bias that multiplies through the int8-activation kernel."""
    call = getattr(linear, "dot_call", None)
    if call is None or getattr(linear, "bias", None) is not None or getattr(linear, "backend", None) != "cpu":
        return None
    return call


def decode_calls(model: CausalLM) -> DecodeCalls | None:
    """model: a CausalLM on the 'cpu' backend. -> its layers' bound calls, or None where they do not apply."""
    from ferry.model.dense_attention import GQAttention
    from ferry.model.layers import GatedMLP

    if not kernel_built():
        return None
    decoder = model.model
    layers = cast("list[DecoderLayer]", list(decoder.layers))
    norm_modules = [*(layer.input_layernorm for layer in layers), decoder.norm]
    norms = [(norm.weight.detach(), float(norm.eps)) for norm in norm_modules]
    calls, has_copy = [], False
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(attn, GQAttention) or not isinstance(mlp, GatedMLP) or attn.backend != "cpu":
            return None
        qkv, o, gate_up, down = _dot(attn.qkv), _dot(attn.o_proj), _dot(mlp.gate_up), _dot(mlp.down_proj)
        if qkv is None or o is None or gate_up is None or down is None:
            return None
        if any(w.dtype != torch.float32 for w, _ in norms):
            return None
        held = [getattr(m, "bf16_copy", None) for m in (attn.qkv, attn.o_proj, mlp.gate_up, mlp.down_proj)]
        has_copy = has_copy or any(c is not None for c in held)
        amx = [c for c in held if c is not None and c.dim() == 6]  # packed for our kernels (copy_op), not oneDNN
        post = layer.post_attention_layernorm
        calls.append(
            LayerCalls(
                i,
                qkv,
                o,
                gate_up,
                down,
                post_norm=(post.weight.detach(), float(post.eps)),
                next_norm=norms[i + 1],
                heads=attn.num_heads,
                kv_heads=attn.num_kv_heads,
                head_dim=attn.head_dim,
                scale=float(attn.scale),
                window=int(attn.window or 0),
                copies=tuple(amx) if len(amx) == 4 else None,
            )
        )
    copies = [t for c in calls for t in (c.copies or ())] if all(c.copies for c in calls) else []
    return DecodeCalls(norms[0], tuple(calls), has_copy, copies)


def flat_arguments(calls: DecodeCalls, kv: PagedKVCache) -> tuple[list[torch.Tensor], list[int], list[float]]:
    """The C++ loop's per-layer lists (csrc/decode_layers.cpp): tensors [qkv, o, gate_up, down] x (codes, scales,
    offsets), post norm weight, next norm weight, K cache view, V cache view; ints [qkv, o, gate_up, down] x (bits,
    group_size, n, digits, amx_from_rows), heads, kv heads, head dim, window; floats post eps, next eps, scale."""
    held = calls.flat.get(id(kv.data))
    if held is not None and held[0] is kv.data:
        return held[1:]
    tensors: list[torch.Tensor] = []
    ints: list[int] = []
    floats: list[float] = []
    for c in calls.layers:
        for _, (codes, scales, offsets, *rest) in (c.qkv, c.o, c.gate_up, c.down):
            tensors += [codes, scales, offsets]
            ints += [int(v) for v in rest]
        tensors += [c.post_norm[0], c.next_norm[0], kv.layer(c.layer, 0), kv.layer(c.layer, 1)]
        ints += [c.heads, c.kv_heads, c.head_dim, c.window]
        floats += [c.post_norm[1], c.next_norm[1], c.scale]
    calls.flat.clear()  # one cache at a time: a replaced one's views are not kept alive
    calls.flat[id(kv.data)] = (kv.data, tensors, ints, floats)
    return tensors, ints, floats


def run(
    calls: DecodeCalls, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata, kv: PagedKVCache
) -> torch.Tensor:
    """x [B, hidden] fp32, one decoding token per sequence (added to in place) -> the final norm of every row
    [B, hidden]. A hot loop: ops called directly, no checks beyond DecodeCalls.takes (asserted by the caller)."""
    ops = torch.ops.ferry_cpu
    add_rms_norm_, rotary_, write_kv, attend, silu_and_mul = (
        ops.add_rms_norm_.default,
        ops.rotary_.default,
        ops.write_kv.default,
        ops.paged_decode_attention.default,
        ops.silu_and_mul.default,
    )
    rows = x.shape[0]
    slots, tables, seq_lens = meta.slot_mapping, meta.decode_block_tables, meta.decode_seq_lens
    cos, sin = cos.contiguous(), sin.contiguous()
    h = ops.rms_norm.default(x, *calls.first_norm)
    # 0: the int8-activation kernel; 1: the bf16 copies, fp32 between them; 2: and gate/up -> down in bf16
    copy_mode = (2 if qkernels.BF16_ACTIVATIONS else 1) if calls.copy_multiplies(rows) else 0
    if CPP_LOOP:
        return ops.decode_layers.default(
            x,
            h,
            cos,
            sin,
            slots,
            tables,
            seq_lens,
            *flat_arguments(calls, kv),
            cpu_decode.BF16_DOT,
            calls.copies if copy_mode else [],
            copy_mode,
            qkernels.copy_op()[1],
        )
    mm, prefetch = qkernels.copy_op()

    def linear(c: LayerCalls, p: int, inp: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """Projection p (qkv, o, gate_up, down) of layer c, as the C++ loop's `linear`."""
        op, args = (c.qkv, c.o, c.gate_up, c.down)[p]
        if not copy_mode:
            return op(inp, *args)
        assert c.copies is not None  # takes() refuses the step otherwise
        return mm(inp, c.copies[p], args[5], bf16_out, prefetch)

    for c in calls.layers:
        heads, kv_heads = c.heads, c.kv_heads
        qkv = linear(c, 0, h).view(rows, heads + 2 * kv_heads, c.head_dim)  # [B, H + 2 Hkv, D]
        rotary_(qkv[:, : heads + kv_heads], cos, sin)
        k_cache, v_cache = kv.layer(c.layer, 0), kv.layer(c.layer, 1)
        write_kv(k_cache, slots, qkv[:, heads : heads + kv_heads])
        write_kv(v_cache, slots, qkv[:, heads + kv_heads :])
        out = attend(qkv[:, :heads], k_cache, v_cache, tables, seq_lens, c.scale, c.window, cpu_decode.BF16_DOT)
        h = add_rms_norm_(x, linear(c, 1, out.view(rows, -1)), *c.post_norm)
        h = add_rms_norm_(x, linear(c, 3, silu_and_mul(linear(c, 2, h, copy_mode == 2))), *c.next_norm)
    return h
