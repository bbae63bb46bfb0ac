"""Fused paged decode attention on the CPU: the C++ kernel in csrc/paged_decode.cpp, built on first use
together with the step's small fused ops (csrc/cpu_layers.cpp, wrapped by cpu_layers.py), the
quantized-weight matmul (csrc/quant_linear.cpp, wrapped by quant_linear.py) and whole-prompt prefill attention
(csrc/prefill_attention.cpp, wrapped by cpu_prefill.py).

The kernel reads each sequence's K/V blocks in place (attention_ref's path gathers them into a copy
first, which cost more than the attention itself), so decode attention is one pass over the cache.
It is compiled once per machine with torch.utils.cpp_extension (~10-60 s) and cached: in torch's
extension directory, or under FERRY_KERNEL_CACHE when set. The build uses -march=native, so the
build name carries a hash of the CPU's feature flags (and of the source, flags and torch version):
a cache directory shared between different machines never hands one a binary built for another.
FERRY_KERNEL_MARCH=<gcc -march value> builds for that target instead of this CPU (the CPU image
builds `x86-64-v3`, AVX2, at image build time); the name then carries the target, not the CPU.
A library already built under FERRY_KERNEL_CACHE is loaded as it is: no compiler at run time.
When the build fails (no compiler, ...) one warning says why and callers use the torch reference.
Builds are serialised by an flock beside the build directory, which the kernel releases when a builder
dies: a builder that holds it and still finds torch's own `lock` file there knows that file was left by a
build that was killed (torch's file baton never expires, and every later process would wait on it
forever), removes it and says so.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in (
        "paged_decode.cpp",
        "cpu_layers.cpp",
        "quant_linear.cpp",
        "quant_dot.cpp",
        "decode_layers.cpp",
        "prefill_attention.cpp",
    )
]
# included by SOURCES: part of the build's identity
HEADERS = [
    Path(__file__).with_name("csrc") / name
    for name in (
        "cpu_math.h",
        "quant_dot_amx.h",
        "bf16_amx.h",
        "bf16_dot.h",
        "paged_decode_bf16.h",
        "prefill_attention_bf16.h",
    )
]
# reassociation (not -ffast-math: the online softmax relies on -inf) lets reductions use vector trees.
# -fopenmp: at::parallel_for is a header template whose OpenMP team exists only when the extension itself
# is compiled with OpenMP; without it every parallel_for here ran on one thread. Linked against the
# libgomp.so.1 torch has already loaded, so kernels and torch share one thread pool.
CFLAGS = [
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fno-signed-zeros",
    "-fassociative-math",
]
SUPPORTED_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)

BF16_DOT = os.environ.get("FERRY_DECODE_BF16_DOT", "0") == "1"
"""FERRY_DECODE_BF16_DOT=1 (default off): a bf16 cache's decode attention computes q.K and P.V with AVX512_BF16's
VDPBF16PS straight from the bf16 rows (csrc/paged_decode_bf16.h), q and the softmax weights rounded to bf16,
instead of widening every K/V value to fp32 first. Off because it was slower on the Xeon it was written on: there
VDPBF16PS zmm issues once per 2 cycles (0.60 ns against an FMA's 0.15, ops/bench/throughput/bf16_dot_rate.cpp),
so its 32 products cost what 4 FMAs do, more than the FMAs plus the shared widening it replaces; SmolLM2's decode
attention ran 4-13% slower (throughput README, "attn" round). Only where the kernel was built for a CPU with
AVX512_BF16 (decode_bf16_dot_built()) and for head sizes 64 and 128; elsewhere the widening path runs. Read at
import; benches flip this attribute to compare both paths in one process."""

_lock = threading.Lock()
_loaded: dict[str, object] = {}  # "op": the torch op, or None once a build has failed


def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's feature flags (Linux), else its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def march() -> str:
    """The compiler's target: FERRY_KERNEL_MARCH, else this CPU ('native')."""
    value = os.environ.get("FERRY_KERNEL_MARCH", "").strip() or "native"
    if not value.replace("-", "").replace(".", "").replace("+", "").isalnum():
        raise ValueError(f"FERRY_KERNEL_MARCH={value!r} is not a -march value (e.g. native, x86-64-v3)")
    return value


def cflags() -> list[str]:
    return [*CFLAGS, f"-march={march()}"]


def build_name() -> str:
    digest = hashlib.sha256()
    target = march()
    for part in (
        *(f.read_bytes() for f in SOURCES + HEADERS),
        " ".join(cflags()).encode(),
        (_cpu_features() if target == "native" else target).encode(),
        torch.__version__.encode(),
    ):
        digest.update(part)
    return f"ferry_cpu_decode_{digest.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """Where the library is built: FERRY_KERNEL_CACHE/<name>, else torch's extension directory."""
    if os.environ.get("FERRY_KERNEL_CACHE"):
        return Path(os.environ["FERRY_KERNEL_CACHE"]) / name
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False))


def _build():
    from torch.utils.cpp_extension import load

    name = build_name()
    build_dir = build_directory(name)
    prebuilt = build_dir / f"{name}.so"
    if os.environ.get("FERRY_KERNEL_CACHE") and prebuilt.is_file():
        torch.ops.load_library(str(prebuilt))  # its name pins sources, flags, target and torch: load it as it is
        return torch.ops.ferry_cpu.paged_decode_attention
    build_dir.mkdir(parents=True, exist_ok=True)
    _ninja_on_path()
    with build_lock(build_dir):
        load(
            name=name,
            sources=[str(f) for f in SOURCES],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    return torch.ops.ferry_cpu.paged_decode_attention


class build_lock:
    """An exclusive flock on <build_dir>.build-lock for the whole build. The kernel drops it when its holder
    dies, so while we hold it no other ferry build is running: torch's baton `lock` in the build directory,
    if there, is a dead build's and would make torch wait forever. Remove it."""

    def __init__(self, build_dir: Path):
        self.build_dir = build_dir
        self.path = build_dir.with_name(build_dir.name + ".build-lock")

    def __enter__(self) -> build_lock:
        self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        baton = self.build_dir / "lock"
        if baton.exists():
            log.warning("removing %s: a killed kernel build left it, and torch would wait on it forever", baton)
            baton.unlink(missing_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv's ninja wheel is not on it unless the venv is activated."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def kernel():
    """The compiled op, building it on the first call; None when it cannot be built."""
    if "op" in _loaded:  # built (or failed) already: no lock on the per-layer path
        return _loaded["op"]
    with _lock:
        if "op" not in _loaded:
            try:
                _loaded["op"] = _build()
            except Exception as exc:  # no compiler, no headers, ...: any failure means "use the reference"
                log.warning(
                    "fused CPU decode attention unavailable, using the plain-torch path: %s: %s",
                    type(exc).__name__,
                    _first_error(str(exc)),
                )
                _loaded["op"] = None
        return _loaded["op"]


def _first_error(message: str) -> str:
    """The line of a (long) compiler log that names the problem."""
    lines = [line.strip() for line in message.splitlines() if line.strip()] or [""]
    return next((line for line in lines if "error" in line.lower()), lines[-1])


def cpu_kernels_enabled() -> bool:
    """The switch of every CPU fast path (this kernel, cpu_layers.py, ferry.model.cpu_linear's packed
    weights): FERRY_CPU_KERNELS=0 forces plain torch. Read when a backend is resolved
    (ferry.kernels.backend: 'torch' instead of 'cpu'), never per call."""
    return os.environ.get("FERRY_CPU_KERNELS", "1") != "0"


def fused_decode_enabled() -> bool:
    """The fused kernel is switched on (cpu_kernels_enabled) and built (at build time and in benches)."""
    return cpu_kernels_enabled() and kernel_built()


def kernel_built() -> bool:
    """The C++ kernels are built (building them on the first call); what the forward pass asks, with the
    switch already folded into its backend."""
    return kernel() is not None


def decode_bf16_dot_built() -> bool:
    """The kernel was built with the bf16 dot-product path (a CPU, or FERRY_KERNEL_MARCH, with AVX512_BF16)."""
    return kernel_built() and bool(torch.ops.ferry_cpu.decode_bf16_dot())


def fused_paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    bf16_dot: bool | None = None,
) -> torch.Tensor:
    """Same contract as attention_ref.paged_decode_attention: q [B, H, D]; k_cache [N, bs, Hkv, D];
    v_cache [N, bs, Hkv, Dv] (any strides) ; block_tables [B, M] int64; seq_lens [B] int64 -> [B, H, Dv]
    in q's dtype, accumulated in fp32. bf16_dot: the bf16-cache path of BF16_DOT (None: that setting)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, window)
    op = kernel()
    if op is None:
        raise RuntimeError("the fused CPU decode kernel could not be built (see the warning logged above)")
    qf = q.float()
    if qf.stride(2) != 1 or qf.stride(1) != qf.shape[2]:  # rows of a wider tensor (qkv's q) are taken as they are
        qf = qf.contiguous()
    out = op(
        qf,
        k_cache,
        v_cache,
        block_tables.contiguous(),
        seq_lens.contiguous(),
        float(scale),
        int(window or 0),
        BF16_DOT if bf16_dot is None else bool(bf16_dot),
    )  # [B, H, Dv] fp32
    return out.to(q.dtype)


CHUNK_MAX_TOKENS = 8
"""Longest prefill chunk run through the decode kernel, which reads the whole context once per query row.
Measured (1 thread, 8 heads / 4 KV heads, D 64, 580-token context): at 8 tokens it ties
attention_ref.chunk_attention (0.7 ms); at 16 tokens that takes 0.6 ms to its 1.6, at 45 tokens 2.0 to 4.9."""


def fused_chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence's prefill chunk against its cache, q [L, H, D] at positions context_len.. (the chunk's own
    K/V already written) -> [L, H, Dv]. Each query row is a decode row whose sequence ends at its own
    position, which is exactly the causal (and sliding-window) mask; all rows share blocks [M], so no
    gather copy of the context is made."""
    length = q.shape[0]
    seq_lens = torch.arange(context_len + 1, context_len + length + 1, device=q.device)  # [L]
    return fused_paged_decode_attention(q, k_cache, v_cache, blocks[None].expand(length, -1), seq_lens, scale, window)


def _check(q, k_cache, v_cache, block_tables, seq_lens, window) -> None:
    """Shapes, dtypes and devices; values (lengths, block ids) are checked by the kernel."""
    for name, t in (
        ("q", q),
        ("k_cache", k_cache),
        ("v_cache", v_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
    ):
        if t.device.type != "cpu":
            raise ValueError(f"{name}: on {t.device}, the fused decode kernel runs on the CPU only")
    if q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q: expected a floating [B, H, D] tensor, got {q.dtype} {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            f"k_cache/v_cache: expected [N, bs, Hkv, D] and [N, bs, Hkv, Dv], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype not in SUPPORTED_CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"k_cache/v_cache: dtypes {k_cache.dtype}/{v_cache.dtype}, expected one of "
            f"{SUPPORTED_CACHE_DTYPES}, both the same"
        )
    batch, heads, dim = q.shape
    if k_cache.shape[3] != dim or heads % k_cache.shape[2]:
        raise ValueError(
            f"q: shape {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)} "
            f"(head_dim must match, heads must be a multiple of kv heads)"
        )
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables: expected int64 [{batch}, M], got {block_tables.dtype} {tuple(block_tables.shape)}"
        )
    if seq_lens.dtype != torch.int64 or tuple(seq_lens.shape) != (batch,):
        raise ValueError(f"seq_lens: expected int64 [{batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window: {window}, expected None or >= 1")
