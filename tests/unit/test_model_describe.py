"""What is served, as /v1/models and the ferry_model_info metric say it: the model's name, architecture,
the checkpoint's dtype, and the weights dtype the workers multiply with (from their load reports)."""

from __future__ import annotations

import time

import gguf
import pytest
import torch
from fastapi.testclient import TestClient
from gguf_files import checkpoint_to_gguf
from prometheus_client import REGISTRY
from reports import load_report

from ferry.engine import EngineConfig, LLMEngine
from ferry.model.config import read_config
from ferry.model.describe import checkpoint_dtype, weights_dtype
from ferry.model.make_model import make_model
from ferry.protocol import LoadReport
from ferry_services.gateway.app import create_app
from ferry_services.gateway.bus import GatewayBus
from ferry_services.gateway.service import model_limits
from ferry_services.gateway.settings import GatewaySettings
from ferry_services.gateway.tokenizer import load_model_info
from ferry_services.worker.reports import describe_engine
from ferry_services.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("describe")
    ckpt = make_model(root / "ckpt", "qwen2", "tiny")
    return checkpoint_to_gguf(ckpt, root / "tiny-qwen.Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)


def _report(worker_id: str, weights: str) -> LoadReport:
    return load_report(worker_id, "decode", weights_dtype=weights)


def test_models_card_says_name_architecture_and_dtypes(q8_gguf):
    settings = GatewaySettings(model=str(q8_gguf), gateway_id="gw-describe")
    info = load_model_info(settings.model)
    bus = GatewayBus("gw-describe")
    with TestClient(create_app(settings, info.tokenizer, model_limits(settings, info), bus)) as client:
        card = client.get("/v1/models").json()["data"][0]
        assert card["id"] == "tiny-qwen.Q8_0" and card["architecture"] == "qwen2"
        assert card["checkpoint_dtype"] == "Q8_0" and card["weights_dtype"] is None  # no worker heard yet
        bus.workers.observe(_report("d0", "float32"), time.monotonic())
        assert client.get("/v1/models/tiny-qwen.Q8_0").json()["weights_dtype"] == "float32"
        bus.workers.observe(_report("d1", "bfloat16"), time.monotonic())
        assert client.get("/v1/models").json()["data"][0]["weights_dtype"] == "bfloat16,float32"


def test_worker_exports_model_info_and_reports_its_weights_dtype(q8_gguf):
    engine = LLMEngine.from_model_path(q8_gguf, EngineConfig(num_kv_blocks=16, weights_dtype="bfloat16"))
    settings = WorkerSettings(model=str(q8_gguf), role="decode", worker_id="w-describe")
    assert describe_engine(engine, settings) == "bfloat16"
    labels = dict(role="decode", model="tiny-qwen.Q8_0", arch="qwen2", weights_dtype="bfloat16")
    assert REGISTRY.get_sample_value("ferry_model_info", {**labels, "checkpoint_dtype": "Q8_0"}) == 1.0


def test_weights_dtype_prefers_what_a_quantized_layer_declares(q8_gguf):
    engine = LLMEngine.from_model_path(q8_gguf, EngineConfig(num_kv_blocks=16, weights_dtype="float32"))
    model = engine.lm.model
    assert weights_dtype(model) == "float32"
    model.model.layers[0].mlp.weights_dtype = "int4"
    assert weights_dtype(model) == "int4"
    assert model.lm_head.weight.dtype == torch.float32


def test_checkpoint_dtype_of_a_folder_and_of_smollm2(tmp_path):
    assert checkpoint_dtype(read_config(make_model(tmp_path / "bf16", "llama", "tiny", dtype="bfloat16"))) == "bfloat16"
    assert checkpoint_dtype(read_config("smollm2")) == "Q4_1"  # general.file_type MOSTLY_Q4_1


def test_auto_keeps_a_q8_0_gguf_in_int8_and_says_so(q8_gguf):
    engine = LLMEngine.from_model_path(q8_gguf, EngineConfig(num_kv_blocks=16))  # weights_dtype auto
    assert weights_dtype(engine.lm.model) == "int8" and engine.lm.weights_dtype == "int8"
