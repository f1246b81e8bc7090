"""The local command line: ``python train.py [fit|probe] [--config FILE] [--section.key VALUE ...]``.

Built on jsonargparse, the library under Lightning's own CLI, so it behaves the way people coming from
Lightning expect: subcommands, one typed ``--section.key`` option per configuration key, a ``--help``
that lists them all, and ``--print_config``. It only reads the command line. The YAML file and the
overrides are merged by ``config.load_config``, the path RunFab's hooks take too, so the values are
checked once, the same way, and the hooks never import jsonargparse (RunFab's image does not have it).

The help of a key is the docstring under its field in the dataclass that defines it, so a key's meaning
is written once, beside its default. They are read here with ``ast``: jsonargparse's own reader of attribute
docstrings needs docstring-parser, one more package for the command line alone. Any other argument of
lightning.Trainer is an option too, ``--trainer.NAME VALUE``, passed to the Trainer (config.py keeps it under
``trainer.lightning``), except those the run sets itself, which are refused with the reason.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import cache

import lightning as L
import yaml
from jsonargparse import ArgumentParser

from runtime import created_files, launcher
from runtime import training_run
from runtime.batch_split import BatchSplit, command_line_microbatch
from callbacks.export import ExportFailed
from callbacks.runfab_metrics import NonFiniteLossError
from config import (CONFIG_ENV, DEFAULT_CONFIG, LIGHTNING_REFUSED, ConfigError, RunConfig, TrainerConfig, as_dict,
                    lightning_argument_problems, lightning_trainer_arguments, load_config)
from runtime.device_policy import world_size
from runtime.probe import run_probe
from pipeline.shards import ShardsError
from pipeline.stages import UnusableInputError

PROG = "train.py"
DEFAULT_SUBCOMMAND = "fit"
SUBCOMMANDS = {
    "fit": "train on NDJSON records from stdin (or the bundled sample), then export the model",
    "probe": "fit one worst-case microbatch with the real model and optimizer, as RunFab's memory probe does",
}
# The commands of `python -m tools`: named to train.py, they are pointed there (never imported here:
# tools/ does not ship). tests/tools/test_entry_point.py keeps the two lists equal.
TOOLS = ("package", "check", "emulate", "report", "bench", "tokenizer", "gpt2-tokenizer", "sample-data", "prepare")
HELP = ("-h", "--help")
PRINT_CONFIG = "--print_config"
PASSED_TO_LIGHTNING = "trainer.lightning"  # the config's field for them; on the command line each is --trainer.NAME


@dataclass
class Command:
    """What the command line asks for: a subcommand, the config file and the keys the user set."""

    name: str
    config_path: str | None
    overrides: list[str]  # omegaconf dotlist ("model.n_layer=2"), only for keys given on the command line
    microbatch: int | None
    accumulation: int | None
    print_config: bool
    ckpt_path: str | None = None  # resume a run from prepared shards: a checkpoint file, or "last"


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
        if command.ckpt_path is not None:
            raise CommandLineError("--ckpt_path resumes a run from prepared shards (--data.source litdata); a run on "
                                   "stdin cannot resume, its input is a stream")
        if cfg.trainer.global_batch_size is not None:
            raise ConfigError(f"trainer.global_batch_size ({cfg.trainer.global_batch_size}) sets the batch of a run "
                              f"from prepared shards (--data.source litdata); on stdin the batch is "
                              f"EFFECTIVE_BATCH_SIZE ({effective}): leave it null")
        split = BatchSplit.for_command_line(effective, world, cfg.data.microbatch, command.microbatch,
                                           command.accumulation)
        training_run.run_training(cfg, split)
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
    configs = [token for token in argv if token == "--config" or token.startswith("--config=")]
    if len(configs) > 1:  # the parser would keep the last one silently
        raise CommandLineError(f"--config is given {len(configs)} times; give one file, and change single keys "
                               "with --section.key VALUE")
    refused = [token.split("=")[0].removeprefix("--trainer.") for token in argv if token.startswith("--trainer.")]
    refused = lightning_argument_problems({name: None for name in refused if name in LIGHTNING_REFUSED})
    if refused:  # the parser has no option for them and would only call them unrecognized
        raise CommandLineError(refused[0])
    try:
        # defaults=False: only what the user typed, so the YAML file is never overridden by a schema default
        namespace = build_parser().parse_args(argv, defaults=False)
    except Exception as error:  # jsonargparse's ArgumentError, raised because exit_on_error is off
        raise CommandLineError(readable(error)) from None
    name = namespace.subcommand
    given = flatten(namespace[name].as_dict() if namespace[name] is not None else {})
    options = {key: given.pop(key, None) for key in ("config", "microbatch", "accumulation", "ckpt_path")}
    return Command(
        name=name,
        config_path=config_from_here(options["config"]),
        overrides=[f"{key}={json.dumps(value)}" for key, value in given.items()],
        microbatch=options["microbatch"],
        accumulation=options["accumulation"],
        print_config=print_config,
        ckpt_path=options["ckpt_path"],
    )


def readable(error: Exception) -> str:
    """jsonargparse's message on one line; for a choice key, the choices and the value given."""
    message = " ".join(str(error).split())
    key = re.match(r'Parser key "([^"]+)"', message)
    value = re.search(r"(?:Got|Given) value: (.*)$", message)
    hints = {name: hint for name, hint, _, _ in config_keys(RunConfig)}
    choices = literal_choices(hints.get(key[1])) if key else None
    if not (choices and value):
        return message
    return f"--{key[1]} must be one of {', '.join(choices)}, not {value[1]}"


def literal_choices(hint: object) -> list[str] | None:
    """The values a choice type (``Literal``, optionally in ``| None`` or ``list[...]``) allows; None for others."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return [str(arg) for arg in args]
    if origin is list:
        return literal_choices(args[0])
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = [arg for arg in args if arg is not type(None)]
        choices = literal_choices(rest[0]) if len(rest) == 1 else None
        return [*choices, "null"] if choices else None
    return None


def config_yaml(cfg: RunConfig) -> str:
    """The merged, resolved configuration as YAML: what ``--print_config`` shows."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False)


def build_parser() -> ArgumentParser:
    root = ArgumentParser(prog=PROG, exit_on_error=False, description=describe(),
                          usage=f"{PROG} [{{{','.join(SUBCOMMANDS)}}}] [--config FILE] [--section.key VALUE ...]")
    subcommands = root.add_subcommands(dest="subcommand", required=False)  # train.py names fit when none is given
    for name, summary in SUBCOMMANDS.items():
        subcommands.add_subcommand(name, subcommand_parser(name, summary), help=summary)
    return root


def describe(summary: str = "") -> str:
    lines = [f"{summary}." if summary else "Pretrain the GPT decoder the way RunFab runs train.py."]
    lines.append(
        f"Subcommands: {DEFAULT_SUBCOMMAND} (the default), "
        f"{', '.join(name for name in SUBCOMMANDS if name != DEFAULT_SUBCOMMAND)}; `python {PROG} SUBCOMMAND --help` "
        f"lists every key. Values come from --config (default: ${CONFIG_ENV} or {DEFAULT_CONFIG}), then "
        "--section.key VALUE overrides, wherever they stand. The bundle tools run as `python -m tools`."
    )
    return " ".join(lines)


def subcommand_parser(name: str, summary: str) -> ArgumentParser:
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
                            help="resume a run from prepared shards (data.source litdata): a checkpoint file, or last "
                                 "(the newest in the output's checkpoints/; none yet: start from the beginning)")
    parser.add_argument(PRINT_CONFIG, action="store_true",
                        help="print the merged configuration as YAML on stdout and exit without training")
    sections = attribute_docstrings(RunConfig)
    groups = {}
    for key, hint, default, help_text in config_keys(RunConfig):
        if key == PASSED_TO_LIGHTNING:
            continue
        section = key.split(".")[0] if "." in key else None
        if section not in groups:
            groups[section] = parser.add_argument_group(section, sections[section]) if section else parser
        groups[section].add_argument(f"--{key}", type=hint, default=default, help=help_text)
    add_lightning_options(parser)
    return parser


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
    helps = lightning_help()
    for name in lightning_trainer_arguments():
        if name not in own and name not in LIGHTNING_REFUSED:
            group.add_argument(f"--trainer.{name}", type=spelled(hints.get(name, typing.Any)),
                               default=argparse.SUPPRESS, help=helps.get(name, "an argument of lightning.Trainer"))


def spelled(hint: object) -> object:
    """A Trainer argument's type without the classes that a command line cannot spell (a Profiler object, ...)."""
    def plain(arg: object) -> bool:
        return arg in (bool, int, float, str, type(None)) or typing.get_origin(arg) is typing.Literal

    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kept = [arg for arg in typing.get_args(hint) if plain(arg)]
        return typing.Union[tuple(kept)] if kept else typing.Any
    return hint if plain(hint) else typing.Any


@cache
def lightning_help() -> dict[str, str]:
    """The first sentence of each argument in the ``Args:`` section of lightning.Trainer's docstring."""
    found, name = {}, None
    for line in inspect.cleandoc(L.Trainer.__init__.__doc__ or "").split("Args:", 1)[-1].splitlines():
        entry = re.match(r"    (\w+): (.*)", line)
        if entry:
            name, found[entry[1]] = entry[1], entry[2]
        elif line.startswith("        ") and name:
            found[name] += " " + line.strip()
        elif line.strip():
            name = None
    return {key: text.replace("``", "").split(". ")[0].rstrip(".") for key, text in found.items()}


def config_keys(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, object, object, str]]:
    """(dotted key, type, default, help) for every leaf field of the configuration dataclasses."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docstrings(cls)
    for item in fields(cls):
        hint = hints[item.name]
        if is_dataclass(hint):
            yield from config_keys(hint, f"{prefix}{item.name}.")
        else:
            default = item.default if item.default is not MISSING else item.default_factory()
            yield f"{prefix}{item.name}", hint, default, docs.get(item.name, "")


@cache
def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring right under the field (a string literal alone on the next line), on one line."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef)).body
    found = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            found[statement.target.id] = " ".join(following.value.value.split())
    return found


def flatten(values: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
