"""config.py: a YAML file (RUNFAB_CONFIG, --config) is held to every key's choices, as the command line is."""

from __future__ import annotations

import pytest

from config import ConfigError, load_config
from tests.helpers import as_yaml


@pytest.mark.parametrize("key, value, says", [
    ("data.source", "web", "data.source must be one of auto, stdin, sample, litdata, not 'web'"),
    ("optim.schedule", "linear", "optim.schedule must be one of cosine, constant, wsd, not 'linear'"),
    ("trainer.accelerator", "tpu", "trainer.accelerator must be one of auto, cpu, gpu, not 'tpu'"),
    ("trainer.worker_start", "spawn", "trainer.worker_start must be one of auto, fork, exec, not 'spawn'"),
    ("trainer.precision", "fp8", "trainer.precision must be one of 32-true, bf16-mixed, bf16-true, 16-mixed, 16-true, "
                                 "64-true (or null), not 'fp8'"),
    ("log_level", "loud", "log_level must be one of debug, info, warning, not 'loud'"),
    ("observe.loggers", ["csv", "mlflow"], "observe.loggers must list only csv, tensorboard, wandb, not 'mlflow'"),
])
def test_a_bad_choice_in_a_yaml_file_is_refused_naming_the_key_and_the_choices(tmp_path, key, value, says):
    config = tmp_path / "config.yaml"
    config.write_text(as_yaml({key: value}))
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    assert str(refused.value) == f"invalid configuration: {says}"


def test_every_bad_choice_is_reported_once_beside_the_other_problems(tmp_path):
    """Every bad choice is a line of the one refusal, with the problems the types do not say."""
    config = tmp_path / "config.yaml"
    config.write_text(as_yaml({"compute.attention": "bogus", "data.source": "web", "data.microbatch": 0}))
    with pytest.raises(ConfigError) as refused:
        load_config(config)
    lines = str(refused.value).splitlines()[1:]
    assert sorted(line.strip() for line in lines) == [
        "compute.attention must be one of auto, fa4, varlen, sdpa, not 'bogus'",
        "data.microbatch must be at least 1, not 0",
        "data.source must be one of auto, stdin, sample, litdata, not 'web'",
    ]


def test_a_null_is_a_choice_only_where_the_key_may_be_null(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(as_yaml({"trainer.precision": None}))
    assert load_config(config).trainer.precision is None
    config.write_text(as_yaml({"trainer.precision": None, "data.source": None}))
    with pytest.raises(ConfigError, match="data.source") as refused:
        load_config(config)
    assert "trainer.precision" not in str(refused.value)


@pytest.mark.parametrize("llama, gpt2", [("conf/llama-150m.yaml", "conf/config.yaml"),
                                         ("conf/llama-smoke.yaml", "conf/smoke.yaml")])
def test_a_llama_preset_is_its_gpt2_preset_but_for_the_model(llama, gpt2):
    """A comparison of the two families changes the model alone: data, optimizer and trainer stay the GPT-2 preset's."""
    from dataclasses import asdict

    ours, theirs = asdict(load_config(llama)), asdict(load_config(gpt2))
    assert ours["model"]["family"] == "llama" and theirs["model"]["family"] == "gpt2"
    assert {k: v for k, v in ours.items() if k != "model"} == {k: v for k, v in theirs.items() if k != "model"}
    shape = ("vocab_size", "n_layer", "n_head", "n_embd", "max_seq_len")
    assert [ours["model"][k] for k in shape] == [theirs["model"][k] for k in shape]


@pytest.mark.parametrize("fast, llama", [("conf/fast-150m.yaml", "conf/llama-150m.yaml"),
                                         ("conf/fast-smoke.yaml", "conf/llama-smoke.yaml")])
def test_a_fast_preset_is_its_llama_preset_but_for_the_optimizer_schedule_and_the_measured_model_keys(fast, llama):
    """What the fast recipe changes is the optim section and three model keys that each measured faster to the
    lab's loss, so its gain is theirs alone."""
    from dataclasses import asdict

    ours, theirs = asdict(load_config(fast)), asdict(load_config(llama))
    assert ours["optim"]["name"] == "muon" and ours["optim"]["schedule"] == "wsd"
    changed = {"tie_embeddings": False, "qk_norm": True, "zero_init_proj": True}
    assert {k: ours["model"][k] for k in changed} == changed
    assert {k: v for k, v in ours["model"].items() if k not in changed} == {
        k: v for k, v in theirs["model"].items() if k not in changed}
    assert {k: v for k, v in ours.items() if k not in ("optim", "model")} == {
        k: v for k, v in theirs.items() if k not in ("optim", "model")}


def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path, monkeypatch):
    """A folder or a FIFO (RUNFAB_CONFIG may name one) is not reported as missing, and a FIFO is never opened."""
    import os

    from config import CONFIG_ENV

    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path, says in ((tmp_path, "is a folder"), (fifo, "is not a regular file"),
                       (tmp_path / "absent.yaml", "was not found")):
        with pytest.raises(ConfigError, match=f"config file {path} {says}: expected a YAML file"):
            load_config(path)
    monkeypatch.setenv(CONFIG_ENV, str(fifo))
    with pytest.raises(ConfigError, match="is not a regular file"):
        load_config()


def numeric_keys(section: type, prefix: str = "") -> list[str]:
    """The dotted key of every field of ``section`` (and the sections under it) typed int or float (or null)."""
    import typing
    from dataclasses import fields, is_dataclass

    hints = typing.get_type_hints(section)
    found = []
    for item in fields(section):
        hint = hints[item.name]
        if is_dataclass(hint):
            found += numeric_keys(hint, f"{prefix}{item.name}.")
        elif {int, float} & {hint, *typing.get_args(hint)}:
            found.append(f"{prefix}{item.name}")
    return found


def test_every_numeric_key_has_a_range_that_help_shows():
    import cli
    from config import KEY_RANGES, RunConfig, range_text

    keys = numeric_keys(RunConfig)
    assert "model.n_layer" in keys and "trainer.limit_val_batches" in keys and "log_level" not in keys
    assert sorted(keys) == sorted(KEY_RANGES), "give every int or float key a range in config.KEY_RANGES, no other"
    helps = " ".join(cli.subcommand_parser("fit").format_help().split())
    shown = [key for key in keys if f"(range: {range_text(key)})" in helps.split(f"--{key} ", 1)[-1].split(" --")[0]]
    assert shown == keys, f"--help does not show the range of {sorted(set(keys) - set(shown))}"


@pytest.mark.parametrize("key, value, says", [
    # whole numbers that size something: the output estimate built 10**30 layers (a hang), or tracebacks later
    ("model.n_layer", 10**30, "model.n_layer must be a whole number in 1..1024, not 10000000000"),
    ("model.vocab_size", 10**30, "model.vocab_size must be a whole number in 1..16777216"),
    ("model.max_seq_len", 10**30, "model.max_seq_len must be a whole number in 2..1048576"),
    ("model.n_embd", 12 * 10**29, "model.n_embd must be a whole number in 1..65536"),
    # counts: limit_val_batches ended in a traceback, prefetch_updates read the whole stream into memory
    ("trainer.limit_val_batches", 10**30, "trainer.limit_val_batches must be a whole number in 1..1000000000"),
    ("data.prefetch_updates", 1000, "data.prefetch_updates must be a whole number in 1..64, not 1000"),
    # seconds: the run ended at its first input pause with OverflowError
    ("data.input_idle_seconds", 1e30, "data.input_idle_seconds must be a number in 0..86400, not 1e+30"),
    ("metrics.interval_seconds", 1e30, "metrics.interval_seconds must be a number in 0..86400, not 1e+30"),
    # other numbers
    ("optim.weight_decay", 1e30, "optim.weight_decay must be a number in 0..10, not 1e+30"),
    ("trainer.memory_headroom_gib", 1e30, "trainer.memory_headroom_gib must be a number in 0..1e+06, not 1e+30"),
])
def test_a_value_beyond_its_keys_range_is_refused_at_once_from_a_file_and_the_command_line(tmp_path, key, value, says):
    import cli

    config = tmp_path / "config.yaml"
    config.write_text(as_yaml({key: value}))
    for load in (lambda: load_config(config), lambda: load_config(None, cli.parse([f"--{key}", str(value)]).overrides)):
        with pytest.raises(ConfigError) as refused:
            load()
        assert str(refused.value).startswith(f"invalid configuration: {says}") and "\n" not in str(refused.value)


@pytest.mark.parametrize("key, value", [("data.token_digests", False), ("compute.residual_in_fp32", True)])
def test_a_key_the_schema_no_longer_has_is_refused_as_any_unknown_key(tmp_path, key, value):
    """A preset or a command line that still names a removed key gets the unknown-key error, never a silent pass."""
    import cli

    section, name = key.split(".")
    config = tmp_path / "config.yaml"
    config.write_text(as_yaml({key: value}))
    with pytest.raises(ConfigError, match=f"Key '{name}' not in '{section.capitalize()}Config'"):
        load_config(config)
    with pytest.raises(cli.CommandLineError, match=f"^unrecognized arguments: --{key} {value}"):
        cli.parse([f"--{key}", str(value)])
