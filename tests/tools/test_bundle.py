"""`python -m tools package`: what goes into the upload ZIP, what is refused, and reproducibility.

Most cases build a small project in a temporary folder (outside git, so the tree is walked) that
breaks exactly one rule, and check that packaging is refused with a message naming the file and the
rule, and that no ZIP is written. A baseline case shows the same tree without the fault is accepted,
so each refusal is caused by its rule. Fake secrets are assembled at run time so this file never
contains one that a scanner (ours or a code host's) would flag.
"""

from __future__ import annotations

import ast
import os
import random
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from runfab import shipping
from tools.bundle import package as bundle

from tests.helpers import ROOT

MIB = 1024 * 1024


# ----------------------------------------------------------------------------- helpers


def write(root: Path, rel: str | bytes, content: str | bytes = "x = 1\n") -> Path:
    path = Path(os.fsdecode(os.path.join(os.fsencode(root), os.fsencode(rel))))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def sparse(root: Path, rel: str, size: int) -> None:
    """A file of `size` bytes that costs no disk or time: the size rules only look at the length."""
    path = write(root, rel, b"")
    with open(path, "r+b") as handle:
        handle.truncate(size)


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A minimal valid project: one file per allow-listed area."""
    root = tmp_path / "project"
    write(root, "train.py", "EFFECTIVE_BATCH_SIZE = 32\n")
    write(root, "model.py")
    write(root, "callbacks/__init__.py", "")
    write(root, "callbacks/metrics.py")
    write(root, "conf/config.yaml", "seed: 1\n")
    write(root, "conf/tokenizer.json", "{}\n")
    write(root, "data/sample.jsonl", '{"text": "hello"}\n')
    write(root, "requirements.txt", "torch>=2.5\n")
    return root


def pack(root: Path, out: Path, capsys, *extra: str) -> tuple[int, str, str]:
    code = bundle.main(["--root", str(root), "--output", str(out), *extra])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def only_zip(out: Path) -> Path:
    zips = list(out.glob("*.zip"))
    assert len(zips) == 1, zips
    return zips[0]


def assert_refused(root: Path, tmp_path: Path, capsys, *expected: str) -> str:
    """Packaging `root` fails, writes nothing, and stderr holds every expected fragment (file, rule)."""
    out = tmp_path / "dist"
    code, stdout, stderr = pack(root, out, capsys)
    assert code == 1, stderr
    assert not out.exists() or not any(out.iterdir()), list(out.iterdir())
    assert stdout == ""
    for fragment in expected:
        assert fragment in stderr, f"{fragment!r} not in:\n{stderr}"
    return stderr


# ----------------------------------------------------------------------------- the real project


def test_real_project_packs_what_training_needs(tmp_path, capsys):
    code, stdout, stderr = pack(ROOT, tmp_path, capsys)
    assert code == 0, stderr
    assert stdout == ""
    with zipfile.ZipFile(only_zip(tmp_path)) as archive:
        assert archive.testzip() is None
        names = archive.namelist()
        infos = archive.infolist()
    assert {"train.py", "conf/config.yaml", "conf/tokenizer.json", "data/sample.jsonl"} <= set(names)
    assert {"conf/gpt2/tokenizer.json", "conf/gpt2/SOURCE.json"} <= set(names)  # the reference config's tokenizer
    assert names == sorted(names)
    assert not [n for n in names if n.startswith(("tests/", "tools/", "docs/", ".")) or "__pycache__" in n]
    assert (ROOT / "tools/bundle/package.py").is_file() and (ROOT / "tools/bundle/check.py").is_file()  # beside it
    assert not [n for n in names if n.endswith((".pyc", ".safetensors", ".pt", ".ckpt"))]
    for info in infos:
        assert info.date_time == (1980, 1, 1, 0, 0, 0)
        assert info.external_attr >> 16 == 0o100644
        assert info.compress_type == zipfile.ZIP_DEFLATED
        assert info.extra == b""


def test_real_project_zip_is_byte_identical_across_runs(tmp_path, capsys):
    assert pack(ROOT, tmp_path / "a", capsys)[0] == 0
    assert pack(ROOT, tmp_path / "b", capsys)[0] == 0
    first, second = only_zip(tmp_path / "a"), only_zip(tmp_path / "b")
    assert first.name == second.name
    assert re.fullmatch(r"runfab-trainer-[0-9a-f]{12}\.zip", first.name)
    assert first.read_bytes() == second.read_bytes()


def test_a_new_bundle_replaces_the_earlier_ones_and_leaves_other_files(project, tmp_path, capsys):
    """`check dist/*.zip` takes one ZIP: packing changed files removes the bundles packed before, nothing else."""
    out = tmp_path / "dist"
    assert pack(project, out, capsys)[0] == 0
    first = only_zip(out)
    others = [write(out, "notes.zip", b"mine"), write(out, "runfab-trainer-latest.zip", b"mine"),
              write(out, "runfab-trainer-0123456789ab.zip.sha256", b"mine")]
    write(project, "model.py", "x = 2\n")
    code, _, stderr = pack(project, out, capsys)
    assert code == 0, stderr
    bundles = sorted(path for path in out.iterdir() if path not in others)
    assert len(bundles) == 1 and bundles[0] != first, bundles
    assert all(path.read_bytes() == b"mine" for path in others)
    assert f"package: removed the older bundle {first}" in stderr.splitlines()


def test_dry_run_lists_files_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "dist"
    code, stdout, stderr = pack(ROOT, out, capsys, "--dry-run")
    assert code == 0, stderr
    assert not out.exists()
    lines = stdout.splitlines()
    listed = [line.split()[-1] for line in lines[:-1]]
    assert "train.py" in listed and "conf/config.yaml" in listed
    assert listed == shipping.shipped_files(ROOT)
    assert not [rel for rel in listed if rel.startswith(("tools/", "tests/"))]
    assert all(re.fullmatch(r" *[\d,]+  \S+", line) for line in lines[:-1])
    assert "total:" in lines[-1]


def test_tools_entry_point_runs_package_and_keeps_stdout_to_the_listing(tmp_path):
    """Through the real entry point, in a fresh interpreter: only the listing reaches stdout."""
    result = subprocess.run(
        [sys.executable, "-m", "tools", "package", "--dry-run", "--output", str(tmp_path / "dist")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.endswith("  train.py") for line in lines)
    assert all(re.fullmatch(r" *[\d,]+  \S.*", line) for line in lines), result.stdout
    assert not (tmp_path / "dist").exists()


def test_train_py_points_a_tool_command_to_the_tools(tmp_path):
    """`train.py package` is not training's business: one line on stderr names the command to use."""
    result = subprocess.run([sys.executable, "train.py", "package", "--dry-run"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert "python -m tools package" in result.stderr and result.stderr.count("\n") == 1, result.stderr


def test_training_never_imports_a_tool_nor_what_only_the_tools_need():
    """The tools import training; the shipped modules never import the tools, which are not in the upload,
    nor the tools' own extra (matplotlib, psutil), which RunFab's image need not have."""
    for rel in shipping.shipped_files(ROOT):
        if rel.endswith(".py"):
            tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
            names = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
            names += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
            assert not [name for name in names if name.split(".")[0] in ("tools", "matplotlib", "psutil")], rel


def test_shipped_sources_do_not_flag_themselves():
    """The selection and the limits ship with training: their own patterns must not trip the scan."""
    assert bundle.find_secrets(ROOT, ["runfab/shipping.py", "runfab/limits.py", "tools/bundle/package.py"]) == []


# ----------------------------------------------------------------------------- selection


def test_minimal_project_is_accepted_and_packs_exactly_the_allow_list(project, tmp_path, capsys):
    # Things that must stay out, several of them inside allowed areas where only a never-rule stops them.
    write(project, "tests/test_model.py")
    write(project, "notebooks/benchmark.py")
    write(project, "tools/check.py")
    write(project, "tools/__init__.py", "")
    write(project, "docs/NOTES.md", "notes\n")
    write(project, "model.pt", b"\x80weights")  # root: outside the allow-list, left out rather than refused
    write(project, ".env", "WANDB_API_KEY=" + "0123456789abcdef" * 2 + "\n")  # likewise: never a candidate
    write(project, "conf/__pycache__/config.yaml")
    write(project, "conf/output/run.yaml")
    write(project, "conf/.venv/lib.yaml")
    write(project, "conf/env/pyvenv.cfg", "home = /usr/bin\n")  # a virtual environment under any name
    write(project, "conf/env/site.yaml")
    write(project, "conf/.DS_Store", b"\0")
    write(project, "callbacks/tests/test_metrics.py")
    write(project, "callbacks/__pycache__/metrics.cpython-311.pyc", b"\0")
    write(project, "data/big.jsonl", '{"text": "more"}\n')
    code, _, stderr = pack(project, tmp_path / "dist", capsys)
    assert code == 0, stderr
    with zipfile.ZipFile(only_zip(tmp_path / "dist")) as archive:
        assert archive.namelist() == [
            "callbacks/__init__.py", "callbacks/metrics.py", "conf/config.yaml", "conf/tokenizer.json",
            "data/sample.jsonl", "model.py", "requirements.txt", "train.py",
        ]


def test_symlink_inside_the_root_is_packed_as_its_content(project, tmp_path, capsys):
    (project / "conf/alias.yaml").symlink_to("config.yaml")
    code, _, stderr = pack(project, tmp_path / "dist", capsys)
    assert code == 0, stderr
    with zipfile.ZipFile(only_zip(tmp_path / "dist")) as archive:
        assert archive.read("conf/alias.yaml") == b"seed: 1\n"


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_checkout_packs_only_tracked_files_and_names_untracked_ones(project, tmp_path, capsys):
    # Tracked by mistake: git lists them, so only the never-rules keep them out.
    write(project, "conf/env/pyvenv.cfg", "home = /usr/bin\n")
    write(project, "conf/env/site.yaml")
    write(project, "conf/__pycache__/config.yaml")
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run(["git", "-C", str(project), "add", "."], check=True)
    write(project, "conf/local.yaml", "seed: 2\n")  # untracked: left out, but named
    write(project, "conf/scratch.tmp", "junk\n")
    (project / ".gitignore").write_text("conf/scratch.tmp\n")
    code, _, stderr = pack(project, tmp_path / "dist", capsys)
    assert code == 0, stderr
    with zipfile.ZipFile(only_zip(tmp_path / "dist")) as archive:
        names = archive.namelist()
    assert "conf/config.yaml" in names
    assert "conf/env/site.yaml" not in names and "conf/__pycache__/config.yaml" not in names
    assert "conf/local.yaml" not in names and "conf/scratch.tmp" not in names
    assert "conf/local.yaml is not tracked by git" in stderr
    assert "scratch.tmp" not in stderr  # ignored files are nobody's concern


def test_missing_train_py_is_refused(project, tmp_path, capsys):
    (project / "train.py").unlink()
    assert_refused(project, tmp_path, capsys, "train.py", "missing")


# ----------------------------------------------------------------------------- secrets


@pytest.mark.parametrize("rel", ["conf/.env", "conf/.env.production", "conf/id_rsa", "conf/tls.pem"])
def test_credential_file_is_refused(project, tmp_path, capsys, rel):
    write(project, rel, "nothing token-like\n")
    assert_refused(project, tmp_path, capsys, rel, "secret file")


def test_private_key_content_is_refused(project, tmp_path, capsys):
    marker = "-----" + "BEGIN OPENSSH " + "PRIVATE KEY" + "-----"
    write(project, "conf/deploy.txt", f"{marker}\nb3BlbnNzaC1rZXktdjEAAAAA\n")
    assert_refused(project, tmp_path, capsys, "conf/deploy.txt:1", "private key")


TOKENS = {
    "Hugging Face token": "hf_" + "a1B2c3D4" * 4,
    "OpenAI-style API key": "sk-" + "Zy9Xw8Vu" * 3,
    "AWS access key id": "AKIA" + "ABCDEFGHIJ234567",
    "GitHub token": "ghp_" + "q7R8s9T0" * 5,
}


@pytest.mark.parametrize("kind", sorted(TOKENS))
def test_token_in_python_source_is_refused_without_leaking_it(project, tmp_path, capsys, kind):
    token = TOKENS[kind]
    write(project, "model.py", f'"""The model."""\n\nTOKEN = "{token}"\n')
    stderr = assert_refused(project, tmp_path, capsys, "model.py:3", kind)
    assert token not in stderr


@pytest.mark.parametrize("line", [
    "WANDB_API_KEY=" + "0123456789abcdef" * 2 + "01234567",
    'os.environ["RUNPOD_API_KEY"] = "rpa_' + "K3y" * 8 + '"',
    "RUNPOD_API_KEY: " + "abcdefgh" * 3,
])
def test_credential_variable_with_a_value_is_refused(project, tmp_path, capsys, line):
    write(project, "conf/config.yaml", f"seed: 1\n# {line}\n")
    name = "WANDB_API_KEY" if "WANDB" in line else "RUNPOD_API_KEY"
    stderr = assert_refused(project, tmp_path, capsys, "conf/config.yaml:2", "credential variable", name)
    assert line.split(name)[1][-12:] not in stderr


def test_credential_variable_read_from_the_environment_is_accepted(project, tmp_path, capsys):
    write(project, "model.py", (
        'import os\nWANDB_API_KEY = os.environ.get("WANDB_API_KEY")\n'
        "RUNPOD_API_KEY = os.environ['RUNPOD_API_KEY']\n"
        "# export WANDB_API_KEY=${WANDB_API_KEY}\n"
    ))
    code, _, stderr = pack(project, tmp_path / "dist", capsys)
    assert code == 0, stderr


def test_symlink_to_a_secret_inside_the_root_is_refused(project, tmp_path, capsys):
    write(project, ".env", "nothing token-like\n")
    (project / "conf/settings.yaml").symlink_to("../.env")
    assert_refused(project, tmp_path, capsys, "conf/settings.yaml", "secret file", "'.env'")


# ----------------------------------------------------------------------------- weights and size


def test_weight_file_in_an_allowed_folder_is_refused(project, tmp_path, capsys):
    write(project, "conf/model.safetensors", b"\0" * 64)
    assert_refused(project, tmp_path, capsys, "conf/model.safetensors", "weight file")


def test_single_file_over_the_per_file_limit_is_refused(project, tmp_path, capsys):
    sparse(project, "data/sample.jsonl", bundle.LIMITS.file_bytes + 1)
    assert_refused(project, tmp_path, capsys, "data/sample.jsonl", "file too large")


def test_expanded_total_over_64_mib_is_refused(project, tmp_path, capsys):
    """Real limits: 17 files of exactly the per-file cap (4 MiB) expand to 68 MiB."""
    assert bundle.LIMITS.expanded_bytes == 64 * MIB
    for index in range(17):
        sparse(project, f"conf/shard-{index:02d}.yaml", bundle.LIMITS.file_bytes)
    assert_refused(project, tmp_path, capsys, "bundle too large", "64.0 MiB expanded limit", "conf/shard-00.yaml")


def test_compressed_size_over_the_limit_is_refused(project, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bundle, "LIMITS", bundle.Limits(zip_bytes=4096))
    write(project, "conf/noise.yaml", random.Random(0).randbytes(16384))  # incompressible
    assert_refused(project, tmp_path, capsys, "bundle too large", "compressed")


# ----------------------------------------------------------------------------- unsafe paths


def test_symlink_escaping_the_root_is_refused(project, tmp_path, capsys):
    write(tmp_path, "outside.yaml", "seed: 9\n")
    (project / "conf/escape.yaml").symlink_to(tmp_path / "outside.yaml")
    assert_refused(project, tmp_path, capsys, "conf/escape.yaml", "unsafe path", "outside the project root")


def test_symlinked_folder_escaping_the_root_is_refused(project, tmp_path, capsys):
    write(tmp_path, "elsewhere/secret.yaml", "seed: 9\n")
    (project / "conf/more").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    assert_refused(project, tmp_path, capsys, "conf/more", "unsafe path", "outside the project root")


@pytest.mark.parametrize("rel, rule", [
    (b"conf/\xffname.yaml", "not valid UTF-8"),
    ("conf/tab\there.yaml", "control character"),
    ("conf/back\\slash.yaml", "Windows"),
    ("conf/drive:stream.yaml", "Windows"),
])
def test_unsafe_file_name_is_refused(project, tmp_path, capsys, rel, rule):
    write(project, rel, "seed: 1\n")
    assert_refused(project, tmp_path, capsys, ascii(os.fsdecode(rel)), "unsafe path", rule)


def test_dot_dot_entry_is_refused(project, tmp_path, capsys, monkeypatch):
    """No file system holds a file named '..', but a listing can still yield one: it must not reach the ZIP."""
    write(tmp_path, "outside.yaml", "seed: 9\n")
    listed = shipping.candidates(project)
    monkeypatch.setattr(shipping, "candidates", lambda root: [*listed, "conf/../../outside.yaml"])
    assert_refused(project, tmp_path, capsys, "conf/../../outside.yaml", "unsafe path", "'..'")


@pytest.mark.parametrize("rel", ["/etc/passwd", "../train.py", "conf/../../x.yaml", "conf//x.yaml", "./train.py", ""])
def test_path_problem_names_each_unsafe_form(rel):
    assert bundle.path_problem(rel)


@pytest.mark.parametrize("rel", ["train.py", "conf/config.yaml", "callbacks/a/b.py", "conf/名前.yaml"])
def test_path_problem_accepts_ordinary_names(rel):
    assert bundle.path_problem(rel) is None


def test_symlink_loop_is_refused(project, tmp_path, capsys):
    (project / "conf/loop.yaml").symlink_to("loop.yaml")
    assert_refused(project, tmp_path, capsys, "conf/loop.yaml", "symlink loop")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_source_commit_names_the_commit_and_the_shipped_files_changed_since(project):
    """What the run record stores as "which implementation ran": the lab records the commit, and the
    hashes of what actually ran because experiments run with uncommitted changes too."""
    assert shipping.source_commit(project) is None  # an unpacked bundle: no checkout
    git = ["git", "-C", str(project), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(project)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    assert shipping.source_commit(project) == {"commit": head, "uncommitted_changes": []}
    write(project, "model.py", "x = 2\n")
    write(project, "notes.md", "not shipped\n")
    subprocess.run([*git, "add", "notes.md"], check=True)
    assert shipping.source_commit(project) == {"commit": head, "uncommitted_changes": ["model.py"]}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_source_commit_of_a_project_in_a_subfolder_of_the_checkout(project):
    """Changed files are named from the project's root, as the shipped files are, not from the checkout's."""
    checkout = project.parent
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "first"], check=True)
    write(project, "model.py", "x = 2\n")
    assert shipping.source_commit(project)["uncommitted_changes"] == ["model.py"]
