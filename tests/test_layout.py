"""The layout the code promises (README, "Layout"), checked on the imports themselves:
export and training read only the runtime's contract modules, and the serving core imports
neither export, training, the tools nor the HTTP front end."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# torch-free modules that say what an engine folder is: export writes them, the runtime reads
CONTRACT = {"config", "files", "graph_io", "manifest", "methods", "tokenizer"}
# the one runtime module that runs the export modules themselves (lazily, with torch)
TORCH_TWIN = ROOT / "runtime/backends/torch_cuda.py"


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
            names += [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def files(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ["export", "train"])
def test_export_and_training_read_only_the_contract(folder):
    bad = []
    for path in files(folder):
        for name in imports(path):
            parts = name.split(".")
            if parts[:2] == ["trt_spec", "runtime"] and len(parts) > 2 \
                    and parts[2] not in CONTRACT:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_the_serving_core_imports_no_tool_front_end_or_exporter():
    bad = []
    for path in files("runtime"):
        for name in imports(path):
            part = name.split(".")[1] if name.startswith("trt_spec.") else None
            if part in ("export", "train") and path == TORCH_TWIN:
                continue
            if part in ("export", "train", "tools", "serve"):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_the_contract_needs_no_torch():
    for name in CONTRACT:
        mods = [m for m in imports(ROOT / "runtime" / f"{name}.py")
                if m.split(".")[0] in ("torch", "transformers")]
        assert not mods, (name, mods)
