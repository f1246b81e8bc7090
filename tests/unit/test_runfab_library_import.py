"""Importing Lightning in a hook's process leaves nothing behind, even when a signal stops the import.

A stand-in ``lightning`` writes what the real import writes (matplotlib's font cache into MPLCONFIGDIR,
the compiler's empty default folder TMPDIR/torchinductor_<user>, named in TORCHINDUCTOR_CACHE_DIR), so
that the tests run in a fraction of a second; tests/integration/test_train_e2e.py checks the real probe
and run the same way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT

STAND_IN = textwrap.dedent("""
    import os, pathlib, signal, sys, tempfile, time
    cache = os.path.join(tempfile.gettempdir(), "torchinductor_someone")
    os.makedirs(cache, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    pathlib.Path(os.environ["MPLCONFIGDIR"], "fontlist-v390.json").write_text("{}")
    if os.environ.get("STOP_WITH"):
        os.kill(os.getpid(), getattr(signal, os.environ["STOP_WITH"]))
        time.sleep(30)
""")

CHECK = textwrap.dedent("""
    import os, sys
    from runfab.library_import import import_lightning
    import_lightning()
    assert "lightning" in sys.modules
    print(sorted(name for name in ("MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR") if name in os.environ))
""")


def import_in_child(tmp_path, stop_with: str | None = None) -> subprocess.CompletedProcess:
    stand_in, temp = tmp_path / "stand_in", tmp_path / "temp"
    stand_in.mkdir()
    temp.mkdir(exist_ok=True)
    (stand_in / "lightning.py").write_text(STAND_IN)
    env = {**os.environ, "TMPDIR": str(temp), "PYTHONPATH": os.pathsep.join([str(stand_in), str(ROOT)])}
    for name in ("MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR", "STOP_WITH"):
        env.pop(name, None)
    if stop_with:
        env["STOP_WITH"] = stop_with
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=60)


def test_the_import_leaves_no_folder_and_the_environment_as_it_was(tmp_path):
    done = import_in_child(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert os.listdir(tmp_path / "temp") == []


def test_a_folder_that_was_there_before_stays(tmp_path):
    (tmp_path / "temp").mkdir()
    (tmp_path / "temp" / "torchinductor_someone").mkdir()  # another process's cache
    done = import_in_child(tmp_path)
    assert done.returncode == 0, done.stderr
    assert os.listdir(tmp_path / "temp") == ["torchinductor_someone"]


@pytest.mark.parametrize("stop_with, status", [("SIGTERM", -signal.SIGTERM), ("SIGINT", -signal.SIGINT)])
def test_a_signal_during_the_import_ends_the_process_as_before_and_leaves_nothing(tmp_path, stop_with, status):
    done = import_in_child(tmp_path, stop_with)
    assert done.returncode == status, done.stderr  # the default end, or KeyboardInterrupt uncaught
    assert os.listdir(tmp_path / "temp") == []
