"""The user's torch.optim.SGD, Adam or AdamW step, applied by the release in its own pass (``DPOptimizer.step``).

Unfused, a DP step reads and writes every parameter-sized tensor once per operation: the noise, the division by the
expected batch size, then the optimizer's own passes (SGD with momentum: the buffer's update and the parameter's;
Adam: the moments, the denominator, the parameter's). Fused (``fastdp.ops.release_``), each element of the sum,
the parameter and its state is read and written once: SGD with momentum moves 24 bytes per float32 parameter
instead of 40 or more, Adam 32 instead of 60 or more.

:class:`TorchOptimizerStep` translates the optimizer's param groups into ``fastdp.ops.OptimizerUpdate``s: the
same hyperparameters read at each step (learning-rate schedulers work), the state in the optimizer's own
``state`` under torch's names (``momentum_buffer``; ``step``, ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``),
so ``state_dict()``, checkpoints and a later unfused step see what torch's step would have left, up to fp32
rounding (torch's own foreach, fused and single-tensor implementations differ likewise). Only what the kernel
implements is fused; anything else (another optimizer or a subclass, hooks, a patched ``step``, ``differentiable``
or ``capturable``, non-float32 parameters, tensor hyperparameters on a GPU, sparse gradients) runs the optimizer's
own ``step()`` after an unfused release, as before.
"""

from __future__ import annotations

import math

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer
from torch.optim import optimizer as torch_optimizer

from fastdp.ops import OptimizerUpdate

_FUSABLE = (SGD, Adam, AdamW)


def _scalar(value) -> float | None:
    """A hyperparameter as a float, None if reading it would synchronise with a device."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" and value.numel() == 1 else None
    return float(value)


def fusable(optimizer: Optimizer) -> bool:
    """Whether the release can apply ``optimizer``'s step (a static check; :meth:`TorchOptimizerStep.updates`
    checks the parameters)."""
    if type(optimizer) not in _FUSABLE or "step" in vars(optimizer):  # a subclass, or a step patched by a scheduler
        return False
    if optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks:
        return False
    if torch_optimizer._global_optimizer_pre_hooks or torch_optimizer._global_optimizer_post_hooks:
        return False
    return not any(group.get("differentiable") or group.get("capturable") for group in optimizer.param_groups)


class TorchOptimizerStep:
    """``optimizer``'s step as ``fastdp.ops`` updates (see the module docstring)."""

    def __init__(self, optimizer: Optimizer):
        self.optimizer = optimizer
        self.applied = False

    def updates(self, params: list[torch.nn.Parameter], sums: list[torch.Tensor]) -> list[OptimizerUpdate] | None:
        position = {id(p): i for i, p in enumerate(params)}
        groups = []
        for group in self.optimizer.param_groups:
            members = []
            for p in group["params"]:
                if id(p) not in position:
                    if p.grad is not None:  # a parameter the release does not write, with a gradient: torch's step
                        return None
                    continue
                i = position[id(p)]
                if p.dtype != sums[i].dtype or p.dtype not in (torch.float32, torch.float64) or p.is_sparse:
                    return None
                if group.get("fused") and p.device.type != "cpu":  # torch keeps a fused step's count on the GPU
                    return None
                members.append((i, p))
            hyper = {key: _scalar(group[key]) for key in ("lr", "weight_decay")}
            if isinstance(self.optimizer, SGD):
                hyper.update({key: _scalar(group[key]) for key in ("momentum", "dampening")})
            else:
                beta1, beta2 = group["betas"]
                hyper.update(beta1=_scalar(beta1), beta2=_scalar(beta2), eps=_scalar(group["eps"]))
                if any(self._adam_step(p, group) is None for _, p in members):
                    return None
            if any(value is None for value in hyper.values()):
                return None
            groups.append((group, members, hyper))
        # Checked: from here on the optimizer's state changes (as its own step would change it).
        updates = []
        for group, members, hyper in groups:
            if members:
                make = self._sgd if isinstance(self.optimizer, SGD) else self._adam
                updates.extend(make(group, members, hyper))
        return updates

    def _sgd(self, group: dict, members: list, hyper: dict) -> list[OptimizerUpdate]:
        momentum = hyper["momentum"]
        buffers, weights = [], []
        if momentum != 0.0:
            for _, p in members:
                state = self.optimizer.state[p]
                buffer = state.get("momentum_buffer")
                if buffer is None:  # torch's first step copies the gradient: a zero buffer with the gradient's weight 1
                    state["momentum_buffer"] = buffer = torch.zeros_like(p, memory_format=torch.preserve_format)
                    weights.append(1.0)
                else:
                    weights.append(1.0 - hyper["dampening"])
                buffers.append(buffer)
        values = {"lr": hyper["lr"], "weight_decay": hyper["weight_decay"], "momentum": momentum,
                  "nesterov": bool(group["nesterov"]), "maximize": bool(group["maximize"])}  # fmt: skip
        return [OptimizerUpdate("sgd", [i for i, _ in members], [p for _, p in members], (buffers, [], []),
                                weights or None, values)]  # fmt: skip

    def _adam_step(self, p: torch.nn.Parameter, group: dict) -> float | None:
        """The step count this step will have (torch's state["step"] + 1), None if it lives on a GPU."""
        step = self.optimizer.state[p].get("step")
        if step is None:
            return 1.0
        return _scalar(step) + 1.0 if isinstance(step, torch.Tensor) and step.device.type == "cpu" else None

    def _adam(self, group: dict, members: list, hyper: dict) -> list[OptimizerUpdate]:
        amsgrad = bool(group["amsgrad"])
        decoupled = bool(group.get("decoupled_weight_decay", isinstance(self.optimizer, AdamW)))
        by_step: dict[float, list] = {}
        for i, p in members:
            state = self.optimizer.state[p]
            if not state:  # torch's lazy initialisation (the step on the host: capturable and fused GPU runs refused)
                state["step"] = torch.tensor(0.0, dtype=torch_optimizer._get_scalar_dtype())
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            by_step.setdefault(float(state["step"]), []).append((i, p))
        lr, weight_decay, beta1, beta2 = hyper["lr"], hyper["weight_decay"], hyper["beta1"], hyper["beta2"]
        updates = []
        for step, chosen in by_step.items():
            states = [self.optimizer.state[p] for _, p in chosen]
            values = {
                "lr": lr, "weight_decay": 0.0 if decoupled else weight_decay,
                "decay": 1.0 - lr * weight_decay if decoupled else 1.0, "beta1_weight": 1.0 - beta1, "beta2": beta2,
                "beta2_weight": 1.0 - beta2, "eps": hyper["eps"], "step_size": lr / (1.0 - beta1**step),
                "bc2_sqrt": math.sqrt(1.0 - beta2**step), "maximize": bool(group["maximize"]), "amsgrad": amsgrad,
            }  # fmt: skip
            tensors = ([s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                       [s["max_exp_avg_sq"] for s in states] if amsgrad else [])  # fmt: skip
            index, tensors_of = [i for i, _ in chosen], [p for _, p in chosen]
            updates.append(OptimizerUpdate("adam", index, tensors_of, tensors, None, values))
        return updates
