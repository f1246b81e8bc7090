"""`python -m tools`: the one way to run a tool. It names its commands, refuses anything else in one
line, and a terminated tool unwinds."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import cli
from tools import dispatch
from tools.__main__ import COMMANDS, main as tools

from tests.helpers import ROOT


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command_on_stdout(flag):
    result = subprocess.run([sys.executable, "-m", "tools", flag], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_describes_itself(name, capsys):
    """Each tool is reached through the entry point, under the name the entry point gives it."""
    try:
        code = tools([name, "--help"])
    except SystemExit as exit_status:
        code = exit_status.code
    assert code == 0
    assert f"python -m tools {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_train_py_points_every_tool_to_the_entry_point(name):
    """`train.py NAME` for a tool names `python -m tools NAME`, and every tool is known to train.py."""
    with pytest.raises(cli.CommandLineError, match=f"python -m tools {name}`"):
        cli.parse([name])
    assert set(cli.TOOLS) == set(COMMANDS)


@pytest.mark.parametrize("argv, found", [([], "got none"), (["bogus"], "got 'bogus'"), (["bench", "bogus"], "got 'bogus'")])
def test_a_missing_or_unknown_command_is_one_line_and_exit_2(argv, found):
    result = subprocess.run([sys.executable, "-m", "tools", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert found in result.stderr and "--help" in result.stderr and result.stderr.count("\n") == 1


@pytest.mark.parametrize("argv, says", [
    (["package", "--output", "bundle.zip"], "--output names the folder the ZIP goes into"),  # not a folder bundle.zip
    (["report", "{out}", "--out", "{out}"], "Is a directory"),  # an OSError about a path: one line, not a traceback
])
def test_a_path_the_tool_cannot_use_is_one_line_and_exit_2(tmp_path, argv, says):
    out = tmp_path / "output"
    (out / "run").mkdir(parents=True)
    (out / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0, "tokens_per_second": 1.0}\n')
    argv = [a.format(out=out) for a in argv]
    result = subprocess.run([sys.executable, "-m", "tools", *argv], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and says in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert not (tmp_path / "bundle.zip").exists()


def test_a_terminated_tool_unwinds_and_removes_what_it_started(tmp_path, monkeypatch, capsys):
    """SIGTERM (a timeout, a scheduler) cleans up as Ctrl-C does: a sandbox in /tmp is removed."""
    import signal
    import types

    from tools import __main__ as entry

    sandbox = tmp_path / "sandbox"

    def main(argv):
        sandbox.mkdir()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            return 0
        finally:
            sandbox.rmdir()

    monkeypatch.setitem(sys.modules, "fake_tool", types.SimpleNamespace(main=main))
    monkeypatch.setitem(entry.COMMANDS, "fake", ("fake_tool", "a command that is terminated"))
    previous = signal.getsignal(signal.SIGTERM)
    assert entry.main(["fake"]) == 130
    assert signal.getsignal(signal.SIGTERM) == previous  # the tool's handler is gone with it
    assert not sandbox.exists() and "interrupted" in capsys.readouterr().err


def test_a_missing_tool_dependency_is_one_line_naming_the_install(monkeypatch, capsys):
    """`compare` on a machine set up by the README's first command only (no matplotlib): one line, exit 2."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails as when not installed
    monkeypatch.delitem(sys.modules, "tools.compare", raising=False)
    assert tools(["compare", "runs/a", "runs/b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'matplotlib'" in err[0] and "requirements-dev.txt" in err[0], err


def test_a_missing_project_module_is_not_taken_for_an_installation(monkeypatch):
    """A tool whose own module is missing is a bug: the import error propagates."""
    with pytest.raises(ModuleNotFoundError):
        dispatch("prog", {"x": ("tools.no_such_tool", "")}, ["x"])
