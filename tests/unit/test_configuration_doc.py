"""docs/configuration.md against `python train.py fit --help`: every key the page names is a key the help lists,
with the default the page states."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

PAGE = (ROOT / "docs" / "configuration.md").read_text()
SECTIONS = ("model", "compute", "data", "optim", "trainer", "metrics", "observe", "output")
NAMED = sorted(set(re.findall(rf"`((?:{'|'.join(SECTIONS)})\.[a-z0-9_]+)", PAGE)))
# a table row of the page: | `section.key` | `default` | meaning |
STATED_DEFAULTS = dict(re.findall(r"^\| `([a-z]+\.[a-z0-9_]+)` \| `([^`]+)` \|", PAGE, flags=re.MULTILINE))


@pytest.fixture(scope="module")
def help_text() -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "fit", "--help"], cwd=ROOT, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return " ".join(proc.stdout.split())  # undo the help formatter's line wrapping


def test_every_key_the_page_names_is_one_the_help_lists(help_text):
    assert len(NAMED) > 20
    unknown = [key for key in NAMED if f"--{key} " not in help_text
               and not key.startswith("trainer.lightning")]
    assert not unknown, f"docs/configuration.md names keys that --help does not list: {unknown}"


def test_every_default_the_page_states_is_the_helps(help_text):
    assert {"compute.attention", "compute.mlp", "compute.loss", "compute.loss_chunk_tokens"} <= set(STATED_DEFAULTS)
    for key, stated in STATED_DEFAULTS.items():
        shown = re.search(rf"--{re.escape(key)} .*?default: ([^)\s]+)\)", help_text)
        assert shown, f"--help shows no default for {key}"
        assert shown.group(1).lower() == stated.lower(), (key, stated, shown.group(1))
