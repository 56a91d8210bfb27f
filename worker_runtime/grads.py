"""Gradients accumulated but not yet applied, as per-rank state: exact resume mid accumulation window.

A script that accumulates gradients over several loop steps (``optimizer.step()`` every k steps)
holds state in ``param.grad`` between optimizer steps; a checkpoint taken inside the window without
it resumes with the window's first micro-batches forgotten (issue 24). Saving every gradient always
would double the model's share of each checkpoint for the common case (gradients applied, then
zeroed or overwritten), so :class:`PendingGrads` saves only the gradients that changed since the
last step of a registered optimizer (an optimizer step hook marks what it applied).
"""

from __future__ import annotations

from typing import Any

import torch

from worker_runtime.state import TrainState


class PendingGrads:
    """The registered modules' gradients not yet applied by an optimizer step (register per rank)."""

    def __init__(self, state: TrainState) -> None:
        self._state = state
        self._applied: dict[int, tuple[int, int]] = {}
        """id(param) -> (id(grad), grad._version) as a registered optimizer's last step left it."""
        self._hooked: set[int] = set()

    def watch(self) -> None:
        """Hook every registered optimizer's step (once each); call when everything is registered."""
        for name in self._state.names():
            optimizer = self._state[name]
            if isinstance(optimizer, torch.optim.Optimizer) and id(optimizer) not in self._hooked:
                optimizer.register_step_post_hook(self._mark)
                self._hooked.add(id(optimizer))

    def _mark(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is not None:
                    self._applied[id(param)] = (id(grad), grad._version)

    def _params(self) -> dict[str, torch.nn.Parameter]:
        found: dict[str, torch.nn.Parameter] = {}
        for name in self._state.names():
            module = self._state[name]
            if isinstance(module, torch.nn.Module):
                found.update({f"{name}.{key}": p for key, p in module.named_parameters()})
        return found

    def state_dict(self) -> dict[str, Any]:
        pending = {}
        for key, param in self._params().items():
            grad = param.grad
            if grad is not None and self._applied.get(id(param)) != (id(grad), grad._version):
                pending[key] = grad.detach()
        return {"grads": pending}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        saved = state_dict.get("grads", {})
        for key, param in self._params().items():
            if key in saved:
                param.grad = saved[key].to(device=param.device, dtype=param.dtype)
