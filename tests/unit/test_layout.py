"""The layout's import rules, read from the source (ast, no imports run): who may import the engine, NATS, or
another service. A new module that breaks one fails here, naming the module and the import."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imports(path: Path) -> set[str]:
    """Every module path a file imports (absolute imports only: the project uses no relative ones)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{alias.name}" for alias in node.names}
    return out


def modules(*folders: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imports(p) for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))}


def offenders(found: dict[str, set[str]], prefix: str, allowed: tuple[str, ...]) -> list[str]:
    return [f"{path}: {name}" for path, names in found.items() if not path.startswith(allowed)
            for name in sorted(names) if name == prefix or name.startswith(prefix + ".")]


def test_only_the_worker_imports_the_engine() -> None:
    assert offenders(modules("services", "shared"), "shared.engine", ("shared/engine/", "shared/worker/")) == []


def test_only_the_bus_imports_nats() -> None:
    assert offenders(modules("services", "shared"), "nats", ("shared/bus.py", "shared/bus_state.py")) == []


def test_services_import_no_other_service_and_shared_none() -> None:
    found = modules("services", "shared")
    bad = []
    for path, names in found.items():
        parts = path.split("/")
        own = f"services.{parts[1]}" if parts[0] == "services" else None
        for name in names:
            if not name.startswith("services."):
                continue
            service = ".".join(name.split(".")[:2])
            if service == own:
                continue
            # the one exception: `deepinfer up` takes its defaults from the services' config records
            if path == "shared/launch/cli_up.py" and name.split(".")[2:3] == ["config"]:
                continue
            bad.append(f"{path}: {name}")
    assert bad == []
