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
    logits: torch.Tensor, requests: list[SampleRequest], generator: torch.Generator | None = None
) -> SampleResult:
    """logits: [B, V] float32, one row per request."""
    if all(_is_plain_greedy(r) for r in requests):  # the common serving case: one argmax, no copies
        return SampleResult(logits.argmax(dim=-1).tolist(), [None] * len(requests))
    raw = logits
    logits = logits.float().clone()  # [B, V]
    _apply_penalties(logits, requests)
    _block_tokens(logits, requests)
    greedy_ids = logits.argmax(dim=-1)  # [B]
    random_rows = [i for i, r in enumerate(requests) if not r.sampling.is_greedy]
    if random_rows:
        picked = _sample_random(logits[random_rows], [requests[i] for i in random_rows], generator)
        greedy_ids[random_rows] = picked
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
    vocab = logits.shape[-1]
    for i, req in enumerate(requests):
        sp = req.sampling
        if sp.repetition_penalty != 1.0:
            seen = torch.tensor(req.token_ids, device=logits.device).unique()
            row = logits[i, seen]
            logits[i, seen] = torch.where(row > 0, row / sp.repetition_penalty, row * sp.repetition_penalty)
        if (sp.presence_penalty or sp.frequency_penalty) and req.num_output_tokens:
            output = torch.tensor(req.token_ids[req.num_prompt_tokens :], device=logits.device)
            counts = torch.bincount(output, minlength=vocab)
            counts = counts[:vocab].to(logits.dtype)  # [V]
            logits[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def _block_tokens(logits: torch.Tensor, requests: list[SampleRequest]) -> None:
    for i, req in enumerate(requests):
        if req.blocked_token_ids:
            logits[i, list(req.blocked_token_ids)] = float("-inf")


def _sample_random(
    logits: torch.Tensor, requests: list[SampleRequest], generator: torch.Generator | None
) -> torch.Tensor:
    """logits: [R, V] of the non-greedy rows -> [R] token ids."""
    temps = torch.tensor([r.sampling.temperature for r in requests], dtype=logits.dtype, device=logits.device)
    logits = logits / temps.unsqueeze(1)
    _filter_top_k_top_p(logits, requests)
    probs = logits.softmax(dim=-1)  # [R, V]
    min_ps = torch.tensor([r.sampling.min_p for r in requests], dtype=probs.dtype, device=probs.device)
    if bool((min_ps > 0).any()):
        floor = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)
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
    for i, req in enumerate(requests):
        if req.sampling.seed is not None:
            own = torch.Generator().manual_seed(_mix_seed(req.sampling.seed, req.num_output_tokens))
            noise[i] = torch.empty(probs.shape[-1], dtype=probs.dtype).exponential_(generator=own).to(probs.device)
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
