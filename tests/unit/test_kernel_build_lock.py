"""The CPU kernel's build lock: a `lock` baton left by a killed build must not hang every later start."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap

import pytest

from ferry.kernels.cpu_decode import build_directory, build_lock

pytestmark = pytest.mark.unit


def test_a_dead_builds_baton_is_removed(tmp_path):
    build_dir = tmp_path / "ferry_cpu_decode_x"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what torch's FileBaton leaves when its builder is killed mid-build
    with build_lock(build_dir) as held:
        assert not (build_dir / "lock").exists()
        # while held, the flock is taken: a non-blocking attempt from another descriptor fails
        fd = os.open(held.path, os.O_RDWR)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                raise AssertionError("the build lock was not held")
            except BlockingIOError:
                pass
        finally:
            os.close(fd)


def test_the_lock_dies_with_its_holder(tmp_path):
    build_dir = tmp_path / "ferry_cpu_decode_y"
    build_dir.mkdir()
    holder = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from ferry.kernels.cpu_decode import build_lock
        lock = build_lock(Path({str(build_dir)!r})).__enter__()
        (Path({str(build_dir)!r}) / "lock").touch()  # a build in progress, then killed
        os._exit(9)
    """)
    proc = subprocess.run([sys.executable, "-c", holder], env=os.environ.copy(), timeout=60)
    assert proc.returncode == 9
    assert (build_dir / "lock").exists()
    with build_lock(build_dir):  # would block forever if the dead holder's flock survived it
        assert not (build_dir / "lock").exists()


def test_build_directory_follows_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FERRY_KERNEL_CACHE", str(tmp_path))
    assert build_directory("ferry_cpu_decode_z") == tmp_path / "ferry_cpu_decode_z"
    monkeypatch.delenv("FERRY_KERNEL_CACHE")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert build_directory("ferry_cpu_decode_z") == tmp_path / "ext" / "ferry_cpu_decode_z"
