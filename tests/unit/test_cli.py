"""The local command line (cli.py): subcommands, typed overrides, --help and --print_config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import cli
from config import ConfigError, RunConfig, bundle_path, key_hints, load_config

from tests.helpers import ROOT, TINY, as_args

KEYS = list(key_hints())


def run_train_py(*args: str, cwd: Path, output: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RUNFABRIC_OUTPUT": str(output)}
    env.pop("RUNFAB_CONFIG", None)
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=120)


def test_help_alone_lists_the_subcommands_with_one_line_each(tmp_path):
    proc = run_train_py("--help", cwd=tmp_path, output=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    lines = [" ".join(line.split()) for line in proc.stdout.splitlines()]
    for name in cli.SUBCOMMANDS:
        assert any(line.startswith(f"{name} ") for line in lines), f"{name} is not listed: {proc.stdout}"
    assert "--model.n_layer" not in proc.stdout, "the top-level help shows a subcommand's keys"


def test_fit_help_lists_every_key_with_type_default_and_help(tmp_path):
    proc = run_train_py("fit", "--help", cwd=tmp_path, output=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # undo the help formatter's line wrapping
    assert "--model.n_layer N_LAYER Transformer blocks (range: 1..1024) (type: int, default: 12)" in text
    assert ("--trainer.max_steps MAX_STEPS Optimizer updates; -1: until the input ends (range: -1..1000000000) "
            "(type: int, default: 2000)" in text)
    assert "--compute.attention {auto,fa4,varlen,sdpa}" in text
    assert "--observe.loggers" in text and "(type: list[Literal['csv', 'tensorboard', 'wandb']], default: [])" in text
    assert "--print_config" in text
    assert len(KEYS) > 60 and "seed" in KEYS and "output.budget_bytes" in KEYS
    missing = [key for key in KEYS if f"--{key} " not in text and key != cli.PASSED_TO_LIGHTNING]
    assert not missing, f"not in --help: {missing}"
    assert "--trainer.log_every_n_steps LOG_EVERY_N_STEPS" in text  # a Trainer argument the config passes through
    assert "--trainer.accumulate_grad_batches " not in text  # refused: RunFab's batch split owns it


def fit_help(*args: str, tmp_path: Path) -> dict[str, str]:
    """``fit --help`` as {option: its help text on one line}."""
    proc = run_train_py("fit", *args, "--help", cwd=tmp_path, output=tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    helps, option = {}, None
    for line in proc.stdout.splitlines():
        words = line.split()
        if line.startswith("  --"):
            option = words[0]
            helps[option] = " ".join(words[1:])
        elif line.startswith("   ") and option:
            helps[option] += " " + " ".join(words)
        else:
            option = None
    return helps


def test_every_config_key_has_its_docstring_as_help(tmp_path):
    helps = fit_help(tmp_path=tmp_path)
    undocumented = [key for key in KEYS if key != cli.PASSED_TO_LIGHTNING
                    and helps[f"--{key}"].split("(type:")[0].strip(" " + key.split(".")[-1].upper()) == ""]
    assert not undocumented, f"write a docstring line under these fields saying what they mean: {undocumented}"
    assert helps["--trainer.max_steps"].startswith("MAX_STEPS Optimizer updates; -1: until the input ends (range: ")
    assert "  " not in helps["--compute.attention"]  # a docstring over several lines is one paragraph


def test_help_after_a_config_file_shows_that_files_values(tmp_path):
    smoke = load_config("conf/smoke.yaml")
    assert smoke.model.n_layer != RunConfig().model.n_layer
    helps = fit_help("--config", "conf/smoke.yaml", tmp_path=tmp_path)
    assert f"default: {smoke.model.n_layer})" in helps["--model.n_layer"], helps["--model.n_layer"]
    assert f"default: {RunConfig().model.n_layer})" in fit_help(tmp_path=tmp_path)["--model.n_layer"]


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
    assert plain.name == "fit" and bundle_path(plain.config_path) == ROOT / "conf/smoke.yaml" and plain.overrides == []
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
    (["--trainer.accumulate_grad_batches", "4"], "RunFab chooses the accumulation"),
    (["--trainer.val_check_interval=100"], "trainer.val_every_steps"),
    (["--config", "conf/smoke.yaml", "--config=conf/config.yaml"], "--config is given 2 times"),
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


@pytest.mark.parametrize("override, says", [
    ("model.n_layer=0", "model.n_layer must be at least 1, not 0"),
    ("model.n_head=0", "model.n_head must be at least 1"),  # was a ZeroDivisionError in the divisibility check
    ("model.max_seq_len=0", "model.max_seq_len must be at least 2"),
    ("model.max_seq_len=1", "model.max_seq_len must be at least 2"),  # no target token: ZeroDivisionError in training
    ("trainer.devices=0", "trainer.devices must be at least 1"),
    ("trainer.val_every_steps=-5", "trainer.val_every_steps must be >= 0"),
    ("trainer.precision=garbage", "trainer.precision must be one of 32-true"),
    ("trainer.accelerator=tpu", "trainer.accelerator must be one of auto, cpu, gpu"),
    ("trainer.gradient_clip_val=-1", "trainer.gradient_clip_val must be >= 0"),
    ("data.source=file", "data.source must be one of auto, stdin, sample"),
    ("optim.lr=-1", "optim.lr must be > 0"),
    ("optim.warmup_steps=-2", "optim.warmup_steps must be >= 0"),
    ("data.microbatch=0", "data.microbatch must be at least 1"),
    ("model.n_embd=30", "with the command line's overrides"),  # a command-line value is not the file's fault
    ("trainer.max_steps=-1", "trainer.max_steps is -1 (until the input ends), so the cosine schedule has no horizon"),
    ("optim.decay_steps=0", "optim.decay_steps must be >= 1"),
    # NaN and infinities slipped through the range checks: the run diverged, never learned or never reported
    ("optim.lr=inf", "optim.lr must be a finite number, not inf"),
    ("optim.eps=inf", "optim.eps must be a finite number"),  # every update is zero
    ("optim.weight_decay=inf", "optim.weight_decay must be a finite number"),
    ("trainer.gradient_clip_val=inf", "trainer.gradient_clip_val must be a finite number"),
    ("model.layer_norm_eps=nan", "model.layer_norm_eps must be a finite number"),
    ("model.init_std=inf", "model.init_std must be a finite number"),
    ("metrics.interval_seconds=nan", "metrics.interval_seconds must be a finite number"),
    ("metrics.interval_seconds=inf", "metrics.interval_seconds must be a finite number"),
    ("metrics.peak_flops=nan", "metrics.peak_flops must be a finite number"),
    ("trainer.memory_headroom_gib=nan", "trainer.memory_headroom_gib must be a finite number"),
    ("trainer.host_memory_budget_gib=nan", "trainer.host_memory_budget_gib must be a finite number"),
    ("trainer.ddp_bucket_cap_mb=inf", "trainer.ddp_bucket_cap_mb must be a finite number"),
    # Lightning's seed_everything raised for a seed numpy does not take
    ("seed=-1", "seed must be a whole number in 0..4294967295"),
    ("seed=4294967296", "seed must be a whole number in 0..4294967295"),
    ("trainer.max_time=00:00:-1:90", "none negative"),
    ("trainer.max_time=00:00:00:99999999999999999999", "must each be below"),  # was an OverflowError
    ("trainer.max_time=00:01:00:00 trainer.export_reserve_seconds=99999999999999999", "must each be below"),
    ("metrics.peak_flops=-1", "metrics.peak_flops must be >= 0"),  # a negative mfu
    ("output.budget_bytes=0", "output.budget_bytes must be at least 1"),
    ("observe.memory_history_entries=0", "observe.memory_history_entries must be at least 1"),
])
def test_a_value_no_run_can_use_is_refused_when_the_config_loads(override, says):
    from config import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_config("conf/smoke.yaml", override.split())
    assert says in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("option", [["--model.max_seq_len", "1"], ["--seed", "-1"]])
def test_a_value_no_run_can_use_is_one_line_and_exit_2_on_the_command_line(tmp_path, option):
    proc = run_train_py("--config", "conf/smoke.yaml", "--data.source", "sample", *option, cwd=tmp_path,
                        output=tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and option[0].removeprefix("--") in errors[0], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_a_config_file_that_is_not_a_mapping_is_refused(tmp_path):
    from config import ConfigError

    path = tmp_path / "list.yaml"
    path.write_text("- model\n- data\n")
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(path)


@pytest.mark.parametrize("microbatch, accumulation", [(0, None), (None, 0), (-3, None)])
def test_a_command_line_split_below_one_row_is_refused_not_replaced(microbatch, accumulation):
    from runtime.batch_split import BatchSplit
    from config import ConfigError

    with pytest.raises(ConfigError, match="must be at least 1|must equal EFFECTIVE_BATCH_SIZE"):
        BatchSplit.for_command_line(32, 1, 8, microbatch, accumulation)


def test_a_probe_given_a_split_that_does_not_make_the_batch_is_refused_not_half_used(monkeypatch, capsys):
    monkeypatch.setattr(cli, "run_probe", lambda *args: pytest.fail("the probe ran with --accumulation ignored"))
    assert cli.main(["probe", "--config", "conf/smoke.yaml", "--trainer.devices", "1", "--microbatch", "8",
                     "--accumulation", "3"], 32) == 2
    assert "microbatch (8) x accumulation (3) x devices (1) must equal EFFECTIVE_BATCH_SIZE (32)" in capsys.readouterr().err


def test_a_relative_config_is_found_in_the_current_folder_first(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("model:\n  n_layer: 3\n")
    monkeypatch.chdir(tmp_path)
    assert cli.parse(["--config", "mine.yaml"]).config_path == str(tmp_path / "mine.yaml")
    assert cli.parse(["--config", "conf/smoke.yaml"]).config_path == "conf/smoke.yaml"  # the bundle's, from anywhere
    assert load_config(cli.parse(["--config", "mine.yaml"]).config_path).model.n_layer == 3


def test_a_microbatch_that_does_not_divide_the_batch_names_those_that_do():
    from runtime.batch_split import BatchSplit
    from config import ConfigError

    with pytest.raises(ConfigError, match=r"microbatch 5 x 2 device\(s\) does not divide .* use one of 1, 2, 4, 8, 16$"):
        BatchSplit.for_command_line(32, 2, 8, 5, None)
    assert BatchSplit.for_command_line(32, 2, 8, 4, None).accumulation == 4
    # only --accumulation given: the message is about it, not about a microbatch the user never typed
    with pytest.raises(ConfigError, match=r"^accumulation 3 x 1 device\(s\) does not divide .* use one of 1, 2, 4, 8, 16, 32$"):
        BatchSplit.for_command_line(32, 1, 8, None, 3)
    assert BatchSplit.for_command_line(32, 1, 8, None, 4).microbatch == 8


def test_an_empty_output_variable_means_the_default_folder_not_the_current_one(monkeypatch):
    monkeypatch.setenv("RUNFABRIC_OUTPUT", "")  # `RUNFABRIC_OUTPUT= python train.py` wrote model/ into the cwd
    assert load_config("conf/smoke.yaml").output.root == "output"
    monkeypatch.setenv("RUNFABRIC_OUTPUT", "/somewhere")
    assert load_config("conf/smoke.yaml").output.root == "/somewhere"


def test_a_worker_typed_by_a_person_is_one_readable_error(monkeypatch, capsys):
    from runtime import launcher
    from runtime import worker

    monkeypatch.delenv(launcher.WORKER_SPEC_ENV, raising=False)
    assert worker.run_worker() == 2  # was a KeyError traceback
    assert "a data-parallel rank that train.py starts itself" in capsys.readouterr().err


@pytest.mark.parametrize("key, value, choices", [
    ("compute.attention", "flash", "auto, fa4, varlen, sdpa"),
    ("compute.loss", "fused", "auto, quack, triton"),
    ("trainer.accelerator", "tpu", "auto, cpu, gpu"),
    ("trainer.precision", "16", "32-true, bf16-mixed, bf16-true, 16-mixed, 16-true, 64-true"),
    ("trainer.worker_start", "spawn", "auto, fork, exec"),
    ("data.source", "file", "auto, stdin, sample, litdata"),
    ("optim.schedule", "linear", "cosine, constant, wsd"),
    ("observe.loggers", "[csv,mlflow]", "csv, tensorboard, wandb"),
])
def test_a_choice_key_refuses_a_value_outside_its_choices_and_names_them(key, value, choices, capsys):
    with pytest.raises(cli.CommandLineError) as caught:
        cli.parse([f"--{key}", value])
    message = str(caught.value)
    assert key in message and value.strip("[]").split(",")[-1] in message and "\n" not in message, message
    assert all(choice in message for choice in choices.split(", ")), message
    assert "typing" not in message and "<class" not in message, message
    assert cli.main(["probe", f"--{key}", value], 32) == 2
    assert capsys.readouterr().err == f"error: {caught.value}\n"


@pytest.mark.parametrize("argv", [["--trainer.precision", "bf16"], ["--trainer.precision=bf16"]])
def test_a_bad_choice_on_the_command_line_lists_the_choices_not_the_type(argv):
    with pytest.raises(cli.CommandLineError) as caught:
        cli.parse(argv)
    assert str(caught.value) == ("--trainer.precision must be one of 32-true, bf16-mixed, bf16-true, 16-mixed, "
                                 "16-true, 64-true (or null), not 'bf16'")


@pytest.mark.parametrize("argv, says", [
    (["--model.n_layer", "1e30"], "--model.n_layer must be a whole number in 1..1024, not '1e30'"),
    (["--trainer.limit_val_batches=1e30"], "--trainer.limit_val_batches must be a whole number in 1..1000000000 (or "
                                          "null), not '1e30'"),
    (["--optim.lr", "fast"], "--optim.lr must be a number in 0..10, not 'fast'"),
])
def test_a_number_of_the_wrong_kind_on_the_command_line_gets_the_keys_range_not_the_type(argv, says):
    with pytest.raises(cli.CommandLineError) as caught:
        cli.parse(argv)
    assert str(caught.value) == says


def test_a_list_key_given_one_bare_value_is_told_it_needs_a_list_not_that_the_value_is_no_choice():
    with pytest.raises(cli.CommandLineError) as caught:
        cli.parse(["--observe.loggers", "csv"])
    assert "list" in str(caught.value) and "must be one of" not in str(caught.value)
    assert cli.parse(["--observe.loggers", "[csv]"]).overrides == [("observe.loggers", ["csv"])]


@pytest.mark.parametrize("typed, meant", [("--model.n_layr", "--model.n_layer"), ("--trainer.max_stps", "--trainer.max_steps"),
                                          ("--optim.lrr", "--optim.lr")])
def test_a_misspelled_key_is_refused_with_the_keys_spelled_closest(typed, meant):
    with pytest.raises(cli.CommandLineError) as caught:
        cli.parse([typed, "3"])
    message = str(caught.value)
    assert message.startswith(f"unrecognized arguments: {typed} 3; did you mean {meant}"), message


def test_other_trainer_arguments_pass_through_from_the_command_line_and_from_yaml(tmp_path):
    command = cli.parse(["--trainer.log_every_n_steps", "7", "--trainer.deterministic", "warn",
                         "--trainer.max_steps=30"])
    cfg = load_config("conf/smoke.yaml", command.overrides)
    assert cfg.trainer.lightning == {"log_every_n_steps": 7, "deterministic": "warn"} and cfg.trainer.max_steps == 30
    path = tmp_path / "mine.yaml"
    path.write_text("trainer:\n  num_sanity_val_steps: 1\n  lightning:\n    detect_anomaly: true\n")
    cfg = load_config(path, ["trainer.log_every_n_steps=5"])
    assert cfg.trainer.lightning == {"detect_anomaly": True, "num_sanity_val_steps": 1, "log_every_n_steps": 5}
    from config import as_dict, load_config_dict

    assert load_config_dict(as_dict(cfg)) == cfg  # a data-parallel worker gets them too


def test_a_passed_through_trainer_argument_reaches_the_trainer_that_fits(tmp_path, capsys):
    """enable_model_summary: the run turns Lightning's table off; passed through, the probe's fit prints it."""
    base = ["probe", "--config", "conf/smoke.yaml", "--microbatch", "2", f"--output.root={tmp_path}", *as_args(TINY)]
    assert cli.main(base, 32) == 0
    assert "Total params" not in capsys.readouterr().err
    assert cli.main([*base, "--trainer.enable_model_summary", "true"], 32) == 0
    assert "Total params" in capsys.readouterr().err


def test_a_trainer_argument_the_run_sets_itself_is_refused_with_the_reason(tmp_path, capsys):
    assert cli.main(["--config", "conf/smoke.yaml", "--trainer.strategy", "ddp"], 32) == 2
    assert capsys.readouterr().err == ("error: trainer.strategy is not passed to Lightning's Trainer: the run joins "
                                       "its own data-parallel processes with DDP (trainer.devices, "
                                       "trainer.ddp_bucket_cap_mb)\n")
    path = tmp_path / "mine.yaml"
    for yaml_text, says in [
        ("trainer:\n  accumulate_grad_batches: 2\n", "trainer.accumulate_grad_batches is not passed to Lightning's "
                                                     "Trainer: RunFab chooses the accumulation"),
        ("trainer:\n  lightning:\n    callbacks: []\n", "trainer.callbacks is not passed to Lightning's Trainer"),
        ("trainer:\n  lightning:\n    max_steps: 5\n", "trainer.max_steps is a key of the config, set it there"),
        ("trainer:\n  lightning:\n    no_such_argument: 1\n", "not an argument of lightning.Trainer"),
    ]:
        path.write_text(yaml_text)
        with pytest.raises(ConfigError) as caught:
            load_config(path)
        assert says in str(caught.value) and "\n" not in str(caught.value)


def test_a_value_lightning_refuses_is_a_config_error_naming_the_argument():
    from runtime.trainer import build_trainer

    cfg = load_config("conf/smoke.yaml", ["trainer.profiler=no_such_profiler"])
    refused = r"^Lightning's Trainer refused its arguments \(trainer.profiler='no_such_profiler'\): "
    with pytest.raises(ConfigError, match=refused):
        build_trainer(cfg, "cpu", 1)


def test_trainer_keys_named_as_lightning_names_them_reach_the_trainer():
    from runtime.trainer import build_trainer

    cfg = load_config("conf/smoke.yaml", ["trainer.gradient_clip_val=0.25", "trainer.limit_val_batches=3"])
    trainer = build_trainer(cfg, "cpu", 1)
    assert trainer.gradient_clip_val == 0.25
    assert load_config("conf/config.yaml").trainer.gradient_clip_val == 1.0
    with pytest.raises(ConfigError, match="Key 'grad_clip' not in 'OptimConfig'"):
        load_config("conf/smoke.yaml", ["optim.grad_clip=1.0"])


def test_help_after_a_config_file_leaves_the_shared_parser_at_the_schema_defaults():
    assert load_config("conf/smoke.yaml").model.n_layer != RunConfig().model.n_layer
    cli.build_parser("conf/smoke.yaml")  # what `--config conf/smoke.yaml --help` builds
    assert cli.subcommand_parser("fit", cli.SUBCOMMANDS["fit"]).get_defaults()["model.n_layer"] == RunConfig().model.n_layer


SECTION_FILE_VALUES = {"model": ("n_layer", 3), "compute": ("loss_chunk_tokens", 4096), "data": ("microbatch", 3),
                       "optim": ("lr", 0.01), "trainer": ("max_steps", 700), "metrics": ("interval_seconds", 7.0),
                       "observe": ("warmup_updates", 3), "output": ("budget_bytes", 12345)}


def test_every_section_file_that_fit_help_offers_sets_its_keys(tmp_path):
    """`--SECTION FILE` (a YAML file of that section's keys) is an option of every section; a dotted override
    given after it wins."""
    sections = [name for name in cli.fit_sections()]
    assert sorted(sections) == sorted(SECTION_FILE_VALUES), "give the new section a value here"
    help_text = cli.subcommand_parser("fit").format_help()
    for section, (key, value) in SECTION_FILE_VALUES.items():
        assert f"--{section} FILE" in help_text
        path = tmp_path / f"{section}.yaml"
        path.write_text(yaml.safe_dump({key: value}))
        command = cli.parse(["fit", f"--{section}", str(path)])
        assert getattr(getattr(load_config(None, command.overrides), section), key) == value, section
        command = cli.parse(["fit", f"--{section}", str(path), f"--{section}.{key}", str(value * 2)])
        assert getattr(getattr(load_config(None, command.overrides), section), key) == value * 2, section
    path = tmp_path / "trainer.yaml"  # the trainer: part of a config, Lightning's arguments included
    path.write_text("max_steps: 900\nlog_every_n_steps: 3\nlightning:\n  detect_anomaly: true\n")
    cfg = load_config(None, cli.parse(["fit", "--trainer", str(path)]).overrides)
    assert cfg.trainer.max_steps == 900 and cfg.trainer.lightning == {"detect_anomaly": True, "log_every_n_steps": 3}


def test_the_fast_dev_run_refusal_gives_advice_that_is_accepted():
    with pytest.raises(cli.CommandLineError) as caught:
        cli.parse(["--trainer.fast_dev_run", "true"])
    advice = str(caught.value).split("set ", 1)[1].split()
    assert advice[0].startswith("--"), caught.value
    assert load_config(None, cli.parse(advice).overrides).trainer.max_steps == 1
