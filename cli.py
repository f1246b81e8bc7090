"""The local command line: ``python train.py [fit|probe] [--config FILE] [--section.key VALUE ...]``.

Built on jsonargparse, the library under Lightning's own CLI, so it behaves the way people coming from
Lightning expect: subcommands, one typed ``--section.key`` option per configuration key, a ``--help``
that lists them all, and ``--print_config``. It only reads the command line, into typed values by dotted
key; ``config.load_config`` merges them over the YAML file, the path RunFab's hooks take too, so the
values are checked once, the same way, and the hooks never import jsonargparse (RunFab's image lacks it).

The help of a key is the docstring under its field in the dataclass that defines it, read by
jsonargparse (with docstring-parser), so a key's meaning is written once, beside its default. Any other
argument of lightning.Trainer is an option too, ``--trainer.NAME VALUE``, passed to the Trainer (config.py
keeps it under ``trainer.lightning``), except those the run sets itself, which are refused with the reason.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
import typing
from dataclasses import dataclass, fields, is_dataclass
from functools import cache
from pathlib import Path

import docstring_parser
import lightning as L
import yaml
from jsonargparse import ArgumentParser, set_parsing_settings

from runfab import created_files
from runtime import launcher
from runtime import training_run
from runtime.batch_split import BatchSplit, command_line_microbatch
from callbacks.export import ExportFailed
from callbacks.runfab_metrics import NonFiniteLossError
from config import (CONFIG_ENV, DEFAULT_CONFIG, KEY_RANGES, LIGHTNING_REFUSED, ConfigError, RunConfig, TrainerConfig, as_dict,
                    lightning_argument_problems, lightning_trainer_arguments, literal_choices, load_config, nullable,
                    range_text)
from runtime.device_policy import world_size
from runtime.probe import run_probe
from pipeline.shards import ShardsError
from pipeline.records import UnusableInputError

PROG = "train.py"
DEFAULT_SUBCOMMAND = "fit"
SUBCOMMANDS = {
    "fit": "train on NDJSON records from stdin (or the bundled sample), then export the model",
    "probe": "fit one worst-case microbatch with the real model and optimizer, as RunFab's memory probe does",
}
# The commands of `python -m tools`: named to train.py, they are pointed there (never imported here:
# tools/ does not ship). tests/tools/test_entry_point.py keeps the two lists equal.
TOOLS = ("package", "check", "emulate", "report", "compare", "evaluate", "sample", "bench", "tokenizer", "gpt2-tokenizer",
         "sample-data", "prepare")
HELP = ("-h", "--help")
PRINT_CONFIG = "--print_config"
SECTION_FILE_KEY = "__path__"  # jsonargparse's record of the file a section's keys came from (--model FILE)
PASSED_TO_LIGHTNING = "trainer.lightning"  # the config's field for them; on the command line each is --trainer.NAME


@dataclass
class Command:
    """What the command line asks for: a subcommand, the config file and the keys the user set."""

    name: str
    config_path: str | None
    overrides: list[tuple[str, object]]  # (dotted key, typed value), only for keys given on the command line
    microbatch: int | None
    accumulation: int | None
    print_config: bool
    ckpt_path: str | None = None  # resume a run from a checkpoint file, or "last" (the newest in output's checkpoints/)


class CommandLineError(Exception):
    """Bad command-line input; the message names the offending option or token."""


# What a command line run reports as one line on stderr, with exit code 2, instead of a traceback.
USER_ERRORS = (
    ConfigError, UnusableInputError, NonFiniteLossError, FileNotFoundError, launcher.WorkerFailed, launcher.Interrupted,
    launcher.InputFailed, ShardsError, ExportFailed, created_files.NotCreatedHere,
)


def main(argv: list[str], effective: int) -> int:
    """Parse, merge the configuration, then print it, probe or train; ``effective`` is train.EFFECTIVE_BATCH_SIZE."""
    try:
        command = parse(argv)
        cfg = load_config(command.config_path, command.overrides)
        if command.print_config:
            # The one stdout write that is no metric line: asked for explicitly, and nothing trains after it.
            print(config_yaml(cfg), end="", file=sys.stdout)
            return 0
        world = world_size(cfg)
        if command.name == "probe":  # any microbatch the probe accepts, not only those that divide the batch
            if command.microbatch is not None and command.accumulation is not None:  # both named: they must agree
                BatchSplit(command.microbatch, command.accumulation, world, effective)
            microbatch = command_line_microbatch(effective, world, cfg.data.microbatch, command.microbatch,
                                                 command.accumulation)
            run_probe(cfg, microbatch, effective)
            return 0
        if cfg.data.source == "litdata":  # Lightning's DDP over files: one process, one node or several
            from runtime import shard_run

            shard_run.train_from_shards(cfg, effective, command.microbatch, command.accumulation, command.ckpt_path)
            return 0
        if cfg.trainer.global_batch_size is not None:
            raise ConfigError(f"trainer.global_batch_size ({cfg.trainer.global_batch_size}) sets the batch of a run "
                              f"from prepared shards (--data.source litdata); on stdin the batch is "
                              f"EFFECTIVE_BATCH_SIZE ({effective}): leave it null")
        split = BatchSplit.for_command_line(effective, world, cfg.data.microbatch, command.microbatch,
                                           command.accumulation)
        training_run.run_training(cfg, split, ckpt_path=command.ckpt_path)
    except (CommandLineError, *USER_ERRORS) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def config_from_here(path: str | None) -> str | None:
    """--config names a file from the current folder when one is there, else one of the bundle's
    (so --config conf/smoke.yaml works from any folder)."""
    if path is not None and Path(path).expanduser().is_file():
        return str(Path(path).expanduser().resolve())
    return path


def parse(argv: list[str]) -> Command:
    """Parse ``argv`` (without the program name); ``fit`` when no subcommand is named.

    ``--help`` prints and raises SystemExit(0); bad input raises CommandLineError.
    """
    if argv[:1] and argv[0] in TOOLS:
        raise CommandLineError(f"{argv[0]} is a tool, not part of training: run `python -m tools {argv[0]}`")
    if not argv[:1] or argv[0] not in (*SUBCOMMANDS, *HELP):  # alone, --help describes the subcommands
        argv = [DEFAULT_SUBCOMMAND, *argv]
    # jsonargparse treats --print_config itself (it would print the command line's values, not the merged
    # configuration), so the flag is taken out before it parses; the option is declared only for --help.
    print_config = PRINT_CONFIG in argv
    argv = [token for token in argv if token != PRINT_CONFIG]
    configs = given_values(argv, "config")
    if len(configs) > 1:  # the parser would keep the last one silently
        raise CommandLineError(f"--config is given {len(configs)} times; give one file, and change single keys "
                               "with --section.key VALUE")
    refused = [token.split("=")[0].removeprefix("--trainer.") for token in argv if token.startswith("--trainer.")]
    refused = lightning_argument_problems({name: None for name in refused if name in LIGHTNING_REFUSED})
    if refused:  # the parser has no option for them and would only call them unrecognized
        raise CommandLineError(refused[0])
    parser = build_parser(configs[0] if configs and any(token in HELP for token in argv) else None)
    try:
        # defaults=False: only what the user typed, so the YAML file is never overridden by a schema default
        namespace = parser.parse_args(argv, defaults=False)
    except Exception as error:  # jsonargparse's ArgumentError, raised because exit_on_error is off
        raise CommandLineError(readable(error, argv)) from None
    name = namespace.subcommand
    given = flatten(namespace[name].as_dict() if namespace[name] is not None else {})
    options = {key: given.pop(key, None) for key in ("config", "microbatch", "accumulation", "ckpt_path")}
    return Command(
        name=name,
        config_path=config_from_here(options["config"]),
        overrides=list(given.items()),
        microbatch=options["microbatch"],
        accumulation=options["accumulation"],
        print_config=print_config,
        ckpt_path=options["ckpt_path"],
    )


def readable(error: Exception, argv: list[str]) -> str:
    """jsonargparse's message on one line; for an option no key has, the keys spelled closest to it."""
    message = " ".join(str(error).split())
    if (key := re.match(r'Parser key "([\w.]+)"', message)) and (choices := key_choices(key[1]))[0]:
        item = re.search(r"Expected a typing.Literal\[.*\]\. Got value: (.*)$", message)
        if not choices[1] and (given := given_values(argv, key[1])):  # not given: from a --SECTION FILE
            return f"--{key[1]} must be one of {choices[0]}, not {given[-1]!r}"
        if choices[1] and item:  # a list key (a bare value, no list, keeps jsonargparse's words)
            return f"--{key[1]} must list only {choices[0]}, not {item[1]!r}"
    if key and key[1] in KEY_RANGES and (given := given_values(argv, key[1])):  # a number of the wrong kind
        whole = isinstance(KEY_RANGES[key[1]][0], int)
        return (f"--{key[1]} must be a {'whole number' if whole else 'number'} in {range_text(key[1])}"
                f"{' (or null)' if nullable(key_hint(key[1])) else ''}, not {given[-1]!r}")
    if not message.startswith("unrecognized arguments"):
        return message
    options = known_options()
    for token in argv:
        spelled = token.split("=", 1)[0]
        if spelled.startswith("--") and spelled not in options:
            close = difflib.get_close_matches(spelled, options, n=3, cutoff=0.75)
            if close:
                return f"{message}; did you mean {' or '.join(close)}?"
    return message


def key_hint(key: str) -> object:
    """The type hint of a configuration key ("model.n_layer"), None for a name the config has no key for."""
    hint: object = RunConfig
    for name in key.split("."):
        hint = typing.get_type_hints(hint).get(name) if is_dataclass(hint) else None
    return hint


def key_choices(key: str) -> tuple[str, bool]:
    """The choices of a configuration key ("model.n_layer") typed ``Literal[...]`` or a list of them ("a, b, c (or
    null)"; "" for any other key or a name the config has no key for), and whether the key is a list."""
    hint = key_hint(key)
    listed = typing.get_origin(hint) is list
    hint = typing.get_args(hint)[0] if listed else hint
    choices = literal_choices(hint)
    return f"{', '.join(map(str, choices))}{' (or null)' if nullable(hint) else ''}" if choices else "", listed


def given_values(argv: list[str], key: str) -> list[str]:
    """What ``argv`` gives ``--key`` (``--key VALUE`` or ``--key=VALUE``), each time it is given."""
    return [token.split("=", 1)[1] if "=" in token else argv[index + 1] for index, token in enumerate(argv)
            if token.startswith(f"--{key}=") or token == f"--{key}" and index + 1 < len(argv)]


def known_options() -> list[str]:
    """Every option of ``fit``: its own, one per configuration key, and the Trainer's that pass through."""
    own = ["--config", "--microbatch", "--accumulation", "--ckpt_path", PRINT_CONFIG]
    keys = [f"--{key}" for key in config_keys(RunConfig)]
    passed = [f"--trainer.{name}" for name in lightning_trainer_arguments()
              if name not in LIGHTNING_REFUSED and f"--trainer.{name}" not in keys]
    return own + keys + passed


def config_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted key of every leaf field of the configuration dataclasses."""
    hints = typing.get_type_hints(cls)
    return [key for item in fields(cls) for key in (config_keys(hints[item.name], f"{prefix}{item.name}.")
                                                   if is_dataclass(hints[item.name]) else [f"{prefix}{item.name}"])]


def config_yaml(cfg: RunConfig) -> str:
    """The merged, resolved configuration as YAML: what ``--print_config`` shows."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False)


def build_parser(config_path: str | None = None) -> ArgumentParser:
    """The whole command line; with ``config_path``, the help shows that file's values as the defaults."""
    root = ArgumentParser(prog=PROG, exit_on_error=False, description=describe(),
                          usage=f"{PROG} [{{{','.join(SUBCOMMANDS)}}}] [--config FILE] [--section.key VALUE ...]")
    subcommands = root.add_subcommands(dest="subcommand", required=False)  # train.py names fit when none is given
    values = flatten(as_dict(load_config(config_from_here(config_path)))) if config_path is not None else None
    for name, summary in SUBCOMMANDS.items():
        if values is None:
            parser = subcommand_parser(name, summary)
        else:  # a parser of its own: the shared one keeps the dataclasses' defaults
            parser = new_subcommand_parser(name, summary)
            parser.set_defaults(values)
        subcommands.add_subcommand(name, parser, help=summary)
    return root


def describe(summary: str = "") -> str:
    lines = [f"{summary}." if summary else "Pretrain the decoder (GPT-2 or Llama) the way RunFab runs train.py."]
    lines.append(
        f"Subcommands: {DEFAULT_SUBCOMMAND} (the default), "
        f"{', '.join(name for name in SUBCOMMANDS if name != DEFAULT_SUBCOMMAND)}; `python {PROG} SUBCOMMAND --help` "
        f"lists every key. Values come from --config (default: ${CONFIG_ENV} or {DEFAULT_CONFIG}), then "
        "--section.key VALUE overrides, wherever they stand. The bundle tools run as `python -m tools`."
    )
    return " ".join(lines)


@cache
def subcommand_parser(name: str, summary: str = "") -> ArgumentParser:
    """The parser of one subcommand, built once per process (reading every docstring takes a while)."""
    return new_subcommand_parser(name, summary)


def new_subcommand_parser(name: str, summary: str = "") -> ArgumentParser:
    # The help of each key is the docstring under its dataclass field (PEP 257 attribute docstrings).
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    parser = ArgumentParser(prog=f"{PROG} {name}", exit_on_error=False, description=describe(summary),
                            usage=f"{PROG} {name} [--config FILE] [--section.key VALUE ...] [--print_config]")
    parser.add_argument("--config", type=typing.Optional[str], default=None,
                        help=f"YAML config of the bundle (default: ${CONFIG_ENV}, else {DEFAULT_CONFIG})")
    parser.add_argument("--microbatch", type=typing.Optional[int], default=None,
                        help="rows per microbatch (default: data.microbatch)")
    parser.add_argument("--accumulation", type=typing.Optional[int], default=None,
                        help="microbatches per update (default: what the batch size implies)")
    if name == "fit":
        parser.add_argument("--ckpt_path", type=typing.Optional[str], default=None,
                            help="resume a run: a checkpoint file, or last (the newest that loads in the output's "
                                 "checkpoints/; none yet: start from the beginning; some and none loads: refused); the "
                                 "model, input, seed, batch, optim.* and process count must be unchanged (on stdin: "
                                 "give the same records again; the trained updates are checked and skipped)")
    parser.add_argument(PRINT_CONFIG, action="store_true",
                        help="print the merged configuration as YAML on stdout and exit without training")
    parser.add_class_arguments(RunConfig, sub_configs=False)
    for action in parser._actions:
        if action.dest in KEY_RANGES:
            action.help = f"{action.help} (range: {range_text(action.dest)})"
        if action.option_strings and action.option_strings[0][2:] in fit_sections():  # jsonargparse's --SECTION FILE
            action.metavar = "FILE"
            action.help = (f"a YAML file of {action.dest} keys (e.g. the {action.dest}: part of a config, without "
                           "that line), applied where it stands among the overrides")
    add_lightning_options(parser)
    return parser


@cache
def fit_sections() -> tuple[str, ...]:
    """The sections of the config (model, data, ...): each has a --SECTION.key option per key and --SECTION FILE."""
    hints = typing.get_type_hints(RunConfig)
    return tuple(item.name for item in fields(RunConfig) if is_dataclass(hints[item.name]))


def add_lightning_options(parser: ArgumentParser) -> None:
    """An option for every lightning.Trainer argument the config has no key for and does not refuse."""
    group = parser.add_argument_group(
        "trainer: other lightning.Trainer arguments",
        f"Passed to the Trainer as given, kept in the config under {PASSED_TO_LIGHTNING} (in YAML, trainer.NAME "
        f"works too). Unset, each keeps the run's default: Lightning's, except no sanity validation and no model "
        f"summary. Refused, because the run sets them itself: "
        f"{', '.join(LIGHTNING_REFUSED)}.")
    own = {item.name for item in fields(TrainerConfig)}
    hints = typing.get_type_hints(L.Trainer.__init__)
    helps = {param.arg_name: " ".join((param.description or "").split()).split(". ")[0].rstrip(".")
             for param in docstring_parser.parse(L.Trainer.__init__.__doc__ or "").params}
    for name in lightning_trainer_arguments():
        if name not in own and name not in LIGHTNING_REFUSED:
            group.add_argument(f"--trainer.{name}", type=spelled(hints.get(name, typing.Any)),
                               default=argparse.SUPPRESS, help=helps.get(name, "an argument of lightning.Trainer"))


def spelled(hint: object) -> object:
    """A Trainer argument's type without the classes that a command line cannot spell (a Profiler object, ...)."""
    def plain(arg: object) -> bool:
        return arg in (bool, int, float, str, type(None)) or typing.get_origin(arg) is typing.Literal

    if typing.get_origin(hint) is typing.Union or type(hint).__name__ == "UnionType":
        kept = [arg for arg in typing.get_args(hint) if plain(arg)]
        return typing.Union[tuple(kept)] if kept else typing.Any
    return hint if plain(hint) else typing.Any


def flatten(values: dict, prefix: str = "") -> dict[str, object]:
    """Dotted keys and their values; where a section file (``--model FILE``) was read, its keys (jsonargparse
    also keeps the file's path, which is no key)."""
    flat = {}
    for key, value in values.items():
        if key == SECTION_FILE_KEY:
            continue
        if isinstance(value, dict) and not (prefix + key == PASSED_TO_LIGHTNING):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
