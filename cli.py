"""The local command line: ``python train.py [fit|probe] [--config FILE] [--section.key VALUE ...]``.

Built on jsonargparse, the library under Lightning's own CLI, so it behaves the way people coming from
Lightning expect: subcommands, one typed ``--section.key`` option per configuration key, a ``--help``
that lists them all, and ``--print_config``. It only reads the command line. The YAML file and the
overrides are merged by ``config.load_config``, the path RunFab's hooks take too, so the values are
checked once, the same way, and the hooks never import jsonargparse (RunFab's image does not have it).

The help line of a key is the ``#`` comment on its field in the dataclass that defines it (or the
comment block just above the field), so a key's meaning is written once, beside its default.
"""

from __future__ import annotations

import ast
import inspect
import io
import json
import sys
import tokenize
import typing
from pathlib import Path
from dataclasses import MISSING, dataclass, fields, is_dataclass
from functools import cache

import yaml
from jsonargparse import ArgumentParser

import launcher
import training_run
from batch_split import BatchSplit, command_line_microbatch
from callbacks.export import ExportFailed
from callbacks.runfab_metrics import NonFiniteLossError
from config import CONFIG_ENV, DEFAULT_CONFIG, ConfigError, RunConfig, as_dict, load_config
from device_policy import world_size
from probe import run_probe
from stages import UnusableInputError

PROG = "train.py"
DEFAULT_SUBCOMMAND = "fit"
SUBCOMMANDS = {
    "fit": "train on NDJSON records from stdin (or the bundled sample), then export the model",
    "probe": "fit one worst-case microbatch with the real model and optimizer, as RunFab's memory probe does",
}
# Former train.py subcommands that now live in `python -m tools` (never imported here: tools/ does not ship).
TOOLS = ("package", "check", "emulate", "report", "tokenizer")
UNDOCUMENTED = "(no description yet)"
PRINT_CONFIG = "--print_config"


@dataclass
class Command:
    """What the command line asks for: a subcommand, the config file and the keys the user set."""

    name: str
    config_path: str | None
    overrides: list[str]  # omegaconf dotlist ("model.n_layer=2"), only for keys given on the command line
    microbatch: int | None
    accumulation: int | None
    print_config: bool


class CommandLineError(Exception):
    """Bad command-line input; the message names the offending option or token."""


# What a command line run reports as one line on stderr, with exit code 2, instead of a traceback.
USER_ERRORS = (
    ConfigError, UnusableInputError, NonFiniteLossError, FileNotFoundError, launcher.WorkerFailed, launcher.Interrupted,
    launcher.InputFailed, ExportFailed,
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
    if not argv[:1] or argv[0] not in SUBCOMMANDS:
        argv = [DEFAULT_SUBCOMMAND, *argv]
    # jsonargparse treats --print_config itself (it would print the command line's values, not the merged
    # configuration), so the flag is taken out before it parses; the option is declared only for --help.
    print_config = PRINT_CONFIG in argv
    argv = [token for token in argv if token != PRINT_CONFIG]
    configs = [token for token in argv if token == "--config" or token.startswith("--config=")]
    if len(configs) > 1:  # the parser would keep the last one silently
        raise CommandLineError(f"--config is given {len(configs)} times; give one file, and change single keys "
                               "with --section.key VALUE")
    try:
        # defaults=False: only what the user typed, so the YAML file is never overridden by a schema default
        namespace = build_parser().parse_args(argv, defaults=False)
    except Exception as error:  # jsonargparse's ArgumentError, raised because exit_on_error is off
        raise CommandLineError(" ".join(str(error).split())) from None
    name = namespace.subcommand
    given = flatten(namespace[name].as_dict() if namespace[name] is not None else {})
    options = {key: given.pop(key, None) for key in ("config", "microbatch", "accumulation")}
    return Command(
        name=name,
        config_path=config_from_here(options["config"]),
        overrides=[f"{key}={json.dumps(value)}" for key, value in given.items()],
        microbatch=options["microbatch"],
        accumulation=options["accumulation"],
        print_config=print_config,
    )


def config_yaml(cfg: RunConfig) -> str:
    """The merged, resolved configuration as YAML: what ``--print_config`` shows."""
    return yaml.safe_dump(as_dict(cfg), sort_keys=False)


def build_parser() -> ArgumentParser:
    root = ArgumentParser(prog=PROG, exit_on_error=False, description=describe())
    subcommands = root.add_subcommands(dest="subcommand")
    for name, summary in SUBCOMMANDS.items():
        subcommands.add_subcommand(name, subcommand_parser(name, summary), help=summary)
    return root


def describe(summary: str = "") -> str:
    lines = [f"{summary}." if summary else "Pretrain the GPT decoder the way RunFab runs train.py."]
    lines.append(
        f"Subcommands: {DEFAULT_SUBCOMMAND} (the default), "
        f"{', '.join(name for name in SUBCOMMANDS if name != DEFAULT_SUBCOMMAND)}; `python {PROG} SUBCOMMAND --help` for each. "
        f"Values come from --config (default: ${CONFIG_ENV} or {DEFAULT_CONFIG}), then --section.key VALUE "
        "overrides, wherever they stand. The bundle tools run as `python -m tools`."
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
    parser.add_argument(PRINT_CONFIG, action="store_true",
                        help="print the merged configuration as YAML on stdout and exit without training")
    for key, hint, default, help_text in config_keys(RunConfig):
        parser.add_argument(f"--{key}", type=hint, default=default, help=help_text or UNDOCUMENTED)
    return parser


def config_keys(cls: type, prefix: str = "") -> typing.Iterator[tuple[str, object, object, str]]:
    """(dotted key, type, default, help) for every leaf field of the configuration dataclasses."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for item in fields(cls):
        hint = hints[item.name]
        if is_dataclass(hint):
            yield from config_keys(hint, f"{prefix}{item.name}.")
        else:
            default = item.default if item.default is not MISSING else item.default_factory()
            yield f"{prefix}{item.name}", hint, default, comments.get(item.name, "")


@cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> its trailing ``#`` comment, or else the comment lines right above it."""
    source = inspect.getsource(inspect.getmodule(cls))
    lines = source.splitlines()
    comments = {token.start[0]: token.string.lstrip("#").strip()
                for token in tokenize.generate_tokens(io.StringIO(source).readline) if token.type == tokenize.COMMENT}
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    found = {}
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        trailing = [comments[row] for row in range(statement.lineno, statement.end_lineno + 1) if row in comments]
        above, row = [], statement.lineno - 1
        while row in comments and lines[row - 1].lstrip().startswith("#"):
            above.insert(0, comments[row])
            row -= 1
        found[statement.target.id] = " ".join(trailing or above)
    return found


def flatten(values: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
