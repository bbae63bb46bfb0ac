"""The Kubernetes NATS cluster (ops/k8s/nats.yaml) run for real: three local nats-server processes
with the ConfigMap's nats.conf + auth.conf (route hosts and ports moved to 127.0.0.1) and the
StatefulSet's environment. Routes authenticate, and FERRY_WORK is replicated on it the way the
services create it: three replicas asked, never fewer, updated only when its configuration differs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import yaml

from ferry.bus import ensure_work_stream
from ferry.launcher.servers import free_port
from ferry.protocol import subjects

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NODES = 3
ROUTE_PASSWORD = "route-pw"
ADMIN_PASSWORD = "admin-pw"


def _k8s_nats() -> tuple[dict[str, str], dict]:
    docs = [d for d in yaml.safe_load_all((ROOT / "ops/k8s/nats.yaml").read_text()) if d]
    config = next(d for d in docs if d["kind"] == "ConfigMap")["data"]
    container = next(d for d in docs if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    return config, container


@dataclass
class Node:
    name: str
    port: int
    cluster_port: int
    monitor_port: int
    process: subprocess.Popen | None = None

    def routez(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/routez", timeout=2) as resp:
            return json.loads(resp.read())


class Cluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.config, self.container = _k8s_nats()
        self.nodes = [Node(f"nats-{i}", free_port(), free_port(), free_port()) for i in range(NODES)]

    def routes_arg(self, password: str) -> str:
        """The StatefulSet's --routes value as Kubernetes expands it, pointed at the local nodes."""
        args = self.container["args"]
        routes = args[args.index("--routes") + 1].replace("$(FERRY_NATS_ROUTE_PASSWORD)", password)
        for i, node in enumerate(self.nodes[:NODES]):
            routes = routes.replace(
                f"nats-{i}.nats-headless.ferry.svc.cluster.local:6222", f"127.0.0.1:{node.cluster_port}"
            )
        assert "svc.cluster.local" not in routes and "$(" not in routes, routes
        return routes

    def start(self, node: Node, route_password: str = ROUTE_PASSWORD) -> None:
        env = dict(os.environ, POD_NAME=node.name, FERRY_NATS_ROUTE_PASSWORD=route_password)
        for var in self.container_secret_vars():
            env.setdefault(var, "unused-" + var.lower())
        env["FERRY_NATS_ADMIN_PASSWORD"] = ADMIN_PASSWORD
        store = self.workdir / node.name
        store.mkdir(exist_ok=True)
        # nats-server refuses -sd beside the file's store_dir: the node's own copy moves the paths
        config = self.config["nats.conf"].replace("store_dir: /data", f"store_dir: {store}")
        config = config.replace("pid_file: /var/run/nats/nats.pid", f"pid_file: {store / 'pid'}")
        # not --cluster: that flag drops the file's route authorization
        config = config.replace("  port: 6222\n", f"  listen: 127.0.0.1:{node.cluster_port}\n")
        (store / "nats.conf").write_text(config)
        (store / "auth.conf").write_text(self.config["auth.conf"])
        cmd = [
            str(Path(sys.executable).parent / "nats-server"),
            "-c",
            str(store / "nats.conf"),
            "--routes",
            self.routes_arg(route_password),
            *("-a", "127.0.0.1", "-p", str(node.port), "-m", str(node.monitor_port)),
            *("-l", str(self.workdir / f"{node.name}.log")),
        ]
        node.process = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def container_secret_vars(self) -> list[str]:
        return [e["name"] for e in self.container["env"] if "secretKeyRef" in e.get("valueFrom", {})]

    def url(self) -> str:
        return ",".join(f"nats://admin:{ADMIN_PASSWORD}@127.0.0.1:{n.port}" for n in self.nodes)

    def stop(self) -> None:
        for node in self.nodes:
            if node.process and node.process.poll() is None:
                node.process.terminate()
                node.process.wait(timeout=15)


async def _until(check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            result = await check()
            if result:
                return result
        except Exception:  # not up yet, no JetStream leader yet
            if time.monotonic() > deadline:
                raise
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.2)


def _peers(node: Node) -> set[str]:
    return {route["remote_name"] for route in node.routez().get("routes") or []}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("nats-cluster"))
    try:
        for node in c.nodes:
            c.start(node)
        yield c
    finally:
        c.stop()


@pytest.fixture
async def js(cluster):
    nc = await nats.connect(
        cluster.url().split(","), connect_timeout=2, max_reconnect_attempts=60, reconnect_time_wait=0.2
    )
    js = nc.jetstream()
    await _until(js.account_info)  # JetStream's meta leader is elected
    yield js
    await nc.close()


async def test_routes_authenticate_and_a_node_without_the_password_stays_out(cluster, js):
    members = {n.name for n in cluster.nodes}

    async def fully_routed() -> bool:
        return all(_peers(n) == members - {n.name} for n in cluster.nodes)

    await _until(fully_routed)
    intruder = Node("nats-9", free_port(), free_port(), free_port())
    cluster.nodes.append(intruder)  # stopped with the others
    try:
        cluster.start(intruder, route_password="a-guess")  # the same config, the wrong route password
        await asyncio.sleep(3)
        assert intruder.process.poll() is None
        assert intruder.routez()["num_routes"] == 0
        assert all(_peers(n) == members - {n.name} for n in cluster.nodes[:NODES])
        log = (cluster.workdir / "nats-0.log").read_text()
        assert "Authentication Failure" in log or "authentication error" in log.lower()
    finally:
        cluster.nodes.remove(intruder)
        intruder.process.terminate()
        intruder.process.wait(timeout=15)


async def test_work_stream_is_replicated_and_never_reduced(js, caplog):
    caplog.set_level(logging.INFO, logger="ferry.bus")
    await _until(lambda: _create(js, replicas=1))
    await ensure_work_stream(js, replicas=3)  # a service with FERRY_WORK_REPLICAS=3: raised, logged
    assert "num_replicas: 1 -> 3" in caplog.text

    async def replicated():
        info = await js.stream_info(subjects.WORK_STREAM)
        return info if len(info.cluster.replicas or []) == NODES - 1 else None

    await _until(replicated)  # the leader plus a follower on each other node
    await ensure_work_stream(js, replicas=1)  # a service started without the setting: keeps 3
    await ensure_work_stream(js, replicas=3)  # and the same again: nothing to update
    info = await js.stream_info(subjects.WORK_STREAM)
    assert info.config.num_replicas == 3 and len(info.cluster.replicas) == NODES - 1
    assert "keeps its 3 replicas" in caplog.text and caplog.text.count("updating stream") == 1
    await js.delete_stream(subjects.WORK_STREAM)


async def _create(js, replicas: int) -> bool:
    await ensure_work_stream(js, replicas=replicas)
    return True
