"""The package's layout keeps its promises: the notebook side never loads torch, imports run one
way, and a module's path says which side of the wire it runs on.

Imports are read from the source (every ``import`` statement, including those inside
functions), so an import circle cannot hide behind a function-local import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "ipydist"

#: What a user of the notebook side imports; none of it may load torch.
NOTEBOOK_SIDE = ["ipydist", "ipydist.magics", "ipydist.session", "ipydist.errors",
                 "ipydist.protocol", "ipydist.specs", "ipydist.cli"]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _type_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``: imports for the type checker only,
    which never run (a protocol module names the types it describes there)."""
    return {id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
            for child in node.body for inner in ast.walk(child)}


def ipydist_imports(name: str) -> set[str]:
    """The ipydist modules ``name`` imports, anywhere in its source (functions included), but
    for type-only imports."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text())
    type_only = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            # ``from ipydist.notebook import cluster`` imports the module ipydist.notebook.cluster
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                       for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: ipydist_imports(name) for name in MODULES}


def side(name: str) -> str:
    # integrations: hooks for other frameworks' training loops, which run on the ranks
    if name.startswith(("ipydist.rank", "ipydist.torch", "ipydist.integrations")):
        return "rank"
    if name in ("ipydist.protocol", "ipydist.specs", "ipydist.errors", "ipydist.error_base",
                "ipydist._version", "ipydist.network"):
        return "shared"
    return "notebook"


def test_the_layout_has_the_two_sides_and_the_wire():
    assert {"ipydist.protocol", "ipydist.specs", "ipydist.rank.__main__",
            "ipydist.notebook.cluster", "ipydist.notebook.cell"} <= set(MODULES)
    notebook = [n for n in MODULES if side(n) == "notebook"]
    rank = [n for n in MODULES if side(n) == "rank"]
    assert len(notebook) > 10 and len(rank) > 10


def test_no_import_circles():
    """Depth-first search for a back edge; report the circle it closes."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                circle = path[path.index(nxt):] + [nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("name", sorted(n for n in MODULES if side(n) == "notebook"))
def test_the_notebook_side_imports_no_rank_module(name):
    rank_imports = sorted(m for m in GRAPH[name] if side(m) == "rank")
    assert rank_imports == [], f"{name} imports rank-side {rank_imports}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if side(n) == "rank"))
def test_the_rank_side_imports_no_notebook_module(name):
    notebook_imports = sorted(m for m in GRAPH[name] if side(m) == "notebook")
    assert notebook_imports == [], f"{name} imports notebook-side {notebook_imports}"


@pytest.mark.parametrize("name", ["ipydist.protocol", "ipydist.specs", "ipydist.errors",
                                  "ipydist.error_base"])
def test_the_wire_contract_needs_only_the_standard_library(name):
    allowed = set(sys.stdlib_module_names) | {"ipydist", "__future__"}
    tree = ast.parse(MODULES[name].read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree)
                if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert imported <= allowed, f"{name} imports {sorted(imported - allowed)}"
    assert all(side(m) == "shared" for m in GRAPH[name]), GRAPH[name]


def python_prints(code: str) -> str:
    """What ``code`` prints, run in a fresh interpreter (so that ``sys.modules`` is its own)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_notebook_side_leaves_torch_out():
    notebook_modules = [n for n in MODULES if side(n) != "rank" and not n.endswith("__main__")]
    code = (
        "import importlib, sys\n"
        f"for name in {NOTEBOOK_SIDE + notebook_modules!r}:\n"
        "    importlib.import_module(name)\n"
        "import ipydist\n"
        "ipydist.metrics()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = python_prints(code)
    assert out == "[]", f"torch was imported: {out[:300]}"


def test_a_rank_imports_numba_only_when_1_bit_sgd_is_used():
    """numba compiles 1-bit SGD's loops; its import (about half a second) stays off every
    rank's start and every cell that does not use Compression.onebit."""
    code = (
        "import sys, torch\n"
        "import ipydist.torch as hvd\n"
        "from ipydist.torch.training.gradients import onebit\n"
        "print('numba' in sys.modules, end=' ')\n"
        "onebit.quantize(torch.ones(3))\n"
        "print('numba' in sys.modules)\n"
    )
    out = python_prints(code)
    assert out == "False True", out


#: torch/'s sub-packages, lowest first: each may import those before it (and itself), never one
#: after it, so that the rank's runtime knows nothing of Horovod's API or of training.
TORCH_LAYERS = ["_core", "_wire", "_mpi", "horovod", "training"]
#: Modules every layer may use: the stdlib-only contract and validated user values.
SHARED = {"ipydist.protocol", "ipydist.specs", "ipydist.errors", "ipydist.error_base",
          "ipydist._version"}


def torch_layer(name: str) -> int | None:
    """Index of ``name``'s sub-package of ipydist.torch; len(TORCH_LAYERS) for the package's
    own ``__init__`` (the re-exports, above every layer); None outside ipydist.torch."""
    if name == "ipydist.torch":
        return len(TORCH_LAYERS)
    parts = name.split(".")
    if parts[:2] != ["ipydist", "torch"]:
        return None
    return TORCH_LAYERS.index(parts[2]) if parts[2] in TORCH_LAYERS else -1


def test_every_torch_module_lives_in_a_layer():
    loose = sorted(n for n in MODULES if torch_layer(n) == -1)
    assert loose == [], f"{loose}: put them in one of ipydist.torch's sub-packages {TORCH_LAYERS}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if torch_layer(n) is not None))
def test_torch_sub_packages_import_downward_only(name):
    mine = torch_layer(name)
    upward = sorted(m for m in GRAPH[name]
                    if torch_layer(m) is not None and torch_layer(m) > mine)
    assert upward == [], (
        f"{name} imports {upward} from a layer above its own (layers, lowest first: "
        f"{TORCH_LAYERS}); inject what it needs instead, as join.serve_steps_of does")


@pytest.mark.parametrize("name", sorted(n for n in MODULES if torch_layer(n) is not None))
def test_torch_never_imports_the_rank_side(name):
    """rank/ drives torch/ (bootstrap, calls); torch/ is handed what it needs from rank/
    (metrics.send_with, the watcher's break_communication_with), so it also runs in a plain
    script under mpiexec or torchrun."""
    rank_side = sorted(m for m in GRAPH[name] if m.startswith("ipydist.rank"))
    assert rank_side == [], f"{name} imports the rank side: {rank_side}"
    others = sorted(m for m in GRAPH[name]
                    if torch_layer(m) is None and m not in SHARED and m != "ipydist")
    assert others == [], f"{name} imports {others}: torch/ uses only itself and {sorted(SHARED)}"


FOLDER_LIMIT = 15


@pytest.mark.parametrize("folder", sorted({p.parent for p in PACKAGE.rglob("*.py")}),
                         ids=lambda p: str(p.relative_to(SRC)))
def test_no_folder_holds_more_than_15_modules(folder):
    modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= FOLDER_LIMIT, (
        f"{folder.relative_to(SRC)} holds {len(modules)} modules: give its concerns rooms")


def private_reach_ins(name: str) -> list[str]:
    """``from ipydist.x import _private`` and ``module._private`` where ``module`` is an
    imported ipydist module: a module's underscore names are its own."""
    tree = ast.parse(MODULES[name].read_text())
    found, bound = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ipydist"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {node.module} import {alias.name}")
                elif f"{node.module}.{alias.name}" in MODULES:
                    bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            bound |= {a.asname for a in node.names if a.asname and a.name in MODULES}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return sorted(set(found))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_reaches_into_another_modules_private_names(name):
    assert private_reach_ins(name) == [], (
        f"{name} uses private names of other modules: {private_reach_ins(name)}; make what it "
        f"needs public (and documented) or hand it in")


def unit(name: str) -> str:
    """The part of the package a module belongs to: a sub-package of ipydist
    (``ipydist.notebook``, ``ipydist.torch``) or a top-level module (``ipydist.session``)."""
    return ".".join(name.split(".")[:2])


def test_no_two_parts_of_the_package_import_each_other():
    """Imports between the package's parts (its sub-packages and top-level modules) run one
    way: the notebook side's modules are handed what they need from the Session, never
    import it back (the circle a module-level check misses, as no single module closes it)."""
    edges = {(unit(a), unit(b)) for a, targets in GRAPH.items() for b in targets
             if unit(a) != unit(b) and unit(a) != "ipydist" and unit(b) != "ipydist"}
    both_ways = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert both_ways == [], f"parts that import each other: {both_ways}"
