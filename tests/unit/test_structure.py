"""The shape of the code: the training modules form no import cycle, and none imports the tools."""

from __future__ import annotations

import ast

from runfab import shipping

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
    assert {"train", "pipeline.stream", "pipeline.records", "pipeline.packing", "pipeline.feeder", "datamodule",
            "runtime.launcher", "runtime.training_run", "runfab.lifetime"} <= graph.keys()
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


def test_the_ground_floor_imports_nothing_of_the_project():
    graph = project_imports()
    ground = {name for name in graph if name.split(".")[0] == "runfab"}
    assert {"runfab.limits", "runfab.lifetime", "runfab.shipping", "runfab.created_files", "runfab.memory"} <= ground
    above = {name: sorted(m for m in graph[name] if m.split(".")[0] != "runfab") for name in ground}
    assert not any(above.values()), f"the ground floor imports the project: {above}"


def package_imports(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(importing package, imported package) -> the modules of the first that import the second."""
    found: dict[tuple[str, str], list[str]] = {}
    for name, imported in graph.items():
        for other in imported:
            pair = (name.split(".")[0], other.split(".")[0])
            if pair[0] != pair[1]:
                found.setdefault(pair, []).append(name)
    return found


def test_no_import_runs_back_up_between_the_packages():
    """Each package (and top-level module) stands above what it imports: no two import each other,
    so the layers read from train.py down to runfab/."""
    pairs = package_imports(project_imports())
    both_ways = sorted((a, b, sorted(pairs[a, b]), sorted(pairs[b, a])) for a, b in pairs if (b, a) in pairs and a < b)
    assert not both_ways, f"packages that import each other: {both_ways}"


def test_no_tool_module_imports_one_that_imports_it_back():
    modules = {str(path.relative_to(ROOT).with_suffix("")).replace("/", "."): path
               for path in (ROOT / "tools").rglob("*.py")}
    modules = {name.removesuffix(".__init__"): path for name, path in modules.items()}
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {m for m in found if m in modules and m != name}
    mutual = sorted((a, b) for a in graph for b in graph[a] if a in graph.get(b, ()) and a < b)
    assert not mutual, f"tool modules that import each other: {mutual}"


KERNEL_PACKAGES = {"triton", "quack", "flash_attn", "cutlass"}


def test_kernel_packages_are_imported_only_in_model_kernels():
    """The fast paths live in one package (model/kernels/), beside the choice among them; the families and the
    rest of the trainer reach a kernel only through it."""
    outside = {}
    for rel in shipping.shipped_files(ROOT):
        if not rel.endswith(".py") or rel.startswith("model/kernels/"):
            continue
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
            found = [name for name in names if name.split(".")[0] in KERNEL_PACKAGES]
            if found:
                outside.setdefault(rel, []).extend(found)
    assert not outside, f"kernel packages imported outside model/kernels/: {outside}"


def test_the_command_line_hands_typed_values_to_the_config_not_text():
    """cli.py parses straight into typed values that config.load_config merges (one loader, omegaconf, for
    RunFab's hooks and the command line): no JSON or dotlist text is written between the two."""
    tree = ast.parse((ROOT / "cli.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {"json", "omegaconf"} & imported, "cli.py writes text for the config's loader"
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not {"dumps", "from_dotlist"} & called, "cli.py writes text for the config's loader"
