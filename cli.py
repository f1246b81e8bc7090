"""The local command line: ``python train.py [fit|probe] [--config FILE] [--section.key VALUE ...]``.

Built on jsonargparse, the library under Lightning's own CLI, so it behaves the way people coming from
Lightning expect: subcommands, one typed ``--section.key`` option per configuration key, a ``--help``
that lists them all, and ``--print_config``. It only reads the command line, into typed values by dotted
key; ``config.load_config`` merges them over the YAML file, the path RunFab's hooks take too, so the
values are checked once, the same way, and the hooks never import jsonargparse (RunFab's image lacks it).

The help of a key is the docstring under its field in the dataclass that defines it, read by
jsonargparse (with docstring-parser), so a key's meaning is written once, beside its default. Any other
argument of lightning.Trainer is an option too, ``--trainer.NAME VALUE``, typed and documented by jsonargparse
from Lightning's signature, passed to the Trainer (config.py keeps it under ``trainer.lightning``), except those
the run sets itself, which are refused with the reason. A value given for a key is checked by its type
(``config.value_problem``, as a YAML file's are) before jsonargparse parses, so the error names the key's
choices or range.
"""

from __future__ import annotations

import contextlib
import difflib
import sys
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import lightning as L
import yaml
from jsonargparse import ArgumentParser, set_parsing_settings

from runfab import created_files
from runtime import launcher
from runtime import training_run
from runtime.batch_split import BatchSplit, command_line_microbatch
from callbacks.export import ExportFailed
from callbacks.runfab_metrics import NonFiniteLossError
from config import (CONFIG_ENV, DEFAULT_CONFIG, KEY_RANGES, LIGHTNING_REFUSED, TRAINER_KEYS, ConfigError, RunConfig,
                    as_dict, key_hints, key_values, lightning_argument_problems, load_config, range_text, value_problem)
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
    given = given_options(argv)
    configs = [value for key, value in given if key == "config"]
    if len(configs) > 1:  # the parser would keep the last one silently
        raise CommandLineError(f"--config is given {len(configs)} times; give one file, and change single keys "
                               "with --section.key VALUE")
    refused = lightning_argument_problems({key.removeprefix("trainer."): None for key, _ in given
                                           if key.removeprefix("trainer.") in LIGHTNING_REFUSED})
    if refused:  # the parser has no option for them and would only call them unrecognized
        raise CommandLineError(refused[0])
    for key, text in given:  # a value the key's type refuses, said with its choices or range, not the type's name
        if key in key_hints() and (problem := value_problem(key, typed(text, key))):
            raise CommandLineError(f"--{problem}")
    parser = build_parser(configs[0] if configs and any(token in HELP for token in argv) else None)
    try:
        # defaults=False: only what the user typed, so the YAML file is never overridden by a schema default
        namespace = parser.parse_args(argv, defaults=False)
    except Exception as error:  # jsonargparse's ArgumentError, raised because exit_on_error is off
        raise CommandLineError(readable(error, argv)) from None
    name = namespace.subcommand
    values = {key: value for key, value in (namespace[name] or {}).items() if not key.endswith(SECTION_FILE_KEY)}
    options = {key: values.pop(key, None) for key in ("config", "microbatch", "accumulation", "ckpt_path")}
    return Command(name=name, config_path=config_from_here(options["config"]), overrides=list(values.items()),
                   microbatch=options["microbatch"], accumulation=options["accumulation"], print_config=print_config,
                   ckpt_path=options["ckpt_path"])


def given_options(argv: list[str]) -> list[tuple[str, str]]:
    """(key, value as typed) for each ``--key VALUE`` or ``--key=VALUE`` of ``argv``, in order."""
    return [(token[2:].split("=", 1)[0], token.split("=", 1)[1] if "=" in token else argv[index + 1])
            for index, token in enumerate(argv) if token.startswith("--")
            and ("=" in token or index + 1 < len(argv) and not argv[index + 1].startswith("--"))]


def typed(text: str, key: str) -> object:
    """A command-line value as the parser reads it: YAML (3, 0.5, null, [csv], or text), and for a key that takes any
    number, 1e30 too (which YAML 1.1 reads as text)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, str) and isinstance(KEY_RANGES.get(key, (0,))[0], float):
        with contextlib.suppress(ValueError):
            return float(value)
    return value


def readable(error: Exception, argv: list[str]) -> str:
    """jsonargparse's message on one line; for an option no key has, the options spelled closest to it."""
    message = " ".join(str(error).split())
    if not message.startswith("unrecognized arguments"):
        return message
    options = [option for action in subcommand_parser("fit")._actions for option in action.option_strings]
    for token in argv:
        spelled = token.split("=", 1)[0]
        if spelled.startswith("--") and spelled not in options:
            if close := difflib.get_close_matches(spelled, options, n=3, cutoff=0.75):
                return f"{message}; did you mean {' or '.join(close)}?"
    return message


def config_yaml(cfg: RunConfig) -> str:
    """The merged, resolved configuration as YAML: what ``--print_config`` shows."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False)


def build_parser(config_path: str | None = None) -> ArgumentParser:
    """The whole command line; with ``config_path``, the help shows that file's values as the defaults."""
    root = ArgumentParser(prog=PROG, exit_on_error=False, description=describe(),
                          usage=f"{PROG} [{{{','.join(SUBCOMMANDS)}}}] [--config FILE] [--section.key VALUE ...]")
    subcommands = root.add_subcommands(dest="subcommand", required=False)  # train.py names fit when none is given
    values = key_values(load_config(config_from_here(config_path))) if config_path is not None else None
    for name, summary in SUBCOMMANDS.items():
        if values is None:
            parser = subcommand_parser(name, summary)
        else:  # a parser of its own: the shared one keeps the dataclasses' defaults
            parser = new_subcommand_parser(name, summary)
            parser.set_defaults(values)
        subcommands.add_subcommand(name, parser, help=summary)
    return root


def describe(summary: str = "") -> str:
    return " ".join([
        f"{summary}." if summary else "Pretrain the decoder (GPT-2 or Llama) the way RunFab runs train.py.",
        f"Subcommands: {DEFAULT_SUBCOMMAND} (the default), "
        f"{', '.join(name for name in SUBCOMMANDS if name != DEFAULT_SUBCOMMAND)}; `python {PROG} SUBCOMMAND --help` "
        f"lists every key. Values come from --config (default: ${CONFIG_ENV} or {DEFAULT_CONFIG}), then "
        "--section.key VALUE overrides, wherever they stand. Any other lightning.Trainer argument is "
        f"--trainer.NAME VALUE, passed to the Trainer as given (kept under {PASSED_TO_LIGHTNING}); unset, each keeps "
        "Lightning's default, except no sanity validation and no model summary; refused, because the run sets them "
        f"itself: {', '.join(LIGHTNING_REFUSED)}. The bundle tools run as `python -m tools`.",
    ])


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
    # Every other lightning.Trainer argument, typed and documented from Lightning's own signature and docstring.
    parser.add_method_arguments(L.Trainer, "__init__", nested_key="trainer", as_group=False, fail_untyped=False,
                                sub_configs=False, skip=TRAINER_KEYS | set(LIGHTNING_REFUSED))
    for action in parser._actions:
        if action.dest in KEY_RANGES:
            action.help = f"{action.help} (range: {range_text(action.dest)})"
        if action.option_strings and action.option_strings[0][2:] in fit_sections():  # jsonargparse's --SECTION FILE
            action.metavar = "FILE"
            action.help = (f"a YAML file of {action.dest} keys (e.g. the {action.dest}: part of a config, without "
                           "that line), applied where it stands among the overrides")
    return parser


def fit_sections() -> tuple[str, ...]:
    """The sections of the config (model, data, ...): each has a --SECTION.key option per key and --SECTION FILE."""
    return tuple(dict.fromkeys(key.split(".")[0] for key in key_hints() if "." in key))
