"""Deterministic fault injection for tests, cells and acceptance runs.

A :class:`Fault` names a surface (any string the caller uses for a tensor or a
timed region), the global rank it hits, what it does and a step schedule. The
:class:`Injector` applies matching faults when the caller hands it a tensor
(:meth:`Injector.corrupt`) or enters a timed region (:meth:`Injector.delay`).
Element positions not given explicitly are drawn from the injector's seed,
the surface, the rank and the step, so a cell replays exactly.

Later issues add more fault kinds (frozen ranks, mismatched collectives,
stalls) on top of the same schedule and record types.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import random
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Fault", "FaultKind", "InjectedFault", "Injection", "Injector", "Schedule"]

_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class FaultKind(enum.StrEnum):
    BITFLIP = "bitflip"
    SCALE = "scale"
    SET = "set"
    DELAY = "delay"
    SLOW = "slow"  # real extra work: the wrapped compute takes ``factor`` times as long (busy CPU)
    DRIFT = "drift"  # a nondeterministic kernel: every call's result differs in its last bits
    FREEZE = "freeze"  # stop the rank: SIGSTOP, or a blocking wait
    SKIP = "skip"  # the rank takes another branch and skips a collective
    MISMATCH = "mismatch"  # the rank calls a collective with different shape, dtype or op
    HOLD = "hold"  # the rank enters a collective that never completes (transport stall)
    KILL = "kill"  # the rank's machine dies here (SIGKILL, no cleanup)
    RAISE = "raise"  # a software fault: the code at this point raises InjectedFault


def burn_cpu(seconds: float) -> None:
    """Real work on this thread for ``seconds`` of its CPU time."""
    end = time.thread_time() + seconds
    x = 1.0
    while time.thread_time() < end:
        for _ in range(200):
            x = x * 1.0000001 + 1e-9


class InjectedFault(RuntimeError):
    """Raised by :meth:`Injector.fail` where a ``raise`` fault is scheduled."""


_CORRUPTING = (FaultKind.BITFLIP, FaultKind.SCALE, FaultKind.SET, FaultKind.DRIFT)
"""The kinds :meth:`Injector.corrupt` applies to a tensor."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Active on steps in ``[start, stop)``; ``stop=None`` means forever."""

    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        if self.start < 0 or (self.stop is not None and self.stop <= self.start):
            raise ValueError(f"schedule needs 0 <= start < stop, got start={self.start} stop={self.stop}")

    @classmethod
    def once(cls, step: int) -> Schedule:
        return cls(start=step, stop=step + 1)

    @classmethod
    def from_step(cls, step: int) -> Schedule:
        return cls(start=step, stop=None)

    @classmethod
    def between(cls, start: int, stop: int) -> Schedule:
        return cls(start=start, stop=stop)

    def active(self, step: int) -> bool:
        return step >= self.start and (self.stop is None or step < self.stop)


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault."""

    surface: str
    rank: int
    kind: FaultKind
    schedule: Schedule = field(default_factory=Schedule)
    bit: int = 0
    """Bit position for ``bitflip`` (0 = least significant bit of the element)."""
    factor: float = 2.0
    """Multiplier for ``scale``; for ``slow``, how many times as long the wrapped compute takes (> 1)."""
    value: float = 0.0
    """Replacement for ``set``."""
    index: int | None = None
    """Flat element index; ``None`` draws one from the seed."""
    all_elements: bool = False
    """``scale``/``set`` the whole tensor instead of one element."""
    seconds: float = 0.0
    """For ``delay``: burned CPU on the ``compute`` surface (a slow device computes), a sleep elsewhere."""
    method: str = "sigstop"
    """``freeze``: ``sigstop`` (the whole process stops) or ``block`` (the thread waits forever)."""
    what: str = "shape"
    """``mismatch``: which metadata differs, ``shape``, ``dtype`` or ``op``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))
        if self.rank < 0:
            raise ValueError(f"fault rank must be >= 0, got {self.rank}")
        if self.kind is FaultKind.DELAY and self.seconds <= 0:
            raise ValueError("a delay fault needs seconds > 0")
        if self.kind is FaultKind.SLOW and self.factor <= 1.0:
            raise ValueError(f"a slow fault needs factor > 1, got {self.factor}")
        if self.bit < 0:
            raise ValueError(f"bit must be >= 0, got {self.bit}")
        if self.method not in ("sigstop", "block"):
            raise ValueError(f"freeze method must be 'sigstop' or 'block', got {self.method!r}")
        if self.what not in ("shape", "dtype", "op"):
            raise ValueError(f"mismatch must be of 'shape', 'dtype' or 'op', got {self.what!r}")

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Fault:
        """Build from a plain mapping such as an entry of ``configs/cells.yaml``.

        The schedule is given by ``step`` (once), ``from_step`` or
        ``between: [start, stop]``; none of them means every step.
        """
        spec = dict(spec)
        keys = [k for k in ("step", "from_step", "between") if k in spec]
        if len(keys) > 1:
            raise ValueError(f"give at most one of step/from_step/between, got {keys}")
        if "step" in spec:
            schedule = Schedule.once(int(spec.pop("step")))
        elif "from_step" in spec:
            schedule = Schedule.from_step(int(spec.pop("from_step")))
        elif "between" in spec:
            start, stop = spec.pop("between")
            schedule = Schedule.between(int(start), int(stop))
        else:
            schedule = Schedule()
        return cls(schedule=schedule, **spec)


@dataclass(frozen=True)
class Injection:
    """Record of one applied fault, for cells to compare with what was reported."""

    surface: str
    rank: int
    step: int
    kind: FaultKind
    index: int | None
    bit: int | None
    seconds: float | None


class Injector:
    """Applies scheduled faults on the ranks they target."""

    def __init__(self, faults: Iterable[Fault] = (), *, seed: int = 0) -> None:
        self.faults: list[Fault] = list(faults)
        self.seed = seed
        self.log: list[Injection] = []
        self._drift_calls = 0
        self._hold_next_call = False
        self._stuck_groups: list[Any] = []

    def add(self, fault: Fault) -> None:
        self.faults.append(fault)

    def clear(self) -> None:
        """Disable every fault (the 'injector off again' step of a protocol)."""
        self.faults.clear()

    def _matching(self, surface: str, rank: int, step: int, kinds: tuple[FaultKind, ...]) -> list[Fault]:
        return [
            f for f in self.faults
            if f.surface == surface and f.rank == rank and f.kind in kinds and f.schedule.active(step)
        ]

    def _draw_index(self, fault: Fault, numel: int, step: int) -> int:
        if fault.index is not None:
            if not 0 <= fault.index < numel:
                raise IndexError(f"fault index {fault.index} outside tensor of {numel} elements")
            return fault.index
        key = f"{self.seed}|{fault.surface}|{fault.rank}|{step}".encode()
        rng = random.Random(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little"))
        return rng.randrange(numel)

    def corrupts(self, surface: str, *, rank: int, step: int) -> bool:
        """Whether :meth:`corrupt` would change a tensor of ``surface`` now (to prepare one only then)."""
        return bool(self._matching(surface, rank, step, _CORRUPTING))

    def corrupt(self, surface: str, tensor: torch.Tensor, *, rank: int, step: int) -> bool:
        """Apply matching bitflip/scale/set faults to ``tensor`` in place."""
        faults = self._matching(surface, rank, step, _CORRUPTING)
        if faults and tensor.numel() == 0:
            raise ValueError(f"cannot inject into empty tensor on surface {surface!r}")
        for fault in faults:
            if fault.kind is FaultKind.DRIFT:  # like a reduction whose order changes from call to call
                self._drift_calls += 1
                with torch.no_grad():
                    tensor.mul_(1.0 + 2.0**-20 * (self._drift_calls % 997 + 1))
                self.log.append(Injection(surface, rank, step, fault.kind, None, None, None))
                continue
            index = None if fault.all_elements and fault.kind is not FaultKind.BITFLIP else self._draw_index(
                fault, tensor.numel(), step)
            with torch.no_grad():
                if fault.kind is FaultKind.BITFLIP:
                    _flip_bit(tensor, index, fault.bit)
                elif index is None:
                    if fault.kind is FaultKind.SCALE:
                        tensor.mul_(fault.factor)
                    else:
                        tensor.fill_(fault.value)
                else:
                    pos = _unravel(index, tensor.shape)
                    if fault.kind is FaultKind.SCALE:
                        tensor[pos] = tensor[pos] * fault.factor
                    else:
                        tensor[pos] = fault.value
            self.log.append(Injection(surface, rank, step, fault.kind, index,
                                      fault.bit if fault.kind is FaultKind.BITFLIP else None, None))
        return bool(faults)

    def delay(self, surface: str, *, rank: int, step: int) -> float:
        """Wait for every matching delay fault; return the seconds. On the ``compute`` surfaces
        (``compute``, ``compute.<part>``) the wait is burned CPU: a slow device computes slowly, and replay times
        compute on the device's own clock, where a sleep would not show (a slow link or file system, elsewhere,
        waits)."""
        total = 0.0
        for fault in self._matching(surface, rank, step, (FaultKind.DELAY,)):
            if surface == "compute" or surface.startswith("compute."):
                burn_cpu(fault.seconds)
            else:
                time.sleep(fault.seconds)
            total += fault.seconds
            self.log.append(Injection(surface, rank, step, fault.kind, None, None, fault.seconds))
        return total

    def slow(self, surface: str, *, rank: int, step: int, compute_s: float) -> float:
        """Extra work for every matching ``slow`` fault: ``(factor - 1) x compute_s`` of burned CPU, where
        ``compute_s`` is what the wrapped compute took on this thread's clock; return the seconds burned."""
        total = 0.0
        for fault in self._matching(surface, rank, step, (FaultKind.SLOW,)):
            extra = (fault.factor - 1.0) * compute_s
            burn_cpu(extra)
            total += extra
            self.log.append(Injection(surface, rank, step, fault.kind, None, None, extra))
        return total


    # -- hangs ------------------------------------------------------------------------------------

    def _record(self, fault: Fault, step: int) -> None:
        self.log.append(Injection(fault.surface, fault.rank, step, fault.kind, None, None, None))

    def freeze(self, surface: str, *, rank: int, step: int) -> None:
        """Stop this rank here if a freeze fault matches (never returns then)."""
        for fault in self._matching(surface, rank, step, (FaultKind.FREEZE,)):
            self._record(fault, step)
            if fault.method == "sigstop":
                os.kill(os.getpid(), signal.SIGSTOP)  # the observer, a separate process, keeps running
            _block_forever()

    def kill(self, surface: str, *, rank: int, step: int) -> None:
        """Die here, as a machine losing power would: SIGKILL, no cleanup, no flush."""
        for fault in self._matching(surface, rank, step, (FaultKind.KILL,)):
            self._record(fault, step)
            os.kill(os.getpid(), signal.SIGKILL)

    def fail(self, surface: str, *, rank: int, step: int) -> None:
        """Raise :class:`InjectedFault` here if a raise fault matches."""
        for fault in self._matching(surface, rank, step, (FaultKind.RAISE,)):
            self._record(fault, step)
            raise InjectedFault(f"injected failure at {surface} on rank {rank}, step {step}")

    def armed(self, surface: str, kind: FaultKind | str, *, rank: int, step: int) -> bool:
        """Whether a fault of ``kind`` would fire at this point (for multi-part injections)."""
        return bool(self._matching(surface, rank, step, (FaultKind(kind),)))

    def skip(self, surface: str, *, rank: int, step: int) -> bool:
        """True when this rank must skip the collective at ``surface`` (a control-flow fault)."""
        faults = self._matching(surface, rank, step, (FaultKind.SKIP,))
        for fault in faults:
            self._record(fault, step)
        return bool(faults)

    def mismatch(
        self, surface: str, tensor: torch.Tensor, op: Any, *, rank: int, step: int
    ) -> tuple[torch.Tensor, Any]:
        """Return the ``(tensor, op)`` this rank passes to the collective at ``surface``.

        Under a mismatch fault the shape (one extra element), the dtype (float64)
        or the reduce op (MAX instead of SUM, SUM otherwise) differs, and the next
        collective that reaches :meth:`wrap_collective`'s wrapper is held: NCCL
        hangs on such a call, while gloo aborts the process on a size mismatch
        and silently completes an op mismatch. Holding the call reproduces the
        NCCL behaviour on CPU after SCOUT's hooks have seen the real arguments.
        """
        for fault in self._matching(surface, rank, step, (FaultKind.MISMATCH,)):
            self._record(fault, step)
            self._hold_next_call = True
            if fault.what == "shape":
                tensor = torch.cat([tensor.reshape(-1), tensor.new_zeros(1)])
            elif fault.what == "dtype":
                tensor = tensor.to(torch.float64 if tensor.dtype != torch.float64 else torch.float32)
            else:
                import torch.distributed as dist

                op = dist.ReduceOp.MAX if op in (None, dist.ReduceOp.SUM) else dist.ReduceOp.SUM
        return tensor, op

    def wrap_collective(self, fn: Callable[..., Any], name: str, *, rank: int,
                        step: Callable[[], int]) -> Callable[..., Any]:
        """The innermost layer around a backend collective: holds mismatched calls and
        calls under a ``hold`` fault forever, as a stalled transport would."""

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if self._hold_next_call or (group is not None and group in self._stuck_groups):
                if kwargs.get("async_op"):
                    # As on NCCL: the launch returns, the work never completes, and neither does any later
                    # work on that communicator (its stream is stuck behind the mismatched call).
                    self._hold_next_call = False
                    if group is not None:
                        self._stuck_groups.append(group)
                    return NeverCompletes()
                _block_forever()
            for fault in self._matching(name, rank, step(), (FaultKind.HOLD,)):
                self._record(fault, step())
                _block_forever()
            return fn(*args, **kwargs)

        return wrapper


class NeverCompletes:
    """The work of an asynchronous collective whose transport never completes (a mismatched NCCL call)."""

    def __init__(self) -> None:
        import torch.futures

        self._future: Any = torch.futures.Future()

    def get_future(self) -> Any:
        return self._future

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout: Any = None) -> bool:
        _block_forever()
        return False


def _block_forever() -> None:
    while True:
        time.sleep(3600)


def _unravel(index: int, shape: torch.Size) -> tuple[int, ...]:
    pos = []
    for size in reversed(shape):
        index, r = divmod(index, size)
        pos.append(r)
    return tuple(reversed(pos))


def _flip_bit(tensor: torch.Tensor, index: int, bit: int) -> None:
    width = tensor.element_size() * 8
    if tensor.dtype == torch.bool and bit != 0:
        raise ValueError("a bool element has one meaningful bit: use bit=0")
    if bit >= width:
        raise ValueError(f"bit {bit} outside a {width}-bit {tensor.dtype} element")
    if tensor.is_complex():
        raise ValueError("bit flips on complex tensors: flip the real view instead")
    as_int = tensor.view(_INT_OF_SIZE[tensor.element_size()])
    # The sign bit as a signed Python int, so the mask fits the integer dtype.
    mask = -(1 << bit) if bit == width - 1 else (1 << bit)
    pos = _unravel(index, tensor.shape)
    as_int[pos] = as_int[pos] ^ mask
