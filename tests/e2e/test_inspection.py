"""The inspection commands of README.md and ops/README.md, run against `ferry up` as written: it
prints where NATS, its monitoring port, the API and Redis are, saves a nats CLI context, and the
monitoring endpoints and (where the `nats` binary is installed) the CLI commands answer."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request

import pytest
from system_launch import start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NATS_CLI = shutil.which("nats")
NO_CLI = (
    "the nats CLI is not installed here: no PyPI package ships it; ops/README.md says how to get it "
    "(the natsio/nats-box image, or a release binary from github.com/nats-io/natscli)"
)


@pytest.fixture(scope="module")
def up(e2e_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("inspect")
    system = start_system(e2e_model, "", "", run_dir, prefill=1, decode=1)  # ferry up starts NATS and Redis
    yield system, run_dir
    assert system.stop() == 0


def _printed(system, name: str) -> str:
    pattern = re.compile(rf"^ferry up: {re.escape(name)}:\s+(\S+)")
    found = [m.group(1) for line in system.output if (m := pattern.match(line))]
    assert found, f"ferry up did not print its {name} ({system.output[:20]})"
    return found[0]


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        return resp.read()


def test_ferry_up_prints_every_url_and_saves_a_nats_context(up):
    system, run_dir = up
    assert _printed(system, "API") == f"{system.base_url}/v1"
    nats_url, monitor_url = _printed(system, "NATS"), _printed(system, "NATS monitoring")
    assert re.fullmatch(r"nats://127\.0\.0\.1:\d+", nats_url) and monitor_url.startswith("http://127.0.0.1:")
    assert re.fullmatch(r"redis://127\.0\.0\.1:\d+/0", _printed(system, "Redis"))
    assert _printed(system, "nats CLI") == "nats"  # the line starts with the command to run
    context = run_dir / "config/nats/context/ferry-up.json"
    assert json.loads(context.read_text())["url"] == nats_url
    assert context.stat().st_mode & 0o077 == 0  # private: a context may hold a password


def test_the_monitoring_endpoints_answer_as_ops_readme_shows(up):
    system, _ = up
    monitor_url = _printed(system, "NATS monitoring")
    assert json.loads(_get(f"{monitor_url}/healthz?js-enabled-only=true"))["status"] == "ok"
    jsz = json.loads(_get(f"{monitor_url}/jsz?consumers=true"))
    streams = [s for account in jsz["account_details"] for s in account["stream_detail"]]
    consumers = {c["name"] for s in streams if s["name"] == "FERRY_WORK" for c in s.get("consumer_detail", [])}
    assert any(c.startswith("prefill-") for c in consumers) and any(c.startswith("decode-") for c in consumers)


@pytest.mark.skipif(NATS_CLI is None, reason=NO_CLI)
@pytest.mark.parametrize(
    ("command", "expected"),
    [
        ("micro ls", "kvcache"),
        ("micro ping", "kvcache"),
        ("micro info kvcache", "ferry.kv.lookup"),
        ("stream info FERRY_WORK", "ferry.work.>"),
        ("consumer ls FERRY_WORK", "decode-"),
        ("consumer report FERRY_WORK", "decode-"),
        ("req ferry.kv.stats ''", "Received"),
    ],
)
def test_the_readme_nats_commands_run_with_the_saved_context(up, command, expected):
    _, run_dir = up
    result = subprocess.run(
        f"{NATS_CLI} --context ferry-up {command}",
        shell=True,
        env={"XDG_CONFIG_HOME": str(run_dir / "config"), "PATH": "/usr/bin:/bin", "HOME": str(run_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout + result.stderr
