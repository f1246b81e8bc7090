"""Build the RunFab upload ZIP: ``python -m tools package [--output DIR] [--dry-run] [--root DIR]``.

The project root is the upload bundle, but the same folder also holds what must never be uploaded:
tests, virtual environments, caches, run outputs, downloaded weights and, on a developer's machine,
credentials. Zipping the folder by hand ships all of it, so this module packs what
``shipping.shipped_files`` selects (an allow-list of what training needs; ``tools/`` is not in it) and
refuses to write anything when the result would break RunFab's contract (section 1: a small,
self-contained code ZIP within the size limits of ``runfab.limits``, with no keys, virtual
environments, caches, large datasets or model weights).

In a git checkout only tracked files ship; untracked files that the allow-list would take are named
on stderr so a forgotten ``git add`` is noticed before the upload fails to import.

Refused (exit 1, nothing written), every problem reported at once with the file and the rule:
credential files and token-like strings, private keys, weight files, single files over 4 MiB, unsafe
entry names (absolute, ``..``, control characters, non-UTF-8, characters that Windows treats as
separators or forbids: RunFab archives the code on a Windows host) and symlinks that leave the root,
and a ZIP over the size limits.

The archive is reproducible: entries sorted by name, timestamps fixed at 1980-01-01, permissions
0644, DEFLATE at level 9 and no extra fields, so the same files give the same bytes (with the same
zlib). The file is named ``runfab-trainer-<first 12 hex digits of its SHA-256>.zip``: an upload can
be checked against its name with ``sha256sum``, and two different bundles never overwrite each other.
Writing one removes the earlier bundles of that name pattern from the output folder, so ``dist/*.zip``
names exactly one file (what ``check`` and ``emulate`` take); nothing else there is touched.

Messages go to stderr; stdout carries only the file listing of ``--dry-run``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import re
import stat
import sys
import tempfile
import unicodedata
import zipfile
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

from runfab import limits as runfab_limits
from runfab.limits import MIB
from runfab.shipping import git_files, shipped_files, untracked_matches

DEFAULT_ROOT = Path(__file__).resolve().parents[2]
ZIP_PREFIX = "runfab-trainer-"
ZIP_NAME_PATTERN = re.compile(re.escape(ZIP_PREFIX) + r"[0-9a-f]{12}\.zip")  # what zip_name() writes


@dataclass(frozen=True)
class Limits:
    """RunFab's upload limits, plus a per-file cap that keeps datasets out of the code ZIP."""

    zip_bytes: int = runfab_limits.ZIP_BYTES
    expanded_bytes: int = runfab_limits.EXPANDED_BYTES
    file_bytes: int = 4 * MIB


LIMITS = Limits()

# ----------------------------------------------------------------------------- what is refused

SECRET_FILE_GLOBS = (
    ".env", ".env.*", "*.pem", "*.key", "*.p12", "*.pfx", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
    ".netrc", ".pypirc", ".git-credentials",
)
WEIGHT_SUFFIXES = frozenset({
    ".safetensors", ".pt", ".pth", ".bin", ".ckpt", ".pickle", ".pkl", ".npy", ".npz", ".onnx", ".gguf", ".h5",
})
CREDENTIAL_VARIABLES = (
    "WANDB_API_KEY", "RUNPOD_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
)
# (what it is, pattern). Scanned as bytes so every selected file is covered, whatever its encoding.
# A credential variable counts only with a literal value: `os.environ["WANDB_API_KEY"]` or
# `WANDB_API_KEY=${WANDB_API_KEY}` are how code should read keys and are not flagged.
SECRET_PATTERNS = tuple(
    (kind, re.compile(pattern))
    for kind, pattern in (
        ("private key", rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY[A-Z ]*-----"),
        ("Hugging Face token", rb"\bhf_[A-Za-z0-9]{30,}"),
        ("OpenAI-style API key", rb"\bsk-[A-Za-z0-9_-]{20,}"),
        ("AWS access key id", rb"\bAKIA[0-9A-Z]{16}\b"),
        ("GitHub token", rb"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})"),
        (
            "credential variable with a value",
            rb"\b(?P<name>" + "|".join(CREDENTIAL_VARIABLES).encode() + rb")['\"]?\]?\s*[=:]\s*"
            rb"(?:(?P<quote>['\"])[^'\"\s]{8,}(?P=quote)|[A-Za-z0-9_/+-]{8,}(?![\w/+.(\[-]))",
        ),
    )
)
# Characters that are separators or forbidden in Windows names; RunFab saves the code to D:\RunFabric.
WINDOWS_UNSAFE_CHARS = frozenset('\\:*?"<>|')

# Entries are written with these so that the same files always give the same bytes.
FIXED_DATE_TIME = (1980, 1, 1, 0, 0, 0)
FILE_MODE = stat.S_IFREG | 0o644
COMPRESS_LEVEL = 9


class BundleRefused(Exception):
    """The bundle breaks at least one rule; each problem names the file, the rule and the fix."""

    def __init__(self, problems: list[str]):
        super().__init__(f"{len(problems)} problem(s)")
        self.problems = problems


# ----------------------------------------------------------------------------- checks


def show(rel: str) -> str:
    """A printable form of a path: odd names are shown escaped so the message itself stays one clean line."""
    return rel if path_problem(rel) is None else ascii(rel)


def path_problem(rel: str) -> str | None:
    """Why `rel` cannot be a ZIP entry name that extracts safely everywhere, or None when it can."""
    if not rel:
        return "empty name"
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return "the name is not valid UTF-8"
    if any(unicodedata.category(char) == "Cc" for char in rel):
        return "the name contains a control character"
    if rel.startswith("/"):
        return "absolute path"
    parts = rel.split("/")
    if ".." in parts:
        return "the path contains a '..' component, which would extract outside the target folder"
    if any(part in ("", ".") for part in parts):
        return "the path contains an empty or '.' component"
    unsafe = sorted(WINDOWS_UNSAFE_CHARS.intersection(rel))
    if unsafe:
        return (f"the name contains {' '.join(unsafe)}, which Windows (where RunFab archives the code) forbids "
                "or reads as a separator")
    return None


def secret_name(rel: str) -> str | None:
    """The credential-file pattern the file name matches, or None."""
    name = rel.rsplit("/", 1)[-1].lower()
    return next((glob for glob in SECRET_FILE_GLOBS if fnmatchcase(name, glob)), None)


def resolved(path: Path) -> Path | None:
    """Where the path really leads, or None for a symlink loop (which cannot be packed either way)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return None


def is_contained_file(root: Path, rel: str) -> bool:
    """Whether `rel` is a safe name for a regular file that resolves inside the root."""
    target = resolved(root / rel) if path_problem(rel) is None else None
    return target is not None and target.is_relative_to(root.resolve()) and target.is_file()


def file_problems(root: Path, rel: str, limits: Limits) -> list[str]:
    """Everything wrong with one selected file that can be seen without reading it."""
    problem = path_problem(rel)
    if problem:
        return [f"{show(rel)}: unsafe path: {problem}; rename or remove it"]
    path = root / rel
    real_root = root.resolve()
    target = resolved(path)
    if target is None:
        return [f"{rel}: unsafe path: symlink loop; remove the link"]
    if not target.is_relative_to(real_root):
        what = f"symlink to {target}" if path.is_symlink() else f"resolves to {target}"
        return [f"{rel}: unsafe path: {what}, outside the project root {real_root}; "
                "copy the file into the project instead"]
    if not path.is_file():
        return [f"{rel}: not a regular file (a folder, a broken symlink or a device); only regular files are packed"]
    problems = []
    # A link inside the root is packed as the file it points to, so the target's name is judged too.
    names = {rel, target.relative_to(real_root).as_posix()}
    for name in sorted(names):
        glob = secret_name(name)
        if glob:
            problems.append(f"{rel}: secret file: the name {name!r} matches {glob!r}, a credentials file; "
                            "keep keys out of the bundle and read them from the environment")
        if Path(name).suffix.lower() in WEIGHT_SUFFIXES:
            problems.append(f"{rel}: weight file: {Path(name).suffix} files hold model weights or pickles, which "
                            "never go in the upload; remove it, or let training write it under $RUNFABRIC_OUTPUT")
    size = path.stat().st_size
    if size > limits.file_bytes:
        problems.append(f"{rel}: file too large: {mib(size)}, over the {mib(limits.file_bytes)} per-file limit for the "
                        "code bundle; stream large data on stdin or through runfabric.dataset.json instead")
    return problems


def check_files(root: Path, files: list[str], limits: Limits | None = None) -> list[str]:
    """Every problem that can be found without reading contents: paths, links, names, sizes, train.py, total."""
    limits = limits or LIMITS
    problems = [problem for rel in files for problem in file_problems(root, rel, limits)]
    if "train.py" not in files:
        problems.append(f"train.py: missing: RunFab imports train.py from the ZIP root, and {root} has none "
                        "(or git does not track it); run from the project or pass --root")
    # Only files that passed the path and link checks are measured: the others may point anywhere.
    sizes = {rel: (root / rel).stat().st_size for rel in files if is_contained_file(root, rel)}
    total = sum(sizes.values())
    if total > limits.expanded_bytes:
        largest = ", ".join(f"{rel} ({mib(size)})" for rel, size in sorted(sizes.items(), key=lambda kv: -kv[1])[:3])
        problems.append(f"bundle too large: {len(sizes)} files expand to {mib(total)}, over RunFab's "
                        f"{mib(limits.expanded_bytes)} expanded limit; largest: {largest}")
    return problems


def find_secrets(root: Path, files: list[str]) -> list[str]:
    """Token-like strings and private keys in the files' contents, one problem per file and kind."""
    problems = []
    for rel in files:
        content = (root / rel).read_bytes()
        for kind, pattern in SECRET_PATTERNS:
            match = pattern.search(content)
            if match:
                line = content.count(b"\n", 0, match.start()) + 1
                problems.append(f"{rel}:{line}: secret in file: looks like a {kind} ({redacted(match)}); remove it "
                                "and read credentials from the environment at run time")
    return problems


def redacted(match: re.Match[bytes]) -> str:
    """Enough of a match to find it in the file, too little to use it: the message must not leak the secret."""
    if "name" in match.re.groupindex:
        return match.group("name").decode() + "=..."
    return match.group()[:6].decode("utf-8", "replace") + "..."


def mib(size: int) -> str:
    return f"{size / MIB:.1f} MiB"


# ----------------------------------------------------------------------------- the archive


def build_zip(root: Path, files: list[str]) -> bytes:
    """The ZIP of `files` in memory, byte-for-byte reproducible (see the module docstring)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for rel in sorted(files):
            info = zipfile.ZipInfo(rel, date_time=FIXED_DATE_TIME)
            info.create_system = 3  # Unix, whatever builds it, so external_attr means the same everywhere
            info.external_attr = FILE_MODE << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, (root / rel).read_bytes(), compresslevel=COMPRESS_LEVEL)
    return buffer.getvalue()


def zip_name(data: bytes) -> str:
    return f"{ZIP_PREFIX}{hashlib.sha256(data).hexdigest()[:12]}.zip"


def checked_zip(root: Path, files: list[str], limits: Limits | None = None) -> bytes:
    """Run every rule on `files`, then build the archive; raises BundleRefused when anything fails.

    Cheap checks run first, so an oversized or unsafe tree is refused before any content is read.
    """
    limits = limits or LIMITS
    problems = check_files(root, files, limits)
    if not problems:
        problems = find_secrets(root, files)
    if problems:
        raise BundleRefused(problems)
    data = build_zip(root, files)
    if len(data) > limits.zip_bytes:
        raise BundleRefused([f"bundle too large: the ZIP is {mib(len(data))} compressed, over RunFab's "
                             f"{mib(limits.zip_bytes)} limit; move data out of conf/ and data/"])
    return data


def write_zip(root: Path, files: list[str], dest: Path, limits: Limits | None = None) -> Path:
    """Check and write the archive into folder `dest`; returns its path. Nothing is written when refused.

    The file appears atomically (temporary file, then rename), so a reader never sees half a ZIP.
    """
    data = checked_zip(root, files, limits)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / zip_name(data)
    with tempfile.NamedTemporaryFile(dir=dest, prefix=".partial-", suffix=".zip", delete=False) as handle:
        try:
            handle.write(data)
        except BaseException:
            os.unlink(handle.name)
            raise
    os.chmod(handle.name, 0o644)
    os.replace(handle.name, path)
    return path


def remove_older_bundles(dest: Path, kept: Path) -> list[Path]:
    """Delete the bundles this tool wrote into `dest` before `kept`; returns them.

    Only regular files named as ``zip_name`` names them go: one bundle left means ``dist/*.zip``
    is one argument, and an outdated ZIP cannot be uploaded by mistake.
    """
    removed = []
    for path in sorted(dest.iterdir()):
        if path != kept and ZIP_NAME_PATTERN.fullmatch(path.name) and path.is_file() and not path.is_symlink():
            path.unlink()
            removed.append(path)
    return removed


# ----------------------------------------------------------------------------- command line


def main(argv: list[str]) -> int:
    """`python -m tools package`: 0 when the ZIP was written (or would be, with --dry-run), 1 when refused."""
    parser = argparse.ArgumentParser(
        prog="python -m tools package",
        description="Write the RunFab upload ZIP of this project (allow-listed files only) after checking it for "
        "secrets, weights, unsafe paths and RunFab's size limits.",
    )
    parser.add_argument("--output", type=Path,
                        help="folder for the ZIP (default: ROOT/dist); earlier runfab-trainer-*.zip there are removed")
    parser.add_argument("--dry-run", action="store_true", help="list the files and sizes on stdout, write nothing")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="project to pack (default: the project this tool belongs to)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.output is not None and (args.output.suffix == ".zip" or args.output.is_file()):
        print(f"package: --output names the folder the ZIP goes into (its name carries the version), not a file: "
              f"{args.output}", file=sys.stderr)
        return 2
    if not root.is_dir():
        print(f"package: --root {args.root} is not a folder; pass the project root", file=sys.stderr)
        return 2

    if git_files(root) is None:
        print(f"package: note: {root} is not a git checkout (or git is unavailable): selecting from every file "
              "in the tree", file=sys.stderr)
    for rel in untracked_matches(root):
        print(f"package: note: {show(rel)} is not tracked by git, so it is left out; `git add` it to pack it",
              file=sys.stderr)
    files = shipped_files(root)
    try:
        if args.dry_run:
            data = checked_zip(root, files)
        else:
            path = write_zip(root, files, args.output or root / "dist")
            data = path.read_bytes()
    except BundleRefused as refusal:
        for problem in refusal.problems:
            print(f"package: refused: {problem}", file=sys.stderr)
        print(f"package: nothing written ({len(refusal.problems)} problem(s) above)", file=sys.stderr)
        return 1

    expanded = sum((root / rel).stat().st_size for rel in files)
    summary = (f"{len(files)} files, {expanded:,} bytes expanded (limit {mib(LIMITS.expanded_bytes)}), "
               f"{len(data):,} bytes compressed (limit {mib(LIMITS.zip_bytes)})")
    if args.dry_run:
        for rel in files:
            print(f"{(root / rel).stat().st_size:>12,}  {rel}", file=sys.stdout)
        print(f"{expanded:>12,}  total: {summary}", file=sys.stdout)
        print("package: dry run, nothing written", file=sys.stderr)
    else:
        print(f"package: wrote {path}: {summary}, sha256 {hashlib.sha256(data).hexdigest()}", file=sys.stderr)
        for older in remove_older_bundles(path.parent, path):
            print(f"package: removed the older bundle {older}", file=sys.stderr)
    return 0
