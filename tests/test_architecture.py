"""The package layout holds: imports run one way, no module-level cycle, torch stays out where it is not needed.

``LAYERS`` below is the one statement of the allowed arrows; docs/architecture.md shows the same line
(a test compares them). A module may import from its own package and from packages of lower layers.
Importing a package of a higher layer runs backwards; importing another package of the same layer runs
sideways; both are reported. Every import counts: module level and inside functions, absolute and
relative, ``if TYPE_CHECKING:`` blocks, and ``importlib.import_module("offload_adamw...")`` with a
literal name. Cycles are looked for among module-level imports that run at import time (not in
functions, not under TYPE_CHECKING).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TOP = "offload_adamw"

#: lowest first; the packages of one layer do not import each other.
LAYERS: tuple[frozenset[str], ...] = (
    # leaf modules with no package imports and no torch: the version, the shared table and JSON writer
    frozenset({"_version", "_output"}),
    frozenset({"contract"}),
    frozenset({"kernels"}),
    frozenset({"distributed"}),
    frozenset({"accel"}),
    frozenset({"optim"}),
    # measurements of the machine and the optimizer: below the tool rooms, so the planner can read its probes
    frozenset({"benchmarking"}),
    frozenset({"checkpoint", "conformance", "planning", "auditing", "selftest"}),
    frozenset({"integrations"}),
    frozenset({"demo"}),
    frozenset({"cli"}),
    # test devices (the simulated CUDA device): tests install them; no module of the library imports them
    frozenset({"testing"}),
    # the public facades: offload_adamw/__init__.py (the lazy re-export table), __main__.py, reference.py
    frozenset({"<facade>"}),
)
FACADE_MODULES = {TOP, f"{TOP}.__main__", f"{TOP}.reference"}
#: modules that must import without torch, and everything they pull in at import time must too.
TORCH_FREE = ("offload_adamw.contract", "offload_adamw.planning.planner", "offload_adamw.planning.models",
              "offload_adamw.planning.report", "offload_adamw.conformance.report", "offload_adamw.benchmarking.device_trace")
#: what a cli/ module may import: it parses and prints, the work is done by the room it is about.
CLI_REACHES = frozenset({"_version", "_output", "cli", "benchmarking", "checkpoint", "conformance", "planning",
                         "auditing", "selftest", "integrations", "demo"})


def layer_line() -> str:
    """LAYERS as the one line docs/architecture.md shows (the version module and the facades left out)."""
    shown = [sorted(layer) for layer in LAYERS if layer not in (frozenset({"_version", "_output"}), frozenset({"<facade>"}))]
    return " < ".join(names[0] if len(names) == 1 else "{" + ", ".join(names) + "}" for names in shown)


@dataclass(frozen=True)
class Import:
    importer: str
    """Dotted name of the importing module."""
    target: str
    """Dotted name of the imported module (the most specific one that exists)."""
    line: int
    at_import_time: bool
    """Module level and not under ``if TYPE_CHECKING:`` (runs when the importer is imported)."""


def module_names(src: Path) -> dict[str, Path]:
    """Every module of the package under ``src``: dotted name -> file (a package is its __init__.py)."""
    names = {}
    for path in sorted((src / TOP).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(node: ast.AST, in_function: bool = False, type_only: bool = False):
    """Yield (node, in_function, type_only) for every node below ``node``."""
    for child in ast.iter_child_nodes(node):
        yield child, in_function, type_only
        child_in_function = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, in_function, True
                yield from _walk(stmt, in_function, True)
            for stmt in child.orelse:
                yield stmt, in_function, type_only
                yield from _walk(stmt, in_function, type_only)
            continue
        yield from _walk(child, child_in_function, type_only)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Import]:
    """Every import of a module of this package made by module ``name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def specific(base: str, names: list[str]) -> list[str]:
        found = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
        return found if len(found) == len(names) else [*found, base]

    out = []
    for node, in_function, type_only in _walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            targets = specific(base, [alias.name for alias in node.names])
        elif (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name))
              and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for dotted in targets:
            if dotted != TOP and not dotted.startswith(TOP + "."):
                continue
            target = dotted
            while target not in modules and "." in target:  # `import a.b.attr` style: the module that exists
                target = target.rpartition(".")[0]
            out.append(Import(name, target, node.lineno, not in_function and not type_only))
    return out


def package_of(module: str) -> str:
    if module in FACADE_MODULES:
        return "<facade>"
    return module.split(".")[1]


def layer_of(package: str) -> int:
    for i, layer in enumerate(LAYERS):
        if package in layer:
            return i
    raise KeyError(package)


def check_layers(src: Path) -> list[str]:
    """Every import under ``src`` that runs backwards or sideways, or leaves the layer table, as one line each."""
    modules = module_names(src)
    problems = []
    for name, path in modules.items():
        for imp in imports_of(name, path, modules):
            src_pkg, dst_pkg = package_of(imp.importer), package_of(imp.target)
            where = f"{path.relative_to(src)}:{imp.line}: {imp.importer} imports {imp.target}"
            try:
                src_layer, dst_layer = layer_of(src_pkg), layer_of(dst_pkg)
            except KeyError as exc:
                problems.append(f"{where}: package {exc} is in no layer of LAYERS")
                continue
            if src_pkg == dst_pkg:
                continue
            if dst_layer > src_layer:
                problems.append(f"{where}: backwards ({src_pkg} is below {dst_pkg})")
            elif dst_layer == src_layer:
                problems.append(f"{where}: sideways ({src_pkg} and {dst_pkg} share a layer)")
    return problems


def check_cli_imports(src: Path) -> list[str]:
    """Every import of a cli/ module that reaches past the rooms the commands are about (into the optimizer,
    the kernels, accel, distributed or the contract), as one line each."""
    modules = module_names(src)
    problems = []
    for name, path in modules.items():
        if package_of(name) != "cli":
            continue
        for imp in imports_of(name, path, modules):
            target = package_of(imp.target)
            if target not in CLI_REACHES:
                problems.append(f"{path.relative_to(src)}:{imp.line}: {imp.importer} imports {imp.target}: a command "
                                f"parses and prints; what it runs belongs in a room of {sorted(CLI_REACHES - {'cli'})}")
    return problems


def import_time_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules its import runs, including the packages (__init__) above each target."""
    modules = module_names(src)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imp in imports_of(name, path, modules):
            if imp.at_import_time and imp.target != name:
                graph[name].add(imp.target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a self-loop), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    counter = 0

    def visit(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def import_time_closure(src: Path, start: str) -> set[str]:
    """Every module of the package that importing ``start`` runs: its targets and every package above them."""
    graph = import_time_graph(src)
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        parts = module.split(".")
        for k in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b first
            prefix = ".".join(parts[:k])
            if prefix in graph and prefix not in seen:
                seen.add(prefix)
                todo.append(prefix)
        todo.extend(t for t in graph.get(module, ()) if t not in seen)
    return seen


def direct_torch_imports(path: Path) -> list[int]:
    """Lines of import-time imports of torch in one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for node, in_function, type_only in _walk(tree):
        if in_function or type_only:
            continue
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            lines.append(node.lineno)
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            lines.append(node.lineno)
    return lines


# --------------------------------------------------------------------------- the package itself


def test_layer_table_knows_every_package():
    packages = {package_of(m) for m in module_names(SRC)}
    known = set().union(*LAYERS)
    assert packages <= known, f"packages in no layer: {sorted(packages - known)}"


def test_imports_run_one_way():
    problems = check_layers(SRC)
    assert not problems, "imports against the layer table (tests/test_architecture.py, LAYERS):\n" + "\n".join(problems)


def test_the_command_line_only_parses_and_prints():
    problems = check_cli_imports(SRC)
    assert not problems, "\n".join(problems)


def test_no_import_time_cycle_among_modules():
    cycles = find_cycles(import_time_graph(SRC))
    assert not cycles, f"module-level import cycles: {cycles}"


def test_the_scan_sees_the_imports_it_must_see():
    """Guards the walker itself: known imports of each kind are found."""
    modules = module_names(SRC)
    found = {(i.importer, i.target, i.at_import_time) for n, p in modules.items() for i in imports_of(n, p, modules)}
    assert ("offload_adamw.optim.update", "offload_adamw.kernels", True) in found
    assert ("offload_adamw.optim.update", "offload_adamw.optim.state", True) in found
    assert ("offload_adamw.demo.runs", "offload_adamw.planning.planner", False) in found  # import_module in a function
    assert ("offload_adamw", "offload_adamw.optim.optimizer", False) in found  # under TYPE_CHECKING


@pytest.mark.parametrize("module", TORCH_FREE)
def test_torch_free_modules_pull_in_no_torch(module):
    closure = import_time_closure(SRC, module)
    modules = module_names(SRC)
    culprits = [f"{modules[m].relative_to(SRC)}:{line}" for m in sorted(closure) for line in direct_torch_imports(modules[m])]
    assert not culprits, f"importing {module} imports torch at: {culprits}"


def test_torch_free_modules_import_without_torch_in_a_fresh_interpreter():
    code = "import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE)
    code += "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                         env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"torch was imported: {out.stdout.strip()}"


def test_init_files_only_re_export():
    offenders = []
    for path in module_names(SRC).values():
        if path.name != "__init__.py":
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in ("__getattr__", "__dir__"):
                continue  # the lazy re-export of PEP 562
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.name}")
    assert not offenders, f"__init__.py files define things instead of re-exporting them: {offenders}"


def test_the_pipeline_is_wired_by_optim_with_what_the_optimizer_has():
    """The other side of accel_names_the_optimizer below: what optim/bucket.py's wiring hands the pipeline, and the
    calls its serve and BackwardBuckets make, are the optimizer's own methods."""
    from offload_adamw.optim.optimizer import OffloadAdamW

    wanted = ("describe_param", "check_gradient", "preflight", "update_group", "state_operands", "check_host_buffers",
              "check_device_buffers", "clip_parameters")
    assert all(callable(getattr(OffloadAdamW, m)) for m in wanted)


def test_nothing_of_the_library_imports_the_test_devices():
    """``offload_adamw.testing`` is imported by tests only (the facades included): production code asks the installed
    stream backend (accel/streams.py), never the simulated device itself."""
    modules = module_names(SRC)
    found = [f"{path.relative_to(SRC)}:{imp.line}: {imp.importer} imports {imp.target}"
             for name, path in modules.items() if package_of(name) != "testing"
             for imp in imports_of(name, path, modules) if package_of(imp.target) == "testing"]
    assert not found, "\n".join(found)


def test_architecture_doc_shows_the_layer_table():
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert layer_line() in doc, f"docs/architecture.md must show the layer line of LAYERS: {layer_line()}"
    for package in set().union(*LAYERS) - {"_version", "_output", "<facade>"}:
        assert f"`{package}/`" in doc, f"docs/architecture.md does not describe {package}/"


# --------------------------------------------------------------------------- the checker can fail


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in {"offload_adamw/__init__.py": "", **files}.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_checker_reports_a_backwards_import(tmp_path):
    src = _tree(tmp_path, {
        "offload_adamw/contract/__init__.py": "",
        "offload_adamw/contract/rules.py": "def f():\n    from offload_adamw.optim import update\n",
        "offload_adamw/optim/__init__.py": "",
        "offload_adamw/optim/update.py": "from offload_adamw.contract import rules\n",
    })
    problems = check_layers(src)
    assert len(problems) == 1
    assert "contract/rules.py:2" in problems[0] and "backwards" in problems[0]


def test_checker_reports_relative_and_sideways_imports_and_unknown_packages(tmp_path):
    src = _tree(tmp_path, {
        "offload_adamw/planning/__init__.py": "",
        "offload_adamw/planning/planner.py": "from ..auditing import audit\n",
        "offload_adamw/auditing/__init__.py": "",
        "offload_adamw/auditing/audit.py": "import importlib\nimportlib.import_module('offload_adamw.misc.tool')\n",
        "offload_adamw/misc/__init__.py": "",
        "offload_adamw/misc/tool.py": "",
    })
    problems = check_layers(src)
    assert any("planning/planner.py:1" in p and "sideways" in p for p in problems), problems
    assert any("auditing/audit.py:2" in p and "'misc' is in no layer" in p for p in problems), problems


def test_checker_reports_a_module_level_cycle_but_not_a_deferred_one(tmp_path):
    src = _tree(tmp_path, {
        "offload_adamw/optim/__init__.py": "",
        "offload_adamw/optim/a.py": "from offload_adamw.optim import b\n",
        "offload_adamw/optim/b.py": "from . import a\n",
        "offload_adamw/optim/c.py": "from offload_adamw.optim import d\n",
        "offload_adamw/optim/d.py": "def later():\n    from offload_adamw.optim import c\n",
    })
    assert find_cycles(import_time_graph(src)) == [["offload_adamw.optim.a", "offload_adamw.optim.b"]]


def test_torch_check_follows_imports_and_packages(tmp_path):
    src = _tree(tmp_path, {
        "offload_adamw/conformance/__init__.py": "from offload_adamw.conformance.checker import check\n",
        "offload_adamw/conformance/checker.py": "import torch\n",
        "offload_adamw/conformance/report.py": "import math\n",
    })
    closure = import_time_closure(src, "offload_adamw.conformance.report")
    assert "offload_adamw.conformance.checker" in closure  # reached through the package's __init__
    assert direct_torch_imports(src / "offload_adamw/conformance/checker.py") == [1]


# ------------------------------------------------------------------ the transfer pipeline's components

ACCEL = SRC / TOP / "accel"
ACCEL_MAX_LINES = 500
ACCEL_MAX_METHODS = 30
#: the components of accel/, each built only by the front (accel/pipeline.py), which chooses them once
ACCEL_COMPONENTS = {"SlotTable", "Gate", "StepGate", "HostUpdate", "AtStep", "DuringBackward", "FreedGradients", "KeptGradients",
                    "AutogradHooks", "DdpSource", "Recorder", "TransferEngine", "StreamUpdate", "DeviceUpdate",
                    "Placements", "DeviceGradients", "LandedDeviceGradients", "ByPlacement", "StepTransport"}
#: other places that build an engine (none: a test device is a stream backend, installed, not an engine of its own)
ENGINE_FACTORIES: dict[str, set[str]] = {}


def accel_sizes(root: Path) -> list[str]:
    """Modules over ACCEL_MAX_LINES lines and classes over ACCEL_MAX_METHODS methods in ``root``."""
    problems = []
    for path in sorted(root.glob("*.py")):
        lines = len(path.read_text().splitlines())
        if lines > ACCEL_MAX_LINES:
            problems.append(f"accel/{path.name}: {lines} lines (at most {ACCEL_MAX_LINES})")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                if len(methods) > ACCEL_MAX_METHODS:
                    problems.append(f"accel/{path.name}: class {node.name} has {len(methods)} methods "
                                    f"(at most {ACCEL_MAX_METHODS})")
    return problems


def component_builders(root: Path) -> list[str]:
    """Places outside accel/pipeline.py that build a component (a call of, or subclassing an engine for, its class)."""
    problems = []
    for path in sorted(root.glob("*.py")):
        if path.name == "pipeline.py":
            continue
        allowed = ENGINE_FACTORIES.get(path.name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Call):
                names = [node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")]
            elif isinstance(node, ast.ClassDef):
                names = [b.id for b in node.bases if isinstance(b, ast.Name)]
            for name in names:
                if name in ACCEL_COMPONENTS and name not in allowed:
                    problems.append(f"accel/{path.name}:{node.lineno} builds {name}: only accel/pipeline.py wires "
                                    "the components")
    return problems


#: what only the step's owner (optim/step.py, optim/policy.py) does: no module of accel/ names these
STEP_DECISIONS = frozenset({"OffloadAdamW", "skip_for_nonfinite", "nonfinite_decision", "step_norm", "last_grad_norm",
                            "clip_grad_norm_", "clip_gradients_"})


def accel_step_decisions(root: Path) -> list[str]:
    """Places in ``root`` (accel/) that import optim/ or name the optimizer's class or one of the step's decisions in
    code (a name, an attribute, an import; messages and docstrings may mention them)."""
    problems = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            named = []
            if isinstance(node, ast.Name):
                named = [node.id]
            elif isinstance(node, ast.Attribute):
                named = [node.attr]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                if any(m == f"{TOP}.optim" or m.startswith(f"{TOP}.optim.") for m in modules):
                    problems.append(f"accel/{path.name}:{node.lineno} imports optim/")
                named = [a.asname or a.name for a in node.names]
            problems += [f"accel/{path.name}:{node.lineno} names {n}" for n in named if n in STEP_DECISIONS]
    return problems


def test_accel_neither_imports_nor_names_the_optimizer_nor_takes_the_steps_decisions():
    """The step's sequence (check, clip, non-finite policy, pre-flight) is optim/step.py's; accel/ is its transport."""
    problems = accel_step_decisions(ACCEL)
    assert not problems, "\n".join(problems)


def test_the_step_decision_check_can_fail(tmp_path):
    (tmp_path / "gate.py").write_text("from offload_adamw.optim.policy import step_norm\n\n"
                                      "def decide(opt):\n    opt.last_grad_norm = 1\n")
    problems = accel_step_decisions(tmp_path)
    assert problems == ["accel/gate.py:1 imports optim/", "accel/gate.py:1 names step_norm",
                        "accel/gate.py:4 names last_grad_norm"], problems


def test_accel_modules_and_classes_stay_small():
    problems = accel_sizes(ACCEL)
    assert not problems, "\n".join(problems)


def test_only_the_front_wires_the_pipelines_components():
    problems = component_builders(ACCEL)
    assert not problems, "\n".join(problems)


def mode_flags(root: Path) -> list[str]:
    """Constructors of the components in ``root`` (accel/) that take a boolean: a mode is a component the front chooses
    once, not a flag each component branches on."""
    problems = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name not in ACCEL_COMPONENTS:
                continue
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
                    problems += [f"accel/{path.name}: {node.name}({a.arg}: bool)" for a in args
                                 if isinstance(a.annotation, ast.Name) and a.annotation.id == "bool"]
    return problems


def test_no_accel_constructor_takes_a_mode_flag():
    problems = mode_flags(ACCEL)
    assert not problems, "\n".join(problems)


#: the optimizer by name, and the methods through which accel/ used to call back into it (issue 39): no module of accel/
#: names one in code (a name, an attribute, a parameter); it is handed data and narrow callables (accel/pipeline.py's
#: Wiring, built by optim/bucket.py) and hands each bucket's work out (accel/work.py)
OPTIMIZER_NAMES = frozenset({"optimizer", "_optimizer", "OffloadAdamW", "UpdateTarget", "DeviceState", "update_group",
                             "state_operands", "preflight", "check_gradient", "describe_param", "check_host_buffers",
                             "check_device_buffers", "clip_parameters", "skip_for_nonfinite", "param_groups"})
#: places of accel/ that still name the optimizer (issue 39): this set only shrinks, and is empty
OPTIMIZER_LEFT: set[str] = set()
#: places that name an optimizer by torch's own interface, with the reason: not a call back into ours
OPTIMIZER_ALLOWED = {
    "accel/amp.py: optimizer": "OffloadGradScaler overrides torch.amp.GradScaler._unscale_grads_(optimizer, ...), "
                               "which torch calls with whichever optimizer the scaler steps",
}


def accel_names_the_optimizer(root: Path) -> list[str]:
    """Places in ``root`` (accel/) that import optim/ or name the optimizer or one of its methods in code, as
    'accel/<file>: <name>' (messages and docstrings may mention them)."""
    problems = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            named = []
            if isinstance(node, ast.Name):
                named = [node.id]
            elif isinstance(node, ast.Attribute):
                named = [node.attr]
            elif isinstance(node, ast.arg):
                named = [node.arg]
            elif isinstance(node, ast.keyword) and node.arg is not None:
                named = [node.arg]
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                named = ["optim/" for m in modules if m == f"{TOP}.optim" or m.startswith(f"{TOP}.optim.")]
                named += [a.asname or a.name for a in node.names]
            problems += [f"accel/{path.name}: {n}" for n in named if n in OPTIMIZER_NAMES or n == "optim/"]
    return sorted(set(problems))


def test_no_module_of_accel_names_the_optimizer():
    """accel/ is a transport: it holds no optimizer and calls none (issue 39)."""
    problems = [p for p in accel_names_the_optimizer(ACCEL) if p not in OPTIMIZER_LEFT and p not in OPTIMIZER_ALLOWED]
    assert not problems, "\n".join(problems)
    gone = OPTIMIZER_LEFT - set(accel_names_the_optimizer(ACCEL))
    assert not gone, f"no longer named: remove from OPTIMIZER_LEFT {sorted(gone)}"


def test_the_optimizer_name_check_can_fail(tmp_path):
    (tmp_path / "host_update.py").write_text(
        "from offload_adamw.optim import update\n\n"
        "class HostUpdate:\n    def __init__(self, optimizer):\n        self._optimizer = optimizer\n\n"
        "    def run(self, target):\n        target.update_group(0, [])\n        return describe(groups=target.param_groups)\n")
    assert accel_names_the_optimizer(tmp_path) == [
        "accel/host_update.py: _optimizer", "accel/host_update.py: optim/", "accel/host_update.py: optimizer",
        "accel/host_update.py: param_groups", "accel/host_update.py: update_group"]


#: the names the components go by where they are wired or handed in
COMPONENT_NAMES = {"gate", "hooks", "ddp", "residency", "schedule", "placements", "slots", "engine", "transport"}
#: components still patched after construction (issue 39): this set only shrinks
PATCHED_LEFT: set[str] = set()


def patched_components(root: Path) -> list[str]:
    """Assignments in a constructor in ``root`` (accel/) to an attribute of a component from outside it
    (``self.gate.x = ...``, ``gate.x = ...``): wiring that patches a built component instead of handing it what it
    needs at its construction, in dependency order. (A component's state written at run time is not wiring.)"""
    problems = []
    for path in sorted(root.glob("*.py")):
        inits = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
        for node in (n for init in inits for n in ast.walk(init)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if not isinstance(t, ast.Attribute):
                    continue
                owner = t.value
                if isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) and owner.value.id == "self":
                    name = owner.attr.lstrip("_")
                elif isinstance(owner, ast.Name) and owner.id != "self":
                    name = owner.id
                else:
                    continue
                if name in COMPONENT_NAMES:
                    problems.append(f"accel/{path.name}: {name}.{t.attr}")
    return problems


def test_no_component_is_patched_after_construction():
    problems = [p for p in patched_components(ACCEL) if p not in PATCHED_LEFT]
    assert not problems, "\n".join(problems)
    gone = PATCHED_LEFT - set(patched_components(ACCEL))
    assert not gone, f"passed at construction already: remove from PATCHED_LEFT {sorted(gone)}"


def test_the_accel_checks_can_fail(tmp_path):
    big = tmp_path / "big.py"
    big.write_text("class Wide:\n" + "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(31))
                   + "\n" * ACCEL_MAX_LINES)
    (tmp_path / "gate.py").write_text("from x import SlotTable\n\ndef make():\n    return SlotTable(None, None)\n")
    sizes = accel_sizes(tmp_path)
    assert any("big.py" in p and "lines" in p for p in sizes) and any("31 methods" in p for p in sizes), sizes
    assert component_builders(tmp_path) == ["accel/gate.py:4 builds SlotTable: only accel/pipeline.py wires the components"]
    (tmp_path / "modes.py").write_text("class AutogradHooks:\n    def __init__(self, slots, *, freed: bool, n: int) -> None:\n"
                                       "        pass\n")
    assert mode_flags(tmp_path) == ["accel/modes.py: AutogradHooks(freed: bool)"]
    (tmp_path / "front.py").write_text("class Front:\n    def __init__(self, gate):\n        self.gate = gate\n"
                                       "        self.gate.intact = len\n        gate.on_open = print\n")
    assert patched_components(tmp_path) == ["accel/front.py: gate.intact", "accel/front.py: gate.on_open"]


def test_checker_reports_a_command_that_does_the_work_itself(tmp_path):
    src = _tree(tmp_path, {
        "offload_adamw/cli/__init__.py": "",
        "offload_adamw/cli/bench.py": "from offload_adamw.kernels.adamw import adamw_update_\n"
                                      "from offload_adamw.benchmarking import host_step\n",
        "offload_adamw/kernels/__init__.py": "",
        "offload_adamw/kernels/adamw.py": "",
        "offload_adamw/benchmarking/__init__.py": "",
        "offload_adamw/benchmarking/host_step.py": "",
    })
    problems = check_cli_imports(src)
    assert len(problems) == 1 and "cli/bench.py:1" in problems[0] and "offload_adamw.kernels.adamw" in problems[0]
