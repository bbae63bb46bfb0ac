"""Writing GGUF files for tests the way llama.cpp's converter does (from facts about its output):
Llama/Mistral Q/K rows permuted to interleaved rotary pairs, norms kept F32, Llama-3 rope scaling as
a `rope_freqs` tensor of divisors, the byte-level BPE tokenizer as `tokenizer.ggml.*` metadata."""

from __future__ import annotations

import json
import math
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import quantize
from safetensors.numpy import load_file

CONTROL, NORMAL = 3, 1
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_GLOBAL["lm_head.weight"] = "output.weight"


def gguf_name(hf: str) -> str:
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    parts = hf.split(".")  # model.layers.N.<module>.<leaf>.weight|bias
    return f"blk.{parts[2]}.{_LAYER['.'.join(parts[3:-1])]}.{parts[-1]}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """The converter's permute: halves-rotary rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    s, dim = cfg["rope_scaling"], cfg["head_dim"]
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / cfg["rope_theta"] ** (i / dim))
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def checkpoint_to_gguf(ckpt: Path, out: Path, qtype=gguf.GGMLQuantizationType.F32, arch: str | None = None) -> Path:
    """A ferry/HF checkpoint folder (llama, mistral or qwen2) as a GGUF file; matrices stored as qtype."""
    cfg = json.loads((ckpt / "config.json").read_text())
    family = cfg["model_type"]
    arch = arch or ("qwen2" if family == "qwen2" else "llama")  # the converter writes Mistral as 'llama'
    w = gguf.GGUFWriter(str(out), arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_uint32(f"{arch}.vocab_size", cfg["vocab_size"])
    _add_tokenizer(w, ckpt)
    if (cfg.get("rope_scaling") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    for name, value in sorted(load_file(str(ckpt / "model.safetensors")).items()):
        value = value.astype(np.float32)
        if arch != "qwen2" and ".q_proj." in name:
            value = permute(value, cfg["num_attention_heads"])
        elif arch != "qwen2" and ".k_proj." in name:
            value = permute(value, cfg["num_key_value_heads"])
        if value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            stored = value.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else quantize(value, qtype)
            w.add_tensor(gguf_name(name), stored, raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w: gguf.GGUFWriter, ckpt: Path) -> None:
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([CONTROL if t in special else NORMAL for t in tokens])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab[tok_cfg["bos_token"]])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_add_bos_token(True)
    w.add_chat_template(tok_cfg["chat_template"])


def sentencepiece_gguf(out: Path, with_merges: bool = False) -> Path:
    """A GGUF holding only a SentencePiece-style BPE vocabulary (Llama 2 / Mistral 7B layout: <unk>,
    <s>, </s>, the 256 <0xNN> byte tokens, then pieces scored by merge order), trained here."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ferry.model.bpe_tokenizer import _corpus

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials, show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t in tokens]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0 if k != 1 else -float(i) for i, k in enumerate(types)])
    w.add_token_types(types)
    if with_merges:
        w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in model["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
