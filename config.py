"""The run configuration: typed sections, loaded from YAML with omegaconf, checked before anything is built.

Every default lives here once; `conf/*.yaml` presets override them, and dotted command-line
overrides (`--model.n_layer 2`) override the presets.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from datetime import timedelta
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from callbacks.observe import ObserveConfig
from stages import DataConfig
from lit_module import OptimConfig
from model import GPTConfig
from runfab_limits import GIB, OUTPUT_BYTES, RAM_BYTES

BUNDLE_ROOT = Path(__file__).resolve().parent
DEFAULT_CONFIG = "conf/config.yaml"
ACCELERATORS = ("auto", "cpu", "gpu")  # trainer.accelerator; auto: gpu when a CUDA GPU is visible
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true", "64-true")  # Lightning's names
WORKER_STARTS = ("auto", "fork", "exec")  # trainer.worker_start; launcher.py says what each does
CONFIG_ENV = "RUNFAB_CONFIG"
SEED_RANGE = range(2**32)  # what numpy's generators (and so Lightning's seed_everything) accept


@dataclass
class TrainerConfig:
    max_steps: int = 2000  # optimizer updates; -1: until the input ends
    max_time: str | None = None  # "DD:HH:MM:SS": training and export, counted from the start of fit
    export_reserve_seconds: int = 60  # kept out of max_time's training loop for the export and run record
    stop_grace_seconds: int = 90  # after SIGTERM/SIGINT, data-parallel ranks that have not stopped by then are killed
    precision: str | None = None  # None: bf16-mixed on CUDA, 32-true on CPU
    accelerator: str = "auto"  # Lightning accelerator (gpu, cpu); auto: gpu when CUDA is available
    val_every_steps: int = 250  # 0 disables validation
    val_batches: int | None = None  # None: the whole held-out pool
    progress_bar: bool | None = None  # None: when stderr is a terminal
    checkpoint_every_steps: int = 0  # 0: no intermediate checkpoints
    compile: bool | None = None  # torch.compile the model trunk; None: on CUDA only
    devices: int | None = None  # data-parallel processes; None: every visible GPU (1 on CPU)
    worker_processes: bool | None = None  # None: only with several devices; true: one device trains in a worker too
    memory_headroom_gib: float = 2.0  # GPU memory the allocator leaves free, in the probe and in training alike
    probe_margin_gib: float = 0.5  # the eager probe's cap is this much tighter than training's (compiled) cap
    cuda_alloc_conf: str | None = "expandable_segments:True"  # PYTORCH_CUDA_ALLOC_CONF unless the platform set one
    host_memory_budget_gib: float = RAM_BYTES / GIB  # RunFab's RAM for the job; GPU counts projected over it are refused (0: off)
    ddp_bucket_cap_mb: float = 25.0  # all-reduce bucket size (DDP's default); dynamo splits the compiled trunk there
    worker_start: str = "auto"  # fork: workers are copies of this process (imports shared, no start-up import); exec: fresh interpreters; auto: fork unless CUDA is initialized here

    def problems(self) -> list[str]:
        found = []
        if self.max_steps < 1 and self.max_steps != -1:
            found.append("trainer.max_steps must be positive, or -1 to train until the input ends")
        if self.max_time is not None:
            try:
                self.time_limit()
            except ValueError as error:
                found.append(str(error))
        if self.accelerator not in ACCELERATORS:
            found.append(f"trainer.accelerator must be one of {', '.join(ACCELERATORS)}, not {self.accelerator!r}")
        if self.precision is not None and self.precision not in PRECISIONS:
            found.append(f"trainer.precision must be one of {', '.join(PRECISIONS)} (or null: bf16-mixed on a GPU, "
                         f"32-true on a CPU), not {self.precision!r}")
        found += [f"trainer.{name} must be at least 1, not {getattr(self, name)}"
                  for name in ("devices", "val_batches") if getattr(self, name) is not None and getattr(self, name) < 1]
        found += [f"trainer.{name} must be >= 0 (0: off), not {getattr(self, name)}"
                  for name in ("val_every_steps", "checkpoint_every_steps", "export_reserve_seconds", "stop_grace_seconds")
                  if getattr(self, name) < 0]
        if self.memory_headroom_gib < 0 or self.probe_margin_gib < 0:
            found.append("trainer.memory_headroom_gib and trainer.probe_margin_gib must be >= 0")
        if self.worker_start not in WORKER_STARTS:
            found.append(f"trainer.worker_start must be one of {', '.join(WORKER_STARTS)}, not {self.worker_start!r}")
        if self.host_memory_budget_gib < 0 or self.ddp_bucket_cap_mb <= 0:
            found.append("trainer.host_memory_budget_gib must be >= 0 (0: no check) and trainer.ddp_bucket_cap_mb > 0")
        return found

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


@dataclass
class MetricsConfig:
    interval_seconds: float = 5.0  # RunFab wants a line every 5-10 s; 0 reports every update (debugging)
    peak_flops: float = 989e12  # MFU denominator per GPU: H100/H200 SXM dense BF16, as the training lab uses; 0: no mfu

    def problems(self) -> list[str]:
        found = ["metrics.interval_seconds must be >= 0 (0 reports every update)"] if self.interval_seconds < 0 else []
        if self.peak_flops < 0:
            found.append(f"metrics.peak_flops must be >= 0 (0: no mfu), not {self.peak_flops}")
        return found


@dataclass
class OutputConfig:
    root: str = "${oc.env:RUNFABRIC_OUTPUT,output}"  # RunFab's output root; ./output when unset or empty
    budget_bytes: int = OUTPUT_BYTES  # RunFab keeps all output in 3 GiB of RAM: model, checkpoints, caches

    def problems(self) -> list[str]:
        return [f"output.budget_bytes must be at least 1, not {self.budget_bytes}"] if self.budget_bytes < 1 else []


@dataclass
class RunConfig:
    seed: int = 1337  # seeds every random generator of the run (model init, data shuffle)
    model: GPTConfig = field(default_factory=GPTConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    output: OutputConfig = field(default_factory=OutputConfig)


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""


def default_config_path() -> Path:
    return bundle_path(os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG)


def bundle_path(path: str | Path) -> Path:
    """Paths in the config are relative to the bundle root, wherever the process was started."""
    path = Path(path)
    return path if path.is_absolute() else BUNDLE_ROOT / path


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Schema defaults <- YAML file <- dotted overrides ("model.n_layer=2"), then checked."""
    path = bundle_path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"config file {path} not found (a relative --config is looked for in the current folder, "
                          f"then in the bundle; {CONFIG_ENV} names a file of the bundle)")
    source = f"{path} with the command line's overrides" if overrides else str(path)
    try:
        values = OmegaConf.load(path)
        if not isinstance(values, DictConfig):
            raise ConfigError(f"{path} must hold a mapping of sections (model:, data:, ...), not a "
                              f"{type(values).__name__.removesuffix('Config').lower()}")
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), values, OmegaConf.from_dotlist(overrides or []))
        config = OmegaConf.to_object(merged)
    except ConfigError:
        raise
    except (OmegaConfBaseException, ValueError) as error:  # ValueError: a section that cannot be built (GPTConfig)
        raise ConfigError(f"invalid configuration ({source}): {error}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from None
    resolve_defaults(config)
    check_config(config)
    return config


def resolve_defaults(cfg: RunConfig) -> None:
    """Defaults that follow other settings: the cosine schedule decays over the whole run."""
    if cfg.optim.decay_steps is None and cfg.trainer.max_steps > 0:
        cfg.optim.decay_steps = cfg.trainer.max_steps
    if not cfg.output.root.strip():  # RUNFABRIC_OUTPUT= (set but empty) is unset, as shells treat it: not the cwd
        cfg.output.root = "output"


def load_config_dict(values: dict) -> RunConfig:
    """A configuration already resolved (as_dict's output), as a data-parallel worker receives it."""
    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.create(values)))
    resolve_defaults(config)
    check_config(config)
    return config


def check_config(cfg: RunConfig) -> None:
    """Every section checks itself (its ``problems()``); all problems are reported at once. A NaN or an
    infinity, which no key has a use for and which slips through range checks, is reported alone."""
    problems = non_finite_keys(cfg) or [
        *([] if cfg.seed in SEED_RANGE else [f"seed must be a whole number in 0..{SEED_RANGE[-1]}, not {cfg.seed}"]),
        *cfg.model.problems(), *cfg.data.problems(), *cfg.optim.problems(cfg.trainer.max_steps),
        *cfg.trainer.problems(), *cfg.metrics.problems(), *cfg.observe.problems(), *cfg.output.problems(),
    ]
    if len(problems) == 1:
        raise ConfigError(f"invalid configuration: {problems[0]}")
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def non_finite_keys(section: object, prefix: str = "") -> list[str]:
    """A line for every key of ``section`` (and the sections under it) that holds a NaN or an infinity."""
    found = []
    for item in fields(section):
        value = getattr(section, item.name)
        if is_dataclass(value):
            found += non_finite_keys(value, f"{prefix}{item.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            found.append(f"{prefix}{item.name} must be a finite number, not {value}")
    return found


def training_time_limit(cfg: RunConfig) -> timedelta | None:
    """``trainer.max_time`` less the export reserve: what the training loop itself may use."""
    return cfg.trainer.time_limit()


def as_dict(cfg: RunConfig) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
