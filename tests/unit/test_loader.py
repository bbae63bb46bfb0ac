"""Checkpoint loading: errors that name the file and tensor, sharded weights, tokenizer, EOS ids,
fingerprint, and the paged cache's block read/write round trip."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferry.model import AttentionMetadata, load_model
from ferry.model.make_model import make_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", "tiny", seed=0)


@pytest.fixture
def copy(tiny, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny, dst)
    return dst


def test_loads_config_tokenizer_and_eos(tiny):
    lm = load_model(tiny)
    assert lm.config.arch == "llama" and lm.config.num_layers == 2 and lm.is_random
    tok = lm.tokenizer
    eos, im_end = tok.encode("<|end_of_text|><|im_end|>", add_special_tokens=False)
    assert lm.eos_token_ids == [eos, im_end]
    ids = tok.encode("hello ferry world")
    assert ids[0] == tok.token_id("bos_token") and tok.decode(ids) == "hello ferry world"
    assert tok.convert_ids_to_tokens(ids[:1]) == ["<|begin_of_text|>"]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_architecture_names_config(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*GPT2LMHeadModel"):
        load_model(copy)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(copy, name):
    (copy / name).unlink()
    with pytest.raises(FileNotFoundError, match=name.replace(".", r"\.")):
        load_model(copy)


def test_wrong_shape_names_file_and_tensor(copy):
    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.layers\.1\.self_attn\.k_proj\.weight.*\(3, 64\)"):
        load_model(copy)


def test_missing_tensor_is_named(copy):
    tensors = load_file(str(copy / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(copy / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.safetensors.*model\.norm\.weight"):
        load_model(copy)


def test_sharded_checkpoint_loads_same_weights(tiny, tmp_path):
    sharded = make_model(tmp_path / "sharded", "llama", "tiny", seed=0, max_shard_mb=0.1)
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, b = load_model(tiny).model.state_dict(), load_model(sharded).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_is_named(tmp_path):
    sharded = make_model(tmp_path / "sharded", "llama", "tiny", seed=0, max_shard_mb=0.1)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-\d+\.safetensors"):
        load_model(sharded)


def test_fingerprint_separates_weights_and_dtype(tiny, tmp_path):
    other = make_model(tmp_path / "other", "llama", "tiny", seed=1)
    assert load_model(tiny).fingerprint == load_model(tiny).fingerprint
    assert load_model(tiny).fingerprint != load_model(other).fingerprint
    assert load_model(tiny).fingerprint != load_model(tiny, dtype="bfloat16").fingerprint


def test_kv_blocks_round_trip_between_caches(tiny):
    """read_blocks from one cache, write_blocks into another: decoding continues identically."""
    lm = load_model(tiny)
    prompt = lm.tokenizer.encode("the ferry crossed the river at night")[:10]
    n = len(prompt)
    src = lm.model.make_kv_cache(8, 4)
    meta = AttentionMetadata.build([n], [0], [[5, 2, 7]], 4)
    lm.model(torch.tensor(prompt), torch.arange(n), meta, src)
    data = src.read_blocks([5, 2, 7])
    assert data.shape == (3, *src.block_shape) and data.is_contiguous()
    dst = lm.model.make_kv_cache(8, 4)
    dst.write_blocks([0, 1, 3], data)
    step = [AttentionMetadata.build([1], [n], [t], 4) for t in ([5, 2, 7], [0, 1, 3])]
    token, pos = torch.tensor([prompt[-1]]), torch.tensor([n])
    torch.testing.assert_close(lm.model(token, pos, step[0], src), lm.model(token, pos, step[1], dst))
    with pytest.raises(ValueError, match="data: shape"):
        dst.write_blocks([0], data)


def test_metadata_rejects_short_block_table():
    with pytest.raises(ValueError, match=r"block_tables\[1\]"):
        AttentionMetadata.build([3, 9], [0, 0], [[0], [1, 2]], 4)
    meta = AttentionMetadata.build([3, 1], [0, 6], [[0], [1, 2]], 4)
    assert meta.slot_mapping.tolist() == [0, 1, 2, 2 * 4 + 2]
    assert meta.logits_indices.tolist() == [2, 3] and meta.seq_lens.tolist() == [3, 7]


def test_chat_template_renders_like_transformers(tiny, tmp_path):
    """A transformers-saved tokenizer with a template using loop controls, tojson and raise_exception."""
    transformers = pytest.importorskip("transformers")
    from ferry.model import Tokenizer

    template = (
        "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
        "{% set messages = messages[1:] %}{% else %}{% set sys = 'default' %}{% endif %}"
        "{{ bos_token }}[SYS]{{ sys | tojson }}\n"
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role') }}{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "  <{{ m['role'] }}> {{ m['content'] | trim }}{{ eos_token if m['role'] == 'assistant' }}\n"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(tiny / "tokenizer.json"), bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    fast.chat_template = template
    fast.save_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    messages = [
        {"role": "system", "content": 'be "brief" ü'},
        {"role": "user", "content": " hi "},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "again"},
    ]
    for gen in (True, False):
        expected = fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    assert ours.encode("hi there") == fast("hi there")["input_ids"]
    with pytest.raises(Exception, match="bad role"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_weights_are_allocated_in_the_target_dtype_only(tiny, monkeypatch):
    """A bf16 load never materialises the model in fp32 first (twice the peak memory)."""
    from ferry.model.causal_lm import CausalLM

    allocated = []
    to_empty = CausalLM.to_empty

    def recording_to_empty(self, *, device, recurse=True):
        allocated.extend({p.dtype for p in self.parameters()})
        return to_empty(self, device=device, recurse=recurse)

    monkeypatch.setattr(CausalLM, "to_empty", recording_to_empty)
    lm = load_model(tiny, dtype="bfloat16")
    assert set(allocated) == {torch.bfloat16}
    assert lm.model.lm_head.weight.dtype == torch.bfloat16
