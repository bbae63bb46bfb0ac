"""Per-request bookkeeping around a Sequence: finish rules, text deltas, what the sampler needs."""

from __future__ import annotations

from ferry.engine.detokenizer import Decoder, IncrementalDetokenizer, StopStringFilter
from ferry.engine.outputs import RequestOutput
from ferry.engine.sampler import SampleRequest
from ferry.engine.sequence import Sequence
from ferry.protocol import TokenLogprob


class RequestState:
    def __init__(self, seq: Sequence, tokenizer: Decoder | None, eos_token_ids: list[int], max_model_len: int) -> None:
        self.seq = seq
        sp = seq.sampling
        self._stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_token_ids))
        self._early_blocked = tuple(sorted(self._stop_ids))
        self._max_len = min(max_model_len, seq.num_prompt_tokens + sp.max_tokens)
        self._stops = StopStringFilter(sp.stop)
        self._detok = _detokenizer(tokenizer, seq, self._stops) if tokenizer else None

    @property
    def max_num_tokens(self) -> int:
        """Prompt + output can never grow past this (max_tokens or the model's context)."""
        return self._max_len

    @property
    def finished_before_start(self) -> bool:
        return self.seq.num_tokens >= self._max_len

    def sample_request(self) -> SampleRequest:
        seq = self.seq
        early = seq.num_output_tokens < seq.sampling.min_tokens
        return SampleRequest(seq.sampling, seq.token_ids, seq.num_prompt_tokens, self._early_blocked if early else ())

    def append(self, token_id: int, logprob: TokenLogprob | None) -> RequestOutput:
        """Add a sampled token; decide whether the request is finished; return its output."""
        seq = self.seq
        seq.token_ids.append(token_id)
        finish = None
        if token_id in self._stop_ids:
            # the stop token's own text is not emitted
            tail, hit = self._stops.add(self._detok.flush() if self._detok else "")
            finish, text = "stop", tail if hit else tail + self._stops.flush()
        else:
            text, hit = self._stops.add(self._detok.add([token_id]) if self._detok else "")
            finish = "stop" if hit else None
        if finish is None and seq.num_tokens >= self._max_len:
            finish = "length"
            tail, hit = self._stops.add(self._detok.flush() if self._detok else "")
            text += tail if hit else tail + self._stops.flush()
            finish = "stop" if hit else finish
        seq.finish_reason = finish
        return self.output([token_id], text, [logprob] if logprob is not None else None)

    def abort(self) -> RequestOutput:
        self.seq.finish_reason = "abort"
        return self.output([], "", None)

    def output(self, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        seq = self.seq
        return RequestOutput(
            seq.request_id,
            seq.num_output_tokens - len(token_ids),
            token_ids,
            text,
            logprobs,
            seq.finish_reason,
            seq.num_prompt_tokens,
            seq.num_cached_tokens,
        )


def _detokenizer(tokenizer: Decoder, seq: Sequence, stops: StopStringFilter) -> IncrementalDetokenizer:
    """A detokenizer positioned after the prompt and any prior output tokens (hand-off, migration),
    with `stops` in the state the earlier holder's filter was in.

    Prior output tokens were streamed by an earlier holder, but text it held back never was: a
    trailing incomplete UTF-8 character, and the tail that could begin a stop string. Replaying the
    tokens through the detokenizer and the stop filter (discarding what they would emit: it was
    emitted) leaves exactly that unread and held, so it comes out with the next tokens, and a stop
    string that began before the hand-off is still found, as in a run that never changed hands."""
    num_prompt = seq.num_prompt_tokens
    detok = IncrementalDetokenizer(tokenizer, seq.token_ids[:num_prompt])
    for token_id in seq.token_ids[num_prompt:]:  # its text was emitted already
        # one at a time, as the earlier holder added them: in one call, a tail that ends in an
        # incomplete character would hold back (and later repeat) the text of every prior token
        stops.add(detok.add([token_id]))
    return detok
