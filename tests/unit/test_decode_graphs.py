"""DecodeGraphs on the CPU (capture=False: the padded static buffers run eagerly; only a GPU can show
the captured graph replaying): bucketing, padding rows that leave every real sequence's cache and
logits untouched, warm-up preparing every bucket, and the runner routing pure-decode steps there."""

from __future__ import annotations

import pytest
import torch

from ferry.engine.decode_graphs import DecodeGraphs, bucket_for, decode_buckets
from ferry.model import AttentionMetadata, load_model
from ferry.model.make_model import make_model

pytestmark = pytest.mark.unit
BS = 16


def test_buckets_are_powers_of_two_up_to_the_cap():
    assert decode_buckets(1) == [1]
    assert decode_buckets(12) == [1, 2, 4, 8, 12]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert [bucket_for(n, decode_buckets(12)) for n in (1, 3, 8, 9, 12, 13)] == [1, 4, 8, 12, 12, None]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_model(make_model(tmp_path_factory.mktemp("graphs") / "tiny", "llama", "tiny", seed=1))


def test_a_padded_decode_step_gives_the_unpadded_logits_and_cache(lm):
    """3 sequences padded to the bucket of 4: the same logits as a plain decode step, the same cache
    everywhere but the padding block."""
    tables, context = [[0, 1], [2], [3, 4, 5]], [20, 9, 40]
    kv_plain, kv_padded = (lm.model.make_kv_cache(8, BS) for _ in "ab")  # block 7: the padding block
    for kv in (kv_plain, kv_padded):
        kv.data.normal_(generator=torch.Generator().manual_seed(3))
    graphs = DecodeGraphs(lm.model, kv_padded, pad_block=7, max_num_seqs=6, max_blocks_per_seq=4, capture=False)
    assert graphs.runs([1, 1, 1]) and not graphs.runs([1, 5]) and not graphs.runs([1] * 7)
    padded = graphs.run([11, 12, 13], context, tables)
    meta = AttentionMetadata.build([1] * 3, context, tables, BS)
    plain = lm.model(torch.tensor([11, 12, 13]), torch.tensor(context), meta, kv_plain)
    torch.testing.assert_close(padded, plain)
    torch.testing.assert_close(kv_padded.data[:, :, :, :7], kv_plain.data[:, :, :, :7])
    assert graphs.prepared_buckets == [4]


def test_warmup_prepares_every_bucket_and_pure_decode_steps_use_them(lm):
    from ferry.engine.config import EngineConfig
    from ferry.engine.llm_engine import LLMEngine
    from ferry.engine.runner import ModelRunner
    from ferry.protocol import SamplingParams

    runner = ModelRunner(lm, 16, BS, max_num_seqs=4, decode_graphs=True)
    runner.warmup()
    assert runner.graphs.prepared_buckets == [1, 2, 4] and runner.kv.num_blocks == 17
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outputs = {}
    for graphs in (False, True):
        engine = LLMEngine(lm, EngineConfig(num_kv_blocks=16, max_num_seqs=4))
        if graphs:  # the same engine with its runner swapped for a graph-running one
            engine.runner = ModelRunner(lm, 16, BS, max_num_seqs=4, decode_graphs=True)
        engine.warmup()
        for i, prompt in enumerate(([5, 6, 7], [9] * 20, [3, 4])):
            engine.add_request(f"r{i}", prompt, greedy)
        tokens = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        outputs[graphs] = tokens
    assert outputs[True] == outputs[False]


def test_every_tensor_a_graph_reads_is_owned_by_the_graphs(lm):
    """A captured graph keeps reading the addresses it was captured with: an input made as a temporary
    for the capture is freed after it and its memory reused (found on an H200: replays indexed out of
    bounds through logits_indices). Every tensor in the step inputs must be a view of a buffer that
    DecodeGraphs keeps for its whole life."""
    kv = lm.model.make_kv_cache(8, BS)
    graphs = DecodeGraphs(lm.model, kv, pad_block=7, max_num_seqs=6, max_blocks_per_seq=4, capture=False)
    owned = {graphs._device.untyped_storage().data_ptr(), graphs._arange.untyped_storage().data_ptr()}
    for bucket in graphs.buckets:
        ids, positions, meta = graphs._inputs(bucket)
        tensors = {"input_ids": ids, "positions": positions}
        tensors |= {name: value for name in meta.__slots__ if isinstance(value := getattr(meta, name), torch.Tensor)}
        assert len(tensors) >= 8
        for name, tensor in tensors.items():
            assert tensor.untyped_storage().data_ptr() in owned, f"bucket {bucket}: {name} is a temporary"
