"""ops/k8s: every built-in resource validates against the Kubernetes JSON schemas that the
kubernetes-validate package bundles (strict: unknown fields are errors); KEDA ScaledObjects (a
CRD with no bundled schema) and the wiring between resources get structural checks."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import promql_parser
import pytest
import yaml
from ops_secrets import deployment_secrets, make_secrets_module

from ferry import metrics
from ferry.launcher import SERVICE_MODULES
from ferry.settings import ServiceSettings

pytestmark = pytest.mark.ops

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops/k8s"
WORKLOADS = ("Deployment", "StatefulSet", "Job")


def _load_all() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


DOCS = _load_all()
BUILTIN = [d for d in DOCS if not d["apiVersion"].startswith("keda.sh/")]
SCALED_OBJECTS = [d for d in DOCS if d["kind"] == "ScaledObject"]


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in DOCS if d["kind"] == kind}


# Passwords come in as variables so that FERRY_NATS_URL / FERRY_REDIS_URL can embed them. The
# Secret itself is made by ops/make_secrets.py --k8s; no file in ops/k8s holds one.
SECRET_VARS = set(make_secrets_module()["SECRET_NAMES"])


def _settings_env_names(service_name: str) -> set[str]:
    """FERRY_* variables the service's settings class reads (`ferry serve <service_name>`)."""
    module = importlib.import_module(SERVICE_MODULES[service_name] + ".settings")
    classes = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, ServiceSettings) and c is not ServiceSettings
    ]
    return {"FERRY_" + field.upper() for c in classes for field in c.model_fields}


def _pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def _containers(workload: dict) -> list[dict]:
    spec = _pod_spec(workload)
    return spec["containers"] + spec.get("initContainers", [])


@pytest.mark.parametrize("doc", BUILTIN, ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_builtin_resources_match_the_kubernetes_schema(doc):
    kubernetes_validate.validate(doc, kubernetes_validate.utils.latest_version(), strict=True)


def test_schema_check_catches_a_typo():
    deployment = dict(_by_kind("Deployment")["gateway"])
    broken = {**deployment, "spec": {**deployment["spec"], "replicaz": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.utils.latest_version(), strict=True)


def test_one_workload_per_role_and_everything_in_one_namespace():
    names = {d["metadata"]["name"] for d in DOCS if d["kind"] in WORKLOADS}
    assert {
        "gateway",
        "prefill-balancer",
        "decode-balancer",
        "prefill-worker",
        "decode-worker",
        "kvcache",
        "nats",
        "redis",
        "model-init",
    } <= names
    assert {d["metadata"].get("namespace") for d in DOCS if d["kind"] != "Namespace"} == {"ferry"}


@pytest.mark.parametrize(
    "workload", [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")], ids=lambda d: d["metadata"]["name"]
)
def test_selectors_match_their_pod_templates(workload):
    selector = workload["spec"]["selector"]["matchLabels"]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= labels.items()


def test_services_select_pods_and_target_their_ports():
    templates = [d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")]
    for name, service in _by_kind("Service").items():
        matches = [
            w
            for w in templates
            if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert matches, f"Service {name} selects no pods"
        port_names = {p["name"] for w in matches for c in _containers(w) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, f"Service {name} targets missing port {port['targetPort']}"


def test_statefulsets_have_their_governing_headless_service():
    services = _by_kind("Service")
    for name, sts in _by_kind("StatefulSet").items():
        governing = services[sts["spec"]["serviceName"]]
        assert governing["spec"]["clusterIP"] == "None", name


def test_ferry_containers_run_ferry_entry_points_with_their_role():
    for workload in (d for d in DOCS if d["kind"] in WORKLOADS):
        for container in _pod_spec(workload)["containers"]:
            command = container["command"]
            if command[:2] != ["ferry", "serve"]:
                continue
            assert command[2] in SERVICE_MODULES, command
            env = {e["name"]: e for e in container.get("env", [])}
            unknown = {n for n in env if n.startswith("FERRY_")} - _settings_env_names(command[2]) - SECRET_VARS
            assert not unknown, f"{workload['metadata']['name']} sets settings it does not read: {unknown}"
            if command[2] == "worker":
                role = workload["metadata"]["name"].removesuffix("-worker")
                assert env["FERRY_ROLE"]["value"] == role
                assert env["FERRY_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_no_secret_is_applied_from_the_folder_and_the_generated_one_is_valid():
    assert not _by_kind("Secret"), "kubectl apply -f ops/k8s/ would apply these values"
    generated = yaml.safe_load(make_secrets_module()["as_k8s_secret"](deployment_secrets()))
    kubernetes_validate.validate(generated, kubernetes_validate.utils.latest_version(), strict=True)
    assert generated["metadata"] == {
        "name": "ferry-secrets",
        "namespace": "ferry",
        "labels": {"app.kubernetes.io/part-of": "ferry"},
    }
    assert set(generated["stringData"]) == SECRET_VARS
    assert all(v.isalnum() and v[0].isalpha() and len(v) >= 32 for v in generated["stringData"].values())


def test_secure_defaults_in_the_cluster():
    """API keys on the exposed gateway, a replicated work queue, one kvcache, Redis per role."""
    gateway = {e["name"]: e for e in _pod_spec(_by_kind("Deployment")["gateway"])["containers"][0]["env"]}
    assert gateway["FERRY_HTTP_HOST"]["value"] == "0.0.0.0"
    assert gateway["FERRY_API_KEYS"]["valueFrom"]["secretKeyRef"]["key"] == "FERRY_API_KEYS"
    assert _by_kind("ConfigMap")["ferry-env"]["data"]["FERRY_WORK_REPLICAS"] == "3"
    kvcache = _by_kind("Deployment")["kvcache"]
    assert kvcache["spec"]["replicas"] == 1 and kvcache["spec"]["strategy"]["type"] == "Recreate"
    redis_users = {"worker": ("prefill-worker", "decode-worker"), "kvcache": ("kvcache",)}
    for workload in (d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet")):
        for container in _pod_spec(workload)["containers"]:
            url = next((e["value"] for e in container.get("env", []) if e["name"] == "FERRY_REDIS_URL"), None)
            users = [u for u, names in redis_users.items() if workload["metadata"]["name"] in names]
            if users:
                assert url == f"redis://{users[0]}:$(FERRY_REDIS_{users[0].upper()}_PASSWORD)@redis:6379/0"
            else:
                assert url is None, f"{workload['metadata']['name']} gets Redis credentials it does not use"


def test_referenced_secrets_and_configmaps_exist():
    secrets = {"ferry-secrets": SECRET_VARS}
    configmaps = set(_by_kind("ConfigMap"))
    for workload in (d for d in DOCS if d["kind"] in WORKLOADS):
        for container in _containers(workload):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], ref
            for source in container.get("envFrom", []):
                assert source["configMapRef"]["name"] in configmaps
        for volume in _pod_spec(workload).get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in configmaps


def test_server_configs_are_the_ones_in_ops():
    nats_cm = _by_kind("ConfigMap")["nats-config"]["data"]
    stale = "stale copy: run python ops/k8s/sync_configs.py"
    assert nats_cm["auth.conf"] == (ROOT / "ops/nats/auth.conf").read_text(), stale
    redis_cm = _by_kind("ConfigMap")["redis-config"]["data"]
    for name in ("redis.conf", "users.acl", "start.sh"):
        assert redis_cm[name] == (ROOT / "ops/redis" / name).read_text(), stale


def test_nats_cluster_config_is_accepted_by_nats_server(tmp_path):
    nats_cm = _by_kind("ConfigMap")["nats-config"]["data"]
    for name, text in nats_cm.items():
        (tmp_path / name).write_text(text)
    sts = _by_kind("StatefulSet")["nats"]
    assert sts["spec"]["replicas"] == 3
    args = _pod_spec(sts)["containers"][0]["args"]
    routes = args[args.index("--routes") + 1].split(",")
    for i in range(3):  # a route per replica, through the headless Service, with the route password
        assert (
            f"nats://route:$(FERRY_NATS_ROUTE_PASSWORD)@nats-{i}.nats-headless.ferry.svc.cluster.local:6222" in routes
        )
    assert "password: $FERRY_NATS_ROUTE_PASSWORD" in nats_cm["nats.conf"]  # routes authenticate
    assert "--cluster" not in args  # the flag would drop the route authorization
    env = dict(os.environ, POD_NAME="nats-0")
    env.update(
        {
            e["name"]: "pw"
            for e in _pod_spec(sts)["containers"][0]["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        }
    )
    binary = Path(sys.executable).parent / "nats-server"
    expanded = [a.replace("$(FERRY_NATS_ROUTE_PASSWORD)", "pw") for a in args]
    result = subprocess.run(
        [str(binary), "-c", str(tmp_path / "nats.conf"), *expanded, "-t"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr + result.stdout


@pytest.mark.parametrize("scaled", SCALED_OBJECTS, ids=lambda d: d["metadata"]["name"])
def test_scaled_objects_scale_workers_on_a_backlog_that_cannot_run_away(scaled):
    """A query over the balancers' per-worker backlog (no missing-consumer runaway), a fallback
    when it cannot be read, and a cap; the workload drains within its grace period."""
    spec = scaled["spec"]
    target = spec["scaleTargetRef"]
    workload = _by_kind(target["kind"])[target["name"]]
    assert _pod_spec(workload)["containers"][0]["command"] == ["ferry", "serve", "worker"]
    role = target["name"].removesuffix("-worker")
    assert 1 <= spec["minReplicaCount"] < spec["maxReplicaCount"]
    assert not [
        t for t in spec["triggers"] if t["type"] == "nats-jetstream"
    ]  # reads last_seq when a consumer is missing

    queries = {t["metadata"]["query"]: t for t in spec["triggers"] if t["type"] == "prometheus"}
    (trigger,) = [t for q, t in queries.items() if "ferry_worker_queue_depth" in q]
    (desired,) = [t for q, t in queries.items() if "ferry_desired_replicas" in q]
    assert desired["metadata"]["query"] == f'max(ferry_desired_replicas{{role="{role}"}})'
    assert desired["metricType"] == "AverageValue" and desired["metadata"]["threshold"] == "1"
    assert desired["metadata"]["ignoreNullValues"] == "true"  # controller off: no series, the backlog decides
    assert "ferry_desired_replicas" in metrics.metric_names()
    meta = trigger["metadata"]
    assert trigger["metricType"] == "AverageValue"  # KEDA's fallback needs AverageValue
    assert meta["ignoreNullValues"] == "false" and int(meta["threshold"]) > 0
    names = set()
    promql_parser.walk(
        promql_parser.parse(meta["query"]),
        lambda node: names.add(node.name) if isinstance(node, promql_parser.VectorSelector) else None,
    )
    assert names == {"ferry_worker_queue_depth"} and "ferry_worker_queue_depth" in metrics.metric_names()
    assert f'role="{role}"' in meta["query"] and "max by (worker)" in meta["query"]  # balancer replicas fold

    day = max(int(t["metadata"]["desiredReplicas"]) for t in spec["triggers"] if t["type"] == "cron")
    fallback = spec["fallback"]
    assert fallback["failureThreshold"] >= 2 and spec["minReplicaCount"] <= fallback["replicas"] <= day
    assert spec["maxReplicaCount"] <= 2 * day  # a cap near the planned peak, not a blank cheque
    down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["stabilizationWindowSeconds"] >= 300


@pytest.mark.parametrize("name", ["prefill-worker", "decode-worker"])
def test_a_worker_removed_by_scale_down_has_time_to_drain(name):
    from ferry_services.worker.settings import WorkerSettings

    pod = _pod_spec(_by_kind("StatefulSet")[name])
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    drain_s = float(env.get("FERRY_SHUTDOWN_GRACE_S") or WorkerSettings.model_fields["shutdown_grace_s"].default)
    # the drain, then handing on what is left (one hand-off timeout at most), then exit
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 30
    for container in pod["containers"]:
        assert "preStop" not in container.get("lifecycle", {}), "a preStop hook spends the drain's time first"


@pytest.mark.parametrize("scaled", SCALED_OBJECTS, ids=lambda d: d["metadata"]["name"])
def test_day_night_schedule_keeps_a_day_floor_above_the_night_floor(scaled):
    spec = scaled["spec"]
    cron = [t["metadata"] for t in spec["triggers"] if t["type"] == "cron"]
    assert cron, "no day/night schedule"
    for window in cron:
        assert {"timezone", "start", "end", "desiredReplicas"} <= set(window)
        assert len(window["start"].split()) == 5 and len(window["end"].split()) == 5
        day = int(window["desiredReplicas"])
        assert spec["minReplicaCount"] < day <= spec["maxReplicaCount"]
        # DeepSeek's ratio: ~70 of 278 nodes at night, i.e. the night floor is about a quarter
        assert 0.15 <= spec["minReplicaCount"] / day <= 0.35


def _model_commands() -> dict[str, str]:
    """The shell of every container that waits for or makes the model, by workload/container."""
    found = {}
    for workload in (d for d in DOCS if d["kind"] in WORKLOADS):
        for container in _containers(workload):
            if container["name"] in ("wait-for-model", "model-init"):
                assert container["command"][:2] == ["sh", "-c"], container["command"]
                found[f"{workload['metadata']['name']}/{container['name']}"] = container["command"][2]
    return found


def _run_model_command(script: str, model: str, tmp_path: Path, timeout_s: float = 2.0) -> subprocess.CompletedProcess:
    # No `ferry` on PATH: a command that tried to make a model would fail instead of writing one.
    env = {"PATH": "/usr/bin:/bin", "FERRY_MODEL": model}
    return subprocess.run(
        ["sh", "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout_s
    )


def test_the_default_model_is_smollm2_like_compose():
    from ferry.model.source import DEFAULT_MODEL

    assert _by_kind("ConfigMap")["ferry-env"]["data"]["FERRY_MODEL"] == DEFAULT_MODEL == "smollm2"
    assert len(_model_commands()) == 7  # model-init and one wait per workload that reads the model


@pytest.mark.parametrize("model", ["smollm2", "{tmp}/m.gguf", "{tmp}/ckpt"])
def test_model_containers_go_on_at_once_for_a_model_that_is_there(model, tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt/config.json").write_text("{}")
    for where, script in _model_commands().items():
        done = _run_model_command(script, model.format(tmp=tmp_path), tmp_path)
        assert done.returncode == 0, (where, done.stderr)


@pytest.mark.parametrize("model", ["{tmp}/m.gguf", "{tmp}/ckpt"])
def test_wait_for_model_waits_for_a_file_or_folder_still_missing(model, tmp_path):
    waits = {where: script for where, script in _model_commands().items() if where.endswith("/wait-for-model")}
    for where, script in waits.items():
        with pytest.raises(subprocess.TimeoutExpired):
            _run_model_command(script, model.format(tmp=tmp_path), tmp_path, timeout_s=0.3)
            pytest.fail(f"{where} went on without {model}")
