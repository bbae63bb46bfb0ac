"""`ferry export-hf MODEL DIR`: a GGUF file (or `smollm2`) as a HF checkpoint folder, for peers that
load only such folders (vLLM): every weight dequantized to float32 safetensors (Q/K rows in HF order),
config.json and generation_config.json from the file's metadata, and the tokenizer ferry builds from
that metadata (tokenizer.json, tokenizer_config.json with the chat template and special tokens).

Dense families only (llama, mistral, qwen2), plain or linear/yarn RoPE; anything else is refused.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ferry.model.config import ModelConfig
from ferry.model.make_model import ARCH_NAMES, MODEL_TYPES

EXPORTABLE_ROPE = (None, "linear", "yarn")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a .gguf file or a pretrained model's name (smollm2)")
    parser.add_argument("out_dir", type=Path)


def run(args: argparse.Namespace) -> int:
    out = export_hf(args.model, args.out_dir)
    print(f"wrote {args.model} as a float32 HF checkpoint to {out}")
    return 0


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for a dense ModelConfig read from a GGUF file."""
    if cfg.arch not in ARCH_NAMES or cfg.is_mla:
        raise ValueError(f"export-hf: architecture {cfg.arch!r} is not exportable (dense llama/mistral/qwen2 only)")
    kind = (cfg.rope_scaling or {}).get("rope_type")
    if kind not in EXPORTABLE_ROPE:
        raise ValueError(f"export-hf: rope scaling {kind!r} is not exportable")
    config: dict[str, Any] = dict(
        architectures=[ARCH_NAMES[cfg.arch]],
        model_type=MODEL_TYPES[cfg.arch],
        hidden_act="silu",
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        tie_word_embeddings=cfg.tie_word_embeddings,
        torch_dtype="float32",
        use_cache=True,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
    )
    if cfg.arch == "llama":
        config.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if cfg.arch == "mistral":
        config["sliding_window"] = cfg.sliding_windows[0] if cfg.sliding_windows else None
    if cfg.arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def export_hf(model: str | Path, out_dir: str | Path) -> Path:
    """Writes the folder and returns it."""
    from ferry.model.gguf_reader import is_gguf, open_gguf
    from ferry.model.source import resolve_model

    path = resolve_model(model)
    if not is_gguf(path):
        raise ValueError(f"export-hf: {path} is not a .gguf file")
    f = open_gguf(path)
    config = hf_config(f.config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = dict(bos_token_id=f.config.bos_token_id, eos_token_id=list(f.config.eos_token_ids))
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    _write_tokenizer(f, out)
    _write_weights(f, out)
    return out


def _write_tokenizer(f, out: Path) -> None:
    from ferry.model.gguf_tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(f)
    tok.backend.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {k: v for k, v in tok.special_tokens.items() if v is not None}
    config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=f.config.max_position_embeddings,
        clean_up_tokenization_spaces=False,
    )
    if tok.chat_template:
        config["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


def _write_weights(f, out: Path) -> None:
    from safetensors.torch import save_file

    tensors = {name: f.tensor(name).contiguous() for name in sorted(f.hf_names) if name}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
