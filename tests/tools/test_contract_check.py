"""``python -m tools check``: the real project passes, and every check fails on a bundle built to break it.

Apart from one run on this project, the bundles are tiny synthetic trainers written with the
standard library only, so a whole check takes well under a second. Each broken bundle differs
from the passing one in exactly the way its test names, and the test asserts that the intended
check fails for the intended reason (and, where it matters, that the others still pass).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from pathlib import Path

import pytest

from tools.bundle import check as contract_check
from tools.bundle.check import Options
from tools.bundle.static_checks import FAIL, PASS, SKIP, Result

from tests.helpers import ROOT

GOOD_PROBE = "return sum(i * i for i in range(microbatch * 1000))"


def write_bundle(folder: Path, *, header: str = "", batch_line: str = "EFFECTIVE_BATCH_SIZE = 32",
                 probe_params: str = "microbatch", probe_body: str = GOOD_PROBE,
                 train_params: str | None = "microbatch, accumulation", footer: str = "") -> Path:
    """A trainer that keeps the contract unless a keyword says otherwise.

    ``header`` runs at import time, ``probe_body`` inside probe_batch; ``train_params=None`` leaves
    train() out.
    """
    folder.mkdir(parents=True)
    parts = [
        '"""A stand-in trainer for the contract checker\'s tests."""',
        "import os\nimport subprocess\nimport sys\nimport time",
        textwrap.dedent(header),
        batch_line,
        f"def probe_batch({probe_params}):\n" + textwrap.indent(textwrap.dedent(probe_body).strip(), "    "),
    ]
    if train_params is not None:
        parts.append(f"def train({train_params}):\n    raise RuntimeError('the checker never trains')")
    parts.append(textwrap.dedent(footer))
    (folder / "train.py").write_text("\n\n".join(parts) + "\n")
    (folder / "model.py").write_text("WIDTH = 8\n")
    return folder


def check(bundle: Path, **options) -> dict[str, Result]:
    options.setdefault("gpus", 1)  # so the parent never imports torch to count GPUs
    results = contract_check.check_bundle(bundle, Options(**options), out=io.StringIO())
    assert [r.key for r in results] == ["layout", "archive", "batch", "hooks", "import", "probe"]
    return {r.key: r for r in results}


def assert_only_failure(results: dict[str, Result], key: str, *phrases: str) -> None:
    """``key`` fails naming every phrase; the checks it does not depend on pass."""
    failed = results[key]
    assert failed.verdict == FAIL, f"{key} should fail: {failed}"
    for phrase in phrases:
        assert phrase in failed.reason, f"{phrase!r} not in {failed.reason!r}"
    for other, result in results.items():
        if other != key:
            assert result.verdict == PASS, f"only {key} should fail, but {other}: {result.verdict} {result.reason}"


def is_running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def good(tmp_path) -> Path:
    return write_bundle(tmp_path / "good")


# ----------------------------------------------------------------------------- passing bundles


@pytest.mark.parametrize("config", ["conf/smoke.yaml", "conf/llama-smoke.yaml"])
def test_real_project_passes_with_the_smoke_config(config):
    """The command users run, through the tools' entry point, on this very project (each model family)."""
    env = {**os.environ, "RUNFAB_CONFIG": config}
    proc = subprocess.run([sys.executable, "-m", "tools", "check"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    for index, key in enumerate(("layout", "archive", "batch", "hooks", "import", "probe"), start=1):
        assert f"PASS  [{index}] {key}:" in proc.stdout, proc.stdout
    assert "FAIL" not in proc.stdout and "All 6 checks passed." in proc.stdout


@pytest.mark.parametrize("packed", [False, True], ids=["directory", "zip"])
def test_a_minimal_bundle_passes(tmp_path, good, packed):
    bundle = good
    if packed:
        bundle = tmp_path / "bundle.zip"
        with zipfile.ZipFile(bundle, "w") as archive:
            for path in good.iterdir():
                archive.write(path, path.name)
    results = check(bundle)
    assert all(r.verdict == PASS for r in results.values()), results
    assert "32" in results["batch"].reason
    assert "import" in results["probe"].reason and "s of the 120 s limit" in results["probe"].reason
    assert ("ZIP" in results["archive"].reason) is packed


def test_temporary_folders_are_removed_and_the_source_left_alone(tmp_path, good, monkeypatch):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    before = {p: p.stat().st_mode for p in good.iterdir()}
    check(good)
    assert list(scratch.iterdir()) == []
    assert {p: p.stat().st_mode for p in good.iterdir()} == before


def test_exit_status_and_summary(tmp_path, good, capsys):
    assert contract_check.main([str(good), "--gpus", "1"]) == 0
    assert "All 6 checks passed." in capsys.readouterr().out
    broken = write_bundle(tmp_path / "broken", batch_line="EFFECTIVE_BATCH_SIZE = 0")
    assert contract_check.main([str(broken), "--gpus", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  [3] batch:" in out and "5 of 6 checks passed; failed: batch." in out
    assert contract_check.main([str(tmp_path / "missing"), "--gpus", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_children_see_the_platform_environment(tmp_path, monkeypatch):
    """Hidden GPUs, the output root, HOME and TMPDIR in temporary folders, a read-only bundle of
    its own, an empty working directory, and RUNFAB_CONFIG passed through."""
    bundle = write_bundle(tmp_path / "env", probe_body="""
        import json, stat
        seen = {key: os.environ.get(key) for key in
                ("CUDA_VISIBLE_DEVICES", "RUNFABRIC_OUTPUT", "HOME", "TMPDIR", "RUNFAB_CONFIG", "PYTHONDONTWRITEBYTECODE")}
        seen["cwd"] = os.getcwd()
        seen["cwd_entries"] = os.listdir(".")
        seen["bundle"] = os.path.dirname(os.path.abspath(__file__))
        seen["bundle_writable"] = bool(os.stat(seen["bundle"]).st_mode & stat.S_IWUSR)
        raise RuntimeError("ENV " + json.dumps(seen))
    """)
    monkeypatch.setenv("RUNFAB_CONFIG", "conf/tiny.yaml")
    results = check(bundle)
    reason = results["probe"].reason
    seen = json.loads(reason[reason.index("ENV ") + 4:])
    assert seen["CUDA_VISIBLE_DEVICES"] == "" and seen["RUNFAB_CONFIG"] == "conf/tiny.yaml"
    assert seen["PYTHONDONTWRITEBYTECODE"] == "1" and seen["cwd_entries"] == [] and not seen["bundle_writable"]
    base = Path(seen["bundle"]).parent
    assert Path(seen["RUNFABRIC_OUTPUT"]).parent == base and Path(seen["HOME"]).parent == base
    assert Path(seen["TMPDIR"]).parent == base and Path(seen["cwd"]).parent == base
    assert not base.exists(), "the sandbox should be gone after the check"


# ----------------------------------------------------------------------------- 1. layout


def test_no_train_py_at_the_root(tmp_path, good):
    (good / "train.py").rename(good / "trainer.py")
    results = check(good)
    assert results["layout"].verdict == FAIL and "no train.py at the bundle root" in results["layout"].reason
    assert {results[k].verdict for k in ("batch", "hooks", "import", "probe")} == {SKIP}


def test_a_zip_of_the_folder_instead_of_its_contents(tmp_path, good):
    archive_path = tmp_path / "nested.zip"
    with zipfile.ZipFile(archive_path, "w") as archive:
        for path in good.iterdir():
            archive.write(path, f"good/{path.name}")
    results = check(archive_path)
    assert results["layout"].verdict == FAIL and "found good/train.py" in results["layout"].reason


# ----------------------------------------------------------------------------- 2. EFFECTIVE_BATCH_SIZE


@pytest.mark.parametrize("batch_line, gpus, phrase", [
    ("EFFECTIVE_BATCH_SIZE = 16 * 2", 1, "16 * 2 is computed"),
    ("EFFECTIVE_BATCH_SIZE = int('32')", 1, "is computed"),
    ("EFFECTIVE_BATCH_SIZE = 0", 1, "outside 1..65536"),
    ("EFFECTIVE_BATCH_SIZE = 70000", 1, "outside 1..65536"),
    ("EFFECTIVE_BATCH_SIZE = 32.0", 1, "is a float"),
    ("EFFECTIVE_BATCH_SIZE = 32", 3, "not divisible by 3 GPU(s)"),
    ("EFFECTIVE_BATCH_SIZE: int = 32", 1, "write a plain module-level"),
    ("EFFECTIVE_BATCH_SIZE = 32\nEFFECTIVE_BATCH_SIZE = 64", 1, "bound more than once"),
    ("BATCH = 32", 1, "no module-level `EFFECTIVE_BATCH_SIZE = <integer>`"),
], ids=["computed", "call", "zero", "too-large", "float", "gpus-3", "annotated", "twice", "missing"])
def test_effective_batch_size_must_be_a_literal_in_range(tmp_path, batch_line, gpus, phrase):
    results = check(write_bundle(tmp_path / "b", batch_line=batch_line), gpus=gpus)
    assert results["batch"].verdict == FAIL and phrase in results["batch"].reason, results["batch"]


def test_a_batch_rebound_at_import_time_is_caught_after_import(tmp_path):
    bundle = write_bundle(tmp_path / "b", footer="globals()['EFFECTIVE_BATCH_SIZE'] = 64\n")
    assert_only_failure(check(bundle), "batch", "after import train.EFFECTIVE_BATCH_SIZE is 64")


# ----------------------------------------------------------------------------- 3. hooks


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(probe_params="batch_size"), "probe_batch(batch_size) at line"),
    (dict(probe_params="microbatch, device"), "expected probe_batch(microbatch)"),
    (dict(train_params="micro_batch, accumulation"), "expected train(microbatch, accumulation)"),
    (dict(train_params="microbatch, accumulation, **kwargs"), "train(microbatch, accumulation, **kwargs)"),
    (dict(train_params=None), "no module-level `def train(microbatch, accumulation)`"),
], ids=["probe-renamed", "probe-extra", "train-renamed", "train-kwargs", "train-missing"])
def test_hooks_need_exactly_the_contract_parameters(tmp_path, kwargs, phrase):
    results = check(write_bundle(tmp_path / "h", **kwargs))
    assert results["hooks"].verdict == FAIL and phrase in results["hooks"].reason, results["hooks"]
    assert results["import"].verdict == PASS


def test_a_hook_replaced_at_import_time_is_caught_after_import(tmp_path):
    bundle = write_bundle(tmp_path / "h", footer="probe_batch = lambda size: None\n")
    assert_only_failure(check(bundle), "hooks", "after import train.probe_batch takes (size)")


# ----------------------------------------------------------------------------- 4. import


@pytest.mark.parametrize("header, phrases", [
    ("FIRST = sys.stdin.readline()", ["the import consumed stdin", "bytes were gone"]),
    ("print('loading the model...')", ["printed", "on stdout", "loading the model"]),
    ("open('cache.json', 'w').write('{}')", ["wrote files", "created cwd/cache.json"]),
    ("import tempfile\ntempfile.mkstemp(suffix='.lock')", ["wrote files", "created TMPDIR/"]),
    ("os.makedirs(os.path.expanduser('~/.cache/x'))\nopen(os.path.expanduser('~/.cache/x/y'), 'w').close()",
     ["created HOME/.cache/x/y"]),
    ("raise RuntimeError('no GPU found')", ["importing train.py raised RuntimeError: no GPU found"]),
    ("HELPER = subprocess.Popen(['sleep', '30'])", ["the import left processes running", "sleep 30"]),
], ids=["reads-stdin", "prints", "writes-cwd", "writes-tmpdir", "writes-home", "raises", "spawns"])
def test_import_must_be_side_effect_free(tmp_path, header, phrases):
    results = check(write_bundle(tmp_path / "i", header=header))
    result = results["import"]
    assert result.verdict == FAIL, result
    for phrase in phrases:
        assert phrase in result.reason, result.reason
    assert results["layout"].verdict == results["batch"].verdict == PASS
    # What the import did is not blamed on the probe, which runs after its own import.
    assert results["probe"].verdict == (SKIP if header.startswith("raise") else PASS), results["probe"]


def test_import_writing_into_the_bundle_is_caught(tmp_path):
    """As root the read-only copy still accepts the write (found by snapshot); otherwise the write raises."""
    bundle = write_bundle(tmp_path / "i", header="open(os.path.join(os.path.dirname(__file__), 'x.txt'), 'w').close()")
    reason = check(bundle)["import"].reason
    assert "created bundle/x.txt" in reason or "PermissionError" in reason, reason


def test_import_over_the_time_limit(tmp_path):
    results = check(write_bundle(tmp_path / "i", header="time.sleep(1.5)"), import_limit=1)
    assert_only_failure(results, "import", "over the 1 s limit", "import took 1.")


def test_empty_folders_from_an_import_are_noted_not_failed(tmp_path):
    """What torch's own import does (an empty TMPDIR/torchinductor_<user>) must not fail a bundle."""
    results = check(write_bundle(tmp_path / "i", header="os.makedirs(os.path.join(os.environ['TMPDIR'], 'torchinductor_me'))"))
    assert results["import"].verdict == PASS
    assert any("TMPDIR/torchinductor_me" in note for note in results["import"].notes)


# ----------------------------------------------------------------------------- 5. probe


@pytest.mark.parametrize("body, phrases", [
    ("return sys.stdin.read(10)", ["probe_batch(1) consumed stdin"]),
    ("print('{\"step\": 1, \"loss\": 2.5}', flush=True)", ["printed", "no metrics", '"loss": 2.5']),
    ("os.makedirs(os.environ['RUNFABRIC_OUTPUT'] + '/checkpoints')\n"
     "open(os.environ['RUNFABRIC_OUTPUT'] + '/checkpoints/probe.ckpt', 'wb').close()",
     ["wrote files", "created output/checkpoints/probe.ckpt"]),
    ("open('probe.log', 'w').write('fit')", ["created cwd/probe.log"]),
    ("raise MemoryError('CUDA out of memory (pretend)')", ["probe_batch(1) raised MemoryError"]),
], ids=["reads-stdin", "prints-metric", "writes-checkpoint", "writes-cwd", "raises"])
def test_probe_must_leave_no_trace(tmp_path, body, phrases):
    assert_only_failure(check(write_bundle(tmp_path / "p", probe_body=body)), "probe", *phrases)


def test_probe_leaving_a_child_process(tmp_path):
    bundle = write_bundle(tmp_path / "p", probe_body="subprocess.Popen(['sleep', '30'])")
    results = check(bundle)
    assert_only_failure(results, "probe", "probe_batch(1) left processes running", "sleep 30")
    pid = int(results["probe"].reason.split("running: ")[1].split()[0])
    assert not is_running(pid), "the checker must kill what the probe left behind"


def test_probe_over_the_time_limit(tmp_path):
    results = check(write_bundle(tmp_path / "p", probe_body="time.sleep(20)"), probe_limit=3)
    assert_only_failure(results, "probe", "did not finish within the 3 s limit", "killed")


def test_probe_microbatch_is_passed_and_must_divide_the_batch(tmp_path):
    bundle = write_bundle(tmp_path / "p", probe_body="assert microbatch == 8, microbatch")
    assert check(bundle, microbatch=8)["probe"].verdict == PASS
    assert "AssertionError: 1" in check(bundle)["probe"].reason
    skipped = check(bundle, microbatch=5)["probe"]
    assert skipped.verdict == SKIP and "--microbatch 5 is not a split RunFab would try" in skipped.reason


def test_probe_stdin_use_is_blamed_on_the_import_when_the_import_reads_it(tmp_path):
    results = check(write_bundle(tmp_path / "p", header="DATA = sys.stdin.read()"))
    assert results["import"].verdict == FAIL and results["probe"].verdict == PASS
    assert any("the import already consumes it" in note for note in results["probe"].notes)


def test_cuda_without_a_visible_gpu_is_a_usage_error(good, monkeypatch, capsys):
    """--cuda on a machine without a GPU would pass a CPU run off as the GPU check asked for: refused, as emulate does."""
    monkeypatch.setattr(contract_check, "visible_gpus", lambda: 0)
    assert contract_check.main(["--cuda", str(good)]) == 2
    captured = capsys.readouterr()
    assert "no CUDA GPU is visible" in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_a_killed_check_takes_its_probe_child_with_it(tmp_path):
    """The children run in sessions of their own, out of reach of whoever kills the tool: the parent-death
    signal takes them down with it rather than leaving them under PID 1."""
    pid_file = tmp_path / "probe.pid"
    bundle = write_bundle(tmp_path / "slow", probe_body=f"""
        open({str(pid_file)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
    """)
    sandboxes = tmp_path / "tmp"  # a killed check cannot remove its sandbox: it goes with tmp_path
    sandboxes.mkdir()
    tool = subprocess.Popen([sys.executable, "-m", "tools", "check", "--gpus", "1", str(bundle)], cwd=ROOT,
                            env={**os.environ, "TMPDIR": str(sandboxes)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not pid_file.is_file() or not pid_file.read_text():
            assert tool.poll() is None and time.monotonic() < deadline, "the probe never started"
            time.sleep(0.1)
        child = int(pid_file.read_text())
        tool.kill()
        tool.wait()
        deadline = time.monotonic() + 5
        while is_running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        survived = is_running(child)
        if survived:
            os.kill(child, signal.SIGKILL)
        assert not survived, "the probe outlived the killed check"
    finally:
        tool.kill()
        tool.wait()
