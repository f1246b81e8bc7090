"""The local command line (cli.py): subcommands, typed overrides, --help and --print_config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import cli
from config import RunConfig, load_config

from tests.helpers import ROOT

# DataConfig's fields without a comment; datamodule.py is being split, they get one there.
PENDING_HELP: set[str] = set()  # keys whose field has no help comment yet


def run_train_py(*args: str, cwd: Path, output: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNFABRIC_OUTPUT": str(output)}
    env.pop("RUNFAB_CONFIG", None)
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120)


def test_help_lists_every_key_with_type_default_and_help(tmp_path):
    proc = run_train_py("--help", cwd=tmp_path, output=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # undo the help formatter's line wrapping
    assert "--model.n_layer N_LAYER transformer blocks (type: int, default: 12)" in text
    assert "--observe.loggers" in text and "(type: list[str], default: [])" in text
    assert "--print_config" in text and "probe" in text
    keys = [key for key, *_ in cli.config_keys(RunConfig)]
    assert len(keys) > 60 and "seed" in keys and "output.budget_bytes" in keys
    missing = [key for key in keys if f"--{key} " not in text]
    assert not missing, f"not in --help: {missing}"


def test_every_key_has_a_line_of_help_from_its_field_comment():
    helps = {key: text for key, _, _, text in cli.config_keys(RunConfig)}
    assert helps["trainer.max_time"] == '"DD:HH:MM:SS": the whole training job, export included'
    assert helps["model.attention"].startswith('"auto": FlashAttention 4')  # the comment block above the field
    assert helps["output.root"] == "RunFab's output root; ./output when unset"
    undocumented = {key for key, text in helps.items() if not text}
    assert undocumented == PENDING_HELP


def test_print_config_shows_the_merged_configuration_and_does_not_train(tmp_path):
    output = tmp_path / "out"
    proc = run_train_py("--config", "conf/smoke.yaml", "--model.n_layer=3", "--observe.loggers", "[csv]",
                        "--print_config", cwd=tmp_path, output=output)
    assert proc.returncode == 0, proc.stderr
    printed = yaml.safe_load(proc.stdout)
    assert printed["model"]["n_layer"] == 3 and printed["observe"]["loggers"] == ["csv"]
    smoke = load_config("conf/smoke.yaml")
    assert printed["model"]["n_embd"] == smoke.model.n_embd, "the YAML file's values were replaced by defaults"
    assert printed["optim"]["decay_steps"] == smoke.trainer.max_steps  # resolved, not ${trainer.max_steps}
    assert printed["output"]["root"] == str(output)
    assert not output.exists() and list(tmp_path.iterdir()) == []


def test_fit_is_the_default_subcommand_and_only_given_keys_override():
    plain = cli.parse(["--config", "conf/smoke.yaml"])
    assert plain.name == "fit" and plain.config_path == "conf/smoke.yaml" and plain.overrides == []
    assert cli.parse(["fit", "--config", "conf/smoke.yaml"]) == plain
    assert not plain.print_config and plain.microbatch is None


def test_overrides_reach_load_config_typed():
    command = cli.parse(["probe", "--microbatch", "8", "--trainer.max_steps", "-1", "--optim.decay_steps=50",
                         "--observe.loggers", "[csv,tensorboard]", "--trainer.max_time", "00:01:00:00",
                         "--trainer.devices", "null", "--trainer.compile", "false"])
    assert command.name == "probe" and command.microbatch == 8
    cfg = load_config("conf/smoke.yaml", command.overrides)
    assert cfg.trainer.max_steps == -1 and cfg.optim.decay_steps == 50
    assert cfg.observe.loggers == ["csv", "tensorboard"] and cfg.trainer.max_time == "00:01:00:00"
    assert cfg.trainer.devices is None and cfg.trainer.compile is False


@pytest.mark.parametrize("argv, named", [
    (["--model.n_layer", "abc"], "model.n_layer"),
    (["--trainer.max_steps"], "--trainer.max_steps"),
    (["stray"], "stray"),
    (["--model.no_such_key", "1"], "--model.no_such_key"),
    (["package", "--dry-run"], "python -m tools package"),
])
def test_bad_input_is_one_readable_error(argv, named):
    with pytest.raises(cli.CommandLineError) as caught:
        cli.parse(argv)
    assert named in str(caught.value) and "\n" not in str(caught.value)


def test_runfab_path_never_imports_jsonargparse():
    code = ("import sys, train\nfrom config import load_config\nload_config('conf/smoke.yaml')\n"
            "assert 'jsonargparse' not in sys.modules and 'cli' not in sys.modules, 'imported on the hook path'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
