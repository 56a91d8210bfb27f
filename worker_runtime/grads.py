"""Gradients accumulated but not yet applied, as per-rank state: exact resume mid accumulation window.

A script that accumulates gradients over several loop steps (``optimizer.step()`` every k steps)
holds state in ``param.grad`` between optimizer steps; a checkpoint taken inside the window without
it resumes with the window's first micro-batches forgotten (issue 24). Saving every gradient always
would double the model's share of each checkpoint for the common case (gradients applied, then
zeroed or overwritten), so :class:`PendingGrads` saves only the gradients that changed since the
last step of a registered optimizer (an optimizer step hook marks what it applied).

FSDP2 (``fully_shard``, the fsdp and hsdp layouts) keeps a window's gradients elsewhere: with
gradient sync off (``set_requires_gradient_sync(False)``) each rank accumulates its own unsharded
gradient on FSDP2's unsharded parameter (or, with a reduce dtype, in ``unsharded_accumulated_grad``),
and the sharded ``param.grad`` stays None until the window's last backward reduce-scatters the sum.
Those are saved too (always pending: FSDP2 clears them when it reduces). They are restored where
FSDP2 keeps them; the unsharded parameter exists only after a first all-gather, so in a new process
they are put in place after the module's first forward (the window's next backward adds to them,
as in the run that was not stopped). FSDP2 has no public API for this state: the attributes read
are FSDPParam's (as of torch 2.13); where they cannot be read the loop logs it, and a resume inside
a window then misses the window's first micro-steps.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import torch

from worker_runtime.state import TrainState

log = logging.getLogger(__name__)


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

    def _fsdp(self) -> list[tuple[torch.nn.Module, str, Any]]:
        """(registered module, parameter key, FSDPParam) of every FSDP2-managed parameter."""
        try:
            return list(self._fsdp_params())
        except (AttributeError, AssertionError):  # FSDP2's internals moved: never fail a save for it
            log.warning("cannot read FSDP2's accumulated gradients (torch %s): a resume inside an "
                        "accumulation window will not be exact", torch.__version__, exc_info=True)
            return []

    def _fsdp_params(self) -> Iterator[tuple[torch.nn.Module, str, Any]]:
        fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDP2 module either
        if fsdp is None:
            return
        for name in self._state.names():
            module = self._state[name]
            if not isinstance(module, torch.nn.Module):
                continue
            prefixes = {id(m): prefix for prefix, m in module.named_modules()}
            seen: set[int] = set()
            for owner in module.modules():
                if not isinstance(owner, fsdp.FSDPModule):
                    continue
                state = owner._get_fsdp_state()
                groups = getattr(state, "_fsdp_param_groups", None)
                if groups is None:  # an older torch: one group a state
                    groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
                for group in groups:
                    if id(group) in seen:
                        continue
                    seen.add(id(group))
                    for fsdp_param in group.fsdp_params:
                        info = fsdp_param._module_info
                        prefix = prefixes.get(id(info.module))
                        if prefix is not None:
                            yield module, f"{name}.{prefix + '.' if prefix else ''}{info.param_name}", fsdp_param

    def state_dict(self) -> dict[str, Any]:
        pending = {}
        for key, param in self._params().items():
            grad = param.grad
            if grad is not None and self._applied.get(id(param)) != (id(grad), grad._version):
                pending[key] = grad.detach()
        saved: dict[str, Any] = {"grads": pending}
        unsharded, accumulated = {}, {}
        for _, key, fsdp_param in self._fsdp():
            full = getattr(fsdp_param, "_unsharded_param", None)
            if full is not None and full.grad is not None:
                unsharded[key] = full.grad.detach()
            if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
                accumulated[key] = fsdp_param.unsharded_accumulated_grad.detach()
        if unsharded or accumulated:
            saved["fsdp"] = {"unsharded": unsharded, "accumulated": accumulated}
        return saved

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        saved = state_dict.get("grads", {})
        for key, param in self._params().items():
            if key in saved:
                param.grad = saved[key].to(device=param.device, dtype=param.dtype)
        fsdp = state_dict.get("fsdp") or {}
        unsharded, accumulated = fsdp.get("unsharded", {}), fsdp.get("accumulated", {})
        later: dict[torch.nn.Module, list[tuple[Any, torch.Tensor]]] = {}
        for module, key, fsdp_param in self._fsdp():
            device = fsdp_param.sharded_param.device
            if key in accumulated:
                fsdp_param.unsharded_accumulated_grad = accumulated[key].to(device)
            if key in unsharded:
                later.setdefault(module, []).append((fsdp_param, unsharded[key].to(device)))
        for module, grads in later.items():
            _put_unsharded_grads(module, grads)


def _put_unsharded_grads(module: torch.nn.Module, grads: list[tuple[Any, torch.Tensor]]) -> None:
    """Give each FSDPParam its unsharded gradient: now if its unsharded parameter exists, else after
    ``module``'s forward (which all-gathers it), before the backward that adds to it."""

    def put() -> bool:
        waiting = []
        for fsdp_param, grad in grads:
            param = getattr(fsdp_param, "_unsharded_param", None)
            if param is None:
                waiting.append((fsdp_param, grad))
            else:
                param.grad = grad
        grads[:] = waiting
        return not grads

    if put():
        return

    def after_forward(*_: Any) -> None:
        if put():
            handle.remove()

    handle = module.register_forward_hook(after_forward)
