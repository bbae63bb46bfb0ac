"""`ferry generate`: run the engine in this process over one prompt or a JSONL file of prompts.

A prompts file has one JSON value per line: a string, or an object with "prompt" (text) or
"prompt_token_ids" (list of ints) and optionally "max_tokens". With --json each finished prompt
prints one line {"index", "token_ids", "text", "finish_reason", ...}, in prompt order.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ferry.engine.config import KV_CACHE_DTYPES, WEIGHTS_DTYPES, EngineConfig


class InputError(Exception):
    """Bad user input: reported as one line, no traceback."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", required=True, help="checkpoint folder (config.json, safetensors, tokenizer), .gguf file, or smollm2"
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="one prompt (text)")
    source.add_argument("--prompts-file", type=Path, help="JSONL: one prompt per line")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None, help="per-request seed (same for every prompt)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON line per prompt")
    parser.add_argument("--batching", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size (default: 1 GiB)")
    parser.add_argument("--no-prefix-caching", action="store_true")
    add_weights_dtype_argument(parser)
    parser.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert parallelism (DeepSeek-V3): N rank processes split the routed experts between them, "
        "each with its own share of the prompts and KV; per-rank load goes to stderr",
    )
    parser.add_argument(
        "--ep-overlap", action="store_true", help="with --ep-size: each step as two overlapped micro-batches"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="KV cache dtype (default: the model's, except bfloat16 for int8/int4 weights on the CPU); "
        "bfloat16 halves KV memory and CPU decode attention's reads, rounding keys and values once when written",
    )


def add_weights_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """--weights-dtype, shared by generate, up and bench."""
    parser.add_argument(
        "--weights-dtype",
        choices=WEIGHTS_DTYPES,
        default="auto",
        help="how projection weights are held (default auto: the checkpoint's); int8/int4 quantize them "
        "group-wise at load and multiply with on-the-fly dequantization",
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except InputError as exc:
        print(f"ferry generate: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ferry.model.source import model_problem
    from ferry.protocol import SamplingParams

    problem = model_problem(args.model)
    if problem:
        raise InputError(f"--model {args.model}: {problem}")
    prompts = [args.prompt] if args.prompt is not None else read_prompts(args.prompts_file)
    try:
        sampling = SamplingParams(
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            stop=args.stop,
        )
        config = EngineConfig(
            max_num_seqs=args.max_num_seqs,
            num_kv_blocks=args.num_kv_blocks,
            batching=args.batching,
            enable_prefix_caching=not args.no_prefix_caching,
            kv_cache_dtype=args.kv_cache_dtype,
            weights_dtype=args.weights_dtype,
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None
    if args.ep_size > 1 or args.ep_overlap:
        results = _generate_expert_parallel(args, prompts, sampling, config)
    else:
        engine = _load_engine(args.model, config)
        results = generate(engine, prompts, sampling, progress=args.prompts_file is not None)
    for index, result in enumerate(results):
        if args.json:
            print(json.dumps({"index": index, **result}), flush=True)
        else:
            print(f"--- prompt {index} ({result['finish_reason']}) ---\n{result['text']}", flush=True)
    return 0


def read_prompts(path: Path) -> list[str | list[int] | dict]:
    """Each line: a string, or {"prompt": str | "prompt_token_ids": [int], "max_tokens"?: int}."""
    if not path.is_file():
        raise InputError(f"--prompts-file {path}: no such file")
    prompts: list[str | list[int] | dict] = []
    for line_no, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path} line {line_no}: not valid JSON ({exc.msg})") from None
        prompts.append(_check_prompt(value, f"{path} line {line_no}"))
    if not prompts:
        raise InputError(f"--prompts-file {path}: no prompts")
    return prompts


def _check_prompt(value: object, where: str) -> str | dict:
    if isinstance(value, str):
        return value
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected a string or an object with 'prompt' or 'prompt_token_ids'")
    ids = value.get("prompt_token_ids")
    if ids is not None and not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        raise InputError(f"{where}: 'prompt_token_ids' must be a non-empty list of ints")
    if ids is None and not isinstance(value.get("prompt"), str):
        raise InputError(f"{where}: needs 'prompt' (a string) or 'prompt_token_ids'")
    max_tokens = value.get("max_tokens")
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise InputError(f"{where}: 'max_tokens' must be an int >= 1")
    return value


def generate(engine, prompts: list, sampling, progress: bool = False) -> list[dict]:
    """Run every prompt to completion; -> one result dict per prompt, in order."""
    from dataclasses import replace

    from tqdm import tqdm

    for index, prompt in enumerate(prompts):
        params = sampling
        if isinstance(prompt, dict) and prompt.get("max_tokens"):
            params = replace(sampling, max_tokens=prompt["max_tokens"])
        try:
            engine.add_request(str(index), _token_ids(engine, prompt), params)
        except ValueError as exc:
            raise InputError(f"prompt {index}: {exc}") from None
    results: list[dict[str, Any]] = [{"token_ids": [], "text": "", "finish_reason": None} for _ in prompts]
    with tqdm(total=len(prompts), desc="generate", unit="prompt", disable=not progress, file=sys.stderr) as bar:
        while engine.has_unfinished_requests():
            for out in engine.step():
                result = results[int(out.request_id)]
                result["token_ids"] += out.new_token_ids
                result["text"] += out.text
                if out.finish_reason is not None:
                    result.update(
                        finish_reason=out.finish_reason,
                        num_prompt_tokens=out.num_prompt_tokens,
                        num_cached_tokens=out.num_cached_tokens,
                    )
                    bar.update(1)
    return results


def _generate_expert_parallel(args: argparse.Namespace, prompts: list, sampling, config: EngineConfig) -> list[dict]:
    from ferry.model import read_config
    from ferry.parallel.group_generate import generate_on_group
    from ferry.parallel.lockstep import check_group_config

    num_experts = read_config(args.model).n_routed_experts
    if args.ep_size < 1 or not num_experts or num_experts % args.ep_size:
        raise InputError(f"--ep-size {args.ep_size}: must divide the model's {num_experts} routed experts")
    try:
        check_group_config(config, args.ep_size)
    except ValueError as exc:
        raise InputError(str(exc)) from None
    mode = "overlap" if args.ep_overlap else "single"
    run = generate_on_group(args.model, prompts, sampling, config, args.ep_size, mode=mode)
    for rank in run.ranks:
        print(
            f"rank {rank.rank}: {rank.num_requests} requests, {rank.expert_tokens} token-expert pairs computed",
            file=sys.stderr,
        )
    return run.results


def _token_ids(engine, prompt: str | dict) -> list[int]:
    if isinstance(prompt, dict):
        if prompt.get("prompt_token_ids") is not None:
            return list(prompt["prompt_token_ids"])
        prompt = prompt["prompt"]
    return engine.tokenizer.encode(prompt)


def _load_engine(model: str, config: EngineConfig):
    from ferry.engine.llm_engine import LLMEngine

    try:
        return LLMEngine.from_model_path(model, config)
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise InputError(f"--model {model}: {exc}") from None
