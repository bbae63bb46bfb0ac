"""compose.yaml / compose.gpu.yaml: valid against the Compose Specification schema, and wired so
that `docker compose up --scale <worker>=N` works and every command runs a real ferry entry point.

The schema is the compose-spec JSON schema vendored by the check-jsonschema package (nothing is
downloaded at test time). Interpolation (`${VAR:-default}`) is resolved with the defaults, as
`docker compose config` would with an empty environment.
"""

from __future__ import annotations

import importlib
import json
import re
from importlib.resources import files
from pathlib import Path

import jsonschema
import pytest
import yaml

from ferry.cli import SUBCOMMANDS
from ferry.launcher import SERVICE_MODULES
from ferry.settings import ServiceSettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FERRY_SERVICES = ("gateway", "prefill-balancer", "decode-balancer", "prefill-worker", "decode-worker", "kvcache")
SCALABLE = ("prefill-balancer", "decode-balancer", "prefill-worker", "decode-worker", "kvcache")
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def _interpolate(value):
    """Resolve ${VAR:-default} with defaults and $$ escapes, recursively, like an empty .env."""
    if isinstance(value, dict):
        return {k: _interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v) for v in value]
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value).replace("$$", "$")
    return value


def _load(name: str) -> tuple[dict, dict]:
    raw = yaml.safe_load((ROOT / name).read_text())  # safe_load resolves the <<: merge keys
    return raw, _interpolate(raw)


@pytest.fixture(scope="module")
def compose() -> dict:
    return _load("compose.yaml")[1]


@pytest.fixture(scope="module")
def schema() -> dict:
    vendored = files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json"
    return json.loads(vendored.read_text())


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml"])
def test_valid_against_compose_spec(schema, name):
    for document in _load(name):  # as written and as interpolated
        jsonschema.Draft202012Validator(schema).validate(document)


def test_bad_file_is_rejected_by_the_schema(schema):
    broken = {"services": {"x": {"image": "a", "depends_on": {"y": {"condition": "service_ready"}}}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(schema).validate(broken)


def test_every_role_is_a_service(compose):
    assert set(FERRY_SERVICES) | {"nats", "redis", "model-init"} <= set(compose["services"])


@pytest.mark.parametrize("name", SCALABLE)
def test_scalable_roles_have_no_fixed_names_ports_or_ids(compose, name):
    service = compose["services"][name]
    assert "container_name" not in service and "hostname" not in service
    assert "ports" not in service
    assert "FERRY_WORKER_ID" not in service.get("environment", {})


@pytest.mark.parametrize("name", FERRY_SERVICES)
def test_commands_are_ferry_entry_points(compose, name):
    command = compose["services"][name]["command"]
    assert command[:2] == ["ferry", "serve"] and len(command) == 3, command
    assert command[2] in SERVICE_MODULES
    assert "serve" in SUBCOMMANDS
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'ferry = "ferry.cli:main"' in pyproject  # the console script the image puts on PATH
    assert f'"{SERVICE_MODULES[command[2]]}"' in pyproject  # the package is installed in the image


def test_workers_have_their_roles(compose):
    assert compose["services"]["prefill-worker"]["environment"]["FERRY_ROLE"] == "prefill"
    assert compose["services"]["decode-worker"]["environment"]["FERRY_ROLE"] == "decode"


def test_model_init_makes_a_demo_model_only_when_none_is_mounted(compose):
    init = compose["services"]["model-init"]
    script = init["command"][-1]
    assert "make-model" in SUBCOMMANDS
    assert 'ferry make-model --arch llama --size tiny "$FERRY_MODEL"' in script
    assert '[ -f "$FERRY_MODEL/config.json" ]' in script
    for name in ("prefill-worker", "decode-worker", "gateway"):
        depends = compose["services"][name]["depends_on"]
        assert depends["model-init"]["condition"] == "service_completed_successfully"
        assert "models:/models" in compose["services"][name]["volumes"]


def test_depends_on_waits_for_health_that_exists(compose):
    services = compose["services"]
    for name, service in services.items():
        for target, cond in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown {target}"
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target}'s missing healthcheck"
            if target in ("nats", "redis"):
                assert cond["condition"] == "service_healthy"


def _settings_env_names(service_name: str) -> set[str]:
    """FERRY_* variables the service's settings class reads (`ferry serve <service_name>`)."""
    module = importlib.import_module(SERVICE_MODULES[service_name] + ".settings")
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, ServiceSettings) and c is not ServiceSettings]
    return {"FERRY_" + field.upper() for c in classes for field in c.model_fields}


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml"])
def test_environment_names_are_settings_the_service_reads(name):
    services = _load(name)[1]["services"]
    for service_name in FERRY_SERVICES:
        environment = services[service_name].get("environment", {})
        base = _load("compose.yaml")[1]["services"][service_name]
        unknown = set(environment) - _settings_env_names(base["command"][2])
        assert not unknown, f"{name}: {service_name} sets settings it does not read: {unknown}"


def test_nats_urls_carry_each_services_own_user(compose):
    users = {"gateway": "gateway", "prefill-balancer": "prefill_balancer",
             "decode-balancer": "decode_balancer", "prefill-worker": "worker",
             "decode-worker": "worker", "kvcache": "kvcache"}
    auth = (ROOT / "ops/nats/auth.conf").read_text()
    for name, user in users.items():
        url = compose["services"][name]["environment"]["FERRY_NATS_URL"]
        assert url.startswith(f"nats://{user}:") and url.endswith("@nats:4222")
        password = url.split(":")[2].split("@")[0]
        # the server reads the same default password from its environment
        env_var = f"FERRY_NATS_{user.upper()}_PASSWORD"
        assert compose["services"]["nats"]["environment"][env_var] == password
        assert f"user: {user}\n      password: ${env_var}" in auth


def test_redis_password_matches_the_services(compose):
    password = compose["services"]["redis"]["environment"]["FERRY_REDIS_PASSWORD"]
    for name in FERRY_SERVICES:
        assert compose["services"][name]["environment"]["FERRY_REDIS_URL"] == f"redis://:{password}@redis:6379/0"


def test_bind_mounts_point_at_files_in_the_repository(compose):
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source


def test_gpu_override_reserves_nvidia_devices_for_workers():
    raw, gpu = _load("compose.gpu.yaml")
    base = _load("compose.yaml")[1]
    assert set(gpu["services"]) <= set(base["services"])
    for name in ("prefill-worker", "decode-worker"):
        devices = gpu["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
    for service in gpu["services"].values():
        assert service["build"]["args"]["VARIANT"] == "cuda"


def test_monitoring_is_a_profile(compose):
    for name in ("prometheus", "grafana"):
        assert compose["services"][name]["profiles"] == ["monitoring"]
    for name in FERRY_SERVICES:
        assert "profiles" not in compose["services"][name]  # plain `up` starts the system


@pytest.mark.slow
def test_model_init_command_runs_once(compose, tmp_path):
    """model-init's own command, run by sh as the container would: makes the demo model, then keeps it."""
    import os
    import subprocess
    import sys

    command = compose["services"]["model-init"]["command"]
    env = dict(os.environ, FERRY_MODEL=str(tmp_path / "demo"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the venv's `ferry`
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "demo/config.json").exists() and (tmp_path / "demo/tokenizer.json").exists()
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and f"model-init: using {tmp_path / 'demo'}" in second.stdout
