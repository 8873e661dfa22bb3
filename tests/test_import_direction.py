"""Packages import in one direction only: extract -> adapters -> serve -> train (the README's Layout). A package may
import those before it, never one after it: every import is read, at module level and inside functions, and so are
``importlib.import_module("...")`` calls with a literal name."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the one direction: each package may import the ones before it
ORDER = ("extract", "adapters", "serve", "train")


def imported(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``source``, wherever it sits, and of import_module("...") calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)):
            found.append((node.lineno, node.args[0].value))
    return found


def violations(package: str, source: str, where: str = "<source>") -> list[str]:
    """The imports of ``source`` (a module of ``package``) that reach a package after it in :data:`ORDER`."""
    allowed = set(ORDER[:ORDER.index(package) + 1])
    return [f"{where}:{line} imports {module}" for line, module in imported(source)
            if module.split(".")[0] in ORDER and module.split(".")[0] not in allowed]


def test_no_package_imports_one_after_it():
    bad, read = [], 0
    for package in ORDER:
        for path in sorted((ROOT / package).rglob("*.py")):
            read += 1
            bad += violations(package, path.read_text(), str(path.relative_to(ROOT)))
    assert read > 50 and not bad, "\n".join(bad)


def test_the_check_sees_imports_wherever_they_hide():
    """The cycle this replaced (serve's query importing train's evaluation inside a function, train's demo
    importing serve) is caught, as is a literal import_module."""
    serve_source = "def recall():\n    from train.evaluate import run_retrieval_cached\n"
    assert violations("serve", serve_source) == ["<source>:2 imports train.evaluate"]
    assert violations("adapters", "import importlib\nimportlib.import_module('serve.search')\n") == [
        "<source>:2 imports serve.search"]
    assert violations("extract", "import adapters.scoring as s\n") == ["<source>:1 imports adapters.scoring"]
    assert violations("train", "from serve.index import build_index\nfrom extract.cli import say\n") == []
