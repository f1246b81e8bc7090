"""The shape of the code: the training modules form no import cycle, and none imports the tools; RunFab's
facts and the packages' versions are written once."""

from __future__ import annotations

import ast
import re
import subprocess
import tomllib
from pathlib import Path

from runfab import limits, shipping

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
    assert {"runfab.limits", "runfab.lifetime", "runfab.shipping", "runfab.created_files",
            "runfab.process_memory"} <= ground
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


CHOOSERS = {"choose_kernels", "use_target", "use_kernels", "attention_kernel", "mlp_kernels", "loss_kernel"}
FORWARDS = {"forward", "hidden_states", "trunk", "loss_sum", "embed"}


def test_kernels_are_chosen_when_the_model_is_built_never_in_a_forward():
    """A model takes its kernels when it is built (model.kernels.choose_kernels, through Decoder.use_target): no
    module under model/ asks whether it is being compiled, and no forward calls the choice. Checked by
    ``grep -rn is_compiling model/`` (nothing) and this walk over every forward's calls."""
    found = []
    for path in sorted((ROOT / "model").rglob("*.py")):
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text())
        found += [f"{rel}:{node.lineno} is_compiling" for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute | ast.Name) and "is_compiling" in (getattr(node, "attr", None),
                                                                                      getattr(node, "id", None))]
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef) or function.name not in FORWARDS:
                continue
            for call in ast.walk(function):
                if isinstance(call, ast.Call):
                    name = getattr(call.func, "attr", None) or getattr(call.func, "id", None)
                    if name in CHOOSERS:
                        found.append(f"{rel}:{call.lineno} {function.name} calls {name}")
    assert not found, f"kernels chosen at run time, not at build: {found}"


# 2**30, 2**20, 1 << 30: RunFab's units are runfab/limits.py's GIB and MIB, spelled there once.
UNIT_LITERALS = {(ast.Pow, 2, 30), (ast.Pow, 2, 20), (ast.LShift, 1, 30)}
# RunFab's figures as a message would spell them (docstrings may describe the platform in words).
RUNFAB_FIGURES = re.compile(r"\b(8|3) GiB\b|\b(256|64|16) MiB\b")


def python_files() -> list[str]:
    """Every Python file of the checkout that git knows of (shipped or not, tests included)."""
    listed = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    return [rel for rel in listed.stdout.split() if (ROOT / rel).is_file()]


def docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return {id(n.body[0].value) for n in nodes if n.body and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant) and isinstance(n.body[0].value.value, str)}


def test_runfabs_facts_are_defined_once_in_runfab_limits():
    """No GiB or MiB spelled as a power of two outside runfab/limits.py, and no message that writes one of
    RunFab's figures (its RAM, output or /tmp) as text instead of from the limit it states."""
    spelled, figures = [], []
    for rel in python_files():
        if rel == "runfab/limits.py":
            continue
        tree = ast.parse((ROOT / rel).read_text())
        prose = docstrings(tree)
        for node in ast.walk(tree):
            operands = (node.left, node.right) if isinstance(node, ast.BinOp) else ()
            if (all(isinstance(operand, ast.Constant) for operand in operands) and operands
                    and (type(node.op), node.left.value, node.right.value) in UNIT_LITERALS):
                spelled.append(f"{rel}:{node.lineno}")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                  and RUNFAB_FIGURES.search(node.value)):
                figures.append(f"{rel}:{node.lineno}")
    assert not spelled, f"use runfab.limits.GIB / MIB: {spelled}"
    assert not figures, f"messages that spell RunFab's figures instead of reading runfab.limits: {figures}"


UNIT_SUFFIXES = ("_BYTES", "_GIB", "_MIB", "_SECONDS", "_CHARS")


def limit_stem(name: str) -> str:
    for suffix in UNIT_SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def test_no_module_defines_a_runfab_limit_again_in_another_unit():
    """``TMP_GIB`` beside runfab.limits' ``TMP_BYTES`` is one fact written twice: a module-level constant whose
    name is a limit's, in any unit, is defined only in runfab/limits.py (the others import it)."""
    stems = {limit_stem(name) for name in vars(limits) if name.isupper() and name not in ("GIB", "MIB")}
    again = []
    for rel in python_files():
        if rel == "runfab/limits.py":
            continue
        for node in ast.parse((ROOT / rel).read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            again += [f"{rel}: {t.id}" for t in targets if isinstance(t, ast.Name) and limit_stem(t.id) in stems]
    assert not again, f"RunFab's limits defined again (import them from runfab.limits): {again}"


def requirement_pins(lines: list[str]) -> dict[str, str]:
    """name -> version specifier of each ``name==x`` / ``name>=x`` requirement in ``lines``."""
    found = {}
    for line in lines:
        for token in line.replace('"', " ").replace(",", " ").split():
            if match := re.fullmatch(r"([A-Za-z0-9_.-]+)((?:==|>=|<=|~=)[^\s]+)", token):
                found[match[1].lower()] = match[2]
    return found


def test_pyproject_and_requirements_name_the_same_versions():
    """A package pinned in both pyproject.toml's extras and requirements.txt (its comments too) has one version."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [spec for specs in project.get("optional-dependencies", {}).values() for spec in specs]
    pinned = requirement_pins(extras + project.get("dependencies", []))
    listed = requirement_pins([line.lstrip("# ") for line in (ROOT / "requirements.txt").read_text().splitlines()])
    differ = {name: (pinned[name], listed[name]) for name in sorted(pinned.keys() & listed.keys())
              if pinned[name] != listed[name]}
    assert "quack-kernels" in pinned and "quack-kernels" in listed
    assert not differ, f"pyproject.toml and requirements.txt disagree (pyproject, requirements): {differ}"


def test_the_command_line_hands_typed_values_to_the_config_not_text():
    """cli.py parses straight into typed values that config.load_config merges (one loader, omegaconf, for
    RunFab's hooks and the command line): no JSON or dotlist text is written between the two."""
    tree = ast.parse((ROOT / "cli.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not {"json", "omegaconf"} & imported, "cli.py writes text for the config's loader"
    called = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not {"dumps", "from_dotlist"} & called, "cli.py writes text for the config's loader"


def test_the_bundle_parses_no_command_line_but_train_pys():
    """A command of ``python -m tools`` (training a tokenizer, preparing shards) is a tool, in tools/: of the shipped
    modules only cli.py parses arguments (with jsonargparse). Checked by ``python -m tools package --dry-run`` (the
    shipped files), then ``grep -lE "import (json)?argparse"`` on them, which finds cli.py alone."""
    def imported(node: ast.AST) -> list[str]:
        return ([a.name for a in node.names] if isinstance(node, ast.Import) else
                [node.module] if isinstance(node, ast.ImportFrom) else [])

    parsing = sorted(rel for rel in shipping.shipped_files(ROOT) if rel.endswith(".py")
                     if any({"argparse", "jsonargparse"} & {name.split(".")[0] for name in imported(node)}
                            for node in ast.walk(ast.parse((ROOT / rel).read_text()))))
    assert parsing == ["cli.py"], f"shipped modules that parse a command line: {parsing}"


def class_bases(tree: ast.AST) -> list[tuple[str, int, str]]:
    """(class name, line, base as written) for every base of every class in ``tree``."""
    return [(node.name, node.lineno, ast.unparse(base)) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            for base in node.bases]


def test_lightning_callbacks_live_in_callbacks():
    """A ``Callback`` subclass is a callback: it lives in callbacks/, one a file, not inside the module that uses it.
    Checked by ``grep -rn "(L.Callback)" --include=*.py . | grep -v ^./callbacks/``."""
    outside = [f"{rel}:{line} {name}" for rel in shipping.shipped_files(ROOT)
               if rel.endswith(".py") and not rel.startswith("callbacks/")
               for name, line, base in class_bases(ast.parse((ROOT / rel).read_text()))
               if base.split(".")[-1] == "Callback"]
    assert not outside, f"Lightning callbacks outside callbacks/: {outside}"


OUTPUT_LAYOUT = {"model", "run", "checkpoints"}  # the folders a run writes under output.root


def test_the_output_folders_layout_is_named_only_in_runtime_output_folder():
    """``root / "checkpoints"`` and its siblings are spelled once, in runtime/output_folder.py (its constants and
    ``*_folder`` functions); the rest of the trainer asks it. The tools and the tests read a run's output as a
    user does, from the layout the docs describe, so they write it out; runfab/shipping.py names a
    ``checkpoints`` folder among what a bundle leaves out wherever it lies, another fact on a floor below."""
    spelled = set()
    for rel in shipping.shipped_files(ROOT):
        if not rel.endswith(".py") or rel == "runtime/output_folder.py":
            continue
        tree = ast.parse((ROOT / rel).read_text())
        joined = {id(node.right) for node in ast.walk(tree) if isinstance(node, ast.BinOp)
                  and isinstance(node.op, ast.Div)}  # the right-hand side of a path join
        spelled |= {f"{rel}:{node.lineno} {node.value}" for node in ast.walk(tree) if isinstance(node, ast.Constant)
                    and (node.value in OUTPUT_LAYOUT and id(node) in joined
                         or node.value in ("checkpoints", "compile-cache") and id(node) not in docstrings(tree)
                         and not rel.startswith("runfab/"))}
    assert not spelled, f"the output layout spelled outside runtime/output_folder.py: {sorted(spelled)}"


def test_a_data_parallel_rank_is_entered_in_runtime_worker_only():
    """``train.py worker`` runs runtime/worker.py: the one module that reads the spec the launcher hands a rank
    (``launcher.worker_spec``); one training run (training_run.py) neither reads it nor defines a rank's entry."""
    readers = set()
    for rel in shipping.shipped_files(ROOT):
        if not rel.endswith(".py") or rel in ("runtime/worker.py", "runtime/launcher.py"):
            continue
        tree = ast.parse((ROOT / rel).read_text())
        readers |= {f"{rel}:{node.lineno} {node.attr}" for node in ast.walk(tree)
                    if isinstance(node, ast.Attribute) and node.attr in ("worker_spec", "WORKER_SPEC_ENV")}
        readers |= {f"{rel}:{node.lineno} {node.name}" for node in ast.walk(tree)
                    if isinstance(node, ast.FunctionDef) and node.name.lstrip("_") == "run_worker"}
    assert not readers, f"a rank's entry outside runtime/worker.py: {sorted(readers)}"


def test_a_files_digest_is_defined_once_on_the_floor_below_its_users():
    """``sha256_file`` (the tokenizer's and the code's identity in a run record, a resume's fingerprint and the
    prepared shards' metadata) is used by callbacks/, runtime/ and tools/: it is defined once, in
    pipeline/fingerprints.py beside the other digests, on a floor all of them import, and imported from there."""
    defined, imported = [], []
    for rel in python_files():
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "sha256_file":
                defined.append(rel)
            elif isinstance(node, ast.ImportFrom) and any(alias.name == "sha256_file" for alias in node.names):
                imported.append(f"{rel}: {node.module}")
    assert defined == ["pipeline/fingerprints.py"], f"sha256_file defined in {defined}"
    assert all(line.endswith(": pipeline.fingerprints") for line in imported), imported


TOP_FOLDERS = ("callbacks", "conf", "data", "docs", "model", "pipeline", "runfab", "runtime", "tests", "tools")
NAMED_PATH = re.compile(r"(?<![\w/.-])((?:%s)/(?:[\w-]+/)*[\w-]+\.(?:py|md|sh|yaml|toml))(?![\w.])"
                        % "|".join(TOP_FOLDERS))


def prose(rel: str) -> str:
    """What a reader reads as a map: a document's text, or a Python file's docstrings and comments."""
    text = (ROOT / rel).read_text()
    if not rel.endswith(".py"):
        return text
    tree = ast.parse(text)
    described = docstrings(tree)
    strings = [node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and id(node) in described]
    comments = [line.split("#", 1)[1] for line in text.splitlines() if "#" in line]
    return "\n".join(strings + comments)


def test_the_files_the_docs_docstrings_and_comments_name_exist():
    """A map that names a file names one that is there: every ``folder/.../name.py`` (or .md, .sh, .yaml, .toml)
    under one of the project's folders that the docs, a docstring or a comment names exists, and every ``name.py``
    a package's ``__init__`` docstring names is a module of that package."""
    listed = subprocess.run(["git", "ls-files", "*.md", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    missing = []
    for rel in listed.stdout.split():
        if not (ROOT / rel).is_file():
            continue
        missing += [f"{rel}: {path}" for path in NAMED_PATH.findall(prose(rel)) if not (ROOT / path).exists()]
        if rel.endswith("/__init__.py"):
            package = (ROOT / rel).parent
            missing += [f"{rel}: {name}" for name in re.findall(r"(?<![\w/.])([\w-]+\.(?:py|sh))\b", prose(rel))
                        if not (package / name).exists() and not (ROOT / name).exists()]
    assert not missing, f"files named that are not there: {missing}"


def test_each_packages_first_lines_say_what_it_holds_and_what_it_is_not():
    """``ls`` plus a package's ``__init__`` docstring orient a newcomer: the docstring names each of the package's
    modules and subpackages, and says what the package is not (a "Not ..." or "never ..." beside the folder a
    newcomer would confuse it with: runfab/ and runtime/, pipeline/ and datamodule.py, data/ and tools/data/)."""
    packages = sorted({str(Path(rel).parent) for rel in python_files() if rel.endswith("/__init__.py")
                       and rel.split("/")[0] not in ("tests",)})
    unnamed, unbounded = [], []
    for package in packages:
        docstring = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text())) or ""
        members = [p.stem if p.is_file() else p.name for p in (ROOT / package).iterdir()
                   if (p.suffix in (".py", ".sh") and not p.name.startswith("__")) or (p / "__init__.py").is_file()]
        unnamed += [f"{package}/{member}" for member in members if not re.search(rf"\b{member}\b", docstring)]
        if not re.search(r"\b(Not|not|never|Never)\b", docstring):
            unbounded.append(package)
    assert not unnamed, f"modules their package's __init__ docstring does not name: {sorted(unnamed)}"
    assert not unbounded, f"packages whose __init__ docstring does not say what they are not: {unbounded}"


def test_only_gpt2s_family_names_a_class_gpt():
    """``GPT`` is GPT-2's family (model/gpt.py); what serves either family (the training module, the decoder, the
    kernels, the callbacks, the tools) says what it is without it: no other module defines a class whose name says
    GPT. Checked by ``grep -rn "^class .*GPT" --include=*.py . | grep -v ^./model/gpt.py``."""
    named = [f"{rel}:{node.lineno} {node.name}" for rel in python_files() if rel != "model/gpt.py"
             and not rel.startswith("tests/")
             for node in ast.walk(ast.parse((ROOT / rel).read_text()))
             if isinstance(node, ast.ClassDef) and "gpt" in node.name.lower()]
    assert not named, f"classes named for GPT-2 outside its family's module: {named}"


def module_stem(rel: str) -> str:
    return Path(rel).stem.replace("_", "")


def test_no_two_floors_hold_modules_of_near_identical_names():
    """A module's name says its one job, so two modules on different floors (packages, or the root) never share a
    name, nor does one repeat the other's with a word in front (``memory`` beside ``host_memory``): host memory is
    read by runfab/process_memory.py, budgeted by runtime/host_budget.py and recorded by callbacks/memory_stages.py;
    the ``data`` section is pipeline/data_section.py, beside the root's config.py."""
    modules = [rel for rel in shipping.shipped_files(ROOT) if rel.endswith(".py") and not rel.endswith("__init__.py")]
    alike = [(a, b) for a in modules for b in modules if a != b and Path(a).parent != Path(b).parent
             and module_stem(b).endswith(module_stem(a))]
    assert not alike, f"modules on different floors whose names say the same: {sorted(alike)}"


# What each package's __init__ docstring says it never imports (runfab/, the ground floor, imports nothing of ours).
NEVER_IMPORTED = {
    "model": {"pipeline", "runtime", "callbacks", "config", "lightning", "torch.distributed"},
    "pipeline": {"runtime", "callbacks", "config", "lightning", "torch.distributed"},
    "callbacks": {"runtime", "config"},
}


def imported_names(tree: ast.AST) -> set[str]:
    """Every module ``tree`` imports (also inside functions and ``if TYPE_CHECKING``), and ``torch.distributed``
    where it is reached as an attribute of an imported torch."""
    found = {"torch.distributed"} if any(isinstance(node, ast.Attribute) and node.attr == "distributed"
                                         and ast.unparse(node.value) == "torch" for node in ast.walk(tree)) else set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_package_imports_what_its_first_lines_say_it_never_imports():
    """pipeline/ reads and packs records and never talks to the other ranks: the per-update agreement of a run from
    shards (Lightning, torch.distributed) is the runtime's (runtime/update_agreement.py). model/ neither, and
    callbacks/ never reach up to the runtime or the config. Checked by ``grep -rnE "lightning|torch.distributed"
    pipeline/ model/`` (prose only)."""
    found = []
    for rel in shipping.shipped_files(ROOT):
        package = rel.split("/")[0]
        if not rel.endswith(".py") or package not in NEVER_IMPORTED:
            continue
        for name in sorted(imported_names(ast.parse((ROOT / rel).read_text()))):
            if any(name == never or name.startswith(never + ".") for never in NEVER_IMPORTED[package]):
                found.append(f"{rel}: {name}")
    assert not found, f"imports a package's first lines rule out: {found}"


def patched_names(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, attribute) of every ``monkeypatch.setattr(target, "name", value)`` or ``("module.name", value)``."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setattr"
                and ast.unparse(node.func.value) == "monkeypatch" and node.args):
            named = node.args[1] if len(node.args) == 3 else node.args[0]
            if isinstance(named, ast.Constant) and isinstance(named.value, str):
                found.append((node.lineno, named.value.rsplit(".", 1)[-1]))
    return found


def test_tests_patch_no_private_name_and_choose_kernels_for_a_gpu_they_describe():
    """A test drives behaviour through public entry points: it patches no private name (``_x``) of a module, and a
    GPU it has not got is described, not faked: ``model.kernels.Target(..., capability=(9, 0))`` chooses the
    kernels of a Hopper GPU on a CPU, where patching ``compute_capability`` would fake the device. Checked by
    ``grep -rnE "setattr\\([^,]*, \\"_|compute_capability\\"" tests/``."""
    found = [f"{rel}:{line} {name}" for rel in python_files() if rel.startswith("tests/")
             for line, name in patched_names(ast.parse((ROOT / rel).read_text()))
             if name == "compute_capability" or name.startswith("_") and not name.endswith("__")]
    assert not found, f"tests that patch a private name or fake the GPU's compute capability: {found}"


def test_every_pin_in_the_requirements_and_the_docs_install_lines_agrees_with_pyproject():
    """A package that pyproject.toml names (dependencies or an extra) and that a requirements*.txt (its comments too)
    or an install line of the docs pins gets one version: exact pins equal, an exact pin inside pyproject's range, the
    same range where both give one, and no exact pin beside pyproject's bare name."""
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {Requirement(spec).name.lower(): Requirement(spec).specifier
                for spec in [*project.get("dependencies", []),
                             *(s for specs in project.get("optional-dependencies", {}).values() for s in specs)]}
    sources = {rel: [line.lstrip("# ") for line in (ROOT / rel).read_text().splitlines()]
               for rel in sorted(p.name for p in ROOT.glob("requirements*.txt"))}
    assert {"requirements.txt", "requirements-dev.txt"} <= sources.keys()
    for rel in ["README.md", *(str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")))]:
        lines = (ROOT / rel).read_text().replace("\\\n", " ").splitlines()
        sources[rel] = [line for line in lines if "pip install" in line]
    differ = []
    for rel, lines in sources.items():
        for name, spec in requirement_pins(lines).items():
            wanted = declared.get(name)
            if wanted is None:
                continue
            exact = spec.startswith("==")
            agrees = (str(wanted) != "" and wanted.contains(spec[2:], prereleases=True) if exact
                      else set(spec.split(",")) <= {str(clause) for clause in wanted})
            if not agrees:
                differ.append(f"{rel}: {name}{spec}, pyproject.toml: {name}{wanted or ' (no version)'}")
    assert len(sources) > 3 and "quack-kernels" in declared
    assert not differ, f"pins that disagree with pyproject.toml: {differ}"


def test_every_key_of_the_config_is_read_by_the_run():
    """No dead key: every leaf of the schema is read as an attribute by a shipped module, outside the command line
    (cli.py), the config's own checks (``problems()`` and config.py's functions) and the field's declaration.
    Checked by name, so a key whose name is also another attribute's passes: the rule catches a key nobody reads."""
    from config import key_hints

    read = set()
    for rel in shipping.shipped_files(ROOT):
        if not rel.endswith(".py") or rel == "cli.py":
            continue
        tree = ast.parse((ROOT / rel).read_text())
        scopes = [node for node in tree.body if isinstance(node, ast.ClassDef)] if rel == "config.py" else [tree]
        checks = {id(node) for scope in scopes for function in ast.walk(scope)
                  if isinstance(function, ast.FunctionDef) and function.name == "problems"
                  for node in ast.walk(function)}
        read |= {node.attr for scope in scopes for node in ast.walk(scope)
                 if isinstance(node, ast.Attribute) and id(node) not in checks}
    keys = list(key_hints())
    assert "trainer.max_time" in keys and len(keys) > 60
    dead = [key for key in keys if key.split(".")[-1] not in read]
    assert not dead, f"keys of the config that no module reads (remove them, or use them): {dead}"


REMOVED_KEYS = ("data.token_digests", "compute.residual_in_fp32")  # residue: alternatives that lost, gone with them


def test_removed_keys_stay_gone_from_the_schema_the_presets_the_code_and_the_docs():
    """A removed key is named only by the tests that check it is refused as any unknown key."""
    from config import key_hints

    assert not set(REMOVED_KEYS) & set(key_hints())
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    named = [f"{rel}: {key}" for rel in listed if not rel.startswith("tests/") and (ROOT / rel).is_file()
             and rel.endswith((".py", ".md", ".yaml", ".txt", ".toml", ".sh"))
             for key in REMOVED_KEYS if key.split(".")[-1] in (ROOT / rel).read_text()]
    assert not named, f"removed keys still named: {named}"


def test_the_command_line_checks_typed_values_and_leaves_lightnings_docstrings_to_jsonargparse():
    """cli.py checks a value it was given by its key's type (config.value_problem, the check YAML files get too), never
    by matching the parser's error text, and takes Lightning's Trainer arguments, types and help from jsonargparse:
    it imports neither ``re`` nor ``docstring_parser``."""
    tree = ast.parse((ROOT / "cli.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert not {"re", "docstring_parser"} & imported, sorted({"re", "docstring_parser"} & imported)
    called = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    assert "value_problem" in called
