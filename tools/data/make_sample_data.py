"""Build data/sample.jsonl, the bundled default training sample.

The text is real English prose that exists offline on every machine: the
docstrings of CPython's standard library plus the reference-manual topics in
``pydoc_data/topics.py``.  Sources are read with ``ast`` instead of being
imported, so nothing is executed and the output depends only on the stdlib
files of the interpreter that runs this script (its version is printed to
stderr as provenance; a different Python gives a slightly different sample).

Usage: python -m tools sample-data [--output data/sample.jsonl]
"""

from __future__ import annotations

import argparse
import ast
import json
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Iterator

from runfab import created_files

# Directories whose contents are tests, tooling or third-party code rather
# than documented library API.
EXCLUDED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "turtledemo",
}
# Shorter docstrings are mostly one-line summaries that add little prose;
# 100 keeps short multi-sentence class and method docs.
MIN_CHARS = 100


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_library_source(relative: Path) -> bool:
    """Keep stdlib modules; drop tests and the directories listed above."""
    if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in relative.parts[:-1]):
        return False
    name = relative.name
    return not (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py")


def module_name(relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def docstrings_of(tree: ast.Module, module: str) -> Iterator[tuple[str, str]]:
    """Yield (qualified name, cleaned docstring) in source order."""
    doc = ast.get_docstring(tree, clean=True)
    if doc:
        yield module, doc

    def visit(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                qualname = f"{prefix}.{child.name}"
                child_doc = ast.get_docstring(child, clean=True)
                if child_doc:
                    yield qualname, child_doc
                yield from visit(child, qualname)
            elif isinstance(child, (ast.stmt, ast.excepthandler)):
                # Definitions nested in `if sys.platform ...:`, `try:` etc. count too.
                yield from visit(child, prefix)

    yield from visit(tree, module)


def stdlib_documents(root: Path) -> Iterator[tuple[str, str]]:
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if not is_library_source(relative):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError) as err:  # deliberately broken fixtures
            print(f"skip {relative}: {err.__class__.__name__}", file=sys.stderr)
            continue
        yield from docstrings_of(tree, module_name(relative))


def topic_documents(root: Path) -> Iterator[tuple[str, str]]:
    """Reference-manual topics: the `topics = {...}` literal in pydoc_data."""
    path = root / "pydoc_data" / "topics.py"
    if not path.exists():
        print(f"no {path}; topics skipped", file=sys.stderr)
        return
    for node in ast.parse(path.read_bytes()).body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets)
        ):
            topics = ast.literal_eval(node.value)
            for key in sorted(topics):
                yield f"pydoc_data.topics:{key}", topics[key].strip()


def build(root: Path, min_chars: int) -> list[dict[str, str]]:
    records, seen = [], set()
    sources = [("stdlib", stdlib_documents(root)), ("topics", topic_documents(root))]
    for _, documents in sources:
        for source, text in documents:
            if len(text) < min_chars or text in seen:
                continue
            seen.add(text)
            records.append({"source": source, "text": text})
    return records


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools sample-data", description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("data/sample.jsonl"),
                        help="the NDJSON file to write (default: data/sample.jsonl)")
    parser.add_argument("--min-chars", type=int, default=MIN_CHARS,
                        help=f"shortest docstring kept, in characters (default: {MIN_CHARS})")
    args = parser.parse_args(argv)

    root = stdlib_root()
    print(
        f"reading stdlib of Python {platform.python_version()} "
        f"({platform.python_implementation()}) at {root}",
        file=sys.stderr,
    )
    records = build(root, args.min_chars)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with created_files.open_created(args.output) as out:  # text mode writes "\n" as is on POSIX
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    size = args.output.stat().st_size
    print(f"wrote {len(records)} documents, {size / 1e6:.2f} MB to {args.output}", file=sys.stderr)
    return 0
