"""The bound calls of a small pure-decode CPU step (ferry.model.decode_calls): the same logits, bit for bit, as the
model's general CPU path, the same greedy tokens from an engine, and the general path wherever they do not apply
(float weights, prefill rows, a batch that the bf16 copy multiplies)."""

from __future__ import annotations

import pytest
import torch

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.kernels import kernel_built
from ferry.kernels import quant_linear as qkernels
from ferry.model import AttentionMetadata, decode_calls, load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not kernel_built(), reason="the C++ CPU kernels could not be built here"),
]
BLOCK = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("decode-calls") / "tiny", "llama", "tiny", seed=0)


def _decode_logits(lm, kv, context_lens: list[int], general: bool) -> torch.Tensor:
    """One decode step of len(context_lens) sequences (sequence i on blocks 4i..4i+3) -> [B, vocab] logits."""
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(context_lens))]
    ids = [(7 * i + 3) % lm.config.vocab_size for i in range(len(context_lens))]
    (input_ids, positions), meta = AttentionMetadata.build_with_inputs(
        [1] * len(context_lens), context_lens, tables, BLOCK, ids
    )
    if general:
        lm.model._decode_calls = None  # what decode_calls() answers for a model it does not take
    try:
        return lm.model(input_ids, positions, meta, kv)
    finally:
        lm.model._decode_calls = False


@pytest.mark.parametrize("cpp_loop", [True, False])
@pytest.mark.parametrize("weights_dtype", ["int4", "int8"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_a_decode_step_gives_the_general_paths_logits_bit_for_bit(tiny, weights_dtype, batch, cpp_loop, monkeypatch):
    monkeypatch.setattr(decode_calls, "CPP_LOOP", cpp_loop)
    lm = load_model(tiny, weights_dtype=weights_dtype)
    assert decode_calls.decode_calls(lm.model) is not None  # else this test would compare the general path to itself
    kv = lm.model.make_kv_cache(4 * batch, BLOCK)
    torch.manual_seed(0)
    kv.data.normal_()  # a context already cached: every sequence attends to 20-50 tokens of it
    context = [20 + 5 * i for i in range(batch)]
    fast = _decode_logits(lm, kv, context, general=False)
    assert isinstance(lm.model._decode_calls, bool)  # reset by the helper: it was built and used
    general = _decode_logits(lm, kv, context, general=True)
    assert torch.equal(fast, general)
    assert torch.equal(_decode_logits(lm, kv, context, general=False), fast)  # a second step: the bound lists kept


def _copy_model(tiny, weights_dtype: str, monkeypatch):
    """A model whose projections hold bf16 copies packed for our kernels (csrc/bf16_amx.h, or csrc/bf16_dot.h without
    AMX; skips where neither runs)."""
    amx = qkernels.BF16_AMX and qkernels.bf16_amx_usable()
    if not (amx or (qkernels.BF16_DOT_GEMM and qkernels.bf16_dot_usable())):
        pytest.skip("the bf16 copies multiply through our kernels only on a CPU with AMX-BF16 or AVX512_BF16")
    monkeypatch.setattr(qkernels, "BF16_COPY_FROM_ROWS", 16)  # load_model's prepack makes the copies
    lm = load_model(tiny, weights_dtype=weights_dtype)
    calls = decode_calls.decode_calls(lm.model)
    assert calls is not None and calls.has_bf16_copy and len(calls.copies) == 4 * len(calls.layers)
    return lm


@pytest.mark.parametrize("cpp_loop", [True, False])
@pytest.mark.parametrize("bf16_activations", [True, False])
@pytest.mark.parametrize("weights_dtype", ["int4", "int8"])
@pytest.mark.parametrize("batch", [15, 16, 17, 24])
def test_a_step_of_the_copys_rows_gives_the_general_paths_logits_bit_for_bit(
    tiny, weights_dtype, batch, bf16_activations, cpp_loop, monkeypatch
):
    """Either side of BF16_COPY_FROM_ROWS (16): 15 rows through the int8-activation kernel, 16+ through the bf16
    copies (gate/up -> down in bf16 with BF16_ACTIVATIONS, else fp32), the same logits as the general path."""
    monkeypatch.setattr(decode_calls, "CPP_LOOP", cpp_loop)
    monkeypatch.setattr(qkernels, "BF16_ACTIVATIONS", bf16_activations)
    lm = _copy_model(tiny, weights_dtype, monkeypatch)
    kv = lm.model.make_kv_cache(4 * batch, BLOCK)
    torch.manual_seed(0)
    kv.data.normal_()
    context = [20 + i for i in range(batch)]
    ops = torch.ops.ferry_cpu
    counter = ops.bf16_amx_calls if qkernels.bf16_amx_usable() else ops.bf16_dot_calls  # quant_linear.copy_op's
    before, runs, run = counter(), [], decode_calls.run
    monkeypatch.setattr(decode_calls, "run", lambda *a: runs.append(1) or run(*a))
    fast = _decode_logits(lm, kv, context, general=False)
    copy_calls = counter() - before
    assert runs == [1]  # the bound calls served the step
    head = getattr(lm.model.lm_head, "bf16_copy", None) is not None  # lm_head's matmul, after the layers
    assert copy_calls == ((4 * lm.config.num_layers + head) if batch >= 16 else 0)  # the copies multiplied, or not
    general = _decode_logits(lm, kv, context, general=True)
    assert runs == [1] and torch.equal(fast, general)
    assert torch.equal(_decode_logits(lm, kv, context, general=False), fast)


def test_a_step_of_the_copys_rows_differs_from_the_kernels(tiny, monkeypatch):
    """The copy mode is really taken: the same 16 rows through the int8-activation kernel give other logits."""
    lm = _copy_model(tiny, "int4", monkeypatch)
    kv = lm.model.make_kv_cache(64, BLOCK)
    torch.manual_seed(0)
    kv.data.normal_()
    context = [20 + i for i in range(16)]
    copy = _decode_logits(lm, kv, context, general=False)
    monkeypatch.setattr(qkernels, "BF16_COPY_FROM_ROWS", 17)
    assert not torch.equal(copy, _decode_logits(lm, kv, context, general=False))


def test_copy_steps_need_every_projections_amx_copy(tiny, monkeypatch):
    """A projection without a copy (past FERRY_QUANT_BF16_COPY_MAX_MB) or with one packed for oneDNN: the general
    path takes steps of the copy's rows; smaller steps keep the bound calls."""
    lm = _copy_model(tiny, "int4", monkeypatch)
    lm.model.model.layers[-1].mlp.down_proj.bf16_copy = None
    calls = decode_calls.decode_calls(lm.model)
    assert calls is not None and calls.copies == []
    kv = lm.model.make_kv_cache(8, BLOCK)
    assert calls.takes(15, kv) and not calls.takes(16, kv)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("decode-calls") / "bench", "llama", "bench", seed=0)  # head_dim 64


@pytest.mark.parametrize("cpp_loop", [True, False])
def test_the_bf16_dot_setting_reaches_their_attention_on_a_bf16_cache(bench, cpp_loop, monkeypatch):
    """cpu_decode.BF16_DOT (FERRY_DECODE_BF16_DOT) picks paged attention's path in the bound calls too: with it on,
    the same logits as the general path with it on, and not those with it off (the VDPBF16PS path rounds q)."""
    from ferry.kernels import cpu_decode

    if not cpu_decode.decode_bf16_dot_built():
        pytest.skip("the VDPBF16PS path is built only for a CPU with AVX512_BF16")
    monkeypatch.setattr(decode_calls, "CPP_LOOP", cpp_loop)
    lm = load_model(bench, weights_dtype="int4")
    assert lm.config.head_dim in (64, 128)  # the head sizes the path takes
    kv = lm.model.make_kv_cache(12, BLOCK, dtype=torch.bfloat16)
    torch.manual_seed(0)
    kv.data.normal_()
    context = [20, 33, 47]
    monkeypatch.setattr(cpu_decode, "BF16_DOT", True)
    fast = _decode_logits(lm, kv, context, general=False)
    assert torch.equal(fast, _decode_logits(lm, kv, context, general=True))
    monkeypatch.setattr(cpu_decode, "BF16_DOT", False)
    assert not torch.equal(fast, _decode_logits(lm, kv, context, general=False))


def _greedy(lm, prompts: list[list[int]]) -> list[list[int]]:
    eng = LLMEngine(lm, EngineConfig(num_kv_blocks=64))
    for i, prompt in enumerate(prompts):
        eng.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for step in eng.step():
            out[step.request_id] += step.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_an_engine_generates_the_same_tokens_without_them(tiny, monkeypatch):
    lm = load_model(tiny, weights_dtype="int4")
    prompts = [[(5 * i + j) % lm.config.vocab_size for j in range(9 + 7 * i)] for i in range(4)]
    runs, calls, run = [], [], decode_calls.run
    monkeypatch.setattr(decode_calls, "run", lambda *a: calls.append(1) or run(*a))
    runs.append(_greedy(lm, prompts))
    assert calls  # the bound calls served the decode steps
    monkeypatch.setattr(decode_calls, "decode_calls", lambda model: None)
    lm.model._decode_calls = False
    runs.append(_greedy(lm, prompts))
    assert runs[0] == runs[1]


def test_an_engine_of_the_copys_rows_generates_the_same_tokens_without_them(tiny, monkeypatch):
    """18 sequences decoding together: the steps of 16+ rows go through the copies in the bound calls, the same
    greedy tokens as the general path."""
    lm = _copy_model(tiny, "int4", monkeypatch)
    prompts = [[(5 * i + j) % lm.config.vocab_size for j in range(5 + i)] for i in range(18)]
    runs, rows, run = [], [], decode_calls.run
    monkeypatch.setattr(decode_calls, "run", lambda calls, x, *a: rows.append(x.shape[0]) or run(calls, x, *a))
    runs.append(_greedy(lm, prompts))
    assert max(rows) == 18  # the bound calls served the 18-row decode steps
    monkeypatch.setattr(decode_calls, "decode_calls", lambda model: None)
    lm.model._decode_calls = False
    runs.append(_greedy(lm, prompts))
    assert runs[0] == runs[1]


def test_steps_they_do_not_take_keep_the_general_path(tiny, monkeypatch):
    assert decode_calls.decode_calls(load_model(tiny).model) is None  # float weights: oneDNN matmuls
    lm = load_model(tiny, weights_dtype="int4")
    calls = decode_calls.decode_calls(lm.model)
    assert calls is not None
    kv = lm.model.make_kv_cache(8, BLOCK)
    assert calls.takes(8, kv)
    monkeypatch.setattr(qkernels, "BF16_FROM_ROWS", 8)
    assert not calls.takes(8, kv) and calls.takes(7, kv)
    _, meta = AttentionMetadata.build_with_inputs([3, 1], [0, 5], [[0], [1]], BLOCK, [1, 2, 3, 4])
    assert lm.model._decode_calls_for(meta, kv) is None  # a prefill row
