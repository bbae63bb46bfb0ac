"""Real servers for tests: NATS (JetStream) and Redis, never mocks.

Where they come from, first that works:
1. NATS_URL / REDIS_URL from the environment (CI services, a developer's own servers);
2. testcontainers, when a Docker engine answers within a second;
3. local nats-server / redis-server processes (ferry.launcher.servers) on free ports.
Servers live for the whole session; connections are fresh per test and start from a clean state
(no FERRY_WORK stream, an empty Redis database).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ferry.launcher.servers import start_nats, start_redis

# Each folder under tests/ is one kind of test, with its marker: the marker is how a subset runs
# (`-m unit`), the folder is where a reader looks. gpu and slow are orthogonal and go anywhere.
FOLDER_MARKERS = {"unit": "unit", "integration": "integration", "e2e": "e2e", "ops": "ops"}
_TESTS = Path(__file__).resolve().parent


def folder_marker_problems(items) -> list[str]:
    """One line per test whose kind markers are not exactly its folder's."""
    kinds = set(FOLDER_MARKERS.values())
    problems = []
    for item in items:
        folder = Path(item.path).resolve().relative_to(_TESTS).parts[0]
        expected = FOLDER_MARKERS.get(folder)
        found = {m.name for m in item.iter_markers()} & kinds
        if expected is None or found != {expected}:
            want = f"marker '{expected}'" if expected else f"a folder of {sorted(FOLDER_MARKERS)}"
            problems.append(f"{item.nodeid}: in tests/{folder}/ with markers {sorted(found)}; wants {want}")
    return problems


def pytest_collection_modifyitems(config, items) -> None:
    problems = folder_marker_problems(items)
    if problems:
        raise pytest.UsageError("tests whose folder and marker disagree:\n  " + "\n  ".join(problems))


def _docker_available() -> bool:
    """True only if a Docker engine answers quickly; never waits on a missing socket."""
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker

        client = docker.from_env(timeout=1)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no engine, no permission, bad DOCKER_HOST: use local processes
        return False


@contextlib.contextmanager
def _container(image: str, port: int, command: str, scheme: str, path: str = "") -> Iterator[str]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs

    with DockerContainer(image).with_command(command).with_exposed_ports(port) as container:
        wait_for_logs(container, "Server is ready|Ready to accept connections", timeout=30)
        host, mapped = container.get_container_host_ip(), container.get_exposed_port(port)
        yield f"{scheme}://{host}:{mapped}{path}"


@contextlib.contextmanager
def _server_url(
    env_var: str, image: str, port: int, command: str, scheme: str, path: str, start_local
) -> Iterator[str]:
    if os.environ.get(env_var):
        yield os.environ[env_var]
    elif _docker_available():
        with _container(image, port, command, scheme, path) as url:
            yield url
    else:
        with start_local() as handle:
            yield handle.url


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    with _server_url("NATS_URL", "nats:2.10-alpine", 4222, "-js", "nats", "", start_nats) as url:
        yield url


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with _server_url("REDIS_URL", "redis:7-alpine", 6379, "redis-server --save ''", "redis", "/0", start_redis) as url:
        yield url


@pytest.fixture
async def nc(nats_url):
    """A fresh NATS connection; the FERRY_WORK stream is deleted first so every test starts empty."""
    from nats.js.errors import NotFoundError

    from ferry.bus import connect
    from ferry.protocol import subjects

    client = await connect(nats_url, name="ferry-test", connect_timeout_s=10)
    with contextlib.suppress(NotFoundError):
        await client.jetstream().delete_stream(subjects.WORK_STREAM)
    yield client
    if not client.is_closed:
        await client.close()


@pytest.fixture
def js(nc):
    return nc.jetstream()


@pytest.fixture
async def redis(redis_url):
    """A fresh async Redis client (bytes in, bytes out) on an emptied database."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A tiny random-weight Llama checkpoint dir, made once per session by `ferry.model.make_model`."""
    from ferry.model.make_model import make_model

    return make_model(tmp_path_factory.mktemp("tiny-model"), arch="llama", size="tiny")
