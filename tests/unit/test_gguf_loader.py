"""GGUF loading: a checkpoint written as llama.cpp's converter writes it loads to the same model
(Q/K rows un-permuted, Llama-3 rope factors, tied embeddings, Qwen2 biases), tokenizes the same, and
anything unsupported is refused at load naming the tensor and its type."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf_files import checkpoint_to_gguf, permute, sentencepiece_gguf

from ferry.model import AttentionMetadata, load_model
from ferry.model.gguf_reader import GgufFile
from ferry.model.make_model import make_model
from ferry.model.source import model_problem, served_name

pytestmark = pytest.mark.unit
Q = gguf.GGMLQuantizationType
TEXT = "hello ferry world, the river boat"


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def pair(request, tmp_path_factory):
    """(checkpoint folder, the same checkpoint as an F32 GGUF)."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    ckpt = make_model(root / "ckpt", request.param, "tiny", seed=5)
    return ckpt, checkpoint_to_gguf(ckpt, root / "model.gguf")


def _prefill_logits(lm, ids: list[int]) -> torch.Tensor:
    kv = lm.model.make_kv_cache(num_blocks=8, block_size=16)
    meta = AttentionMetadata.build([len(ids)], [0], [list(range(8))], 16)
    return lm.model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)[0]


def test_f32_gguf_loads_the_same_model(pair):
    ckpt, path = pair
    ours, ref = load_model(path), load_model(ckpt)
    assert ours.config.arch == ("qwen2" if ref.config.arch == "qwen2" else "llama")
    assert ours.config.tie_word_embeddings == ref.config.tie_word_embeddings
    assert ours.config.qkv_bias == ref.config.qkv_bias and not ours.is_random
    for (name, a), (_, b) in zip(ours.model.named_parameters(), ref.model.named_parameters()):
        assert torch.equal(a, b), name
    ids = ref.tokenizer.encode(TEXT)
    assert ours.tokenizer.encode(TEXT) == ids and ours.tokenizer.decode(ids) == TEXT
    messages = [{"role": "user", "content": "hi"}]
    assert ours.tokenizer.apply_chat_template(messages) == ref.tokenizer.apply_chat_template(messages)
    torch.testing.assert_close(_prefill_logits(ours, ids), _prefill_logits(ref, ids), atol=1e-5, rtol=1e-5)
    assert ours.eos_token_ids == [ref.tokenizer.token_id("eos_token")]
    assert ours.fingerprint != ref.fingerprint


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_gguf_is_dequantized_near_the_original(pair, qtype, tmp_path):
    ckpt, _ = pair
    lm = load_model(checkpoint_to_gguf(ckpt, tmp_path / "q.gguf", qtype), weights_dtype="float32")  # dequantized
    ref = load_model(ckpt)
    assert lm.model.lm_head.weight.dtype == torch.float32
    tolerance = {Q.F16: 1e-3, Q.Q8_0: 0.01, Q.Q4_0: 0.2, Q.Q4_1: 0.2}[qtype]  # relative, per matrix
    for (name, a), (_, b) in zip(lm.model.named_parameters(), ref.model.named_parameters()):
        assert (a - b).norm() <= tolerance * b.norm(), name


def _rewrite(path, out, arch=None, tensor_type=None, extra_tensor=None):
    """A copy of the GGUF at path with a different architecture, one tensor retyped, or one more tensor."""
    reader = gguf.GGUFReader(str(path))
    arch = arch or reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch)
    old = reader.fields["general.architecture"].contents()
    for key, field in reader.fields.items():
        if key.startswith(("GGUF.", "general.architecture")):
            continue
        value, kind = field.contents(), field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key.replace(f"{old}.", f"{arch}.", 1), value, kind, sub_type=sub)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_down.weight" and tensor_type is not None:
            block, size = gguf.GGML_QUANT_SIZES[tensor_type]
            w.add_tensor(t.name, np.zeros((t.shape[1], t.shape[0] // block * size), np.uint8), raw_dtype=tensor_type)
        else:
            w.add_tensor(t.name, np.asarray(t.data))
    if extra_tensor:
        w.add_tensor(extra_tensor, np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-refuse")
    return checkpoint_to_gguf(make_model(root / "ckpt", "llama", "tiny"), root / "llama.gguf")


def test_q_and_k_rows_are_put_back(llama_gguf):
    f = GgufFile(llama_gguf)
    for gguf_name, name, heads in (
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", f.config.num_heads),
        ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj.weight", f.config.num_kv_heads),
    ):
        stored = np.asarray(f._tensors[gguf_name].data)
        raw = f.raw_tensor(name)
        assert np.array_equal(permute(raw.data, heads), stored) and not np.array_equal(raw.data, stored)


def test_unsupported_tensor_type_is_refused_naming_tensor_and_type(llama_gguf, tmp_path):
    bad = _rewrite(llama_gguf, tmp_path / "q5k.gguf", tensor_type=Q.Q5_0)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_down\.weight' has type Q5_0"):
        load_model(bad)


def test_unsupported_architecture_and_unknown_tensor_are_refused(llama_gguf, tmp_path):
    with pytest.raises(ValueError, match=r"architecture 'phi3' is not supported"):
        load_model(_rewrite(llama_gguf, tmp_path / "phi3.gguf", arch="phi3"))
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.attn_q_norm\.weight' \(F32\) is not a known llama"):
        load_model(_rewrite(llama_gguf, tmp_path / "extra.gguf", extra_tensor="blk.0.attn_q_norm.weight"))


def test_generate_cli_refuses_a_bad_gguf_in_one_line(llama_gguf, tmp_path):
    bad = _rewrite(llama_gguf, tmp_path / "q5.gguf", tensor_type=Q.Q5_0)
    cmd = [sys.executable, "-m", "ferry.cli", "generate", "--model", str(bad), "--prompt", "hi"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "'blk.0.ffn_down.weight' has type Q5_0" in result.stderr


def test_model_paths_are_checked_by_kind(llama_gguf, tmp_path):
    assert model_problem(llama_gguf) is None
    assert "no such checkpoint folder or .gguf file" in model_problem(tmp_path / "nothing.gguf")
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "not a .gguf file" in model_problem(tmp_path / "weights.bin")
    assert "no config.json" in model_problem(tmp_path)
    assert served_name(llama_gguf) == "llama" and served_name("smollm2") == "SmolLM2-135M-Instruct.Q4_1"


SPM_TEXTS = ["hello ferry world", "  two  spaces\nand a new line", "Ünïcödé 日本語 🚀", "<s>the boat</s> 42!"]


@pytest.mark.parametrize("with_merges", [False, True], ids=["merges-from-scores", "merges-in-file"])
def test_sentencepiece_vocabulary_tokenizes_as_transformers_does(tmp_path, with_merges):
    from transformers import AutoTokenizer

    from ferry.model.gguf_tokenizer import tokenizer_from_gguf

    path = sentencepiece_gguf(tmp_path / "spm.gguf", with_merges)
    ours = tokenizer_from_gguf(GgufFile(path))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("the")[0] == 1  # BOS: llama.cpp adds it to a SentencePiece vocabulary by default
    assert "<0xE6>" in ours.convert_ids_to_tokens(ours.encode("日"))  # unknown characters fall back to bytes


def test_bench_sizes_its_workload_from_a_gguf(llama_gguf):
    from ferry.bench.cli import _model_vocab

    assert _model_vocab(str(llama_gguf)) == GgufFile(llama_gguf).config.vocab_size == 512


@pytest.mark.parametrize("service", ["worker", "gateway"])
def test_services_refuse_a_bad_gguf_at_start_in_one_line(llama_gguf, tmp_path, service):
    """Before any NATS connection (none answers here): one line naming the tensor and its type."""
    import os

    bad = _rewrite(llama_gguf, tmp_path / "q5.gguf", tensor_type=Q.Q5_0)
    env = dict(
        os.environ, FERRY_MODEL=str(bad), FERRY_NATS_URL="nats://127.0.0.1:1", FERRY_REDIS_URL="redis://127.0.0.1:1"
    )
    result = subprocess.run(
        [sys.executable, "-m", f"ferry_services.{service}"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "'blk.0.ffn_down.weight' has type Q5_0" in result.stderr
