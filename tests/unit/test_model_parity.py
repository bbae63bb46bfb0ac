"""ferry vs transformers, fp32: a batch of mixed-length prompts on the paged cache (chunked prefill,
sequences joining at different steps, >= 16 decode steps) gives the same logits and greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from ferry.model import AttentionMetadata, load_model
from ferry.model.bpe_tokenizer import train_tokenizer
from ferry.model.make_model import hf_config, make_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

ARCHS = ["llama", "qwen2", "mistral", "deepseek-v3"]
BLOCK_SIZE = 4
PROMPT_LENS = [5, 19, 1, 30]
JOIN_STEPS = [0, 0, 2, 5]  # step at which each sequence arrives
CHUNK = 12  # prefill chunk budget per sequence per step, so long prompts prefill in pieces
NUM_STEPS = 24


def _hf_written_checkpoint(arch: str, out_dir) -> None:
    """A checkpoint written by transformers itself: its own random init and save_pretrained."""
    tok = train_tokenizer(512)
    ids = {
        "bos": tok.token_to_id("<|begin_of_text|>"),
        "eos": tok.token_to_id("<|end_of_text|>"),
        "pad": tok.token_to_id("<|pad|>"),
    }
    cfg = hf_config(arch, "tiny", ids)
    cfg.pop("ferry_random_weights")
    cfg["max_position_embeddings"] = 512  # a different size than make-model's, to vary the rope tables
    if arch == "mistral":
        cfg["sliding_window"] = 16
    if arch == "deepseek-v3":  # make-model covers the q LoRA; this one the direct q_proj
        cfg["q_lora_rank"] = None
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # transformers zero-inits these; random values make the test see them
        for name, param in model.named_parameters():
            if name.endswith("bias") or "e_score_correction" in name:
                param.normal_(0, 0.05)
        for name, buf in model.named_buffers():
            if "e_score_correction" in name:
                buf.normal_(0, 0.05)
    model.save_pretrained(out_dir)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>", pad_token="<|pad|>"
    )
    fast.save_pretrained(out_dir)


@pytest.fixture(
    scope="module",
    params=[(a, s) for a in ARCHS for s in ("transformers", "make-model")],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def checkpoint(request, tmp_path_factory):
    arch, source = request.param
    out = tmp_path_factory.mktemp(f"{arch}-{source}")
    if source == "transformers":
        _hf_written_checkpoint(arch, out)
    else:
        make_model(out, arch, "tiny", seed=3)
    return out


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _run_ferry(lm, prompts):
    """Drives the paged cache like an engine would: -> per sequence, list of (logits, token) per output."""
    kv = lm.model.make_kv_cache(num_blocks=64, block_size=BLOCK_SIZE)
    free = list(range(63, -1, -1))
    tokens = [list(p) for p in prompts]
    cached = [0] * len(prompts)
    tables: list[list[int]] = [[] for _ in prompts]
    outputs: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in range(NUM_STEPS):
        active = [i for i in range(len(prompts)) if JOIN_STEPS[i] <= step]
        qlens = [min(CHUNK, len(tokens[i]) - cached[i]) for i in active]
        for i, q in zip(active, qlens):
            while len(tables[i]) * BLOCK_SIZE < cached[i] + q:
                tables[i].append(free.pop())
        meta = AttentionMetadata.build(qlens, [cached[i] for i in active], [tables[i] for i in active], BLOCK_SIZE)
        ids = torch.tensor([t for i, q in zip(active, qlens) for t in tokens[i][cached[i] : cached[i] + q]])
        pos = torch.tensor([p for i, q in zip(active, qlens) for p in range(cached[i], cached[i] + q)])
        logits = lm.model(ids, pos, meta, kv)
        assert logits.shape == (len(active), lm.config.vocab_size) and logits.dtype == torch.float32
        for row, (i, q) in enumerate(zip(active, qlens)):
            cached[i] += q
            if cached[i] == len(tokens[i]):  # prompt done (or decoding): sample greedily
                outputs[i].append(logits[row])
                tokens[i].append(int(logits[row].argmax()))
    return tokens, outputs


def _run_transformers(model, prompt, generated):
    """transformers' own forward and KV cache, one sequence at a time, fed ferry's tokens."""
    cache = transformers.DynamicCache(config=model.config)
    logits = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), cache=cache, use_cache=True)
        logits.append(out.logits[0, -1])
        for token in generated[:-1]:
            out = model(torch.tensor([[token]]), cache=cache, use_cache=True)
            logits.append(out.logits[0, -1])
    return logits


def test_logits_and_greedy_tokens_match_transformers(checkpoint):
    lm = load_model(checkpoint)
    prompts = _prompts(min(lm.config.vocab_size, lm.tokenizer.vocab_size))
    tokens, outputs = _run_ferry(lm, prompts)
    assert min(len(o) for o in outputs) >= 16
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    for prompt, seq_tokens, seq_logits in zip(prompts, tokens, outputs):
        generated = seq_tokens[len(prompt) :]
        reference = _run_transformers(model, prompt, generated)
        for step, (ours, theirs) in enumerate(zip(seq_logits, reference)):
            torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4, msg=f"step {step}")
        assert [int(r.argmax()) for r in reference] == generated


def test_config_marks_random(checkpoint):
    lm = load_model(checkpoint)
    hf = json.loads((checkpoint / "config.json").read_text())
    assert lm.is_random == bool(hf.get("ferry_random_weights"))
