"""Optimizer replay on a rotating slice (paper section 9, "Optimizer boundary").

Before a due optimizer step, a step pre-hook clones a slice (default 64K
elements) of one parameter, its effective gradient and every per-element
optimizer state tensor (scalar state such as ``step`` is cloned whole). After
the real step has run unchanged, the SAME optimizer class with the same group
hyperparameters is applied to the clone. Three surfaces come out:

* ``optimizer.replayed``: the replayed update, compared across peers;
* ``optimizer.live``: the live updated slice, compared across peers (where
  replicas own equal state, e.g. DDP and HSDP replicas of one shard);
* ``optimizer.self_check``: whether the live slice equals the replayed one,
  the only evidence where the update is uniquely owned (pure FSDP).

The slice rotates over parameters and offsets from check to check. Offsets are
aligned to 64 elements so the replayed kernel takes the same vectorized path
as the live one.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

from scout_core.signature import local_tensor, sign_many

__all__ = ["OptimizerSlice"]

_ALIGN = 64


class OptimizerSlice:
    def __init__(self, optimizer: torch.optim.Optimizer, slice_elems: int,
                 local_only: Iterable[torch.Tensor] = ()) -> None:
        if slice_elems < 1:
            raise ValueError(f"slice_elems must be >= 1, got {slice_elems}")
        self.optimizer = optimizer
        self.slice_elems = slice_elems
        # Parameters the peers do not hold alike (MoE experts: each EP position has its own): their update is
        # only checked against its own replay on each rank (the self-check), never compared across peers.
        self.local_only = {id(p) for p in local_only}
        self.turn = 0
        self.eligible: frozenset[int] | None = None
        """``id()`` of the parameters the slice rotates over (known from the first slice): certification's units."""
        self.chosen: int | None = None
        """``id()`` of the parameter of the pending slice."""
        self.pending: dict[str, Any] | None = None
        # ZeRO-3 with several sub-groups (DeepSpeed's sub_group_size) steps the inner optimizer once per sub-group
        # in one training step, each time with only that sub-group's flat partition in its param_groups. The
        # slice is taken in one of those inner steps, rotating over them from check to check; a slice taken in
        # every one of them would always end up in the last sub-group, and the others would never be checked.
        self._inner_calls = 0
        self._inner_per_step = 1
        self._take_at = 0
        self._visits: dict[int, int] = {}

    def _choose(self) -> tuple[int, int, torch.Tensor, dict[str, Any]] | None:
        params = [(gi, p) for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]
                  if p.grad is not None and local_tensor(p).numel() > 0]
        if not params:
            return None
        self.eligible = frozenset(id(p) for _, p in params)
        gi, p = params[self.turn % len(params)]
        n = local_tensor(p).numel()
        span = min(self.slice_elems, n)
        slots = max(1, (n - span) // _ALIGN + 1)
        # Each parameter's offsets rotate with its own visits: a count shared with the choice of parameter (or of
        # sub-group) would give a parameter only the offsets congruent to its place, and leave the rest unchecked.
        visits = self._visits.get(id(p), 0)
        offset = min((visits % slots) * _ALIGN, n - span)
        return gi, offset, p, self.optimizer.param_groups[gi]

    def inner_step(self) -> bool:
        """Count one inner optimizer step of the training step; whether the slice is taken in this one."""
        call, self._inner_calls = self._inner_calls, self._inner_calls + 1
        if call == 0:
            self._take_at = self.turn % self._inner_per_step  # fixed for the step: taking the slice turns it
        return call == self._take_at

    def end_step(self) -> None:
        """The training step ended: how many inner steps it had (none: a skipped step, e.g. an fp16 overflow,
        which says nothing about the next)."""
        if self._inner_calls:
            self._inner_per_step = self._inner_calls
        self._inner_calls = 0

    @torch.no_grad()
    def before_step(self) -> None:
        chosen = self._choose()
        self.turn += 1
        if chosen is None:
            self.pending = self.chosen = None
            return
        gi, offset, p, group = chosen
        self.chosen = id(p)
        self._visits[id(p)] = self._visits.get(id(p), 0) + 1
        span = min(self.slice_elems, local_tensor(p).numel())
        sl = slice(offset, offset + span)
        flat = local_tensor(p).reshape(-1)
        state = {}
        for k, v in self.optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                lv = local_tensor(v)
                state[k] = lv.reshape(-1)[sl].clone() if lv.numel() == flat.numel() else lv.clone()
            else:
                state[k] = v
        self.pending = {
            "param": p, "slice": sl, "value": flat[sl].clone(), "grad": local_tensor(p.grad).reshape(-1)[sl].clone(),
            "state": state, "hyper": {k: v for k, v in group.items() if k != "params"}, "group": gi,
        }

    @torch.no_grad()
    def after_step(self) -> list[tuple[str, Any]]:
        """Replay the update on the clone; return the three surfaces' evidence."""
        pending, self.pending = self.pending, None
        if pending is None:
            return []
        live = local_tensor(pending["param"]).reshape(-1)[pending["slice"]].clone()
        replayed = self.replay_update(pending["value"], pending["grad"], pending["state"], pending["hyper"])
        s_replayed, s_live = sign_many([replayed, live])
        same = s_replayed.signature == s_live.signature  # bitwise, NaN payloads included
        if id(pending["param"]) in self.local_only:
            return [("optimizer.self_check", same)]
        return [
            ("optimizer.replayed", (s_replayed.signature, s_replayed.nonfinite)),
            ("optimizer.live", (s_live.signature, s_live.nonfinite)),
            ("optimizer.self_check", same),
        ]

    @torch.no_grad()
    def replay_update(self, value: torch.Tensor, grad: torch.Tensor, state: dict[str, Any],
                      hyper: dict[str, Any]) -> torch.Tensor:
        """One step of this rank's optimizer class, with ``hyper``, on a clone of ``value``: the updated clone."""
        clone = torch.nn.Parameter(value.clone())
        clone.grad = grad.clone()
        # Build with what the constructor accepts, then copy the group verbatim: optimizers keep
        # derived keys (AdamW's decoupled_weight_decay) that their constructor does not take.
        accepted = inspect.signature(type(self.optimizer).__init__).parameters
        kwargs = {k: v for k, v in hyper.items() if k in accepted}
        # Some optimizers keep a constructor argument on the object, not in the group (DeepSpeed's FusedAdam:
        # adam_w_mode): a plain value of that name is passed on, or the replay would run another update rule.
        kwargs.update({k: getattr(self.optimizer, k) for k in accepted if k not in kwargs and k != "self"
                       and isinstance(getattr(self.optimizer, k, None), (bool, int, float, str))})
        replay_opt = type(self.optimizer)([clone], **kwargs)
        replay_opt.param_groups[0].update(hyper)
        if state:
            replay_opt.state[clone] = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                       for k, v in state.items()}
        with torch.enable_grad():
            replay_opt.step()
        return clone.detach()
