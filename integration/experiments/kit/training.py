"""The networks of the experiments and how they are trained: a network's spec, its objective,
Adam with cosine decay and random flips, early stopping on a validation score.

- :class:`NetSpec`, :func:`build`, :func:`training_objective`: a U-Net or an SSN and its loss
  (BCE with a foreground weight; the SSN loss of :func:`lsn_ext.models.ssn_loss` per pixel);
- :func:`train`, :class:`EarlyStopping`, :func:`hash_int`: the training loop (seeded by the
  spec's tag), with the best checkpoint kept when it stops early;
- :func:`mean_logits`, :func:`validation_dice`: the early-stopping score of the converged runs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from integration.experiments.kit.budget import Budget
from integration.experiments.kit.data import Data
from lsn_ext.data import random_flips
from lsn_ext.metrics import dice_per_image
from lsn_ext.models import SSN, UNet, ssn_loss


@dataclass(frozen=True)
class NetSpec:
    """One network to train: architecture and loss."""

    kind: str  # "unet" or "ssn"
    rank: int = 0
    dropout: float = 0.0
    member: int = 0
    ssn_samples: int = 20
    antithetic: bool = True
    step_factor: int = 1
    objective: str = "logsumexp"  # ssn_loss's objective

    def tag(self) -> str:
        """The spec as a name: part of its cache file names and of its training seed."""
        tag = (
            f"{self.kind}-r{self.rank}-d{self.dropout}-m{self.member}-M{self.ssn_samples}"
            f"-a{int(self.antithetic)}-x{self.step_factor}"
        )
        return tag if self.objective == "logsumexp" else f"{tag}-{self.objective}"


def build(spec: NetSpec, budget: Budget, in_channels: int) -> nn.Module:
    """The untrained network of ``spec`` at ``budget``'s widths (SSN rank at most its rank)."""
    if spec.kind == "unet":
        return UNet(in_channels, 1, widths=budget.widths, dropout=spec.dropout)
    rank = min(spec.rank, budget.rank)
    return SSN.with_unet(in_channels, widths=budget.widths, rank=rank, dropout=spec.dropout)


def training_objective(
    spec: NetSpec, factor: float
) -> Callable[[nn.Module, Tensor, Tensor], Tensor]:
    """``loss(net, x, y)`` of ``spec`` with foreground weight ``factor`` (SSN: per pixel)."""
    if spec.kind == "unet":
        weight = torch.tensor(float(factor))
        return lambda net, x, y: F.binary_cross_entropy_with_logits(net(x), y, pos_weight=weight)

    def ssn_objective(net: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        out = net.distribution(x)
        loss = ssn_loss(
            out,
            y,
            spec.ssn_samples,
            antithetic=spec.antithetic,
            pos_weight=factor,
            objective=spec.objective,
        )
        return loss / y[0].numel()

    return ssn_objective


@dataclass
class EarlyStopping:
    """Early stopping for :func:`train`: a validation score (higher is better) every
    ``every`` steps; training stops after ``patience`` evaluations without improvement and
    the network returns with the weights of its best evaluation. :func:`train` fills in
    ``best_step``, ``best_score`` and ``steps_run``; ``stopped`` says whether the patience ran
    out before the step cap. No stop before ``min_steps``, nor while the best score is still at
    or below ``floor`` (e.g. a network at background, Dice 0, runs to the cap).
    """

    score: Callable[[nn.Module], float]
    every: int
    patience: int
    min_steps: int = 0
    floor: float = -math.inf
    best_step: int = 0
    best_score: float = -math.inf
    steps_run: int = 0
    stopped: bool = False

    def check(self, net: nn.Module, step: int, last: bool = False) -> bool:
        """Evaluate after ``step`` steps (eval mode, no gradients); True: stop now."""
        self.steps_run = step
        if step % self.every and not last:
            return False
        net.eval()
        with torch.no_grad():
            score = float(self.score(net))
        net.train()
        if score > self.best_score:
            self.best_score, self.best_step = score, step
            self._best = {k: v.detach().clone() for k, v in net.state_dict().items()}
        self.stopped = (
            step >= self.min_steps
            and self.best_score > self.floor
            and step - self.best_step >= self.patience * self.every
        )
        return self.stopped

    def restore(self, net: nn.Module) -> None:
        """Load the best evaluation's weights into ``net`` (after :func:`train`)."""
        if hasattr(self, "_best"):
            net.load_state_dict(self._best)
            del self._best


def train(
    spec: NetSpec,
    data: Data,
    factor: float,
    seed: int,
    budget: Budget,
    stopping: EarlyStopping | None = None,
) -> nn.Module:
    """Adam with cosine decay for ``budget.steps × spec.step_factor`` steps, random flips.

    With ``stopping``, the steps are a cap: training ends when the validation score has not
    improved for ``stopping.patience`` evaluations, with the best evaluation's weights.
    """
    torch.manual_seed(seed * 1000 + hash_int(spec.tag()))
    net = build(spec, budget, data.train_x.shape[1])
    objective = training_objective(spec, factor)
    steps = budget.steps * spec.step_factor
    opt = torch.optim.Adam(net.parameters(), lr=budget.lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed * 7919 + hash_int(spec.tag()))
    net.train()
    order: list[Tensor] = []
    for step in range(1, steps + 1):
        if not order:
            order = list(torch.randperm(len(data.train_x), generator=gen).split(budget.batch_size))
        idx = order.pop(0)
        xb, yb = random_flips(data.train_x[idx], data.train_y[idx], gen)
        loss = objective(net, xb, yb)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"{spec.tag()} diverged (loss {loss.item()})")
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        if stopping is not None and stopping.check(net, step, last=step == steps):
            break
    if stopping is not None:
        stopping.restore(net)
    return net.eval()


def hash_int(text: str) -> int:
    """A stable integer of ``text`` (24 bits of its SHA-1), for seeds."""
    return int(hashlib.sha1(text.encode()).hexdigest()[:6], 16)


def mean_logits(net: nn.Module, x: Tensor) -> Tensor:
    """The logits of a U-Net, or the mean logits of an SSN."""
    return net.distribution(x).mean if isinstance(net, SSN) else net(x)


def validation_dice(net: nn.Module, data: Data) -> float:
    """Dice of ``logit > 0`` (SSN: its mean logit) pooled over the validation images."""
    pred = mean_logits(net, data.val_x) > 0
    return float(dice_per_image(pred.reshape(1, -1), (data.val_y > 0.5).reshape(1, -1))[0])
