"""Packages import in one direction only: extract -> adapters -> serve -> train (the README's Layout). A package may
import those before it, never one after it: every import is read, at module level and inside functions, and so are
``importlib.import_module("...")`` calls with a literal name. The checks that read every module (~3 s together on
two busy cores, most of it parsing, shared through :func:`parsed`) are ``slow``: the full suite and CI run them, the
fast subset runs the checks of the checks."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: the one direction: each package may import the ones before it
ORDER = ("extract", "adapters", "serve", "train")


def parsed(path: Path) -> ast.Module:
    """A module's syntax tree, parsed once per process and text for every check here (each reads them all: parsing
    them took ~1 s a check; a file rewritten since is parsed again)."""
    return _parse(path.read_text())


@functools.lru_cache(maxsize=None)
def _parse(source: str) -> ast.Module:
    return ast.parse(source)


def _tree(source: str | ast.Module) -> ast.Module:
    return source if isinstance(source, ast.Module) else ast.parse(source)


def imported(source: str | ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``source``, wherever it sits, and of import_module("...") calls."""
    found = []
    for node in ast.walk(_tree(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(package: str, source: str | ast.Module, where: str = "<source>") -> list[str]:
    """The imports of ``source`` (a module of ``package``) that reach a package after it in :data:`ORDER`."""
    allowed = set(ORDER[:ORDER.index(package) + 1])
    return [f"{where}:{line} imports {module}" for line, module in imported(source)
            if module.split(".")[0] in ORDER and module.split(".")[0] not in allowed]


@pytest.mark.slow
def test_no_package_imports_one_after_it():
    bad, read = [], 0
    for package in ORDER:
        for path in sorted((ROOT / package).rglob("*.py")):
            read += 1
            bad += violations(package, parsed(path), str(path.relative_to(ROOT)))
    assert read > 50 and not bad, "\n".join(bad)


def test_the_check_sees_imports_wherever_they_hide():
    """The cycle this replaced (serve's query importing train's evaluation inside a function, train's demo
    importing serve) is caught, as is a literal import_module."""
    serve_source = "def recall():\n    from train.eval.evaluate import run_retrieval_cached\n"
    assert violations("serve", serve_source) == ["<source>:2 imports train.eval.evaluate"]
    assert violations("adapters", "import importlib\nimportlib.import_module('serve.search')\n") == [
        "<source>:2 imports serve.search"]
    assert violations("extract", "import adapters.scoring as s\n") == ["<source>:1 imports adapters.scoring"]
    assert violations("train", "from serve.index import build_index\nfrom extract.common.cli import say\n") == []


def private_imports(source: str | ast.Module, module: str = "<source>") -> list[str]:
    """``from X import _name`` where X is one of our modules other than ``module`` itself: a private name used from
    outside the module that owns it (a child process's code string importing its own module is not read: it is
    a string)."""
    found = []
    for node in ast.walk(_tree(source)):
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.split(".")[0] in ORDER and node.module != module):
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


@pytest.mark.slow
def test_no_module_reaches_for_another_modules_private_names():
    bad = []
    for package in ORDER:
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            bad += [f"{path.relative_to(ROOT)}:{x}" for x in private_imports(parsed(path), module)]
    assert not bad, "\n".join(bad)
    assert private_imports("from extract.pipeline import _concat\n") == ["1: from extract.pipeline import _concat"]


def module_cycles(root: Path = ROOT, packages: tuple[str, ...] = ORDER) -> list[list[str]]:
    """Cycles among the modules of ``packages`` under ``root`` (every import, inside functions too; a module
    importing the package it sits in does not count: that is how a package's ``__init__`` re-exports), by Tarjan's
    strongly connected components: each cycle once, its modules sorted."""
    modules = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
            modules[name] = path

    def ours(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Import):
                deps |= {ours(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else ours(node.module)
                         for a in node.names}
        graph[name] = {d for d in deps if d and d != name and not name.startswith(d + ".")}
    index, low, stack, cycles = {}, {}, [], []

    def visit(v):  # recursive Tarjan: the module graph is a few hundred nodes deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


@pytest.mark.slow
def test_no_two_modules_import_each_other():
    """Within a package too: two modules that import each other are one concept split in two, or a helper in the
    wrong one (as scoring / adapter_scorer and the index layout / FAISS types were)."""
    assert module_cycles() == []


def test_the_cycle_check_finds_cycles_planted_in_a_package_tree(tmp_path):
    """A tree of the four packages in tmp_path with two cycles planted: two modules of one package, one of the
    imports inside a function; three modules of three packages, one edge a module imported by name from its package
    (``from train import y``). Neither a package ``__init__`` re-exporting its module that imports the package, nor
    a module imported by many, is a cycle. Each cycle is found, once; the tree without the closing imports has none."""
    files = {
        "extract/__init__.py": "",
        "extract/base.py": "VALUE = 1\n",
        "extract/one.py": "from extract.two import helper\nfrom extract.base import VALUE\n",
        "extract/two.py": "from extract.base import VALUE\n\n\ndef helper():\n    import extract.one\n",
        "adapters/__init__.py": "from adapters.head import Head\n",
        "adapters/head.py": "import adapters\nfrom extract.base import VALUE\n\n\nclass Head:\n    pass\n",
        "adapters/z.py": "from serve.x import X\n",
        "serve/__init__.py": "",
        "serve/x.py": "from train import y\n\nX = 1\n",
        "train/__init__.py": "",
        "train/y.py": "import adapters.z\nfrom extract.base import VALUE\n",
    }
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    assert sorted(module_cycles(tmp_path)) == [["adapters.z", "serve.x", "train.y"], ["extract.one", "extract.two"]]
    (tmp_path / "extract/two.py").write_text("def helper():\n    pass\n")
    (tmp_path / "train/y.py").write_text("from extract.base import VALUE\n")
    assert module_cycles(tmp_path) == []


#: inside train/, each part may import those before it (the README's Layout lists them in this order); a module
#: at train/'s top level other than the demo's is shared by all of them and imports none
TRAIN_ORDER = ("train.bad_steps", "train.measure", "train.child", "train.eval", "train.adapter", "train.pretrain",
               "train.bench", "train.demo_hard", "train.demo_3d", "train.demo_pretrain", "train.demo")
TRAIN_PEERS = {"train.adapter": {"train.pretrain"}, "train.pretrain": {"train.adapter"}}  # neither imports the other


def train_part(module: str) -> str | None:
    """The part of train/ ``module`` belongs to (``train.adapter.engine`` -> ``train.adapter``), None outside."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "train" and len(parts) > 1 else None


def train_violations(module: str, source: str | ast.Module, where: str = "<source>") -> list[str]:
    """The imports of ``source`` (a module of train/) that reach a part of train/ after its own in
    :data:`TRAIN_ORDER`, or a peer it must not import."""
    own = train_part(module)
    if own not in TRAIN_ORDER:
        return [f"{where}: {own} is not in TRAIN_ORDER: place it"]
    allowed = set(TRAIN_ORDER[:TRAIN_ORDER.index(own) + 1]) - TRAIN_PEERS.get(own, set())
    return [f"{where}:{line} imports {name}" for line, name in imported(source)
            if train_part(name) is not None and train_part(name) not in allowed]


@pytest.mark.slow
def test_train_parts_import_in_one_direction():
    """Function-level imports count: hiding an import inside a function does not change its direction."""
    bad = []
    for path in sorted((ROOT / "train").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        if module == "train":
            continue
        bad += train_violations(module, parsed(path), str(path.relative_to(ROOT)))
    assert not bad, "\n".join(bad)
    hidden = "def report():\n    from train.bench.nla import make_batch\n"
    assert train_violations("train.eval.nla_report", hidden) == ["<source>:2 imports train.bench.nla"]
    assert train_violations("train.adapter.engine", "from train.pretrain.engine import train\n") == [
        "<source>:1 imports train.pretrain.engine"]
    assert train_violations("train.bench.adapter", "from train.adapter.step import AdapterRun\n") == []


#: the evaluation path: what python -m train.eval runs between a scorer, a data source and a figure
EVALUATION_PATH = ("train/eval/evaluate.py", "train/eval/zeroshot.py", "train/eval/report.py",
                   "train/eval/clip_benchmark.py", "adapters/eval/retrieval.py")


def type_tests(source: str, names: tuple[str, ...] = ("scorer", "source", "cache")) -> list[str]:
    """Calls of isinstance / hasattr / getattr on a variable named in ``names``: asking what a scorer or a source is
    instead of asking it (its protocol, adapters.scoring.CacheReadable and extract.data.records.DataSource, says)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "hasattr", "getattr")
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in names):
            found.append(f"{node.lineno}: {node.func.id}({node.args[0].id}, ...)")
    return found


def test_the_evaluation_path_asks_the_scorer_not_its_type():
    bad = [f"{path}:{x}" for path in EVALUATION_PATH for x in type_tests((ROOT / path).read_text())]
    assert not bad, "\n".join(bad)
    assert type_tests("if hasattr(source, 'records'):\n    pass\n") == ["1: hasattr(source, ...)"]
    assert type_tests("ok = isinstance(items, list)\n") == []
