"""The checks that read the bundle rather than run it, and the verdict every check gives.

``layout`` (train.py at the root), ``archive`` (RunFab's size limits), ``batch`` (a literal
``EFFECTIVE_BATCH_SIZE`` in 1..65536, divisible by the GPU count) and ``hooks`` (``probe_batch(microbatch)``
and ``train(microbatch, accumulation)``). RunFab reads the batch size from the source, so these read
the source with ``ast``; what the import child saw is compared with it where the child got that far.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from runfab.hooks import BATCH_MAX, BATCH_MIN, BATCH_NAME, HOOKS
from runfab.limits import EXPANDED_BYTES as EXPANDED_LIMIT, MIB, ZIP_BYTES as ZIP_LIMIT

if TYPE_CHECKING:
    from tools.bundle.sandbox import BundleSource, ChildRun


PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Result:
    """One check's verdict. ``reason`` is the one line a user needs; ``notes`` are details worth knowing."""

    key: str
    verdict: str
    reason: str
    notes: list[str] = field(default_factory=list)
    seconds: float | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == PASS


def check_layout(source: BundleSource) -> Result:
    if "train.py" in source.files:
        return Result("layout", PASS, "train.py is at the bundle root")
    nested = sorted(rel for rel in source.files if rel.endswith("/train.py") and rel.count("/") == 1)
    hint = (f"; found {nested[0]}: pack the folder's contents, not the folder" if nested else "")
    return Result("layout", FAIL, f"no train.py at the bundle root{hint}")


def check_archive(source: BundleSource) -> Result:
    problems, facts = [], [f"{size_text(source.expanded_bytes)} expanded (limit {size_text(EXPANDED_LIMIT)})"]
    if source.expanded_bytes > EXPANDED_LIMIT:
        problems.append(f"expands to {size_text(source.expanded_bytes)}, over RunFab's {size_text(EXPANDED_LIMIT)}")
    if source.packed_bytes is not None:
        facts.insert(0, f"ZIP {size_text(source.packed_bytes)} (limit {size_text(ZIP_LIMIT)})")
        if source.packed_bytes > ZIP_LIMIT:
            problems.append(f"the ZIP is {size_text(source.packed_bytes)}, over RunFab's {size_text(ZIP_LIMIT)}")
    if source.unsafe:
        problems.append(f"members that would unpack outside the bundle root: {listing(source.unsafe)}")
    notes = [] if source.kind == "zip" else [
        f"a directory has no compressed size; check the ZIP to test the {size_text(ZIP_LIMIT)} limit"]
    if problems:
        return Result("archive", FAIL, "; ".join(problems), notes)
    return Result("archive", PASS, "; ".join(facts), notes)


def parse_train(bundle: Path) -> tuple[ast.Module | None, str | None]:
    try:
        source = (bundle / "train.py").read_text(encoding="utf-8")
        return ast.parse(source, filename="train.py"), None
    except SyntaxError as error:
        return None, f"train.py does not parse: line {error.lineno}: {error.msg}"
    except (OSError, UnicodeDecodeError) as error:
        return None, f"train.py cannot be read: {error}"


def batch_literal(tree: ast.Module) -> tuple[int | None, str]:
    """The value of the one module-level ``EFFECTIVE_BATCH_SIZE = <int>``, or None and why not.

    RunFab reads the number from the source, so it has to be written out: a computed value, an
    annotation, a second binding or a ``global`` rebinding in a function all fail here.
    """
    top_level = [node for node in tree.body if isinstance(node, ast.Assign)
                 and any(isinstance(t, ast.Name) and t.id == BATCH_NAME for t in node.targets)]
    others = [node for node in ast.walk(tree) if binds_batch(node) and node not in top_level]
    if not top_level:
        if others:
            return None, (f"{BATCH_NAME} is only bound as `{ast.unparse(others[0]).splitlines()[0]}` (line "
                          f"{others[0].lineno}); write a plain module-level `{BATCH_NAME} = 32`")
        return None, f"no module-level `{BATCH_NAME} = <integer>` in train.py"
    if len(top_level) > 1 or others:
        lines = sorted(node.lineno for node in top_level + others)
        return None, (f"{BATCH_NAME} is bound more than once (lines {', '.join(map(str, lines))}); "
                      f"assign it once, literally")
    node = top_level[0]
    value = node.value
    if isinstance(value, ast.Constant) and type(value.value) is int:
        return value.value, f"line {node.lineno}"
    written = ast.unparse(value)
    if isinstance(value, ast.Constant):
        return None, f"{BATCH_NAME} = {written} is a {type(value.value).__name__}, not an integer literal"
    return None, f"{BATCH_NAME} = {written} is computed (line {node.lineno}); write the number itself"


def binds_batch(node: ast.AST) -> bool:
    if isinstance(node, ast.Global | ast.Nonlocal):
        return BATCH_NAME in node.names
    if isinstance(node, ast.AugAssign | ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == BATCH_NAME
    if isinstance(node, ast.Assign):
        return any(isinstance(n, ast.Name) and n.id == BATCH_NAME for t in node.targets for n in ast.walk(t))
    if isinstance(node, ast.NamedExpr):
        return node.target.id == BATCH_NAME
    if isinstance(node, ast.alias):
        return (node.asname or node.name) == BATCH_NAME
    return False


def check_batch(tree: ast.Module | None, parse_error: str | None, gpus: int, gpus_from: str,
                child: ChildRun | None) -> Result:
    if tree is None:
        return Result("batch", FAIL, parse_error or "train.py cannot be read")
    value, where = batch_literal(tree)
    if value is None:
        return Result("batch", FAIL, where)
    problems = []
    if not BATCH_MIN <= value <= BATCH_MAX:
        problems.append(f"{BATCH_NAME} = {value} is outside {BATCH_MIN}..{BATCH_MAX}")
    elif value % gpus:
        problems.append(f"{BATCH_NAME} = {value} is not divisible by {gpus} GPU(s) ({gpus_from})")
    reported = (child.report or {}).get("batch") if child else None
    if reported and reported["found"] and reported["repr"] != repr(value):
        problems.append(f"the source says {value} but after import train.{BATCH_NAME} is {reported['repr']}")
    if problems:
        return Result("batch", FAIL, "; ".join(problems))
    return Result("batch", PASS, f"{BATCH_NAME} = {value} ({where}), an integer literal divisible by "
                                 f"{gpus} GPU(s) ({gpus_from})")


def check_hooks(tree: ast.Module | None, parse_error: str | None, child: ChildRun | None) -> Result:
    """Both hooks as module-level ``def`` statements with exactly the contract's parameters, and the same
    after import (a decorator or a later rebinding could change what RunFab actually calls)."""
    if tree is None:
        return Result("hooks", FAIL, parse_error or "train.py cannot be read")
    problems = []
    for name, expected in HOOKS.items():
        defs = [node for node in tree.body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name]
        if not defs:
            problems.append(f"no module-level `def {name}({', '.join(expected)})`")
            continue
        node = defs[-1]
        if isinstance(node, ast.AsyncFunctionDef):
            problems.append(f"{name} is `async def`; RunFab calls it as a plain function")
        found = ast_parameters(node.args)
        if found != expected:
            problems.append(f"{name}({', '.join(found)}) at line {node.lineno}; expected {name}({', '.join(expected)})")
    if problems:
        return Result("hooks", FAIL, "; ".join(problems))
    report = child.report if child else None
    if not report or "hooks" not in report:
        return Result("hooks", SKIP, "the source is right, but the signatures after import could not be checked: "
                                     "train.py did not import (see import)")
    for name, expected in HOOKS.items():
        seen = report["hooks"][name]
        if not seen["found"]:
            problems.append(f"after import train.{name} is missing")
        elif not seen.get("callable"):
            problems.append(f"after import train.{name} is a {seen['type']}, not a function")
        elif "error" in seen:
            problems.append(f"after import the signature of train.{name} cannot be read: {seen['error']}")
        elif seen["params"] != expected:
            problems.append(f"after import train.{name} takes ({', '.join(seen['params'])}), "
                            f"expected ({', '.join(expected)})")
    if problems:
        return Result("hooks", FAIL, "; ".join(problems))
    return Result("hooks", PASS, "probe_batch(microbatch) and train(microbatch, accumulation), in the source and "
                                 "after import")


def ast_parameters(args: ast.arguments) -> list[str]:
    return ([a.arg for a in args.posonlyargs + args.args] + ([f"*{args.vararg.arg}"] if args.vararg else [])
            + [a.arg for a in args.kwonlyargs] + ([f"**{args.kwarg.arg}"] if args.kwarg else []))


def size_text(size: int) -> str:
    return f"{size / MIB:.1f} MiB" if size >= MIB else f"{size / 1024:.1f} KiB"


def listing(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
