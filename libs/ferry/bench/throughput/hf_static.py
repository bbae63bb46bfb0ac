"""transformers' static batched `generate` on the burst, as a user would write it: load the model,
left-pad each batch of `--batch-size` prompts, greedy `generate(max_new_tokens=<the batch's
largest max_tokens>)`, no min length. run.py times this whole process (start to exit), like `ferry
generate`. Counts each request's output up to its own max_tokens and its first EOS; prints JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ferry.bench.throughput import burst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    requests = burst.read_prompts(args.prompts)
    num_out = 0
    for i in range(0, len(requests), args.batch_size):
        batch = requests[i : i + args.batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.int64)  # [B, S] left-padded
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids) :] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(r.max_tokens for r in batch),
                do_sample=False,
                pad_token_id=pad,
            )
        for row, r in enumerate(batch):
            num_out += _useful(out[row, width:].tolist(), r.max_tokens, eos_ids)
    print(json.dumps({"output_tokens": num_out, "threads": torch.get_num_threads()}))


def _useful(new_ids: list[int], max_tokens: int, eos_ids: set[int]) -> int:
    """Tokens this request asked for: up to its max_tokens, through its first EOS."""
    for n, token in enumerate(new_ids[:max_tokens], 1):
        if token in eos_ids:
            return n
    return min(len(new_ids), max_tokens)


if __name__ == "__main__":
    main()
