"""`ferry make-model`: write a random-weight HF-format checkpoint (config, safetensors, tokenizer).

The checkpoint loads in ferry and in transformers alike; `ferry_random_weights: true` in config.json
marks it random so the system can say so. Sizes are data (SIZES below), not code.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ferry.dtypes import DTYPE_NAMES, torch_dtype

ARCH_NAMES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "deepseek-v3": "DeepseekV3ForCausalLM",
}
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "deepseek-v3": "deepseek_v3"}

# shapes shared by every family at a size; BENCH is the Llama shape from shared/BENCHMARKS.md
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
    "1b": dict(  # Llama-3.2-1B's shape (shared/BENCHMARKS.md: the GPU model, random bf16 weights)
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=8192,
        vocab_size=128256,
        max_position_embeddings=131072,
    ),
    "bench": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=1408,
        vocab_size=2048,
        max_position_embeddings=8192,
    ),
}
# per-family extras; each one exercises what makes the family different
EXTRAS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        size: dict(
            rope_theta=500000.0,
            rope_scaling=dict(
                rope_type="llama3",
                factor=32.0 if size == "1b" else 8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=SIZES[size]["max_position_embeddings"] // (16 if size == "1b" else 8),
            ),
            **(dict(tie_word_embeddings=True) if size == "1b" else {}),
        )
        for size in SIZES
    },
    "mistral": {"tiny": dict(sliding_window=24), "bench": dict(sliding_window=4096)},
    "qwen2": {size: dict(tie_word_embeddings=True, rope_theta=1000000.0, use_sliding_window=False) for size in SIZES},
    "deepseek-v3": {
        "tiny": dict(
            num_hidden_layers=3,
            num_key_value_heads=4,
            head_dim=8,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
        ),
        "bench": dict(
            num_key_value_heads=8,
            head_dim=32,
            q_lora_rank=192,
            kv_lora_rank=128,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            moe_intermediate_size=352,
            first_k_dense_replace=1,
        ),
    },
}
DEEPSEEK_COMMON = dict(
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    rope_interleave=True,
    rope_theta=10000.0,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=sorted(ARCH_NAMES), default="llama")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float32")
    parser.add_argument(
        "--max-shard-mb",
        type=float,
        default=0.0,
        help="split weights into shards of at most this size with an index (0 = one file)",
    )
    parser.add_argument("out_dir", type=Path)


def run(args: argparse.Namespace) -> int:
    make_model(args.out_dir, args.arch, args.size, seed=args.seed, dtype=args.dtype, max_shard_mb=args.max_shard_mb)
    print(f"wrote random-weight {args.arch} ({args.size}) checkpoint to {args.out_dir}")
    return 0


def _token_id(tok, token: str) -> int:
    token_id = tok.token_to_id(token)
    assert token_id is not None, f"{token!r}: not in the trained vocabulary"  # the trainer adds every special token
    return token_id


def hf_config(arch: str, size: str, vocab_ids: dict[str, int], dtype: str = "float32") -> dict[str, Any]:
    if arch not in ARCH_NAMES:
        raise ValueError(f"arch: unsupported {arch!r}, expected one of {sorted(ARCH_NAMES)}")
    if size not in SIZES or size not in EXTRAS[arch]:
        sizes = sorted(s for s in SIZES if s in EXTRAS[arch])
        raise ValueError(f"size: unsupported {size!r} for {arch}, expected one of {sizes}")
    config = dict(
        architectures=[ARCH_NAMES[arch]],
        model_type=MODEL_TYPES[arch],
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        torch_dtype=dtype,
        initializer_range=0.02,
        attention_bias=False,
        use_cache=True,
    )
    config.update(SIZES[size])
    if arch == "deepseek-v3":
        yarn = dict(
            rope_type="yarn",
            factor=4.0,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=SIZES[size]["max_position_embeddings"] // 4,
        )
        config.update(DEEPSEEK_COMMON, rope_scaling=yarn)
    config.update(EXTRAS[arch][size])
    config.update(
        bos_token_id=vocab_ids["bos"],
        eos_token_id=vocab_ids["eos"],
        pad_token_id=vocab_ids["pad"],
        ferry_random_weights=True,
    )
    return config


def make_model(
    out_dir: str | Path, arch: str, size: str, seed: int = 0, dtype: str = "float32", max_shard_mb: float = 0.0
) -> Path:
    """Writes the checkpoint and returns its folder."""
    from ferry.model import bpe_tokenizer as bpe

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = bpe.train_tokenizer(SIZES[size]["vocab_size"])
    specials = {"bos": bpe.BOS, "eos": bpe.EOS, "pad": bpe.PAD, "im_end": bpe.IM_END}
    ids = {name: _token_id(tok, token) for name, token in specials.items()}
    config = hf_config(arch, size, ids, dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    generation = dict(bos_token_id=ids["bos"], eos_token_id=[ids["eos"], ids["im_end"]], pad_token_id=ids["pad"])
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    bpe.save_tokenizer(tok, out_dir)
    _write_weights(out_dir, config, seed, dtype, max_shard_mb)
    return out_dir


def _write_weights(out_dir: Path, hf: dict[str, Any], seed: int, dtype: str, max_shard_mb: float) -> None:
    import torch

    from ferry.model.causal_lm import CausalLM
    from ferry.model.config import config_from_hf
    from ferry.model.random_init import random_state_dict, save_state_dict

    cfg = config_from_hf(hf)
    generator = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = CausalLM(cfg)
    tensors = random_state_dict(model, generator, std=hf["initializer_range"])
    target = torch_dtype(dtype)
    save_state_dict({k: v.to(target) for k, v in tensors.items()}, out_dir, max_shard_mb)
