"""quant_matmul: x @ W.T for a group-wise quantized W (quant_ref.QuantizedWeight), dequantized on the fly.

Which kernel runs follows the model's backend (ferry.kernels.backend, set once at load on every
QuantLinear by CausalLM.set_attention_backend): 'triton' (CUDA; on the CPU only under TRITON_INTERPRET=1)
runs triton_quant.py; 'cpu' runs a C++ kernel (built with the decode kernel, cpu_decode.py) for fp32
activations when the kernels are built and FERRY_CPU_KERNELS is not 0; anything else, and 'torch', the
plain-torch reference, which dequantizes the whole weight first.

The CPU has two kernels, and a weight is packed once at load (pack_cpu) for the one that runs it:
- csrc/quant_dot.cpp (DotPacked): activations quantized to int8 per 32 inputs, exact int32 dot products
  (AVX-512 VNNI, else AVX2), the default where it builds (AVX2 and up);
- csrc/quant_linear.cpp (CpuPacked): weights dequantized to fp32 in registers, fp32 activations; for
  machines without AVX2 and with FERRY_QUANT_INT8_ACTIVATIONS=0.
On a CPU with AMX (FERRY_QUANT_BF16_FROM_ROWS to change), a call of 512 rows or more (a prefill step)
instead dequantizes the weight to bfloat16 for that call and multiplies in bfloat16 through torch (oneDNN's
AMX tiles); see BF16_FROM_ROWS. Calls of BF16_COPY_FROM_ROWS rows or more multiply a bf16 copy of the weight kept
at load instead, with our AMX bf16 GEMM (csrc/bf16_amx.h; BF16_AMX), or on a CPU with AVX512_BF16 but no AMX with our
vdpbf16ps GEMM over the same packed copy (csrc/bf16_dot.h; BF16_DOT_GEMM).
"""

from __future__ import annotations

import logging
import os
import threading

import torch

from ferry.kernels.cpu_decode import kernel, kernel_built
from ferry.kernels.quant_pack import CpuPacked, DotPacked, pack_for_cpu, pack_for_dot
from ferry.kernels.quant_ref import QuantizedWeight, dequantize, quant_matmul_ref

log = logging.getLogger(__name__)


def quant_matmul(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    packed: CpuPacked | DotPacked | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (accumulated in fp32 by the kernels). packed: qw's copy for a
    CPU kernel (pack_cpu, made once at load; without it the CPU kernel packs on every call). backend:
    one of ATTENTION_BACKENDS; None: Triton for CUDA tensors, else 'cpu'."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x {tuple(x.shape)}: last dimension must be the weight's {qw.in_features} inputs")
    backend = backend or ("triton" if x.is_cuda else "cpu")
    rows = x.reshape(-1, x.shape[-1])
    if backend == "triton":
        from ferry.kernels.triton_quant import triton_quant_matmul

        return _with_bias(triton_quant_matmul(rows, qw), bias).view(*x.shape[:-1], -1)
    if backend == "cpu" and x.device.type == "cpu" and x.dtype == torch.float32 and kernel_built():
        if BF16_FROM_ROWS and rows.shape[0] >= BF16_FROM_ROWS:
            return _with_bias(bf16_quant_matmul(rows, qw), bias).view(*x.shape[:-1], -1)
        packed = packed or pack_cpu(qw)
        out = dot_quant_matmul(rows, packed) if isinstance(packed, DotPacked) else cpu_quant_matmul(rows, packed)
        return _with_bias(out, bias).view(*x.shape[:-1], -1)
    return quant_matmul_ref(x, qw, bias)


def bf16_quant_matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 through bfloat16: the weight dequantized for this call only (the model
    stays quantized in memory), x rounded to bfloat16, the products summed by torch's bfloat16 matmul."""
    return torch.mm(x.to(torch.bfloat16), dequantize(qw, torch.bfloat16).t()).float()


def cpu_has_flag(flag: str) -> bool:
    """The CPU has this feature (Linux: a flag in /proc/cpuinfo, e.g. amx_bf16, amx_int8)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and f" {flag} " in f" {line.split(':', 1)[-1].strip()} " for line in f)
    except OSError:
        return False


def cpu_has_amx_bf16() -> bool:
    """The CPU multiplies bfloat16 in AMX tiles."""
    return cpu_has_flag("amx_bf16")


def cpu_has_amx_int8() -> bool:
    """The CPU multiplies int8 in AMX tiles."""
    return cpu_has_flag("amx_int8")


def cpu_has_avx512_bf16() -> bool:
    """The CPU has AVX512_BF16 (`vdpbf16ps`: bf16 pairs dotted into fp32 lanes), which oneDNN's bf16 GEMM uses
    where AMX is missing (AMD Zen 4/5, Xeons of Cooper Lake)."""
    return cpu_has_flag("avx512_bf16")


def _rows_setting(
    name: str, with_amx: int, zero_means: str, has_amx: bool | None = None, with_avx512_bf16: int = 0
) -> int:
    """A row-count setting from the environment: its default is `with_amx` on a CPU with AMX (has_amx; None: the
    CPU has AMX-BF16), else `with_avx512_bf16` on a CPU with AVX512_BF16, else 0."""
    has_amx = cpu_has_amx_bf16() if has_amx is None else has_amx
    default = with_amx if has_amx else (with_avx512_bf16 if with_avx512_bf16 and cpu_has_avx512_bf16() else 0)
    raw = os.environ.get(name, str(default)).strip()
    if not raw.isdigit():
        raise ValueError(f"{name}={raw!r}: must be a row count (0: {zero_means})")
    return int(raw)


def _bf16_from_rows() -> int:
    return _rows_setting("FERRY_QUANT_BF16_FROM_ROWS", 512, "off")


BF16_FROM_ROWS = _bf16_from_rows()
"""CPU calls of this many rows or more multiply in bfloat16 (bf16_quant_matmul); 0: never. Default 512 on a
CPU with AMX, else 0. Read once at import. On a 2-core Xeon with AMX (ops/bench/quant/20261205-xeon-amx-bf16-
prefill), one SmolLM2 layer's seven int4 matmuls took 56 ms at 2048 rows in the int8-activation kernel and
13 ms this way (24 vs 11 ms at 1024 rows; at 256 rows the kernel is faster, 5.9 vs 8.2 ms: the per-call
dequantization costs ~3.4 ms a layer); `ferry up` under the burst: 260-266 output tok/s against 213-218,
TTFT p50 2.3-2.5 s against 4.7. The cost: bfloat16 activations (8 bits of mantissa; SmolLM2 with every
row in bfloat16: 99.2% teacher-forced agreement with fp32, KL 0.00055) and batch invariance (a decode row
that shares a step of 512+ rows with a prefill is multiplied in bfloat16 too). Without AMX a bfloat16
matmul is no faster than the kernels, hence off there (an AMD EPYC with AVX512_BF16: 1827 vs 2112 ms for a
SmolLM2 step's matmuls at 2048 rows, ~200 ms of it the per-call dequantization; the bf16 copy there takes
1581). Where QuantLinear keeps a bf16 copy (BF16_COPY_FROM_ROWS), the copy serves these calls instead (no
per-call dequantization)."""


def _switch(name: str, on: str, off: str) -> bool:
    """An on/off environment setting, default on: '1' or '0', anything else refused by name."""
    raw = os.environ.get(name, "1").strip()
    if raw not in ("0", "1"):
        raise ValueError(f"{name}={raw!r}: must be 1 ({on}) or 0 ({off})")
    return raw == "1"


def _bf16_dot_gemm() -> bool:
    return _switch("FERRY_QUANT_BF16_DOT_GEMM", "our AVX512_BF16 kernel", "oneDNN")


def _bf16_copy_from_rows() -> int:
    without_amx = 24 if _bf16_dot_gemm() else 64  # our AVX512_BF16 GEMM, else oneDNN's
    return _rows_setting("FERRY_QUANT_BF16_COPY_FROM_ROWS", 16, "keep no bf16 copy", with_avx512_bf16=without_amx)


BF16_COPY_FROM_ROWS = _bf16_copy_from_rows()
"""Where > 0, every CPU QuantLinear keeps, beside its codes, a bfloat16 copy of its dequantized weight packed once
(QuantLinear.bf16_copy, made at prepack by pack_bf16_copy: for our AMX bf16 GEMM, csrc/bf16_amx.h, or without AMX
our AVX512_BF16 GEMM, csrc/bf16_dot.h, the same layout; with FERRY_QUANT_BF16_AMX=0 / FERRY_QUANT_BF16_DOT_GEMM=0 for
oneDNN), and multiplies calls of this many rows or more with it (AMX tiles or vdpbf16ps) instead of the
int8-activation kernel or BF16_FROM_ROWS' per-call dequantization; shorter calls keep the kernel, bit for bit. 0: no
copy. The copies together stay within BF16_COPY_MAX_BYTES. Default 16 on a CPU with AMX, 24 on one with AVX512_BF16 but
no AMX (our vdpbf16ps GEMM, csrc/bf16_dot.h; 64 with FERRY_QUANT_BF16_DOT_GEMM=0, oneDNN's), else 0; read once at
import. The cost is memory: 2 bytes per weight beside the codes' ~0.6
(SmolLM2-135M: ~270 MB of bf16 copies beside ~70 MB of int4 codes). The model still holds and reports its quantized
weights (/v1/models says int4); the copy is the same values rounded to bf16, a cache for the matmul. On a 2-core Xeon
with AMX, a whole SmolLM2 step's matmuls with the weights streamed from memory
(ops/bench/quant/20261205d-xeon-amx-bf16-kernel/amx_rows.json), int4 codes on the AMX int8 tiles vs the copy in our
kernel: 8.9 vs 11.3 ms at 8 rows, 10.5 vs 11.4 at 12, 11.4 vs 11.7 at 14, 12.3 vs 11.6 at 16, 20.5 vs 13.6 at 24, 44.6
vs 17.8 at 64 (the copy through oneDNN: 17.4 ms at 16, 24.8 at 64): hence 16 (24 while the copy went through oneDNN). On
a 2-core AMD EPYC without AMX (ops/bench/quant/20261205e-amd-bf16-copy- rows), the int4 kernel's VNNI loop vs the copy
through oneDNN: 8.8 vs 15.1 ms at 8 rows, 16.1 vs 19.6 at 16, 29.7 vs 30.0 at 32, 57.5 vs 50.6 at 64, 114 vs 90 at 128,
2112 vs 1581 at 2048; a SmolLM2 engine burst (steps.py) 278-293 output tok/s without a copy, 332 from 16 rows, 339-343
from 64 (TTFT p50 2.0 -> 1.4 s): hence 64 there with oneDNN. Our AVX512_BF16 GEMM on the same box
(ops/bench/throughput/reports/20261205x-amd-bf16-dot-gemm/amx_rows.json), int4 VNNI vs ours vs oneDNN's copy: 12.5 vs
16.1 vs 16.4 ms at 12 rows, 15.9 vs 18.0 vs 19.4 at 16, 22.7 vs 21.0 vs 25.2 at 24, 29.9 vs 24.7 vs 30.4 at 32, 57.4 vs
44.1 vs 51.1 at 64, 492 vs 373 vs 372 at 512, 2097 vs 1517 vs 1504 at 2048: the crossover with int4 between 16 and 24
rows (a second sweep, wide_narrow_rows.json: 15.8 vs 18.4 at 16, 19.4 vs 19.9-20.9 at 20, 22.8 vs 20.9-23.0 at 24),
hence 24. Quality as BF16_FROM_ROWS: bf16 activations (SmolLM2 with every row in
bf16: 99.2% teacher-forced agreement with fp32, KL 0.00055), and a decode row in a batch of 16+ (64+ there) rows goes
bf16 too."""


def _bf16_copy_max_bytes() -> int:
    raw = os.environ.get("FERRY_QUANT_BF16_COPY_MAX_MB", "2048").strip()
    if not raw.isdigit():
        raise ValueError(f"FERRY_QUANT_BF16_COPY_MAX_MB={raw!r}: must be a size in MiB")
    return int(raw) << 20


BF16_COPY_MAX_BYTES = _bf16_copy_max_bytes()
"""The most the bf16 copies of one process may hold together (FERRY_QUANT_BF16_COPY_MAX_MB, default 2048 MiB): a
layer whose copy would pass it keeps its codes only and multiplies with the kernel. Why: the copy costs 2 bytes a
weight, ~3x an int4 model's codes; a 7B model's copies would take ~14 GB that nobody asked for by keeping its
weights in int4. SmolLM2-135M's take ~270 MB. A layer's copy is given back when the layer is freed."""

_bf16_copy_lock = threading.Lock()
_bf16_copy_bytes = 0
_bf16_copy_full_logged = False


def reserve_bf16_copy(nbytes: int) -> bool:
    """Whether a copy of nbytes fits BF16_COPY_MAX_BYTES beside those alive (then it is counted)."""
    global _bf16_copy_bytes, _bf16_copy_full_logged
    with _bf16_copy_lock:
        if _bf16_copy_bytes + nbytes > BF16_COPY_MAX_BYTES:
            if not _bf16_copy_full_logged:
                _bf16_copy_full_logged = True
                log.warning(
                    "bf16 weight copies: %d MiB held, the next layer's would pass FERRY_QUANT_BF16_COPY_MAX_MB "
                    "(%d MiB): layers past it multiply with the int kernel (slower prefill, same memory as the codes)",
                    _bf16_copy_bytes >> 20,
                    BF16_COPY_MAX_BYTES >> 20,
                )
            return False
        _bf16_copy_bytes += nbytes
        return True


def release_bf16_copy(nbytes: int) -> None:
    global _bf16_copy_bytes
    with _bf16_copy_lock:
        _bf16_copy_bytes -= nbytes


def bf16_copy_bytes() -> int:
    """What the bf16 copies alive hold, in bytes."""
    return _bf16_copy_bytes


def bf16_copy_matmul(
    x: torch.Tensor, copy: torch.Tensor, out_dtype: torch.dtype = torch.float32, out_features: int | None = None
) -> torch.Tensor:
    """x [M, K] fp32 or bf16 -> [M, N] out_dtype: x rounded to bf16, multiplied with a bf16 copy of the weight made
    by pack_bf16_copy (QuantLinear.bf16_copy), summed in fp32. A copy packed for our AMX kernel (6-D, pack_bf16_amx;
    out_features: N, default its padded column count) goes to csrc/bf16_amx.h, which rounds the output to bf16
    only where out_dtype is bf16; a copy packed for oneDNN (2-D) to oneDNN, which rounds it to bf16 (then widened
    to fp32 unless out_dtype is bf16)."""
    if copy.dim() == 6:
        n = out_features or copy.shape[0] * 32
        op, prefetch = copy_op()
        return op(x.contiguous(), copy, n, out_dtype == torch.bfloat16, prefetch)
    rows = x.to(torch.bfloat16, memory_format=torch.contiguous_format)
    return torch.ops.mkldnn._linear_pointwise(rows, copy, None, "none", [], "").to(out_dtype)


def pack_bf16_amx(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (any float dtype) -> bf16 [ceil(N / 32), ceil(K / 32), 2, 16, 16, 2], csrc/bf16_amx.h's
    layout: per group of 32 columns and 32-input chunk, two AMX B tiles (columns 0-15, 16-31), each 16 input pairs
    x 16 columns x 2 inputs; N and K padded with zeros."""
    n, k = weight.shape
    groups, chunks = -(-n // 32), -(-k // 32)
    padded = torch.zeros(groups * 32, chunks * 32, dtype=torch.bfloat16)
    padded[:n, :k] = weight
    # [group, column tile, column, chunk, pair, input of the pair] -> [group, chunk, column tile, pair, column, input]
    return padded.view(groups, 2, 16, chunks, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def bf16_amx_usable() -> bool:
    """The C++ kernels were built with the AMX bf16 GEMM and this process may use the tiles (the CPU has AMX-BF16
    and Linux granted the tile state)."""
    if "bf16" not in _dot_usable:
        _dot_usable["bf16"] = kernel_built() and bool(torch.ops.ferry_cpu.bf16_amx())
    return _dot_usable["bf16"]


def bf16_dot_usable() -> bool:
    """The C++ kernels were built with the AVX512_BF16 GEMM (csrc/bf16_dot.h) and this CPU runs it."""
    if "bf16_dot" not in _dot_usable:
        _dot_usable["bf16_dot"] = kernel_built() and bool(torch.ops.ferry_cpu.bf16_dot())
    return _dot_usable["bf16_dot"]


def copy_op() -> tuple:
    """(op, prefetch_bytes) that multiplies a copy packed by pack_bf16_amx: our AMX GEMM where the tiles are usable,
    else our AVX512_BF16 GEMM (the same arguments and layout)."""
    if bf16_amx_usable():
        return torch.ops.ferry_cpu.bf16_amx_linear.default, BF16_AMX_PREFETCH
    return torch.ops.ferry_cpu.bf16_dot_linear.default, BF16_DOT_PREFETCH


def pack_bf16_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 weight [N, K] packed once for bf16_copy_matmul: for our AMX kernel where BF16_AMX is on and the tiles
    are usable, else for our AVX512_BF16 kernel where BF16_DOT_GEMM is on and the CPU has AVX512_BF16 (the same
    layout), else for oneDNN (ferry.model.cpu_linear.pack; None where torch has no oneDNN)."""
    if (BF16_AMX and bf16_amx_usable()) or (BF16_DOT_GEMM and not bf16_amx_usable() and bf16_dot_usable()):
        return pack_bf16_amx(weight)
    from ferry.model import cpu_linear

    return cpu_linear.pack(weight)


BF16_ACTIVATIONS = _switch("FERRY_QUANT_BF16_ACTIVATIONS", "stay in bf16 between copies", "fp32")
"""Where the bf16 copies multiply a call (BF16_COPY_FROM_ROWS rows or more: a prefill step), the activations that
only go from one copy matmul to the next stay in bfloat16 instead of a round trip through fp32: gate/up -> SiLU-and-mul
-> down, and q/k/v -> prompt attention (torch's flash attention in bf16) -> o_proj; the residual stream, norms and
rotary embedding stay fp32, the KV cache its own dtype. The next matmul rounds its input to bf16 anyway, so what
changes is one more rounding of the gate/up outputs and attention's inputs and softmax in bf16. Why (2-core Xeon
with AMX, SmolLM2 burst, ops/bench/throughput/reports/20261205-prefill/prefill_ops.txt): of the 4 prefill steps'
2.66 s of op time, the bf16 matmuls were 0.85 s, fp32 flash attention 0.69 s and dtype casts 0.53 s.
FERRY_QUANT_BF16_ACTIVATIONS=0 (read once at import) keeps every activation fp32 between the matmuls."""


def _bf16_amx() -> bool:
    return _switch("FERRY_QUANT_BF16_AMX", "our AMX bf16 kernel", "oneDNN")


BF16_AMX = _bf16_amx()
"""Whether the bf16 weight copies (BF16_COPY_FROM_ROWS) are packed for our AMX bf16 GEMM (csrc/bf16_amx.h) instead
of oneDNN, where the kernel could ask Linux for the tile state; the copy is held once either way (a layout per
kernel). FERRY_QUANT_BF16_AMX=0, read once at import, packs them for oneDNN as before. Both sum bf16 products in fp32
(TDPBF16PS); ours hands forward the fp32 sums (oneDNN rounded them to bf16), and rounds to bf16 where the caller
asks (bf16_forward). Why: oneDNN streamed a decode step's weights well under memory speed. On a 2-core Xeon with AMX,
a whole SmolLM2 step's matmuls, weights streamed (ops/bench/quant/20261205d-xeon-amx-bf16-kernel/amx_rows.json),
ours vs oneDNN: 11.6 vs 17.4 ms at 16 rows, 14.0 vs 21.0 at 32, 17.8 vs 24.8 at 64, 26.6 vs 35.5 at 128, 113 vs
119 at 512, 229 vs 267 at 1024, but 508 vs 467 at 2048 (row_block.txt; a prefill step's worst case, kept: the copy
is not held twice). The ~270 MB copy at 1-16 rows takes 10.8-11.6 ms: ~24 GB/s, this box's memory speed (membw.py:
a copy moves 13.2 GB/s each way). The SmolLM2 burst, with BF16_COPY_FROM_ROWS 16 against oneDNN's 24 (the throughput
README's twelfth round): in-process engine decode steps of > 8 sequences -9 to -10%, prefill steps +12 to +14%, tok/s
+1 to +3%, TTFT p50 +14%; `ferry up` 365.6 -> 399.4 tok/s (+9%), TTFT p50 1366 -> 1383 ms."""


BF16_AMX_PREFETCH = 0
"""How far ahead of a thread's weight stream csrc/bf16_amx.h prefetches, in bytes (0: none, the hardware prefetchers
alone). Software prefetch 2 KB or 8 KB ahead measured no better: within +-5% at 8-32 rows, 7-25% slower at 64-128
rows (ops/bench/quant/20261205d-xeon-amx-bf16-kernel/first_sweep.txt)."""


BF16_DOT_GEMM = _bf16_dot_gemm()
"""On a CPU with AVX512_BF16 but no AMX (AMD Zen 4/5), whether the bf16 weight copies (BF16_COPY_FROM_ROWS) are packed
for our vdpbf16ps GEMM (csrc/bf16_dot.h; pack_bf16_amx's layout, so decode_calls binds them as on AMX) instead of
oneDNN. FERRY_QUANT_BF16_DOT_GEMM=0, read once at import, packs them for oneDNN as before. Ours sums each output's
pairs in one fp32 chain (bit for bit what torch does adding the products in that order; oneDNN's order is its own) and
hands forward the fp32 sums (oneDNN rounded them to bf16). Measured: see BF16_COPY_FROM_ROWS."""


BF16_DOT_PREFETCH = -1
"""csrc/bf16_dot.h's prefetch_bytes: -1, 4 KB ahead of the weight stream where one pass of <= 12 rows covers a call,
else the next column group's weights spread over the current group's passes (the memory fetches the next group while
the later passes compute from L2). On a 2-core AMD EPYC, a whole SmolLM2 step's matmuls
(ops/bench/throughput/reports/20261205x-amd-bf16-dot-gemm/first_sweep.txt): no prefetch 15.3 / 20.5 / 31.8 / 52.4 ms at
8 / 16 / 32 / 64 rows; 4 KB ahead 11.7 / 21.7 / 33.5 / 51.8; the next group 19.8 / 18.3 / 24.4 / 43.6."""


INT8_ACTIVATIONS = _switch("FERRY_QUANT_INT8_ACTIVATIONS", "int8 activations", "fp32")
"""Whether the CPU multiplies quantized weights with int8 activations (csrc/quant_dot.cpp) where that kernel
builds. Measured on a 2-core Zen 5 (AVX-512 VNNI), a whole SmolLM2 step's matmuls with the weights streamed
from memory (ops/bench/quant/step_rows.py, report 20261204-int8-activations-amd/step_rows.json), against the
float kernel's better path: int8 (two activation digits) 3.9 vs 4.3 ms at 1 row, 9.0 vs 11.0 at 8, 29.6 vs
38.8 at 32, 103 vs 138 at 128; int4 (one digit) 2.8 vs 3.8, 5.0 vs 10.8, 15.6 vs 38.7, 56 vs 129. Built for
AVX2 (x86-64-v3) on the same machine it tied or led the float kernel from 1 to 128 rows (one-digit int8 then;
not measured on a real AVX2-only CPU). FERRY_QUANT_INT8_ACTIVATIONS=0, read once at import, keeps the float
kernel."""


def dot_kernel_built() -> bool:
    """The int8-activation kernel was built, for an instruction set it runs on (AVX2 and up)."""
    if "dot" not in _dot_usable:
        _dot_usable["dot"] = kernel_built() and torch.ops.ferry_cpu.quant_dot_isa() != ""
    return _dot_usable["dot"]


_dot_usable: dict[str, bool] = {}


def pack_cpu(qw: QuantizedWeight) -> CpuPacked | DotPacked:
    """qw's copy for the CPU kernel that will multiply with it (made once at load)."""
    return pack_for_dot(qw) if INT8_ACTIVATIONS and dot_kernel_built() else pack_for_cpu(qw)


ACTIVATION_DIGITS = {8: 2, 4: 2}
"""int8 digits per activation, by weight bits. One digit (x ~ d * q, d = absmax / 127 per 32 inputs) moved
SmolLM2's teacher-forced int8 run from KL 0.0011 to 0.0040 nats and its argmax agreement to 0.949-0.973
(the 95% bar, within a tie or two); two (x ~ d / 256 * (256 * q1 + q2), the second digit the first's
remainder) keep 0.0011 / 0.996, the float path's, at twice the dot instructions. Against int4's own weight
error (KL ~0.4) one digit's looked like noise, but on SmolLM2's own Q4_1 codes (the served default) one
digit turned the README's greedy answer to "What is the capital of France?" from "The capital of France
is Paris." into "L'Étoile, la Cité, ..." (agreement with the dequantized fp32 model 0.953): two for int4
too."""


def _amx_int8_from_rows() -> int:
    return _rows_setting("FERRY_QUANT_AMX_INT8", AMX_INT8_DEFAULT_ROWS, "off", cpu_has_amx_int8())


AMX_INT8_DEFAULT_ROWS = 8
AMX_INT8_FROM_ROWS = _amx_int8_from_rows()
"""Calls of the int8-activation kernel with this many rows or more take its AMX int8 tile path (csrc/
quant_dot_amx.h) where the kernel could ask Linux for the tile state (amx_int8_usable()); the output is the same,
bit for bit (the same activation digits, exact int32 sums per 32 inputs, the same fp32 epilogue in the same
order), only sooner. 0: the VNNI loop at every size. FERRY_QUANT_AMX_INT8, read once at import; default
AMX_INT8_DEFAULT_ROWS on a CPU with amx_int8, else 0. No extra memory: int8 codes are the tiles' layout already,
int4 codes are split into bytes per tile on the fly. QuantLinear's decode path binds it at prepack
(dot_arguments), quant_matmul reads it per call. On a 2-core Xeon, a whole SmolLM2 step's int4 matmuls with the
weights streamed from memory (ops/bench/quant/20261205c-xeon-amx-int8, the throughput README's eleventh round):
the tiles lose at 1-4 rows (a fixed tile latency per 32 inputs), hence 8. Calls of BF16_COPY_FROM_ROWS+ rows
never reach this kernel where QuantLinear keeps a bf16 copy."""


def amx_int8_usable() -> bool:
    """The kernel was built with the AMX int8 path and this process may use the tiles (the CPU has AMX-INT8 and
    Linux granted the tile state)."""
    return dot_kernel_built() and bool(torch.ops.ferry_cpu.quant_dot_amx())


def dot_quant_matmul(
    x: torch.Tensor, packed: DotPacked, digits: int | None = None, amx_from_rows: int | None = None
) -> torch.Tensor:
    """The int8-activation kernel: x [M, K] fp32 -> [M, N] fp32; digits: ACTIVATION_DIGITS[bits], amx_from_rows:
    AMX_INT8_FROM_ROWS, unless given."""
    if not dot_kernel_built():
        raise RuntimeError("the int8-activation CPU kernel is unavailable (no C++ kernels, or built without AVX2)")
    return torch.ops.ferry_cpu.quant_dot_linear.default(x.contiguous(), *dot_arguments(packed, digits, amx_from_rows))


def dot_arguments(packed: DotPacked, digits: int | None = None, amx_from_rows: int | None = None) -> tuple:
    """The kernel's arguments after x (QuantLinear binds them once: its forward then calls the op directly)."""
    bits = packed.bits
    return (
        packed.codes,
        packed.scales,
        packed.offsets,
        bits,
        packed.group_size,
        packed.out_features,
        digits or ACTIVATION_DIGITS[bits],
        AMX_INT8_FROM_ROWS if amx_from_rows is None else amx_from_rows,
    )


def _tiled_from_rows() -> int:
    raw = os.environ.get("FERRY_QUANT_TILED_FROM_ROWS", "64").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"FERRY_QUANT_TILED_FROM_ROWS={raw!r}: must be a whole number of rows >= 1")
    return int(raw)


TILED_FROM_ROWS = _tiled_from_rows()
"""(The float kernel.) From this many rows of x on, it dequantizes each weight block once into an fp32 buffer and
multiplies all rows with it (a register-blocked GEMM); below, it dequantizes in registers per pass of a few
rows (fewer bytes touched). Measured on a 2-core Zen 5 (AVX-512) with SmolLM2's shapes and every layer's weights
streamed from memory as in a step (ops/bench/quant/step_rows.py, report 20261204-smollm2-cpu-amd/): the
register passes are ahead below 64 rows (8 rows: int8 8.9 vs 12.4 ms, int4 6.1 vs 9.8 ms for a step's
matmuls; 32 rows: 22.9 vs 25.3, 18.9 vs 21.3), the two even at 64, the tiled GEMM ahead from ~128
(prefill). The 8 set before came from one weight timed over and over (matmul_rows.py), which stays in
cache. FERRY_QUANT_TILED_FROM_ROWS, read once at import, moves it (benchmarks: a huge value keeps the
register passes for every batch)."""


def cpu_quant_matmul(x: torch.Tensor, packed: CpuPacked, tiled_from_rows: int = TILED_FROM_ROWS) -> torch.Tensor:
    """The C++ kernel: x [M, K] fp32 -> [M, N] fp32."""
    if kernel() is None:
        raise RuntimeError("the C++ CPU kernels could not be built (see the warning logged above)")
    return torch.ops.ferry_cpu.quant_linear(
        x.contiguous(),
        packed.codes,
        packed.scales,
        packed.offsets,
        packed.bits,
        packed.group_size,
        packed.out_features,
        tiled_from_rows,
    )


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out.add_(bias.to(out.dtype))
