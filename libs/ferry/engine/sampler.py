"""Sampler: logits of the batch's last tokens -> next token ids (and logprobs) for each sequence.

Every transformation is row-wise, so a sequence's token never depends on which other sequences
share the batch. A seeded request draws its noise from its own generator, reseeded from
(seed, output position): the same seed gives the same tokens alone, in any batch, and after a
preemption. Sampling uses the exponential-race trick (argmax of p / Exp(1) noise, which picks
token i with probability p_i) so the draw is one vector op and one host sync per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferry.kernels.cpu_layers import argmax_rows
from ferry.protocol import SamplingParams, TokenLogprob


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one sequence."""

    sampling: SamplingParams
    token_ids: list[int]
    """Prompt then output tokens so far (the sequence's own list: read, never copied per step)."""
    num_prompt_tokens: int
    blocked_token_ids: tuple[int, ...] = ()
    """Tokens not allowed now (EOS and stop ids before min_tokens)."""

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


_SEED_MASK = (1 << 63) - 1


def sample(
    logits: torch.Tensor,
    requests: list[SampleRequest],
    generator: torch.Generator | None = None,
    fused: bool = False,
) -> SampleResult:
    """logits: [B, V] float32, one row per request. fused: the model runs the 'cpu' backend, so the
    greedy pick may use its C++ argmax (the same ids as torch.argmax)."""
    if all(_is_plain_greedy(r) for r in requests):  # the common serving case: one argmax, no copies
        return SampleResult(argmax_rows(logits, fused).tolist(), [None] * len(requests))
    raw = logits
    logits = logits.float().clone()  # [B, V]
    _apply_penalties(logits, requests)
    _block_tokens(logits, requests)
    greedy_ids = argmax_rows(logits, fused)  # [B]
    random_rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, dtype=torch.int64).to(logits.device, non_blocking=True)
        picked = _sample_random(logits[rows], [requests[i] for i in random_rows], generator)
        greedy_ids[rows] = picked
    token_ids = greedy_ids.tolist()
    return SampleResult(token_ids, _logprobs(raw, requests, token_ids))


def _is_plain_greedy(req: SampleRequest) -> bool:
    """Greedy with nothing that changes the logits first and no logprobs to compute."""
    sp = req.sampling
    return (
        sp.is_greedy
        and not req.blocked_token_ids
        and sp.logprobs is None
        and sp.repetition_penalty == 1.0
        and not sp.presence_penalty
        and not sp.frequency_penalty
    )


def _apply_penalties(logits: torch.Tensor, requests: list[SampleRequest]) -> None:
    """Repetition, presence and frequency penalties of the whole batch at once: every row's token ids
    go to the device in one padded tensor (pad id = vocab, a column dropped after), no per-row copy."""
    rep = [r.sampling.repetition_penalty for r in requests]
    freq = [r.sampling.frequency_penalty if r.num_output_tokens else 0.0 for r in requests]
    pres = [r.sampling.presence_penalty if r.num_output_tokens else 0.0 for r in requests]
    if any(p != 1.0 for p in rep):
        seen = _token_mask(logits, [r.token_ids if p != 1.0 else [] for r, p in zip(requests, rep)]) > 0
        penalty = _column(rep, logits)  # [B, 1]
        logits.copy_(torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits))
    if any(freq) or any(pres):
        outputs = [r.token_ids[r.num_prompt_tokens :] if f or p else [] for r, f, p in zip(requests, freq, pres)]
        counts = _token_mask(logits, outputs)  # [B, V]
        logits -= _column(freq, logits) * counts + _column(pres, logits) * (counts > 0).to(logits.dtype)


def _block_tokens(logits: torch.Tensor, requests: list[SampleRequest]) -> None:
    if any(r.blocked_token_ids for r in requests):
        blocked = _token_mask(logits, [list(r.blocked_token_ids) for r in requests]) > 0
        logits.masked_fill_(blocked, float("-inf"))


def _token_mask(logits: torch.Tensor, rows: list[list[int]]) -> torch.Tensor:
    """-> [B, V] counts of each row's token ids, from one padded host tensor copied once."""
    batch, vocab = logits.shape
    width = max((len(ids) for ids in rows), default=0) or 1
    padded = torch.full((batch, width), vocab, dtype=torch.int64)
    for i, ids in enumerate(rows):
        padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    padded = padded.to(logits.device, non_blocking=True)
    counts = torch.zeros(batch, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=logits.dtype))
    return counts[:, :vocab]


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype).to(like.device, non_blocking=True).unsqueeze(1)


def _sample_random(
    logits: torch.Tensor, requests: list[SampleRequest], generator: torch.Generator | None
) -> torch.Tensor:
    """logits: [R, V] of the non-greedy rows -> [R] token ids."""
    logits = logits / _column([r.sampling.temperature for r in requests], logits)
    _filter_top_k_top_p(logits, requests)
    probs = logits.softmax(dim=-1)  # [R, V]
    min_ps = [r.sampling.min_p for r in requests]
    if any(p > 0 for p in min_ps):  # decided on the host: no device read
        floor = probs.amax(dim=-1, keepdim=True) * _column(min_ps, probs)
        probs = probs.masked_fill(probs < floor, 0.0)
    noise = _exponential_noise(probs, requests, generator)  # [R, V]
    return (probs / noise).argmax(dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, requests: list[SampleRequest]) -> None:
    """Mask (in place) tokens outside each row's top-k and nucleus."""
    top_ks = [r.sampling.top_k for r in requests]
    top_ps = [r.sampling.top_p for r in requests]
    if not any(top_ks) and all(p >= 1.0 for p in top_ps):
        return
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)  # [1, V]
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_ks], device=logits.device).unsqueeze(1)  # [R, 1]
    drop = ranks >= k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability mass ahead of each token
    drop |= before >= torch.tensor(top_ps, dtype=before.dtype, device=before.device).unsqueeze(1)
    logits.scatter_(1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _exponential_noise(
    probs: torch.Tensor, requests: list[SampleRequest], generator: torch.Generator | None
) -> torch.Tensor:
    """[R, V] Exp(1) noise. Seeded rows come from a CPU generator, so a seed gives the same
    tokens on any device; `generator` (a CPU one) serves the rest on CPU, the device RNG elsewhere."""
    on_cpu = probs.device.type == "cpu"
    noise = torch.empty_like(probs).exponential_(generator=generator if on_cpu else None)
    seeded = [i for i, req in enumerate(requests) if req.sampling.seed is not None]
    if seeded:  # drawn on the host row by row, then copied to the device together
        own = torch.empty(len(seeded), probs.shape[-1], dtype=probs.dtype)
        for row, i in enumerate(seeded):
            seed = _mix_seed(requests[i].sampling.seed or 0, requests[i].num_output_tokens)  # not None: seeded
            own[row].exponential_(generator=torch.Generator().manual_seed(seed))
        index = torch.tensor(seeded, dtype=torch.int64).to(probs.device, non_blocking=True)
        noise.index_copy_(0, index, own.to(probs.device, non_blocking=True))
    return noise


def _mix_seed(seed: int, position: int) -> int:
    """One generator seed per (request seed, output position), the same in every process."""
    return ((seed & _SEED_MASK) * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 1) & _SEED_MASK


def _logprobs(raw: torch.Tensor, requests: list[SampleRequest], token_ids: list[int]) -> list[TokenLogprob | None]:
    """Logprobs of the model's own distribution (before penalties and temperature)."""
    rows = [i for i, r in enumerate(requests) if r.sampling.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(requests)
    if not rows:
        return out
    logp = raw[rows].float().log_softmax(dim=-1)  # [R, V]
    picked = torch.tensor([token_ids[i] for i in rows], device=logp.device).unsqueeze(1)  # [R, 1]
    chosen = logp.gather(1, picked).squeeze(1).tolist()
    max_k = max(requests[i].sampling.logprobs or 0 for i in rows)
    top_vals, top_ids = logp.topk(max_k, dim=-1) if max_k else (logp[:, :0], logp[:, :0].long())
    top_val_rows, top_id_rows = top_vals.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        k = requests[i].sampling.logprobs
        out[i] = TokenLogprob(token_ids[i], chosen[j], top_id_rows[j][:k], top_val_rows[j][:k])
    return out
