"""LLMEngine on a tiny random checkpoint: prefix reuse, preemption, stops, abort, roles, static mode."""

import dataclasses
import random

import pytest
import torch

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import load_model
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds sync cost on a busy box
    yield load_model(make_model(tmp_path_factory.mktemp("engine") / "tiny", "llama", "tiny"))
    torch.set_num_threads(threads)


def engine(lm, **kw):
    return LLMEngine(lm, EngineConfig(**{"num_kv_blocks": 256, **kw}))


def run_all(eng, prompts, sampling=GREEDY):
    samplings = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
    for i, (prompt, params) in enumerate(zip(prompts, samplings)):
        eng.add_request(f"r{i}", prompt, params)
    outs = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_unfinished_requests():
        for out in eng.step():
            outs[out.request_id].append(out)
    return [outs[f"r{i}"] for i in range(len(prompts))]


def tokens(outs):
    return [[t for o in seq for t in o.new_token_ids] for seq in outs]


def random_prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_shared_512_token_prefix_is_computed_once(lm):
    prefix = random_prompts(1, 512, 512, seed=1)[0]
    suffixes = random_prompts(8, 3, 20, seed=2)
    prompts = [prefix + s for s in suffixes]
    eng = engine(lm, num_kv_blocks=512)
    got = tokens(run_all(eng, prompts))
    stats = eng.stats()
    decode_tokens = len(prompts) * (GREEDY.max_tokens - 1)
    assert stats.num_computed_tokens == 512 + sum(map(len, suffixes)) + decode_tokens
    assert stats.num_cached_tokens == 7 * 512
    assert got == tokens(run_all(engine(lm, num_kv_blocks=512, enable_prefix_caching=False), prompts))


def test_small_pool_preempts_and_keeps_greedy_outputs(lm):
    prompts = random_prompts(12, 20, 60, seed=3)
    sampling = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    expected = tokens(run_all(engine(lm), prompts, sampling))
    small = engine(lm, num_kv_blocks=14)  # ~4 sequences fit at their peak
    assert tokens(run_all(small, prompts, sampling)) == expected
    assert small.stats().num_preemptions > 0
    assert small.stats().kv_blocks_used == 0


def test_static_batching_gives_the_same_tokens(lm):
    prompts = random_prompts(10, 5, 40, seed=4)
    dynamic = engine(lm, max_num_seqs=4)
    static = engine(lm, max_num_seqs=4, batching="static")
    samplings = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (3, 20) * 5]
    assert tokens(run_all(static, prompts, samplings)) == tokens(run_all(dynamic, prompts, samplings))
    assert static.stats().num_steps > dynamic.stats().num_steps  # slots stay empty until the batch ends


def test_chunked_prefill_matches_whole_prefill(lm):
    prompts = random_prompts(3, 100, 200, seed=5)
    chunked = engine(lm, max_num_seqs=4, max_num_batched_tokens=32)
    assert tokens(run_all(chunked, prompts)) == tokens(run_all(engine(lm), prompts))


def test_stream_text_and_indices_add_up(lm):
    outs = run_all(engine(lm), random_prompts(4, 5, 30, seed=6))
    for seq in outs:
        ids = [t for o in seq for t in o.new_token_ids]
        assert [o.index for o in seq] == list(range(len(ids)))
        assert "".join(o.text for o in seq) == lm.tokenizer.decode(ids)
        assert [o.finish_reason for o in seq] == [None] * (len(seq) - 1) + ["length"]


def test_stop_token_and_stop_string(lm):
    prompt = random_prompts(1, 10, 10, seed=7)[0]
    base = tokens(run_all(engine(lm), [prompt], SamplingParams(max_tokens=12, temperature=0)))[0]
    stop_id = base[3]
    first = base.index(stop_id)
    out = run_all(engine(lm), [prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]))[0]
    assert tokens([out])[0] == base[: first + 1] and out[-1].finish_reason == "stop"
    text = lm.tokenizer.decode(base)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = run_all(engine(lm), [prompt], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    emitted = "".join(o.text for o in out)
    assert out[-1].finish_reason == "stop" and stop not in emitted and emitted == text[: text.index(stop)]


def test_without_detokenize_the_tokens_and_stops_are_the_same_but_no_text(lm):
    prompts = random_prompts(4, 5, 30, seed=9)
    stop_id = tokens(run_all(engine(lm), prompts[:1], SamplingParams(max_tokens=8, temperature=0)))[0][4]
    samplings = [SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[stop_id])] + [GREEDY] * 3
    with_text = run_all(engine(lm), prompts, samplings)
    ids_only = run_all(engine(lm, detokenize=False), prompts, samplings)
    assert tokens(ids_only) == tokens(with_text)
    assert [seq[-1].finish_reason for seq in ids_only] == [seq[-1].finish_reason for seq in with_text]
    assert ids_only[0][-1].finish_reason == "stop" and all(o.text == "" for seq in ids_only for o in seq)
    with pytest.raises(ValueError, match=r"sampling\.stop"):
        engine(lm, detokenize=False).add_request("s", prompts[0], SamplingParams(stop=["ab"]))


def test_min_tokens_blocks_stop_ids_until_reached(lm):
    prompt = random_prompts(1, 10, 10, seed=8)[0]
    base = tokens(run_all(engine(lm), [prompt], SamplingParams(max_tokens=6, temperature=0)))[0]
    sampling = SamplingParams(max_tokens=30, min_tokens=5, temperature=0, stop_token_ids=[base[0]])
    got = tokens(run_all(engine(lm), [prompt], sampling))[0]
    assert base[0] not in got[:5] and len(got) >= 5


def test_logprobs_come_with_each_token(lm):
    out = run_all(engine(lm), [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, logprobs=2))[0]
    for o in out:
        (lp,) = o.logprobs
        assert lp.token_id == o.new_token_ids[0] and lp.top_token_ids[0] == lp.token_id
        assert len(lp.top_logprobs) == 2 and lp.logprob <= 0


def test_abort_frees_blocks_at_once(lm):
    eng = engine(lm, prefill_order="fcfs")  # "a" (55 tokens) is admitted first, "b" (a prefix of it) waits to reuse it
    eng.add_request("a", list(range(5, 60)), GREEDY)
    eng.add_request("b", list(range(5, 40)), GREEDY)
    eng.step()
    used = eng.stats().kv_blocks_used
    out = eng.abort_request("a")
    assert out.finish_reason == "abort" and eng.stats().kv_blocks_used == used - 4
    assert eng.abort_request("a") is None
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats().kv_blocks_used == 0


def test_prefill_role_hands_kv_to_a_decode_engine(lm):
    prompt = random_prompts(1, 40, 40, seed=9)[0]
    expected = tokens(run_all(engine(lm), [prompt]))[0]
    prefill = engine(lm, role="prefill")
    (first,) = tokens(run_all(prefill, [prompt]))
    assert first == expected[:1] and prefill.stats().num_pinned == 1
    kv = prefill.take_prefilled("r0")
    assert kv.num_tokens == 40 and len(kv.block_hashes) == 2 and prefill.stats().num_pinned == 0
    decode = engine(lm, role="decode")
    assert decode.can_admit(41)
    decode.add_prefilled("r0", prompt, first, GREEDY, kv.data, kv.num_tokens)
    rest = []
    while decode.has_unfinished_requests():
        for out in decode.step():
            assert out.index == 1 + len(rest)
            rest += out.new_token_ids
    assert first + rest == expected
    assert decode.stats().num_computed_tokens == len(expected) - 1


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_running_request_taken_out_continues_exactly_in_another_engine(lm, prefix_caching):
    """A decode worker that shuts down moves its sequences: KV + tokens so far out of one engine,
    into another, and the rest of the tokens equal a run that never moved."""
    prompts = random_prompts(2, 37, 37, seed=11)
    expected = tokens(run_all(engine(lm), prompts))
    source = engine(lm, role="decode", enable_prefix_caching=prefix_caching)
    source.add_request("r0", prompts[0], GREEDY)
    streamed = []
    while len(streamed) < 4:
        streamed += [t for out in source.step() if out.request_id == "r0" for t in out.new_token_ids]
    source.add_request("r1", prompts[1], GREEDY)  # waiting: nothing computed yet
    kv, outputs = source.take_running("r0")
    assert outputs == streamed and kv.num_tokens == len(prompts[0]) + len(streamed) - 1
    assert len(kv.block_hashes) == kv.num_tokens // 16
    waiting_kv, waiting_outputs = source.take_running("r1")
    assert (waiting_kv.num_tokens, waiting_outputs, waiting_kv.data.shape[0]) == (0, [], 0)
    assert source.stats().kv_blocks_used == 0 and not source.has_unfinished_requests()
    with pytest.raises(KeyError):
        source.take_running("r0")
    target = engine(lm, role="decode")
    target.add_prefilled("r0", prompts[0], outputs, GREEDY, kv.data, kv.num_tokens)
    rest = []
    while target.has_unfinished_requests():
        for out in target.step():
            assert out.index == len(streamed) + len(rest)
            rest += out.new_token_ids
    assert streamed + rest == expected[0]


def handed_off_text(lm, prompt, sampling, num_streamed: int) -> str | None:
    """Text of a request as a client sees it when its first `num_streamed` tokens came from another
    engine (1: the prefill worker's hand-off; more: a migration): what the earlier holder streamed,
    then what the next holder streams. None when it finished before the hand-off."""
    first = engine(lm)
    first.add_request("h", prompt, sampling)
    ids, text = [], ""
    while len(ids) < num_streamed and first.has_unfinished_requests():
        for out in first.step():
            ids, text = ids + out.new_token_ids, text + out.text
    if not first.has_unfinished_requests():
        return None
    rest = engine(lm)
    rest.add_request("h", prompt, sampling, output_token_ids=ids)
    while rest.has_unfinished_requests():
        text += "".join(out.text for out in rest.step())
    return text


def test_stop_strings_and_held_back_text_survive_a_hand_off(lm):
    """A stop string that starts in the text of tokens streamed by an earlier holder (the prefill
    worker, or a worker the request migrated from) and ends in the next holder's tokens is still
    found, and the text the earlier holder held back as a possible stop-string start still reaches
    the client: the whole stream equals a run that never changed hands."""
    checked = 0
    for seed in range(12):
        prompt = random_prompts(1, 24, 24, seed=100 + seed)[0]
        plain = run_all(engine(lm), [prompt])[0]
        texts = [out.text for out in plain]
        for num_streamed in (1, 3):
            before, after = "".join(texts[:num_streamed]), "".join(texts[num_streamed:])
            if not before or len(after) < 2:
                continue
            stop = before[-1] + after[:2]  # spans the hand-off
            sampling = dataclasses.replace(GREEDY, stop=[stop])
            alone = "".join(out.text for out in run_all(engine(lm), [prompt], sampling)[0])
            handed_off = handed_off_text(lm, prompt, sampling, num_streamed)
            if handed_off is None:  # the stop string occurs earlier too
                continue
            assert handed_off == alone, (seed, num_streamed, stop)
            checked += 1
    assert checked >= 8, "too few prompts produced text on both sides of the hand-off"


def test_requests_that_cannot_fit_are_refused(lm):
    eng = engine(lm, num_kv_blocks=4)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("a", list(range(5, 60)), SamplingParams(max_tokens=20))
    eng.add_request("b", [5], GREEDY)
    with pytest.raises(ValueError, match="already"):
        eng.add_request("b", [5], GREEDY)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("c", [5, lm.config.vocab_size], GREEDY)


def test_migrated_request_continues_after_its_streamed_tokens(lm):
    prompt = random_prompts(1, 30, 30, seed=10)[0]
    expected = tokens(run_all(engine(lm), [prompt]))[0]
    eng = engine(lm)
    eng.add_request("m", prompt, GREEDY, output_token_ids=expected[:4])
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [o.index for o in outs] == list(range(4, 10))
    assert expected[:4] + [t for o in outs for t in o.new_token_ids] == expected


def test_kv_events_report_stored_and_evicted_blocks(lm):
    eng = engine(lm, num_kv_blocks=8)
    run_all(eng, [list(range(5, 5 + 64))], SamplingParams(max_tokens=1, temperature=0))
    stored, removed = eng.drain_kv_events()
    assert len(stored) == 4 and removed == []
    run_all(eng, [list(range(200, 200 + 100))], SamplingParams(max_tokens=1, temperature=0))
    stored, removed = eng.drain_kv_events()
    # 6 full blocks and the 4-token partial one (named when it was freed); 7 needed: 4 free, 3 evicted LRU
    assert len(stored) == 7 and len(removed) == 3
