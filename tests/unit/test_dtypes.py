"""ferry.dtypes: the one table of dtype names, and the places that read it."""

from __future__ import annotations

import pytest
import torch

from ferry.dtypes import DTYPE_NAMES, torch_dtype
from ferry.engine.config import EngineConfig
from ferry.settings import load_settings
from ferry_services.worker.settings import WorkerSettings

pytestmark = pytest.mark.unit


def test_every_name_is_a_torch_floating_dtype():
    assert [torch_dtype(n) for n in DTYPE_NAMES] == [torch.float32, torch.bfloat16, torch.float16]


def test_an_unknown_name_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"kv_cache_dtype: unsupported 'int8', expected one of"):
        torch_dtype("int8", "kv_cache_dtype")


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_engine_and_worker_take_every_name(name, monkeypatch):
    assert EngineConfig(kv_cache_dtype=name).kv_cache_dtype == name
    monkeypatch.setenv("FERRY_KV_CACHE_DTYPE", name)
    assert load_settings(WorkerSettings).kv_cache_dtype == name


def test_the_worker_refuses_an_unknown_kv_cache_dtype(monkeypatch):
    monkeypatch.setenv("FERRY_KV_CACHE_DTYPE", "int8")
    with pytest.raises(SystemExit, match="FERRY_KV_CACHE_DTYPE='int8'"):
        load_settings(WorkerSettings)
    monkeypatch.setenv("FERRY_KV_CACHE_DTYPE", "")
    assert load_settings(WorkerSettings).kv_cache_dtype == ""
