"""The host memory a run will need, against the job's budget for it (or, on the CPU, the memory there is).

RunFab grants the whole job 8 GiB of RAM however many GPUs it has, and charges it as PSS summed over the
process tree (runfab/process_memory.py reads it): the figures here are PSS.

- ``projected`` / ``host_budget_problem``: the job's peak for a GPU count (processes' PSS, the
  output folder, /tmp), from measured figures; train() and probe_batch() refuse a count that cannot
  fit before they read any data or start any worker.
- ``cpu_memory_problem``: a CPU run's processes against the memory this machine has left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from model.families import build_model
from model.flops import count_parameters, matrix_parameters
from model.kernels import ComputeConfig
from model.loss import padded_vocab_size
from runfab.limits import GIB, MIB, RAM_BYTES, TMP_BYTES

log = logging.getLogger(__name__)


# RunFab charges the processes' PSS, the RAM-backed output folder and /tmp to the one budget.
# The process figures are the whole job's peak PSS with the reference configuration under RunFab's
# procedure, pinned to 2 cores (docs/PERFORMANCE.md, "Host memory"): one GPU trains in RunFab's own
# process; each further GPU adds a forked worker and the feeder's share of its queue.
ONE_GPU_GIB = 3.06
PER_ADDED_GPU_GIB = 0.68
COMPILE_CACHE_GIB_PER_GPU = 0.02  # inductor, Triton and FA4 caches under the output's data/
MARGIN_GIB = 0.25  # what a sampler every 0.5 s can miss, and the spread between runs

# ----------------------------------------------------------------------------- budget


@dataclass(frozen=True)
class HostBudget:
    """What a GPU run of ``gpus`` GPUs is expected to hold of the job's RAM at its peak, in GiB."""

    gpus: int
    processes: float
    output: float
    tmp: float = TMP_BYTES / GIB  # RunFab's /tmp: the trainer writes nothing there, others may
    margin: float = MARGIN_GIB

    @property
    def total(self) -> float:
        return self.processes + self.output + self.tmp + self.margin

    def line(self, budget_gib: float) -> str:
        return (f"host memory for {self.gpus} GPU(s): processes {self.processes:.2f} + output {self.output:.2f} "
                f"+ /tmp {self.tmp:.2f} + margin {self.margin:.2f} = {self.total:.2f} GiB of {budget_gib:.1f} GiB")


def projected(gpus: int, output_bytes: float) -> HostBudget:
    """The projected peak for ``gpus`` GPUs whose run writes ``output_bytes`` (export, checkpoints)."""
    processes = ONE_GPU_GIB + PER_ADDED_GPU_GIB * (gpus - 1)
    return HostBudget(gpus, processes, output_bytes / GIB + COMPILE_CACHE_GIB_PER_GPU * gpus)


def output_bytes(cfg) -> int:
    """What a run writes to the output folder at its peak: the fp32 export (4 bytes a parameter) and,
    when checkpoints are on, two Lightning checkpoints (weights and AdamW's two moments, 12 bytes a
    parameter each, while the newest replaces the last)."""
    with torch.device("meta"):  # the real parameter count, without allocating anything
        parameters = count_parameters(build_model(cfg.model))
    return 4 * parameters + (2 * 12 * parameters if cfg.trainer.checkpoint_every_steps > 0 else 0)


def observation_bytes(cfg) -> int:
    """What the observation files of a run take in the output folder: 8x what the reference model's
    took on an H200 (a profiler trace per profiled update, a memory snapshot)."""
    return len(cfg.observe.profiled()) * (16 * MIB) + ((8 * MIB) if cfg.observe.memory_update > 0 else 0)


def host_budget_problem(budget_gib: float, gpus: int, output_bytes: float) -> str | None:
    """Why ``gpus`` GPUs cannot fit ``budget_gib`` of host memory, or None when they can (0: no check)."""
    if budget_gib <= 0:
        return None
    need = projected(gpus, output_bytes)
    if need.total <= budget_gib:
        return None
    fits = max((n for n in range(1, gpus) if projected(n, output_bytes).total <= budget_gib), default=0)
    advice = f"Use at most {fits} GPU(s): --trainer.devices {fits}, or fewer GPUs on RunFab's slider" if fits else (
        "Not even one GPU fits: shrink the model's export or raise the budget")
    return (f"{need.line(budget_gib)}: over the job's budget (trainer.host_memory_budget_gib; RunFab grants "
            f"{RAM_BYTES / GIB:g} GiB whatever the GPU count, output folder and /tmp included). {advice}")


# A CPU run keeps its activations in host memory too, and the reference model at microbatch 8
# needs tens of GiB there: the machine's own OOM killer, not a message, would end it. A process's
# peak RSS in the probe (two eager fp32 steps on worst-case rows) fits this model, checked against
# measured peaks in docs/PERFORMANCE.md ("Host memory"):
#   0.40 GiB imported (a one-layer probe's whole peak) + 0.03 GiB of headroom, so that the estimate stays
#     above the measured peaks (tests/unit/test_runtime_host_budget.py)
#   + 16 B per parameter (weights, gradients, AdamW's two moments)
#   + tokens x layers x (12 x width + k x MLP width) fp32 values (the blocks' saved activations: attention and norms,
#     and k per MLP unit: GPT-2's GELU MLP keeps 2 (its product and GELU), Llama's SwiGLU 4 (gate and up, SiLU,
#     their product); for GPT-2's 4 x width that is 20 x width)
#   + min(tokens, loss chunk) x padded vocabulary x 2.5 fp32 values (a chunk's logits, and the copy its softmax
#     and gradient are computed in: the logits are let go before the gradient's products)
#   + rows x row length^2 x heads x layers x 0.5 fp32 values (SDPA with a document mask).
CPU_PROCESS_GIB = 0.40 + 0.03
CPU_FP32_PER_TOKEN_LAYER_WIDTH = 12
CPU_FP32_PER_TOKEN_LAYER_MLP_UNIT = {"gpt2": 2, "llama": 4}
CPU_FP32_PER_LOGIT = 2.5
CPU_FP32_PER_ATTENTION_PAIR = 0.5


def cpu_parameters(model) -> int:
    """The parameters the estimate counts for ``model`` (a ModelConfig), the embedding at the padded vocabulary (the
    loss's weight copy and gradient are padded too)."""
    L, C, T = model.n_layer, model.n_embd, model.max_seq_len
    vocab = padded_vocab_size(model.vocab_size)
    if model.family == "gpt2":
        return vocab * C + T * C + L * (12 * C * C + 13 * C) + 2 * C
    heads = vocab * C * (1 if model.tie_embeddings else 2)
    return heads + matrix_parameters(model) - model.vocab_size * C + L * 2 * C + C


def cpu_process_bytes(model, microbatch: int, chunk_tokens: int = ComputeConfig.loss_chunk_tokens) -> float:
    """A CPU training process's peak host memory at ``microbatch`` rows (``model`` a ModelConfig; ``chunk_tokens``
    compute.loss_chunk_tokens)."""
    L, C, T = model.n_layer, model.n_embd, model.max_seq_len
    vocab = padded_vocab_size(model.vocab_size)  # the loss's weight copy and gradient are padded; so are its logits
    tokens = microbatch * T
    mlp_units = CPU_FP32_PER_TOKEN_LAYER_MLP_UNIT[model.family] * model.mlp_width
    per_token_layer = CPU_FP32_PER_TOKEN_LAYER_WIDTH * C + mlp_units
    logits = min(tokens, chunk_tokens or tokens) * vocab
    values = (per_token_layer * tokens * L + CPU_FP32_PER_LOGIT * logits
              + CPU_FP32_PER_ATTENTION_PAIR * microbatch * T * T * model.n_head * L)
    return CPU_PROCESS_GIB * GIB + 16 * cpu_parameters(model) + 4 * values


def available_host_bytes() -> float | None:
    """Memory this process may still take: the kernel's MemAvailable, capped by a cgroup v2 limit."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def cpu_memory_problem(model, microbatch: int, processes: int, available: float | None,
                       chunk_tokens: int = ComputeConfig.loss_chunk_tokens) -> str | None:
    """Why ``processes`` CPU training processes at ``microbatch`` rows cannot fit ``available`` bytes, or None."""
    if available is None:
        return None
    need = processes * cpu_process_bytes(model, microbatch, chunk_tokens)
    if need <= available:
        return None
    fits = next((m for m in range(microbatch - 1, 0, -1)
                 if processes * cpu_process_bytes(model, m, chunk_tokens) <= available), None)
    advice = f"--microbatch {fits}, " if fits else ""
    return (
        f"training on the CPU at microbatch {microbatch} needs about {need / GIB:.1f} GiB of host memory "
        f"({processes} process(es): activations, logits and attention of {microbatch} rows of {model.max_seq_len} "
        f"tokens, {model.n_layer} layers of width {model.n_embd}), but {available / GIB:.1f} GiB are available. "
        f"Use {advice}a smaller model (--config conf/smoke.yaml), or a GPU"
    )
