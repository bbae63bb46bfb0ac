"""`ferry generate`: batch invariance of one run vs each prompt alone; bad input is one line."""

import argparse
import json
import random

import pytest
import torch

from ferry.engine import generate_cli
from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model.make_model import make_model
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds sync cost on a busy box
    yield make_model(tmp_path_factory.mktemp("gen") / "tiny", "llama", "tiny")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    lines = [{"prompt_token_ids": [rng.randrange(5, 500) for _ in range(rng.randint(2, 150))]} for _ in range(64)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path, [line["prompt_token_ids"] for line in lines]


def cli(capsys, *argv):
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    status = generate_cli.run(parser.parse_args(list(argv)))
    out, err = capsys.readouterr()
    return status, out, err


def alone(model, prompt, sampling):
    engine = LLMEngine.from_model_path(model, EngineConfig(num_kv_blocks=64))
    engine.add_request("x", prompt, sampling)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


@pytest.mark.parametrize(
    "sampling_args",
    [
        ["--temperature", "0"],
        ["--temperature", "0.9", "--top-p", "0.9", "--top-k", "50", "--seed", "42"],
    ],
    ids=["greedy", "seeded"],
)
def test_one_run_equals_each_prompt_alone(capsys, tiny_model, prompts_file, sampling_args):
    path, prompts = prompts_file
    status, out, _ = cli(
        capsys,
        "--model",
        str(tiny_model),
        "--prompts-file",
        str(path),
        "--max-tokens",
        "12",
        "--ignore-eos",
        "--json",
        "--num-kv-blocks",
        "1024",
        *sampling_args,
    )
    assert status == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == list(range(64))
    params = dict(zip(sampling_args[::2], sampling_args[1::2]))
    sampling = SamplingParams(
        max_tokens=12,
        ignore_eos=True,
        temperature=float(params["--temperature"]),
        top_p=float(params.get("--top-p", 1.0)),
        top_k=int(params.get("--top-k", 0)),
        seed=int(params["--seed"]) if "--seed" in params else None,
    )
    for row, prompt in zip(rows, prompts):
        assert row["finish_reason"] == "length" and len(row["token_ids"]) == 12
        assert row["token_ids"] == alone(tiny_model, prompt, sampling), f"prompt {row['index']} differs"


def test_text_prompt_prints_decoded_text(capsys, tiny_model):
    status, out, _ = cli(
        capsys,
        "--model",
        str(tiny_model),
        "--prompt",
        "hello world",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--num-kv-blocks",
        "64",
    )
    row = json.loads(out)
    assert status == 0 and len(row["token_ids"]) == 5 and row["finish_reason"] == "length"
    assert row["num_prompt_tokens"] >= 2


def test_missing_model_is_one_line(capsys, tmp_path):
    status, out, err = cli(capsys, "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and "nope" in err and "Traceback" not in err


def test_malformed_jsonl_line_is_named(capsys, tiny_model, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"prompt": 3}\n')
    status, _, err = cli(capsys, "--model", str(tiny_model), "--prompts-file", str(bad))
    assert status == 2 and "line 2" in err and err.count("\n") == 1
    bad.write_text('"fine"\n\n{not json\n')
    status, _, err = cli(capsys, "--model", str(tiny_model), "--prompts-file", str(bad))
    assert status == 2 and "line 3" in err and "not valid JSON" in err


@pytest.mark.slow  # spawns two rank processes
def test_ep_size_gives_the_single_process_tokens_and_per_rank_load(tmp_path, capsys):
    model = make_model(tmp_path / "ds", "deepseek-v3", "tiny")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": [5 + i, 9, 17 * i % 400 + 3]}) for i in range(3)))
    common = ["--model", str(model), "--prompts-file", str(prompts), "--json", "--temperature", "0"]
    _, single, _ = cli(capsys, *common, "--max-tokens", "6", "--ignore-eos")
    status, grouped, err = cli(capsys, *common, "--max-tokens", "6", "--ignore-eos", "--ep-size", "2", "--ep-overlap")
    assert status == 0
    tokens = [[json.loads(line)["token_ids"] for line in out.splitlines()] for out in (single, grouped)]
    assert tokens[0] == tokens[1] and all(len(t) == 6 for t in tokens[0])
    assert "rank 0: 2 requests" in err and "rank 1: 1 requests" in err


def test_ep_size_needs_routed_experts_it_divides(tiny_model, capsys):
    status, _, err = cli(capsys, "--model", str(tiny_model), "--prompt", "hi", "--ep-size", "2")
    assert status == 2
    assert "--ep-size 2: must divide the model's 0 routed experts" in err


def test_ep_size_refuses_quantized_weights_naming_both_options(tmp_path, capsys):
    model = make_model(tmp_path / "ds", "deepseek-v3", "tiny")
    status, _, err = cli(capsys, "--model", str(model), "--prompt", "hi", "--ep-size", "2", "--weights-dtype", "int4")
    assert status == 2
    assert "weights dtype int4" in err and "--weights-dtype" in err and "--ep-size" in err
