"""The layout the code promises (README, "Layout"), checked on the imports themselves:
export and training read only the runtime's contract modules, export imports no training, and
the serving core imports neither export, training, the tools nor the HTTP front end."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# torch-free modules that say what an engine folder is: export writes them, the runtime reads
# (and how a config's fields are named as options: every command builds its configs with it)
CONTRACT = {"config", "corpus", "files", "graph_io", "manifest", "methods", "options",
            "tokenizer"}
# the torch-cuda backend: it runs the export modules, so it lives beside them, and is a
# runtime backend, so it reads the runtime's backend contract
TORCH_BACKEND = ROOT / "export/torch_backend.py"
# training's target as users run it: the engine folder's graphs on the ORT backend (it runs
# the runtime as a user does; nothing in the runtime reads training)
ENGINE_TARGET = ROOT / "train/engine_target.py"
# the folders of the package's parts, by the name they import under (trt_spec.<part>)
PARTS = {"export": "export", "runtime": "runtime", "serve": "serve", "tools": "tools",
         "plugins": "plugins", "train": "train", "cli": "trt_spec/cli"}


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
        if path in (TORCH_BACKEND, ENGINE_TARGET):
            continue
        for name in imports(path):
            parts = name.split(".")
            if parts[:2] == ["trt_spec", "runtime"] and len(parts) > 2 \
                    and parts[2] not in CONTRACT:
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_export_imports_no_training():
    """Layers go one way: training builds on export (its models, checkpoints and ShareGPT
    reader, export/sharegpt.py), never export on training."""
    bad = [f"{path.relative_to(ROOT)}: {name}" for path in files("export")
           for name in imports(path) if name.split(".")[:2] == ["trt_spec", "train"]]
    assert not bad, bad


def test_the_serving_core_imports_no_tool_front_end_or_exporter():
    bad = []
    for path in files("runtime"):
        for name in imports(path):
            part = name.split(".")[1] if name.startswith("trt_spec.") else None
            if part in ("export", "train", "tools", "serve", "plugins"):
                bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert not bad, bad


def test_the_contract_needs_no_torch():
    for name in CONTRACT:
        mods = [m for m in imports(ROOT / "runtime" / f"{name}.py")
                if m.split(".")[0] in ("torch", "transformers")]
        assert not mods, (name, mods)


def method_name_branches(path: Path, names: set[str]) -> list[str]:
    """Where `path` compares something called *method* or *kind* (or *by*, a draft's source)
    with a method's name, or spells two or more method names in one tuple, list or set."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            spelled = [c.value for side in sides for c in ast.walk(side)
                       if isinstance(c, ast.Constant) and c.value in names]
            subject = " ".join(ast.unparse(s) for s in sides)
            if spelled and ("method" in subject or "kind" in subject
                            or subject.startswith("by ")):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            spelled = [e.value for e in node.elts if isinstance(e, ast.Constant)
                       and e.value in names]
            if len(spelled) >= 2:
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_engine_and_server_read_method_traits_not_names(tmp_path):
    """Outside the registry (runtime/methods.py) and the proposers, runtime/ and serve/ read
    a method's traits (lookup, picks_length, device, reads), never branch on its name."""
    from trt_spec.runtime.methods import METHODS

    names = set(METHODS)
    files = [p for folder in ("runtime", "serve") for p in (ROOT / folder).rglob("*.py")
             if p.name != "methods.py" and "proposers" not in p.parts]
    found = [f for p in files for f in method_name_branches(p, names)]
    assert not found, "\n".join(found)
    probe = tmp_path / "probe.py"  # the check sees what it looks for
    probe.write_text("if s.method in ('suffix', 'hybrid'):\n    pass\nX = ('none', 'ngram')\n")
    assert len(method_name_branches(probe, names)) == 3


def test_export_and_training_dispatch_through_the_registry(tmp_path):
    """export/ and train/ pick what a method's drafter needs (its checkpoint reader, its
    trainer, its module count) from the registry's traits or from tables keyed by method
    (checked against the registry), never by comparing a method or drafter kind with a name:
    neither a method's nor its train name ("draft")."""
    from trt_spec.runtime.methods import METHODS, TRAIN_NAMES

    names = set(METHODS) | set(TRAIN_NAMES)
    found = [f for folder in ("export", "train") for p in files(folder)
             for f in method_name_branches(p, names)]
    assert not found, "\n".join(found)
    probe = tmp_path / "probe.py"  # the check sees what it looks for
    probe.write_text("if kind == 'eagle3':\n    pass\nif drafter.kind != 'eagle':\n    pass\n"
                     "if 'draft' in config.methods:\n    pass\nK = ('mtp', 'eagle')\n")
    assert len(method_name_branches(probe, names)) == 4


def test_no_module_is_over_500_lines():
    """A module a newcomer reads in one sitting: split one that grows past 500 lines."""
    folders = ("runtime", "serve", "tools", "export", "train", "plugins", "trt_spec", "scripts")
    long = {str(p.relative_to(ROOT)): n for folder in folders for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_backends_are_named_once():
    """backends/sources.BACKENDS is the one list of backend names (settings and the CLI's
    --backend choices read it); each has its graph source registered once the package is
    imported (torch-cuda at the package's edge)."""
    from trt_spec.runtime.backends.sources import BACKENDS, GRAPH_SOURCES

    assert sorted(GRAPH_SOURCES) == sorted(BACKENDS)
    assert not [p for p in (ROOT / "runtime").rglob("*.py") if p.name != "sources.py"
                and "\nBACKENDS = " in p.read_text()]


def import_graph() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports, at the top or inside a
    function (trt_spec itself: the package's edge, trt_spec/__init__.py)."""
    modules = {"trt_spec": ROOT / "trt_spec/__init__.py"}
    for part, folder in PARTS.items():
        for path in files(folder):
            names = [n for n in path.relative_to(ROOT / folder).with_suffix("").parts
                     if n != "__init__"]
            modules[".".join(["trt_spec", part, *names])] = path

    def module_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {t for n in imports(path) if n.startswith("trt_spec")
                if (t := module_of(n)) not in (None, m)} for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on.discard(w), component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_no_import_cycle_spans_two_parts():
    """Imports inside functions count: a cycle through two parts (runtime and export, say)
    ties them into one unit that cannot be read, tested or shipped apart."""
    graph = import_graph()
    assert "trt_spec.export.torch_backend" in graph  # the walk sees the package
    spanning = [sorted(c) for c in cycles(graph)
                if len({(m.split(".") + ["edge"])[1] for m in c}) > 1]
    assert not spanning, spanning
    probe = {"trt_spec.a.x": {"trt_spec.b.y"}, "trt_spec.b.y": {"trt_spec.a.x"},
             "trt_spec.a.z": set()}  # the check sees what it looks for
    assert cycles(probe) == [{"trt_spec.a.x", "trt_spec.b.y"}]


def test_proposers_only_draft():
    """The speculation rules belong to the planner (runtime/speculation/): proposers apply
    them through the gate it hands them, so no proposer imports the policy, and no import
    cycle runs through a proposer or the policy (settings -> methods -> proposers -> policy
    -> settings tied seven modules into one)."""
    graph = import_graph()
    policy = "trt_spec.runtime.speculation.policy"
    proposers = [m for m in graph if m.startswith("trt_spec.runtime.proposers.")]
    assert "trt_spec.runtime.proposers.suffix" in proposers  # the walk sees them
    assert not [m for m in proposers if policy in graph[m]]
    tied = [sorted(c) for c in cycles(graph) if c & {policy, *proposers}]
    assert not tied, tied


def test_no_function_takes_more_than_12_parameters():
    """Outside the command line (which maps options onto config objects) settings travel as
    typed configs, not long keyword chains: no function takes more than 12 parameters."""
    folders = ("runtime", "serve", "tools", "export", "train", "plugins", "scripts")
    long = []
    for path in (p for folder in folders for p in files(folder)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
                n = len([x for x in names if x not in ("self", "cls")])
                if n > 12:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert not long, long


def long_functions(path: Path, limit: int) -> list[str]:
    """Every function (or method, nested ones too) in `path` longer than `limit` lines,
    decorators left out."""
    return [f"{path.name}:{node.lineno} {node.name}: "
            f"{node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_server_function_is_over_60_lines(tmp_path):
    """The server reads route by route: no function in serve/ over 60 lines (create_app
    registers routes that live in their own modules; it holds none)."""
    long = [f for path in files("serve") for f in long_functions(path, 60)]
    assert not long, long
    probe = tmp_path / "probe.py"  # the check sees what it looks for, nested functions too
    probe.write_text("def outer():\n    async def inner():\n" + "        pass\n" * 60)
    assert [f.split()[1] for f in long_functions(probe, 60)] == ["outer:", "inner:"]


def test_no_tool_function_is_over_60_lines():
    """The tools read step by step: no function in tools/ over 60 lines (bench's run_bench
    is a list of named steps: load, warm up, run ours and the peers per workload, collect)."""
    long = [f for path in files("tools") for f in long_functions(path, 60)]
    assert not long, long


# The serving spine, top to bottom: a module imports only modules of its own layer or below
# (the generator loads an engine folder and is used by the layers above the engine; it
# uses none of them). Everything else in runtime/ is the engine's layer or below it.
LAYERS = {"trt_spec.runtime.api": 3, "trt_spec.serve": 3, "trt_spec.runtime.chat": 3,
          "trt_spec.runtime.scheduler": 2, "trt_spec.runtime.generator": 1}
ENGINE_LAYER = 0


def layer(module: str) -> int | None:
    """A module's layer on the spine (None: off it: tools, export, training, the CLI)."""
    for prefix, n in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return n
    return ENGINE_LAYER if module.startswith("trt_spec.runtime.") else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {t}" for m, targets in graph.items() if layer(m) is not None
            for t in targets if layer(t) is not None and layer(t) > layer(m)]


def test_layers_point_one_way():
    """The API and the server (and runtime/chat.py, which both run) -> the scheduler -> the
    generator -> the engine, its planner, backends and proposers; never back up (imports
    inside functions count)."""
    graph = import_graph()
    assert not upward_imports(graph), upward_imports(graph)
    probe = {"trt_spec.runtime.generator": {"trt_spec.runtime.scheduler"},
             "trt_spec.runtime.engine": {"trt_spec.runtime.generator"},
             "trt_spec.runtime.scheduler": {"trt_spec.runtime.engine"}}
    assert len(upward_imports(probe)) == 2  # the check sees what it looks for


def test_the_engine_reads_like_the_loop():
    """runtime/engine.py stays a page of the algorithm: under 300 lines, no function over 40."""
    path = ROOT / "runtime/engine.py"
    assert len(path.read_text().splitlines()) < 300
    assert not long_functions(path, 40), long_functions(path, 40)
