"""`python -m tools`: the entry point names its commands and refuses anything else in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tools.__main__ import COMMANDS

from tests.helpers import ROOT


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_lists_every_command_on_stdout(flag):
    result = subprocess.run([sys.executable, "-m", "tools", flag], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)


@pytest.mark.parametrize("argv, found", [([], "got none"), (["bogus"], "got 'bogus'")])
def test_a_missing_or_unknown_command_is_one_line_and_exit_2(argv, found):
    result = subprocess.run([sys.executable, "-m", "tools", *argv], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert found in result.stderr and "--help" in result.stderr and result.stderr.count("\n") == 1
