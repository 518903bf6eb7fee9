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


def method_name_branches(path: Path, names: set[str]) -> list[str]:
    """Where `path` compares something called *method* (or *by*, a draft's source) with a
    method's name, or spells two or more method names in one tuple, list or set."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            spelled = [c.value for side in sides for c in ast.walk(side)
                       if isinstance(c, ast.Constant) and c.value in names]
            subject = " ".join(ast.unparse(s) for s in sides)
            if spelled and ("method" in subject or subject.startswith("by ")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            spelled = [e.value for e in node.elts if isinstance(e, ast.Constant)
                       and e.value in names]
            if len(spelled) >= 2:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_and_server_read_method_traits_not_names(tmp_path):
    """Outside the registry (runtime/methods.py) and the proposers, runtime/ and serve/ read
    a method's traits (lookup, picks_length, device, reads), never branch on its name. The
    torch-cuda backend, which runs the export modules, is the one module still to move."""
    from trt_spec.runtime.methods import METHODS

    names = set(METHODS)
    files = [p for folder in ("runtime", "serve") for p in (ROOT / folder).rglob("*.py")
             if p.name != "methods.py" and "proposers" not in p.parts and p != TORCH_TWIN]
    found = [f for p in files for f in method_name_branches(p, names)]
    assert not found, "\n".join(found)
    probe = tmp_path / "probe.py"  # the check sees what it looks for
    probe.write_text("if s.method in ('suffix', 'hybrid'):\n    pass\nX = ('none', 'ngram')\n")
    assert len(method_name_branches(probe, names)) == 3


def test_no_module_is_over_500_lines():
    """A module a newcomer reads in one sitting: split one that grows past 500 lines."""
    folders = ("runtime", "serve", "tools", "export", "train", "plugins", "trt_spec", "scripts")
    long = {str(p.relative_to(ROOT)): n for folder in folders for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_backends_are_named_once():
    """settings.BACKENDS is the one list of backend names (the CLI's --backend choices read
    it); each has its graph source registered in backends/base.py."""
    from trt_spec.runtime.backends.base import GRAPH_SOURCES
    from trt_spec.runtime.settings import BACKENDS

    assert tuple(GRAPH_SOURCES) == BACKENDS
    assert not [p for p in (ROOT / "runtime").rglob("*.py") if p.name != "settings.py"
                and "\nBACKENDS = " in p.read_text()]
