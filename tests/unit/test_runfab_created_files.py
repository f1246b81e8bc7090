"""Files the trainer and its tools create are never written through a link planted where they go:
the link is refused in one line and left in place, and what it points to stays as it was."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from config import ConfigError
from runfab import created_files
from runtime.output_folder import LOCK_NAME, claimed_output

from tests.helpers import ROOT, as_args, records, tiny


@pytest.fixture
def precious(tmp_path):
    path = tmp_path / "precious.txt"
    path.write_text("mine\n")
    return path


def test_a_planted_lock_link_is_refused_and_neither_followed_nor_removed(tmp_path, precious):
    root = tmp_path / "out"
    root.mkdir()
    (root / LOCK_NAME).symlink_to(precious)
    with pytest.raises(ConfigError) as error:
        with claimed_output(root):
            pass
    message = str(error.value)
    assert f"{root / LOCK_NAME} is a symbolic link (to {precious})" in message and "\n" not in message
    assert precious.read_text() == "mine\n"
    assert (root / LOCK_NAME).is_symlink() and os.readlink(root / LOCK_NAME) == str(precious)


def test_a_dangling_lock_link_does_not_create_its_target(tmp_path):
    root = tmp_path / "out"
    root.mkdir()
    target = tmp_path / "nowhere.txt"
    (root / LOCK_NAME).symlink_to(target)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        with claimed_output(root):
            pass
    assert not target.exists() and (root / LOCK_NAME).is_symlink()


def test_the_lock_of_a_run_is_its_own_file_and_is_removed_at_the_end(tmp_path):
    root = tmp_path / "out"
    with claimed_output(root):
        assert (root / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    assert not os.path.lexists(root / LOCK_NAME)


def test_a_smoke_run_on_an_output_with_a_planted_lock_link_exits_2_in_one_line(tmp_path, precious):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).symlink_to(precious)
    env = dict(os.environ, RUNFABRIC_OUTPUT=str(out), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), "--config", "conf/smoke.yaml",
                           *as_args(tiny({"trainer.max_steps": 2, "optim.schedule": "constant"}))], input=records(50), env=env,
                          capture_output=True, timeout=180, cwd=tmp_path)
    stderr = done.stderr.decode()
    assert done.returncode == 2, stderr
    assert stderr.strip().splitlines()[-1].startswith(f"error: the output root's lock file {out / LOCK_NAME} is a "
                                                      "symbolic link")
    assert "Traceback" not in stderr and done.stdout == b""
    assert precious.read_text() == "mine\n" and (out / LOCK_NAME).is_symlink()


@pytest.mark.parametrize("mode", ["w", "a", "x", "a+", "wb"])
def test_no_mode_writes_through_a_link(tmp_path, precious, mode):
    link = tmp_path / "link"
    link.symlink_to(precious)
    with pytest.raises(created_files.NotCreatedHere, match="is a symbolic link"):
        created_files.open_created(link, mode)
    assert precious.read_text() == "mine\n" and link.is_symlink()


def test_a_hard_link_and_a_fifo_are_refused_and_left_as_they_were(tmp_path, precious):
    (tmp_path / "hard").hardlink_to(precious)
    with pytest.raises(created_files.NotCreatedHere, match="other hard link"):
        created_files.write_text(tmp_path / "hard", "overwritten")
    assert precious.read_text() == "mine\n"
    os.mkfifo(tmp_path / "fifo")  # without the check, opening it would block until someone reads it
    with pytest.raises(created_files.NotCreatedHere, match="not a regular file"):
        created_files.write_text(tmp_path / "fifo", "x")


def test_a_file_is_created_replaced_and_appended_to(tmp_path):
    path = tmp_path / "new.txt"
    created_files.write_text(path, "first, longer\n")
    created_files.write_text(path, "second\n")
    with created_files.open_created(path, "a") as file:
        file.write("third\n")
    assert path.read_text() == "second\nthird\n"
    with pytest.raises(FileExistsError):
        created_files.open_created(path, "x")


def test_the_run_folder_mark_and_a_tools_page_refuse_a_planted_link(tmp_path, precious):
    from callbacks import owned_folders

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / owned_folders.MARK).symlink_to(precious)
    with pytest.raises(created_files.NotCreatedHere):
        owned_folders.mark(tmp_path / "run")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "tokens_per_second": 1.0}\n')
    page = tmp_path / "page.html"
    page.symlink_to(precious)
    done = subprocess.run([sys.executable, "-m", "tools", "report", str(tmp_path), "--out", str(page)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (f"python -m tools report: {page} is a symbolic link (to {precious}); "
                                                    "nothing is written through it and it was left as it is: move it "
                                                    "away, or write somewhere else")
    assert precious.read_text() == "mine\n" and page.is_symlink()
