"""The secrets a deployment gets from ops/make_secrets.py, made once per test session: compose
files are read with them in the environment, as `docker compose` reads them from .env."""

from __future__ import annotations

import functools
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def make_secrets_module() -> dict:
    return runpy.run_path(str(ROOT / "ops/make_secrets.py"))


@functools.cache
def deployment_secrets() -> dict[str, str]:
    return make_secrets_module()["make_secrets"]()
