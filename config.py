"""The run configuration: typed sections, loaded from YAML with omegaconf, checked before anything is built.

Every default lives here once; `conf/*.yaml` presets override them, and dotted command-line
overrides (`--model.n_layer 2`) override the presets.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import os
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import timedelta
from functools import cache
from pathlib import Path
from typing import Any, Literal, get_args

import lightning as L
import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from callbacks.observe import ObserveConfig
from pipeline.data_section import DataConfig
from lit_module import OptimConfig
from model.decoder import ModelConfig
from model.kernels import ComputeConfig
from runfab.limits import GIB, OUTPUT_BYTES, RAM_BYTES

BUNDLE_ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = "conf/config.yaml"
Accelerator = Literal["auto", "cpu", "gpu"]
Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true"]  # Lightning's names
WorkerStart = Literal["auto", "fork", "exec"]  # launcher.py says what each does
LogLevel = Literal["debug", "info", "warning"]
WORKER_STARTS = get_args(WorkerStart)
CONFIG_ENV = "RUNFAB_CONFIG"
SEED_RANGE = range(2**32)  # what numpy's generators (and so Lightning's seed_everything) accept


@dataclass
class TrainerConfig:
    """The ``trainer`` section of the config: how long and on what the run trains, and the Lightning Trainer's
    arguments. A key named as a lightning.Trainer argument means what that argument means."""

    max_steps: int = 2000
    """Optimizer updates; -1: until the input ends"""
    max_time: str | None = None
    """Time limit "DD:HH:MM:SS" for training and export together, counted from the start of fit; null: no limit"""
    export_reserve_seconds: int = 60
    """Seconds of max_time kept out of the training loop for the export and the run record"""
    stop_grace_seconds: int = 90
    """After SIGTERM or SIGINT, seconds the data-parallel ranks get to stop before they are killed"""
    precision: Precision | None = None
    """Lightning precision; null: bf16-mixed on a GPU, 32-true on a CPU"""
    accelerator: Accelerator = "auto"
    """Lightning accelerator; auto: gpu when a CUDA GPU is visible, else cpu"""
    gradient_clip_val: float = 1.0
    """Largest total gradient norm of an update; larger gradients are scaled down to it. 0: no clipping"""
    val_every_steps: int = 250
    """Optimizer updates between validations; 0: no validation. (Lightning's val_check_interval counts
    microbatches, whose number per update RunFab chooses.)"""
    limit_val_batches: int | None = None
    """Validation batches per validation; null: the whole held-out pool"""
    enable_progress_bar: bool | None = None
    """Lightning's progress bar, on stderr; null: when stderr is a terminal"""
    checkpoint_every_steps: int = 0
    """Optimizer updates between Lightning checkpoints, kept in the output's checkpoints/ folder (and one written
    when a signal stops a run on stdin), which the fit option ckpt_path last resumes from; 0: none"""
    compile: bool | None = None
    """torch.compile the model trunk; null: on a GPU only"""
    devices: int | None = None
    """Data-parallel processes, one per GPU; null: every visible GPU (1 on a CPU)"""
    worker_processes: bool | None = None
    """Train in worker processes that this one feeds; null: only with several devices"""
    memory_headroom_gib: float = 2.0
    """GPU memory the allocator leaves free, the same in the probe and in training"""
    probe_margin_gib: float = 0.5
    """How much tighter the eager probe's GPU memory cap is than compiled training's"""
    cuda_alloc_conf: str | None = "expandable_segments:True"
    """PYTORCH_CUDA_ALLOC_CONF of the run, unless the environment sets one; null: the allocator's defaults"""
    host_memory_budget_gib: float = RAM_BYTES / GIB
    """Host memory of the job (RunFab's RAM); a GPU count whose projected host memory exceeds it is refused
    before training. 0: no check"""
    ddp_bucket_cap_mb: float = 25.0
    """Size of DDP's all-reduce buckets in MB; the compiled trunk is split into graphs at bucket boundaries"""
    global_batch_size: int | None = None
    """Rows per optimizer update when training from prepared shards (data.source litdata); null:
    train.EFFECTIVE_BATCH_SIZE, which RunFab's hooks always use"""
    worker_start: WorkerStart = "auto"
    """How workers start: fork (copies of this process, sharing its imports) or exec (fresh interpreters);
    auto: fork unless CUDA is already initialized in this process"""
    lightning: dict[str, Any] = field(default_factory=dict)
    """Other lightning.Trainer arguments, passed to the Trainer as given. Write them as trainer.NAME (e.g.
    --trainer.log_every_n_steps 10); the config keeps them here"""

    def problems(self) -> list[str]:
        """What the ranges (KEY_RANGES) do not say."""
        found = [f"trainer.{name} must be >= 0 (0: off), not {getattr(self, name)}"
                 for name in ("val_every_steps", "checkpoint_every_steps") if getattr(self, name) < 0]
        if self.max_steps < 1 and self.max_steps != -1:
            found.append("trainer.max_steps must be positive, or -1 to train until the input ends")
        if self.max_time is not None:
            try:
                self.time_limit()
            except ValueError as error:
                found.append(str(error))
        if self.gradient_clip_val < 0:
            found.append(f"trainer.gradient_clip_val must be >= 0 (0: no clipping), not {self.gradient_clip_val}")
        if self.ddp_bucket_cap_mb <= 0:
            found.append(f"trainer.ddp_bucket_cap_mb must be above 0, not {self.ddp_bucket_cap_mb}")
        return found + lightning_argument_problems(self.lightning)

    def time_limit(self) -> timedelta | None:
        """``max_time`` less the export reserve: what the training loop itself may use."""
        if self.max_time is None:
            return None
        expected = f'trainer.max_time must look like "DD:HH:MM:SS" (whole numbers, none negative), not {self.max_time!r}'
        if self.max_time.isdigit():  # YAML 1.1 reads an unquoted 1:00:00:00 as a base-60 number
            expected += ' (in a YAML file, quote it: max_time: "01:00:00:00")'
        try:
            days, hours, minutes, seconds = parts = [int(part) for part in self.max_time.split(":")]
            if min(parts) < 0:
                raise ValueError(expected)
            total = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
            limit = total - timedelta(seconds=self.export_reserve_seconds)
        except ValueError:
            raise ValueError(expected) from None
        except OverflowError:
            raise ValueError(f"trainer.max_time ({self.max_time}) and trainer.export_reserve_seconds "
                             f"({self.export_reserve_seconds}) must each be below {timedelta.max.days} days") from None
        if limit <= timedelta(0):
            raise ValueError(
                f"trainer.max_time ({self.max_time}) leaves no training time after the "
                f"{self.export_reserve_seconds} s kept for the export (trainer.export_reserve_seconds)"
            )
        return limit


TRAINER_KEYS = frozenset(item.name for item in fields(TrainerConfig))  # the trainer section's keys, not Lightning's


@dataclass
class MetricsConfig:
    """The ``metrics`` section of the config: the metric lines on stdout."""

    interval_seconds: float = 5.0
    """Seconds between metric lines (RunFab wants one every 5-10 s); 0: a line for every update"""
    peak_flops: float = 989e12
    """Peak FLOP/s of one GPU, the denominator of MFU; the default is an H100/H200 SXM's dense BF16, as the
    training lab counts it"""

    def problems(self) -> list[str]:
        found = ["metrics.interval_seconds must be >= 0 (0 reports every update)"] if self.interval_seconds < 0 else []
        return found + ([f"metrics.peak_flops must be >= 0 (0: no mfu), not {self.peak_flops}"] if self.peak_flops < 0
                        else [])


@dataclass
class OutputConfig:
    """The ``output`` section of the config: where the run writes."""

    root: str = "${oc.env:RUNFABRIC_OUTPUT,output}"
    """Folder of the model, the run record and checkpoints: RunFab's RUNFABRIC_OUTPUT, else ./output"""
    budget_bytes: int = OUTPUT_BYTES
    """Bytes all output may take: RunFab keeps it in the job's RAM (model, checkpoints, caches)"""


@dataclass
class RunConfig:
    """The whole configuration: one section per concern."""

    seed: int = 1337
    """Seeds every random generator of the run (model init, data shuffle)"""
    log_level: LogLevel = "info"
    """What stderr tells: info (the run's steps, the budget lines, each metric line, the outcome); debug adds
    each stage's host memory; warning keeps only warnings and errors. stdout always has the metric lines"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The decoder: its family (gpt2, llama) and shape"""
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    """How the model computes: kernels, loss chunks, recomputation"""
    data: DataConfig = field(default_factory=DataConfig)
    """Where records come from, their tokenization, shuffle and packing"""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule"""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Length of the run, devices, precision, memory limits and the Lightning Trainer's arguments"""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """The metric lines on stdout"""
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    """Profiler trace, CUDA memory snapshot and experiment loggers"""
    output: OutputConfig = field(default_factory=OutputConfig)
    """Where the run writes, and how much"""


# The range of every numeric key, both ends allowed: the config check refuses a value outside it before anything
# is sized by it, and --help shows it. A section's problems() holds the finer rules (max_steps -1, lr above 0, ...).
UPDATES, SECONDS = 10**9, 86_400  # update numbers and counts; seconds of a wait (a day)
KEY_RANGES: dict[str, tuple[int, int] | tuple[float, float]] = {
    "seed": (SEED_RANGE[0], SEED_RANGE[-1]),
    "model.vocab_size": (1, 2**24), "model.n_layer": (1, 1024), "model.n_head": (1, 1024), "model.n_embd": (1, 2**16),
    "model.max_seq_len": (2, 1_048_576), "model.layer_norm_eps": (0.0, 1.0), "model.init_std": (0.0, 10.0),
    "model.n_kv_head": (1, 1024), "model.intermediate_size": (1, 1_048_576), "model.rope_theta": (0.0, 1e12),
    "compute.mlp_kept_derivatives": (0, 1024), "compute.loss_chunk_tokens": (0, 1_073_741_824),
    "data.loader_workers": (0, 256), "data.microbatch": (1, 2**16), "data.max_record_bytes": (1, GIB),
    "data.give_up_after": (1, 10**12), "data.tokenize_batch_docs": (1, 1_048_576), "data.tokenize_batch_bytes": (1, 2**34),
    "data.tokenizer_threads": (1, 1024), "data.input_idle_seconds": (0.0, float(SECONDS)),
    "data.val_fraction": (0.0, 1.0), "data.val_max_tokens": (0, 2**40), "data.shuffle_buffer_docs": (1, 1_073_741_824),
    "data.shuffle_buffer_tokens": (1, 2**36), "data.max_train_tokens": (1, 2**60), "data.prefetch_updates": (1, 64),
    "optim.lr": (0.0, 10.0), "optim.min_lr_ratio": (0.0, 1.0), "optim.weight_decay": (0.0, 10.0),
    "optim.beta1": (0.0, 1.0), "optim.beta2": (0.0, 1.0), "optim.eps": (0.0, 1.0), "optim.warmup_steps": (0, UPDATES),
    "optim.decay_steps": (1, UPDATES), "optim.decay_fraction": (0.0, 1.0), "optim.muon_lr": (0.0, 10.0),
    "optim.muon_momentum": (0.0, 1.0), "optim.muon_weight_decay": (0.0, 10.0), "optim.embed_lr": (0.0, 10.0),
    "optim.head_lr": (0.0, 10.0),
    "trainer.max_steps": (-1, UPDATES), "trainer.export_reserve_seconds": (0, SECONDS),
    "trainer.stop_grace_seconds": (0, SECONDS), "trainer.gradient_clip_val": (0.0, 1e6),
    "trainer.val_every_steps": (0, UPDATES), "trainer.limit_val_batches": (1, UPDATES),
    "trainer.checkpoint_every_steps": (0, UPDATES), "trainer.devices": (1, 1024),
    "trainer.memory_headroom_gib": (0.0, 1e6), "trainer.probe_margin_gib": (0.0, 1e6),
    "trainer.host_memory_budget_gib": (0.0, 1e6), "trainer.ddp_bucket_cap_mb": (0.0, 1e6),
    "trainer.global_batch_size": (1, 1_073_741_824),
    "metrics.interval_seconds": (0.0, float(SECONDS)), "metrics.peak_flops": (0.0, 1e20),
    "observe.warmup_updates": (0, UPDATES), "observe.profile_update": (0, UPDATES), "observe.profile_updates": (0, 10**6),
    "observe.memory_update": (0, UPDATES), "observe.memory_history_entries": (1, 10**9),
    "output.budget_bytes": (1, 2**60),
}


def range_text(key: str) -> str:
    low, high = KEY_RANGES[key]
    return f"{low}..{high}" if isinstance(low, int) else f"{low:g}..{high:g}"


@cache
def key_hints() -> dict[str, Any]:
    """Every key of the schema ("model.n_layer", "seed") and its type hint, in the schema's order."""
    def walk(section: type, prefix: str) -> Iterable[tuple[str, Any]]:
        hints = typing.get_type_hints(section)
        for item in fields(section):
            hint = hints[item.name]
            yield from walk(hint, f"{prefix}{item.name}.") if is_dataclass(hint) else [(f"{prefix}{item.name}", hint)]

    return dict(walk(RunConfig, ""))


def key_values(cfg: RunConfig) -> dict[str, Any]:
    """Every key of ``cfg`` and its value ("model.n_layer": 12)."""
    return {key: functools.reduce(getattr, key.split("."), cfg) for key in key_hints()}


def value_problem(key: str, value: Any) -> str | None:
    """What a value of ``key`` is not, in the words a YAML file's check and the command line share: a choice key's
    choices (a list key's, for each item), a numeric key's kind of number; None where it is neither or fits."""
    hint = key_hints()[key]
    listed = typing.get_origin(hint) is list
    null = " (or null)" if nullable(hint) else ""
    if value is None and null:
        return None
    if choices := literal_choices(typing.get_args(hint)[0] if listed else hint):
        named = ", ".join(map(str, choices))
        if not listed:
            return None if value in choices else f"{key} must be one of {named}{null}, not {value!r}"
        if not isinstance(value, list):
            return f"{key} must be a list of {named}, not {value!r}"
        wrong = [one for one in value if one not in choices]
        return f"{key} must list only {named}, not {wrong[0]!r}" if wrong else None
    if key not in KEY_RANGES:
        return None
    whole = isinstance(KEY_RANGES[key][0], int)
    if isinstance(value, int if whole else (int, float)) and not isinstance(value, bool):
        return None
    return f"{key} must be {'a whole number' if whole else 'a number'} in {range_text(key)}{null}, not {value!r}"


def literal_choices(hint: Any) -> tuple:
    """The values of the ``Literal[...]`` in ``hint`` (itself, or it or null); () where it has none."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return args
    if origin in (typing.Union, types.UnionType):
        return tuple(choice for arg in args for choice in literal_choices(arg))
    return ()


def nullable(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


# lightning.Trainer arguments that trainer.NAME does not pass through, and why: the run sets them itself, and
# another value would break RunFab's batch split, the one pass over the input, or the run's own callbacks.
LIGHTNING_REFUSED = {
    "accumulate_grad_batches": "RunFab chooses the accumulation (locally: --microbatch and --accumulation)",
    "strategy": "the run joins its own data-parallel processes with DDP (trainer.devices, trainer.ddp_bucket_cap_mb)",
    "num_nodes": "the run starts its data-parallel processes on this machine only",
    "use_distributed_sampler": "the feeder already hands each rank its own rows",
    "plugins": "precision is trainer.precision, and the cluster is the processes the run starts itself",
    "callbacks": "the run installs its own (metrics, export, run record, signals)",
    "logger": "choose Lightning loggers with observe.loggers",
    "default_root_dir": "it is output.root",
    "enable_checkpointing": "set trainer.checkpoint_every_steps (0: no checkpoints)",
    "gradient_clip_algorithm": "the run clips the total gradient norm (trainer.gradient_clip_val), the norm the "
                               "metrics report",
    "max_epochs": "the input is one stream, read once: bound the run with trainer.max_steps or trainer.max_time",
    "min_epochs": "the input is one stream, read once: bound the run with trainer.max_steps or trainer.max_time",
    "min_steps": "it would hold off the stop that SIGTERM, trainer.max_time or the end of the input asks for",
    "val_check_interval": "it counts microbatches, whose number per update RunFab chooses: set "
                          "trainer.val_every_steps (optimizer updates)",
    "check_val_every_n_epoch": "the run is one epoch: set trainer.val_every_steps (optimizer updates)",
    "limit_train_batches": "it counts microbatches and could end the run inside an update: set trainer.max_steps",
    "overfit_batches": "it counts microbatches and could end the run inside an update: set trainer.max_steps",
    "fast_dev_run": "it counts microbatches and could end the run inside an update: for one update, set "
                    "--trainer.max_steps 1 --optim.warmup_steps 0",
}


@cache
def lightning_trainer_arguments() -> tuple[str, ...]:
    """The parameters of ``lightning.Trainer``."""
    return tuple(name for name in inspect.signature(L.Trainer.__init__).parameters if name != "self")


def lightning_argument_problems(arguments: dict) -> list[str]:
    """What is wrong with the names in ``trainer.lightning`` (Lightning itself checks the values)."""
    found = []
    for name in arguments:
        if name in LIGHTNING_REFUSED:
            found.append(f"trainer.{name} is not passed to Lightning's Trainer: {LIGHTNING_REFUSED[name]}")
        elif name in TRAINER_KEYS:
            found.append(f"trainer.lightning.{name}: trainer.{name} is a key of the config, set it there")
        elif name not in lightning_trainer_arguments():
            found.append(f"trainer.lightning.{name} is not an argument of lightning.Trainer")
    return found


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def default_config_path() -> Path:
    return bundle_path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def bundle_path(path: str | Path) -> Path:
    """Paths in the config are relative to the bundle root, wherever the process was started."""
    path = Path(path)
    return path if path.is_absolute() else BUNDLE_ROOT / path


def load_config(path: str | Path | None = None, overrides: Iterable[str | tuple[str, Any]] = ()) -> RunConfig:
    """Schema defaults <- YAML file <- overrides, then checked. An override is a typed value by its dotted key
    (``("model.n_layer", 2)``, what the command line's parser gives), or omegaconf's ``"model.n_layer=2"``."""
    path = bundle_path(path) if path is not None else default_config_path()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "was not found"
        raise ConfigError(f"config file {path} {what}: expected a YAML file (a relative --config is looked for in "
                          f"the current folder, then in the bundle; {CONFIG_ENV} names a file of the bundle)")
    source = f"{path} with the command line's overrides" if overrides else str(path)
    try:
        values = OmegaConf.load(path)
        if not isinstance(values, DictConfig):
            raise ConfigError(f"{path} must hold a mapping of sections (model:, data:, ...), not a "
                              f"{type(values).__name__.removesuffix('Config').lower()}")
        given = OmegaConf.create()
        for item in overrides:  # a later override replaces an earlier one; trainer.lightning's mapping merges
            if isinstance(item, str):
                given = OmegaConf.merge(given, OmegaConf.from_dotlist([item]))
            else:
                OmegaConf.update(given, item[0], item[1], force_add=True)
        return built(values, given)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    except (OmegaConfBaseException, ValueError) as error:  # ValueError: a section that cannot be built (ModelConfig)
        if isinstance(error, ConfigError):
            raise
        key = f"{error.full_key}: " if getattr(error, "full_key", None) else ""
        raise ConfigError(f"invalid configuration ({source}): {key}{str(error).splitlines()[0]}") from None


def load_config_dict(values: dict) -> RunConfig:
    """A configuration already resolved (as_dict's output), as a data-parallel worker receives it."""
    return built(OmegaConf.create(values))


def built(*layers: DictConfig) -> RunConfig:
    """The schema's defaults with ``layers`` merged over them in turn, interpolations resolved, defaults that
    follow other keys filled in, then checked."""
    merged = OmegaConf.merge(OmegaConf.structured(schema(RunConfig)), *map(lightning_arguments_apart, layers))

    def build(cls: type, items: dict) -> Any:
        hints = typing.get_type_hints(cls)
        return cls(**{name: build(hints[name], value) if is_dataclass(hints[name]) else value
                      for name, value in items.items()})

    cfg = build(RunConfig, OmegaConf.to_container(merged, resolve=True, throw_on_missing=True))
    if cfg.optim.decay_steps is None and cfg.trainer.max_steps > 0:  # the cosine schedule decays over the whole run
        cfg.optim.decay_steps = cfg.trainer.max_steps
    if not cfg.output.root.strip():  # RUNFABRIC_OUTPUT= (set but empty) is unset, as shells treat it: not the cwd
        cfg.output.root = "output"
    check_config(cfg)
    return cfg


def lightning_arguments_apart(values: DictConfig) -> DictConfig:
    """``trainer.NAME``, where NAME is an argument of lightning.Trainer and no key of the config, moved to
    ``trainer.lightning``: YAML files and overrides name a Trainer argument as Lightning does."""
    passed = [name for name in values.get("trainer") or ()
              if name not in TRAINER_KEYS and name in lightning_trainer_arguments()]
    if not passed:
        return values
    moved = OmegaConf.to_container(values, resolve=False)  # interpolations are resolved after the merge
    moved["trainer"]["lightning"] = (moved["trainer"].get("lightning") or {}) | {
        name: moved["trainer"].pop(name) for name in passed}
    return OmegaConf.create(moved)


@cache
def schema(section: type) -> type:
    """``section`` as omegaconf's schema, its choice keys typed ``str``: omegaconf before 2.4 refuses
    ``Literal`` fields. check_config checks the choices with either version."""
    hints = typing.get_type_hints(section)
    specs = []
    for item in fields(section):
        hint = hints[item.name]
        if is_dataclass(hint):
            specs.append((item.name, schema(hint), field(default_factory=schema(hint))))
        else:
            specs.append((item.name, without_literal(hint),
                          field(default=item.default, default_factory=item.default_factory)))
    return dataclasses.make_dataclass(section.__name__, specs)


def without_literal(hint: Any) -> Any:
    """``hint`` with each ``Literal[...]`` in it replaced by the type of its values."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return type(args[0])
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(without_literal(arg) for arg in args)]
    return list[without_literal(args[0])] if origin is list else hint


def check_config(cfg: RunConfig) -> None:
    """Every choice key holds one of its choices, every section checks itself (its ``problems()``), and every
    numeric key lies in its range (a section's own line about a key, which says what its special values mean,
    stands for the range's); all problems are reported at once, each once. A NaN or an infinity, which no key has
    a use for and which slips through range checks, is reported alone."""
    values = key_values(cfg)
    problems = [f"{key} must be a finite number, not {value}" for key, value in values.items()
                if isinstance(value, float) and not math.isfinite(value)] or [
        *filter(None, (value_problem(key, value) for key, value in values.items())),
        *cfg.model.problems(), *cfg.compute.problems(), *cfg.data.problems(),
        *cfg.optim.problems(cfg.trainer.max_steps), *cfg.trainer.problems(), *cfg.metrics.problems(),
        *cfg.observe.problems(),
    ]
    named = {word.strip("(),:;") for line in problems for word in line.split()}
    for key, (low, high) in KEY_RANGES.items():
        value, whole = values[key], isinstance(low, int)
        if value is not None and not low <= value <= high and key not in named:
            problems.append(f"{key} must be at least {low}, not {value}" if whole and 1 <= low and value < low
                            else f"{key} must be {'a whole number' if whole else 'a number'} in {range_text(key)}, "
                                 f"not {value}")
    problems = list(dict.fromkeys(problems))  # model/decoder.py checks model.family too, for a ModelConfig built alone
    if len(problems) == 1:
        raise ConfigError(f"invalid configuration: {problems[0]}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def as_dict(cfg: RunConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.create(dataclasses.asdict(cfg)), resolve=True)
