"""The wheel holds every package in the tree: pyproject.toml lists packages by hand (libs/ferry and
services/ map to two roots), and a package missing there is missing from the image's wheel."""

from __future__ import annotations

from pathlib import Path

import pytest
import tomllib

pytestmark = pytest.mark.ops

ROOT = Path(__file__).resolve().parents[2]


def _packages_in_tree() -> set[str]:
    found = set()
    for root, name in ((ROOT / "libs" / "ferry", "ferry"), (ROOT / "services", "ferry_services")):
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            found.add(".".join((name, *parts)))
    return found


def test_every_package_in_the_tree_is_in_the_wheel():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert _packages_in_tree() - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
    assert listed - _packages_in_tree() == set(), "listed in pyproject.toml but not in the tree"
