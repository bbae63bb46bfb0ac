"""The expert-parallel exchange: both dispatches (counts first, then exactly the rows; or one padded
all-to-all whose header rows carry the counts) give every token what the whole MoE gives it, run
whole or as two overlapped micro-batches, with ranks of different token counts, a rank with none,
and experts with copies on both ranks. Two spawned gloo ranks; and the index arithmetic on a
hand-made example."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from ferry.model import ep_layout
from ferry.model.config import ModelConfig
from ferry.model.moe import MoE
from ferry.parallel.lockstep import GroupAddress, init_group, leave_group
from ferry.parallel.placement import ExpertPlacement

pytestmark = pytest.mark.unit

HIDDEN = 32


def test_slot_major_rows_put_every_sources_rows_of_a_slot_together():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])  # [sources, slots]
    blocks = torch.tensor([[0, 3], [1, 6]])  # compact blocks; blocks behind a header row, padded to 5
    (compact, padded), ends = ep_layout.slot_major_rows(counts, blocks)
    assert compact.tolist() == [0, 1, 3, 4, 5, 6, 2]  # slot 0: 0,1 | 3; slot 1: 4,5,6; slot 2: 2
    assert padded.tolist() == [1, 2, 6, 7, 8, 9, 3]
    assert ends.tolist() == [3, 6, 7]


def test_tagged_rows_carry_slots_and_weights_bit_exact_in_any_dtype():
    x = torch.arange(12, dtype=torch.bfloat16).view(3, 4)
    slots = torch.tensor([[[0, -1], [70000, 1], [-1, -1]]])  # [blocks, T, k]
    weights = torch.tensor([[0.1, 2.5], [1e-30, -3.0], [0.0, 7.0]])
    rows, got_slots, got_weights = ep_layout.untag_rows(ep_layout.tag_rows(x, slots, weights), 4, 2)
    assert torch.equal(rows, x) and got_slots.tolist() == slots[0].tolist()
    assert torch.equal(got_weights, weights)


def _moe(favoured: tuple[int, ...] = ()) -> MoE:
    """A 1-layer MoE: 8 experts in 4 groups of 2, top-3 of 2 groups; `favoured` experts get a large
    score-correction bias, so every token picks them (and stays in their groups)."""
    cfg = ModelConfig(
        arch="deepseek_v3", vocab_size=8, hidden_size=HIDDEN, num_layers=1, num_heads=1, num_kv_heads=1,
        head_dim=8, intermediate_size=8, max_position_embeddings=8, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=16,
        num_experts_per_tok=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    )  # fmt: skip
    moe = MoE(cfg)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        moe.gate.e_score_correction_bias.zero_()
        moe.gate.e_score_correction_bias[list(favoured)] = 10.0
    return moe


def _rank(rank: int, address: GroupAddress, slots: tuple, tokens: list[int], favoured: tuple, failures) -> None:
    from ferry.model import moe_ep

    torch.set_num_threads(1)
    init_group(address, rank, 2, "cpu")
    try:
        moe = _moe(favoured)
        x = torch.randn(tokens[rank], HIDDEN, generator=torch.Generator().manual_seed(10 + rank))
        expected = moe(x)
        layer = moe_ep.ExpertParallelMoE(moe, ExpertPlacement(8, slots), rank)
        counted = layer(x)  # no token counts given: counts first
        if layer.comm_waits is not None:
            failures.put(f"rank {rank}: a serving layer keeps a list of every wait (it would only grow)")
        layer.computed_tokens, layer.comm_waits = 0, []  # what the overlap bench sets per step
        padded = moe_ep.run_to_end(layer.steps(x, tokens))
        padded_computed, padded_waits, layer.comm_waits = layer.computed_tokens, len(layer.comm_waits), None
        if padded_waits != 2:
            failures.put(f"rank {rank}: the padded exchange waited {padded_waits} times (dispatch + combine: 2)")
        both_halves = _interleaved(layer, x, tokens)  # two micro-batches overlapped, padded
        moe_ep.PADDED_EXCHANGE_MAX_RANKS_PER_TOP_K = moe_ep.PADDED_EXCHANGE_MAX_BYTES = 0  # too big: counts first
        counted_too = moe_ep.run_to_end(layer.steps(x, tokens))
        both_halves_counted = _interleaved(layer, x, tokens)
        results = dict(counted=counted, padded=padded, counted_too=counted_too)
        results |= dict(both_halves=both_halves, both_halves_counted=both_halves_counted)
        for name, got in results.items():
            if not torch.allclose(got, expected, atol=1e-5, rtol=1e-5):
                failures.put(f"rank {rank}, {name}: max error {(got - expected).abs().max()}")
        has_copies = sum(map(len, slots)) > 8
        if not has_copies and padded_computed != _assignments_on(rank, moe, slots, tokens):
            failures.put(f"rank {rank}: its experts computed {padded_computed} rows in the padded exchange")
    except Exception as error:  # reported here: leave_group ends the process before a raise could reach spawn
        failures.put(f"rank {rank}: {type(error).__name__}: {error}")
    finally:
        leave_group(exit_process=True)  # no interpreter finalization with gloo's threads alive (see leave_group)


def _assignments_on(rank: int, moe: MoE, slots: tuple, tokens: list[int]) -> int:
    """(token, expert) assignments of every rank's tokens that land on `rank` (no copies in slots)."""
    total = 0
    for source, count in enumerate(tokens):
        x = torch.randn(count, HIDDEN, generator=torch.Generator().manual_seed(10 + source))
        ids, _ = moe.gate(x)
        total += int(torch.isin(ids, torch.tensor(slots[rank])).sum())
    return total


def _interleaved(layer, x: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """x split in two micro-batches whose steps alternate (as OverlapRunner's overlap mode runs them)."""
    from ferry.parallel.overlap import interleave

    first = [count // 2 for count in tokens]  # every rank's first half: the same list everywhere
    second = [count - half for count, half in zip(tokens, first)]
    cut = first[torch.distributed.get_rank()]
    return torch.cat(interleave([layer.steps(x[:cut], first), layer.steps(x[cut:], second)]))


def _run_pair(slots: tuple, tokens: list[int], favoured: tuple = ()) -> list[str]:
    failures = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(GroupAddress.free_local(), slots, tokens, favoured, failures), nprocs=2)
    reported = []
    while not failures.empty():
        reported.append(failures.get())
    return reported


CONTIGUOUS = ((0, 1, 2, 3), (4, 5, 6, 7))


@pytest.mark.parametrize("slots", [CONTIGUOUS, ((0, 1, 2, 3, 4, 5), (4, 5, 6, 7, 0, 1))], ids=["contiguous", "copies"])
@pytest.mark.parametrize("tokens", [[5, 9], [7, 0]], ids=["uneven", "one-idle"])
def test_both_dispatches_give_what_the_whole_moe_gives(slots, tokens):
    assert _run_pair(slots, tokens) == []


def test_a_rank_no_token_picks_receives_only_untagged_rows_and_computes_nothing():
    """Experts 0-3 (rank 0's) favoured: rank 1 is sent every token, none with an assignment there."""
    moe = _moe(favoured=(0, 1, 2, 3))
    ids, _ = moe.gate(torch.randn(64, HIDDEN))
    assert bool((ids < 4).all()), "the bias keeps every token on rank 0's experts"
    assert _run_pair(CONTIGUOUS, [6, 9], favoured=(0, 1, 2, 3)) == []


def test_every_token_on_every_rank_fills_the_padded_blocks_and_still_matches():
    """Experts 0 and 4 favoured: every token has an expert on both ranks, so every padded row is real
    (the size bound is hit)."""
    moe = _moe(favoured=(0, 4))
    ids, _ = moe.gate(torch.randn(64, HIDDEN))
    assert bool(((ids < 4).any(1) & (ids >= 4).any(1)).all()), "every token picks experts on both ranks"
    assert _run_pair(CONTIGUOUS, [6, 9], favoured=(0, 4)) == []
