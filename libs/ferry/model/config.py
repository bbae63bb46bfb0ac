"""ModelConfig: one dataclass for every supported architecture, read from a HF config.json.

Model sizes are data: Llama, Mistral and Qwen2 differ only in flags (qkv bias, tied embeddings,
sliding window); DeepSeek-V3 adds the MLA and MoE fields, which stay at their zero defaults for the
dense families.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ferry.dtypes import check_dtype_name

# HF `architectures[0]` -> our short family name.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


@dataclass(slots=True)
class ModelConfig:
    arch: str  # "llama" | "mistral" | "qwen2" | "deepseek_v3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters minus rope_theta; None = plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama attention_bias also covers o_proj
    mlp_bias: bool = False
    sliding_windows: tuple[int | None, ...] = ()  # per layer; () = no window anywhere
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    is_random: bool = False  # written by `ferry make-model`
    # --- DeepSeek-V3 (MLA + MoE); zero for the dense families ---
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    raw: dict[str, Any] = field(default_factory=dict, repr=False)  # the config.json as read

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES.values():
            raise ValueError(f"arch: unsupported {self.arch!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        check_dtype_name(self.dtype, "dtype")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError("sliding_windows: needs one entry per layer")
        if self.is_mla:
            self._check_mla()

    def _check_mla(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive for deepseek_v3")
        if self.n_routed_experts % self.n_group:
            raise ValueError(f"n_group: {self.n_group} does not divide n_routed_experts")
        if not 0 < self.num_experts_per_tok <= self.n_routed_experts:
            raise ValueError("num_experts_per_tok: must be in 1..n_routed_experts")

    @property
    def is_mla(self) -> bool:
        return self.arch == "deepseek_v3"

    def window(self, layer: int) -> int | None:
        return self.sliding_windows[layer] if self.sliding_windows else None

    def config_hash(self) -> str:
        data = asdict(self)
        data.pop("raw")
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Builds a ModelConfig from a parsed HF config.json; raises ValueError naming the field."""
    archs = hf.get("architectures") or []
    if not archs or archs[0] not in ARCHITECTURES:
        raise ValueError(f"architectures: unsupported {archs!r}; supported: {sorted(ARCHITECTURES)}")
    arch = ARCHITECTURES[archs[0]]
    num_heads = _req(hf, "num_attention_heads")
    rope_theta, rope_scaling = _rope(hf)
    kwargs: dict[str, Any] = dict(
        arch=arch,
        vocab_size=_req(hf, "vocab_size"),
        hidden_size=_req(hf, "hidden_size"),
        num_layers=_req(hf, "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or _req(hf, "hidden_size") // num_heads,
        intermediate_size=_req(hf, "intermediate_size"),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
        o_bias=arch != "qwen2" and bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        sliding_windows=_windows(hf, arch),
        dtype=_dtype(hf),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_ids(hf.get("eos_token_id")),
        is_random=bool(hf.get("ferry_random_weights", False)),
        raw=hf,
    )
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: only 'silu' is supported, got {hf.get('hidden_act')!r}")
    if arch == "deepseek_v3":
        kwargs.update(_deepseek_fields(hf))
    return ModelConfig(**kwargs)


def _deepseek_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("scoring_func/topk_method: only sigmoid + noaux_tc (DeepSeek-V3) is supported")
    return dict(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=_req(hf, "kv_lora_rank"),
        qk_nope_head_dim=_req(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=_req(hf, "qk_rope_head_dim"),
        v_head_dim=_req(hf, "v_head_dim"),
        rope_interleave=bool(hf.get("rope_interleave", True)),
        n_routed_experts=_req(hf, "n_routed_experts"),
        n_shared_experts=hf.get("n_shared_experts") or 0,
        num_experts_per_tok=_req(hf, "num_experts_per_tok"),
        moe_intermediate_size=_req(hf, "moe_intermediate_size"),
        n_group=hf.get("n_group") or 1,
        topk_group=hf.get("topk_group") or 1,
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=hf.get("first_k_dense_replace", 0),
    )


def _req(hf: dict[str, Any], name: str) -> Any:
    if hf.get(name) is None:
        raise ValueError(f"{name}: missing from config.json")
    return hf[name]


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 5 writes `rope_parameters` (theta inside); older files `rope_theta` + `rope_scaling`."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3", "yarn", "linear"):
        raise ValueError(f"rope_scaling: unsupported rope_type {kind!r}")
    params["rope_type"] = kind
    return theta, (None if kind == "default" else params)


def _windows(hf: dict[str, Any], arch: str) -> tuple[int | None, ...]:
    window = hf.get("sliding_window")
    n = hf["num_hidden_layers"]
    if not window:
        return ()
    if arch == "mistral":
        return (int(window),) * n
    if arch == "qwen2" and hf.get("use_sliding_window"):
        types = hf.get("layer_types") or ["full_attention"] * n
        return tuple(int(window) if t == "sliding_attention" else None for t in types)
    return ()


def _dtype(hf: dict[str, Any]) -> str:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint folder, a .gguf file or a pretrained model's name, without torch
    (the gateway needs only this)."""
    from ferry.model.source import resolve_model

    path = resolve_model(path)
    if path.suffix == ".gguf":
        from ferry.model.gguf_reader import open_gguf

        return open_gguf(path).config
    file = Path(path) / "config.json"
    if not file.exists():
        raise FileNotFoundError(f"{file}: missing")
    try:
        return config_from_hf(json.loads(file.read_text()))
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None
