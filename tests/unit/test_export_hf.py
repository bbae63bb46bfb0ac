"""`ferry export-hf`: a GGUF file written back as a HF checkpoint folder loads in transformers (what vLLM
reads) to the model ferry loads from the GGUF: same weights, same tokens, same logits; what cannot be
written as a HF config (Llama-3 rope factors) is refused."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_files import checkpoint_to_gguf

from ferry.cli import main as ferry_main
from ferry.model import AttentionMetadata, load_model
from ferry.model.export_hf import export_hf
from ferry.model.make_model import make_model

pytestmark = pytest.mark.unit
TEXT = "hello ferry world, the river boat"


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def exported(request, tmp_path_factory):
    """(the GGUF file, the folder `ferry export-hf` wrote from it)."""
    root = tmp_path_factory.mktemp(f"export-{request.param}")
    gguf = checkpoint_to_gguf(make_model(root / "ckpt", request.param, "tiny", seed=3), root / "model.gguf")
    assert ferry_main(["export-hf", str(gguf), str(root / "hf")]) == 0
    return gguf, root / "hf"


def test_transformers_loads_the_same_model(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, folder = exported
    ours = load_model(gguf)
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = ours.tokenizer.encode(TEXT)
    assert tok.encode(TEXT) == ids and tok.decode(ids, skip_special_tokens=True) == TEXT
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ours.tokenizer.apply_chat_template(messages)
    )
    state = theirs.state_dict()
    for name, param in ours.model.named_parameters():
        assert torch.equal(state[name], param), name
    kv = ours.model.make_kv_cache(num_blocks=8, block_size=16)
    meta = AttentionMetadata.build([len(ids)], [0], [list(range(8))], 16)
    with torch.no_grad():
        mine = ours.model(torch.tensor(ids), torch.arange(len(ids)), meta, kv)[0]
        ref = theirs(torch.tensor([ids])).logits[0, -1]  # ferry's forward gives the last position's logits
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


def test_config_and_generation_config_carry_the_eos_ids(exported):
    gguf, folder = exported
    cfg = load_model(gguf).config
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(cfg.eos_token_ids)
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"


def test_llama3_rope_factors_are_refused(tmp_path):
    gguf = checkpoint_to_gguf(make_model(tmp_path / "ckpt", "llama", "tiny"), tmp_path / "model.gguf")
    with pytest.raises(ValueError, match="rope scaling 'factors' is not exportable"):
        export_hf(gguf, tmp_path / "hf")
