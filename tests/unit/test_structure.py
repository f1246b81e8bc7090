"""The shape of the code: the training modules form no import cycle, and none imports the tools."""

from __future__ import annotations

import ast

from runtime import shipping

from tests.helpers import ROOT


def project_imports() -> dict[str, set[str]]:
    """For each shipped module (``callbacks.export``, ``train``...), the project modules it imports."""
    modules = {rel[:-3].replace("/", "."): ROOT / rel for rel in shipping.shipped_files(ROOT) if rel.endswith(".py")}
    modules = {name.removesuffix(".__init__"): path for name, path in modules.items()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_no_training_module_imports_one_that_imports_it_back():
    graph = project_imports()
    assert {"train", "pipeline.stages", "pipeline.feeder", "datamodule", "runtime.launcher",
            "runtime.training_run", "runtime.lifetime"} <= graph.keys()
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, path + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
