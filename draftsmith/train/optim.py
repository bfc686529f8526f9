"""The optimizers draftsmith trains with: AdamW, or Muon on the hidden layers' matrices with AdamW on the
rest (`MuonAdamW`), on one schedule (linear warm-up, cosine decay to a floor); the gradient clipping every
training module uses; and `warmup_cosine_optimizers`, what each module's `configure_optimizers` returns.

The learning rate rises linearly from 0 over `warmup_steps`, then follows half a cosine down to
`min_lr_ratio · lr` at the end of training (transformers' `get_cosine_with_min_lr_schedule_with_warmup`
when training is bounded by steps). The end is the last step where `trainer.max_steps` (or epochs)
bound training; where only `trainer.max_time` does, the cosine runs over the share of that time spent,
so a run given twenty minutes finishes its schedule in twenty minutes on any machine.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch

from draftsmith import DraftsmithError


def cosine_factor(progress: float, min_lr_ratio: float) -> float:
    """The learning rate ÷ its peak after warm-up, `progress` (0..1) of the way through training."""
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, progress))))


OPTIMIZERS = ("adamw", "muon")
NS_STEPS = 5  # Newton–Schulz steps a Muon update runs unless told otherwise, as Muon's authors run it


def newton_schulz(update: torch.Tensor, steps: int = NS_STEPS, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The matrix `update` orthogonalized: U S' V^T for its SVD U S V^T, S' near 1 (within about 0.7..1.2),
    by Muon's quintic Newton–Schulz iteration X <- aX + (bA + cA^2)X, A = XX^T, (a, b, c) = (3.4445,
    -4.7750, 2.0315) (Jordan et al., 2024, "Muon: An optimizer for hidden layers in neural networks"),
    on the wide orientation of the matrix, in `dtype`."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.to(dtype)
    wide = x.shape[0] <= x.shape[1]
    x = x if wide else x.T
    x = x / x.norm().clamp_min(1e-7)  # the spectral norm at most 1, where the iteration converges
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x if wide else x.T


class MuonAdamW(torch.optim.Optimizer):
    """Muon (momentum, Nesterov, the update orthogonalized by `newton_schulz`) for the param groups marked
    `muon`, AdamW for the others, in one optimizer, as Lightning's automatic optimization wants one.

    A Muon matrix of shape (A, B) moves by lr · 0.2 · sqrt(max(A, B)) times its orthogonalized update,
    which gives the update the root-mean-square of a typical AdamW step (Liu et al., 2025, "Muon is
    Scalable for LLM Training"), so that one learning rate and schedule serve both kinds of group.
    Weight decay is decoupled in both. `dtype` is the Newton–Schulz iteration's: bfloat16 where the
    CPU or GPU multiplies it fast, float32 where it does not."""

    def __init__(self, groups: list[dict[str, Any]], lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, momentum: float = 0.95, eps: float = 1e-8, ns_steps: int = NS_STEPS,
                 dtype: torch.dtype = torch.bfloat16):
        for g in groups:
            if g.get("muon") and any(p.ndim != 2 for p in g["params"]):
                raise DraftsmithError("Muon updates matrices: a `muon` group holds a parameter that is not 2-D")
        super().__init__(groups, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, momentum=momentum,
                                      eps=eps, ns_steps=ns_steps, muon=False))
        self.ns_dtype = dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g in self.param_groups:
            lr, wd = g["lr"], g["weight_decay"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                grad, state = p.grad, self.state[p]
                p.mul_(1 - lr * wd)
                if g["muon"]:
                    if not state:
                        state["momentum"] = torch.zeros_like(p)
                    buf = state["momentum"].lerp_(grad, 1 - g["momentum"])
                    update = newton_schulz(grad.lerp(buf, g["momentum"]), g["ns_steps"], self.ns_dtype)
                    p.add_(update.to(p.dtype), alpha=-lr * 0.2 * math.sqrt(max(p.shape)))
                    continue
                if not state:
                    state["step"], state["exp_avg"], state["exp_avg_sq"] = 0, torch.zeros_like(p), torch.zeros_like(p)
                b1, b2 = g["betas"]
                state["step"] += 1
                state["exp_avg"].lerp_(grad, 1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(grad, grad, value=1 - b2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** state["step"])).add_(g["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - b1 ** state["step"]))
        return loss


def adamw_warmup_cosine(params: Iterable[torch.nn.Parameter], lr: float, total_steps: float, warmup_steps: int,
                        min_lr_ratio: float, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                        spent: Callable[[], float] | None = None,
                        muon: Iterable[torch.nn.Parameter] | None = None,
                        ns_dtype: torch.dtype = torch.bfloat16, ns_steps: int = NS_STEPS) -> dict[str, Any]:
    """What `configure_optimizers` returns; the schedule steps every optimizer step.

    spent: the share of a time budget spent so far (0..1); the cosine follows it instead of the steps
    (`total_steps` is then unused).
    muon: the parameters (matrices among `params`) Muon updates; the others AdamW (`MuonAdamW`). None:
    AdamW for all. ns_dtype, ns_steps: its Newton–Schulz iteration's (`newton_schulz`)."""
    params = [p for p in params if p.requires_grad]
    if muon is None:
        opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    else:
        mats = {id(p) for p in muon}
        groups = [{"params": [p for p in params if id(p) in mats], "muon": True},
                  {"params": [p for p in params if id(p) not in mats], "muon": False}]
        opt = MuonAdamW([g for g in groups if g["params"]], lr=lr, betas=betas, weight_decay=weight_decay,
                        ns_steps=ns_steps, dtype=ns_dtype)
    decay_steps = max(1, int(total_steps) - warmup_steps) if spent is None else 1

    def factor(step: int) -> float:  # a plain function: LambdaLR keeps no state of it in a checkpoint
        if step < warmup_steps:  # by steps alone: no clock read (under DDP each read is a broadcast)
            return step / warmup_steps
        return cosine_factor((step - warmup_steps) / decay_steps if spent is None else spent(), min_lr_ratio)

    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def budget_timer(trainer: Any) -> Any:
    """Lightning's Timer callback where `trainer.max_time` bounds training, else None."""
    from pytorch_lightning.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    return timer if timer is not None and timer.time_remaining() is not None else None


def time_spent(trainer: Any) -> Callable[[], float]:
    """The share of `trainer.max_time` spent in training, from Lightning's own Timer (which restores it on
    resume and stops the run at 1). Across processes every rank takes rank 0's reading, so that all apply
    the same learning rate."""
    timer = budget_timer(trainer)
    if timer is None:
        raise DraftsmithError("training has no end: set trainer.max_steps (or max_epochs) or trainer.max_time")

    def spent() -> float:
        elapsed = timer.time_elapsed()
        share = elapsed / max(elapsed + timer.time_remaining(), 1e-9)
        return trainer.strategy.broadcast(share) if trainer.world_size > 1 else share
    return spent


def clip_gradients(module: Any, optimizer: torch.optim.Optimizer, clip_val: float | None,
                   algorithm: str | None) -> None:
    """A training module's `configure_gradient_clipping`: Lightning's clipping, except by norm under FSDP.

    Lightning's FSDP precision refuses `gradient_clip_algorithm="norm"` (each rank holds only a shard of
    every gradient); the FSDP root module's own `clip_grad_norm_` reduces the shards' norms across ranks."""
    from pytorch_lightning.strategies import FSDPStrategy

    if clip_val and algorithm in (None, "norm") and isinstance(module.trainer.strategy, FSDPStrategy):
        module.trainer.model.clip_grad_norm_(clip_val)
    else:
        module.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)


def warmup_cosine_optimizers(module: Any, trained: Iterable[torch.nn.Parameter],
                             muon: Callable[[], list[torch.nn.Parameter]] | None = None) -> dict[str, Any]:
    """A training module's `configure_optimizers`: AdamW over `trained` on `adamw_warmup_cosine`'s schedule, from
    the module's hyper-parameters lr, warmup_steps, min_lr_ratio, weight_decay and, where it has them, betas and
    optimizer; over steps or, where only max_time bounds training, over time. With the hyper-parameter
    `optimizer: muon`, the parameters `muon()` names (a module that offers Muon gives it) go to Muon,
    orthogonalized by `muon_ns_steps` Newton–Schulz steps, and the rest to AdamW (`MuonAdamW`)."""
    h, total = module.hparams, module.trainer.estimated_stepping_batches
    spent = time_spent(module.trainer) if math.isinf(total) else None
    chosen = None
    if h.get("optimizer", "adamw") == "muon":
        from pytorch_lightning.strategies import DeepSpeedStrategy, FSDPStrategy

        if muon is None:
            raise DraftsmithError(f"{type(module).__name__} trains with AdamW only")
        if isinstance(module.trainer.strategy, (FSDPStrategy, DeepSpeedStrategy)):
            raise DraftsmithError("optimizer muon orthogonalizes whole matrices, which FSDP and DeepSpeed shard "
                                  "across devices: train with DDP (`trainer.strategy: ddp`) or optimizer adamw")
        chosen = muon()
    ns_dtype = torch.bfloat16 if "bf16" in str(module.trainer.precision) else torch.float32
    return adamw_warmup_cosine(trained, h.lr, total, h.warmup_steps, h.min_lr_ratio, h.weight_decay,
                               betas=h.get("betas", (0.9, 0.999)), spent=spent, muon=chosen, ns_dtype=ns_dtype,
                               ns_steps=h.get("muon_ns_steps", NS_STEPS))
