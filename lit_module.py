"""The LightningModule: the decoder, its loss normalization, optimizer and schedule. No I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import lightning as L
import torch
from torch.profiler import record_function
from torchmetrics.aggregation import MeanMetric

from model.decoder import ModelConfig
from model.families import build_model
from model.kernels import ComputeConfig, Target


Schedule = Literal["cosine", "constant", "wsd"]
OptimizerName = Literal["adamw", "muon"]


@dataclass
class OptimConfig:
    """The ``optim`` section of the config: the optimizer and the learning-rate schedule."""

    name: OptimizerName = "adamw"
    """adamw: AdamW for every parameter. muon: torch.optim.Muon for the blocks' weight matrices (muon_lr), AdamW
    (lr, embed_lr, head_lr) for the embeddings, the LM head, norms and biases; the schedule scales every rate"""
    lr: float = 6e-4
    """Peak learning rate of AdamW, reached at the end of warmup"""
    embed_lr: float | None = None
    """AdamW's peak learning rate for the token embedding (and gpt2's position embedding; a tied LM head is the
    token embedding, so it takes this too); null: lr"""
    head_lr: float | None = None
    """AdamW's peak learning rate for an untied LM head (llama's model.tie_embeddings false); null: lr"""
    min_lr_ratio: float = 0.1
    """Where the cosine schedule ends, as a fraction of lr"""
    weight_decay: float = 0.1
    """AdamW weight decay of the weight matrices; norms and biases get none"""
    decay_embeddings: bool = False
    """Apply weight_decay to the token embedding (and gpt2's position embedding) too. An untied LM head (llama's
    model.tie_embeddings false) is a weight matrix and always decays"""
    beta1: float = 0.9
    """AdamW's first-moment decay"""
    beta2: float = 0.95
    """AdamW's second-moment decay"""
    eps: float = 1e-8
    """AdamW's epsilon"""
    warmup_steps: int = 100
    """Optimizer updates of linear warmup from 0 to lr"""
    schedule: Schedule = "cosine"
    """Learning rate after warmup: cosine (down to lr x min_lr_ratio at decay_steps), constant, or wsd (warmup, a
    stable plateau at lr, then a linear decay to lr x min_lr_ratio over the last decay_fraction of decay_steps)"""
    decay_steps: int | None = None
    """Update at which the cosine or wsd schedule reaches its floor, counted from the first update; null:
    trainer.max_steps"""
    decay_fraction: float = 0.2
    """wsd: the fraction of decay_steps, at its end, over which the learning rate decays"""
    fused: bool | None = None
    """AdamW's fused kernel; null: on CUDA"""
    muon_lr: float = 0.02
    """muon: peak learning rate of Muon (scaled per matrix by sqrt(max(1, rows / columns)), as Muon's default does)"""
    muon_momentum: float = 0.95
    """muon: Muon's momentum (Nesterov)"""
    muon_weight_decay: float = 0.0
    """muon: Muon's decoupled weight decay of the blocks' matrices (weight_decay applies to AdamW's matrices)"""

    def problems(self, max_steps: int) -> list[str]:
        """What makes the schedule impossible; ``max_steps`` (trainer.max_steps) is where decay_steps comes from by default."""
        ranges = [
            ("optim.lr", self.lr > 0, "> 0"),
            ("optim.embed_lr", self.embed_lr is None or self.embed_lr > 0, "> 0, or null (optim.lr)"),
            ("optim.head_lr", self.head_lr is None or self.head_lr > 0, "> 0, or null (optim.lr)"),
            ("optim.min_lr_ratio", 0 <= self.min_lr_ratio <= 1, "in [0, 1]"),
            ("optim.weight_decay", self.weight_decay >= 0, ">= 0"), ("optim.beta1", 0 <= self.beta1 < 1, "in [0, 1)"),
            ("optim.beta2", 0 <= self.beta2 < 1, "in [0, 1)"), ("optim.eps", self.eps > 0, "> 0"),
            ("optim.warmup_steps", self.warmup_steps >= 0, ">= 0"),
            ("optim.decay_steps", self.decay_steps is None or self.decay_steps >= 1, ">= 1, or null (trainer.max_steps)"),
            ("optim.decay_fraction", 0 < self.decay_fraction <= 1, "in (0, 1]"),
            ("optim.muon_lr", self.muon_lr > 0, "> 0"), ("optim.muon_momentum", 0 <= self.muon_momentum < 1, "in [0, 1)"),
            ("optim.muon_weight_decay", self.muon_weight_decay >= 0, ">= 0"),
        ]
        found = [f"{name} must be {rule}, not {getattr(self, name.split('.')[1])}" for name, ok, rule in ranges if not ok]
        if found:
            return found
        if self.schedule == "constant":
            return []
        if self.decay_steps is None:
            return [f"trainer.max_steps is -1 (until the input ends), so the {self.schedule} schedule has no horizon: "
                    "set optim.decay_steps, or use optim.schedule constant"]
        source = " (it follows trainer.max_steps)" if self.decay_steps == max_steps else ""
        if self.schedule == "cosine" and not self.decay_steps > self.warmup_steps:
            return [f"the cosine schedule warms up for optim.warmup_steps ({self.warmup_steps}) steps and decays until "
                    f"optim.decay_steps ({self.decay_steps}){source}, which must be later: for a run this short set "
                    f"optim.warmup_steps below {self.decay_steps}, or use optim.schedule constant"]
        if self.schedule == "wsd" and not wsd_decay_start(self) >= self.warmup_steps:
            return [f"the wsd schedule warms up for optim.warmup_steps ({self.warmup_steps}) steps but starts its decay "
                    f"at update {wsd_decay_start(self)}: the last optim.decay_fraction ({self.decay_fraction}) of "
                    f"optim.decay_steps ({self.decay_steps}){source}; lower optim.warmup_steps or optim.decay_fraction"]
        return []


def wsd_decay_start(cfg: OptimConfig) -> int:
    """The update at which the wsd schedule leaves its plateau."""
    return round((cfg.decay_steps or 0) * (1 - cfg.decay_fraction))


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Linear warmup to 1, then constant, cosine down to ``min_lr_ratio`` at ``decay_steps``, or wsd: 1 until
    ``wsd_decay_start``, then linear down to ``min_lr_ratio`` at ``decay_steps``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "wsd":
        start = wsd_decay_start(cfg)
        progress = min(1.0, max(0, step - start) / max(1, (cfg.decay_steps or 1) - start))
        return 1 - (1 - cfg.min_lr_ratio) * progress
    horizon = max(1, (cfg.decay_steps or 1) - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / horizon)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class DecoderTrainingModule(L.LightningModule):
    """Trains the decoder (either family) so that every optimizer update's gradient is exactly

        sum of the update's target-token losses / the update's target-token count,

    however the update is split into microbatches (accumulation) and ranks.
    """

    def __init__(self, model_config: ModelConfig, optim_config: OptimConfig,
                 compute_config: ComputeConfig | None = None, target: Target | None = None) -> None:
        super().__init__()
        self.optim_config = optim_config
        self.model = build_model(model_config, compute_config, target)  # its kernels chosen for ``target``
        self.val_loss = MeanMetric()
        self.last_grad_norm: torch.Tensor | None = None
        self._step_marker: record_function | None = None  # open from on_before_optimizer_step to optimizer_step's end

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        with record_function("forward"):  # markers name the phases in profiler traces and memory snapshots
            loss_sum = self.model.loss_sum(batch)
        # Lightning divides the returned loss by accumulate_grad_batches and DDP averages gradients
        # over ranks; multiplying both back makes the update's gradient the exact per-token mean.
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size / batch["update_target_tokens"]
        return {"loss": loss_sum * scale, "loss_sum": loss_sum.detach(), "target_tokens": batch["target_tokens"]}

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        with record_function("backward"):
            super().backward(loss, *args, **kwargs)

    def on_before_optimizer_step(self, optimizer) -> None:
        self._step_marker = record_function("optimizer_step")  # clipping and the AdamW step
        self._step_marker.__enter__()

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        if self._step_marker is not None:
            self._step_marker.__exit__(None, None, None)
            self._step_marker = None

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer) -> None:
        with record_function("zero_grad"):
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss_sum = self.model.loss_sum(batch)
        count = (batch["targets"] >= 0).sum()
        self.val_loss.update(loss_sum / count.clamp(min=1), weight=count)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip by total norm to the Trainer's ``gradient_clip_val`` (trainer.gradient_clip_val), and keep the
        pre-clip norm on the device for the metrics (no host sync), also when nothing is clipped."""
        max_norm = gradient_clip_val if gradient_clip_val else float("inf")
        self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, foreach=True)

    def parameter_groups(self, params: list[torch.nn.Parameter] | None = None) -> list[dict]:
        """AdamW's groups: weight decay on matrices only; norms, biases and (by default) embeddings are left alone.
        The embeddings (optim.embed_lr) and an untied head (optim.head_lr) given a learning rate of their own are
        a group each after those two, the rest at optim.lr. ``params``: the parameters AdamW holds (default: all)."""
        cfg = self.optim_config
        embeddings = {id(p) for p in self.model.embeddings()}
        head = self.model.lm_head_weight
        own = {}  # parameter id -> the name of its own group
        if cfg.embed_lr is not None:
            own |= dict.fromkeys(embeddings, "embeddings")
        if cfg.head_lr is not None and id(head) not in embeddings:
            own[id(head)] = "head"
        decay, no_decay, apart = [], [], {"embeddings": [], "head": []}
        for p in self.model.parameters() if params is None else params:
            is_embedding = id(p) in embeddings
            if id(p) in own:
                apart[own[id(p)]].append(p)
            elif p.dim() >= 2 and (not is_embedding or cfg.decay_embeddings):
                decay.append(p)
            else:
                no_decay.append(p)
        groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        if apart["embeddings"]:
            groups.append({"params": apart["embeddings"], "lr": cfg.embed_lr,
                           "weight_decay": cfg.weight_decay if cfg.decay_embeddings else 0.0})
        if apart["head"]:  # a matrix of its own: it decays
            groups.append({"params": apart["head"], "lr": cfg.head_lr, "weight_decay": cfg.weight_decay})
        return groups

    def muon_parameters(self) -> list[torch.nn.Parameter]:
        """What Muon holds under optim.name muon: the blocks' weight matrices (not the embeddings nor the head)."""
        return [p for p in self.model.blocks.parameters() if p.dim() == 2]

    def configure_optimizers(self):
        cfg = self.optim_config
        fused = cfg.fused if cfg.fused is not None else self.device.type == "cuda"
        matrices = self.muon_parameters() if cfg.name == "muon" else []
        held = {id(p) for p in matrices}
        adamw = torch.optim.AdamW(self.parameter_groups([p for p in self.model.parameters() if id(p) not in held]),
                                  lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
        optimizer = adamw if not matrices else OptimizerPair(
            torch.optim.Muon(matrices, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.muon_weight_decay),
            adamw,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class OptimizerPair(torch.optim.Optimizer):
    """Two optimizers over disjoint parameters presented as one, since Lightning's automatic optimization (gradient
    accumulation, clipping, precision) steps one optimizer. Its ``param_groups`` are the two optimizers' own group
    dicts, so a scheduler setting a group's lr sets it in the optimizer that holds the group; its state dict holds
    both optimizers' state dicts."""

    def __init__(self, first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
        self.optimizers = (first, second)
        super().__init__([p for group in first.param_groups + second.param_groups for p in group["params"]], {})
        self.param_groups = first.param_groups + second.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def state_dict(self) -> dict:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        states = state_dict.get("optimizers")
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ValueError(f"expected the state of {len(self.optimizers)} optimizers (optim.name muon), found "
                             f"{type(states).__name__}: was the checkpoint written with another optim.name?")
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)
