"""The offline shape catalog of an MoE model's experts (paper section 6.2).

An expert's input has a data-dependent row count (the tokens routed to it), from 0 to the capacity limit.
Replaying whatever shape training happened to route covers the paths of that shape only; the catalog lists,
once and offline, which shapes to replay so that a rotation through them covers every execution path:

1. enumerate the admitted shapes: row counts 0..capacity for every represented layer, EP position and expert
   (grouped execution: every expert of a kernel receives the same row count, see docs/moe.md);
2. profile each: a :class:`PathProfiler` gives the kernel and scheduling fingerprint and how often each path
   runs (:class:`ReferencePathProfiler`, the tiled model of :mod:`scout_core.moe.paths`, on any device;
   :class:`CudaPathProfiler`, kernel names and launch shapes from the CUDA profiler; :class:`KernelOpProfiler`,
   the operators the model's own expert code runs, on any device);
3. compress within each fingerprint by dominance (:func:`scout_core.moe.dominance.compress`).

The result is bound to the environment it was profiled in: :meth:`Catalog.load` rejects it, naming what
changed, when the device, torch, the model configuration, the tile configuration or the profiler differ.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from scout_core.moe.dominance import compress
from scout_core.moe.paths import PATH_ROLES, TileConfig, path_counts, select_tile
from scout_core.report import list_of

__all__ = ["CATALOG_FORMAT", "Catalog", "CatalogDrift", "CudaPathProfiler", "ExpertProblem", "KernelOpProfiler",
           "MoESpec", "PathProfiler", "PathRecord", "ReferencePathProfiler", "build_catalog", "catalog_environment",
           "import_kernel", "runtime_environment"]

CATALOG_FORMAT = "scout-moe-catalog"
CATALOG_VERSION = 1


class CatalogDrift(RuntimeError):
    """The catalog was built for another environment; it names each fact that changed."""


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """What the catalog needs to know of the model's MoE layers."""

    layers: tuple[str, ...] = ("layers.0.moe",)
    """The represented MoE layers (module names)."""
    hidden: int = 128
    """Model width: the experts' input and output size."""
    ffn: int = 128
    """Expert hidden size (the up projection's output)."""
    experts: int = 8
    """Experts per layer, over all EP positions."""
    ep_size: int = 4
    """Expert-parallel positions; each holds ``experts // ep_size`` experts."""
    capacity: int = 128
    """Most rows one expert can receive in a step (the capacity limit)."""
    experts_per_kernel: int = 1
    """1: one GEMM per expert; more: a grouped GEMM over that many local experts per launch."""

    def __post_init__(self) -> None:
        if self.experts % self.ep_size:
            raise ValueError(f"experts ({self.experts}) must divide over ep_size ({self.ep_size})")
        local = self.experts // self.ep_size
        if not 1 <= self.experts_per_kernel <= local or local % self.experts_per_kernel:
            raise ValueError(f"experts_per_kernel must divide the {local} local experts, "
                             f"got {self.experts_per_kernel}")
        if min(self.hidden, self.ffn, self.capacity) < 1 or not self.layers:
            raise ValueError("hidden, ffn and capacity must be >= 1 and layers non-empty")


@dataclass(frozen=True)
class ExpertProblem:
    """One admitted shape: ``rows`` tokens for each of ``group`` experts in one kernel launch."""

    rows: int
    hidden: int
    ffn: int
    group: int = 1


@dataclass(frozen=True)
class PathRecord:
    """What a profiler says of one shape: its kernel and scheduling fingerprint, and its path counts."""

    fingerprint: str
    counts: tuple[int, ...]


class PathProfiler(Protocol):
    name: str

    def profile(self, problem: ExpertProblem) -> PathRecord: ...


class ReferencePathProfiler:
    """The tiled reference kernel's paths for an expert MLP (up ``[m, h] @ [h, f]``, down ``[m, f] @ [f, h]``):
    the fingerprint is the tile each projection's heuristic picks, the counts are per projection and role,
    summed over the experts of the group. The counts are those :class:`~scout_core.moe.paths.
    ReferenceGroupedGemm` really executes (tested)."""

    name = "reference"

    def __init__(self, *, small: TileConfig | None = None, large: TileConfig | None = None,
                 switch_rows: int = 64) -> None:
        self.small, self.large, self.switch_rows = small, large, switch_rows

    def tiles(self) -> dict[str, Any]:
        return {"small": asdict(self.small or TileConfig(bm=16, bn=32, bk=32)),
                "large": asdict(self.large or TileConfig(bm=64, bn=32, bk=32)), "switch_rows": self.switch_rows}

    def profile(self, problem: ExpertProblem) -> PathRecord:
        counts: list[int] = []
        names = []
        for m, n, k in ((problem.rows, problem.ffn, problem.hidden), (problem.rows, problem.hidden, problem.ffn)):
            tile = select_tile(m, n, k, small=self.small, large=self.large, switch_rows=self.switch_rows)
            names.append(tile.name)
            per = path_counts(m, n, k, tile)
            counts += [per[r] * problem.group for r in PATH_ROLES]
        return PathRecord(f"reference/{'+'.join(names)}/group{problem.group}", tuple(counts))


class CudaPathProfiler:
    """On CUDA: the kernels an expert MLP launches for a shape, from ``torch.profiler``: the fingerprint is
    the kernel names in launch order, the counts are each launch's grid size (thread blocks) and block size.
    Profiled three times; a shape whose record changes between runs raises (the catalog would be noise)."""

    name = "cuda"

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaPathProfiler needs a CUDA device")
        self.device, self.dtype = device or torch.device("cuda"), dtype

    def tiles(self) -> dict[str, Any]:
        return {"dtype": str(self.dtype)}

    def _once(self, problem: ExpertProblem) -> PathRecord:
        from torch.profiler import ProfilerActivity, profile

        x = torch.randn(problem.group, problem.rows, problem.hidden, device=self.device, dtype=self.dtype)
        up = torch.randn(problem.group, problem.hidden, problem.ffn, device=self.device, dtype=self.dtype)
        down = torch.randn(problem.group, problem.ffn, problem.hidden, device=self.device, dtype=self.dtype)
        torch.cuda.synchronize(self.device)
        with profile(activities=[ProfilerActivity.CUDA], record_shapes=False) as prof:
            torch.bmm(torch.nn.functional.silu(torch.bmm(x, up)), down)
            torch.cuda.synchronize(self.device)
        names, counts = [], []
        for ev in prof.events():
            if ev.device_type.name != "CUDA":
                continue
            meta = getattr(ev, "event_metadata", None)  # torch's EventMetadata: a kernel's launch shape
            grid = getattr(meta, "grid", None) or ()
            block = getattr(meta, "block", None) or ()
            if not grid or not block:
                raise RuntimeError(f"the profiler gave no launch shape for kernel {ev.name!r} (torch "
                                   f"{torch.__version__}): a catalog of kernel names alone would be noise")
            names.append(ev.name)
            counts += [_product(grid), _product(block)]
        return PathRecord("cuda/" + "|".join(names), tuple(counts))

    def profile(self, problem: ExpertProblem) -> PathRecord:
        runs = [self._once(problem) for _ in range(3)]
        if any(r != runs[0] for r in runs[1:]):
            raise RuntimeError(f"unstable kernel fingerprint for {problem}: {runs}")
        return runs[0]


class KernelOpProfiler:
    """Any device: the operators the model's OWN expert code runs for a shape, from ``torch.profiler``.

    ``kernel(x, up, down)`` computes one expert MLP (``x`` [rows, hidden], ``up`` [hidden, ffn], ``down``
    [ffn, hidden]) exactly as the model does; it is profiled as training runs it, forward and backward, in
    ``dtype``. The fingerprint is the set of operator names (ATen operators, and on CUDA the kernels launched),
    the counts how often each ran, over the group's experts. A kernel that switches code by shape through other
    operators or another number of calls (a matrix-vector path for few rows, tiles launched one by one) shows as
    another fingerprint or other counts, with no model of the kernel on SCOUT's side (unlike
    :class:`ReferencePathProfiler`); a switch inside one operator or one CUDA kernel does not show. Profiled three
    times; a shape whose record changes between runs raises. ``kernel_name`` says which code was profiled."""

    name = "ops"

    def __init__(self, kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any], *, kernel_name: str,
                 device: torch.device | None = None, dtype: torch.dtype | str = torch.float32) -> None:
        if isinstance(dtype, str):  # a name, as the command line gives it
            if dtype not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
            dtype = getattr(torch, dtype)
        self.kernel, self.kernel_name = kernel, kernel_name
        self.device, self.dtype = device or torch.device("cpu"), dtype

    def tiles(self) -> dict[str, Any]:
        return {"kernel": self.kernel_name, "dtype": str(self.dtype)}

    def _once(self, problem: ExpertProblem) -> PathRecord:
        from torch.profiler import ProfilerActivity, profile

        gen = torch.Generator().manual_seed(0)
        x, up, down = (torch.randn(*shape, generator=gen).to(self.device, self.dtype).requires_grad_() for shape in
                       ((problem.rows, problem.hidden), (problem.hidden, problem.ffn), (problem.ffn, problem.hidden)))
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(problem.group):
                out = self.kernel(x, up, down)
                out.backward(torch.ones_like(out))
            if cuda:
                torch.cuda.synchronize(self.device)
        counts: dict[str, int] = {}
        for ev in prof.events():
            name = ("cuda:" + ev.name) if ev.device_type.name == "CUDA" else ev.name
            if name.startswith(("aten::", "cuda:")):
                counts[name] = counts.get(name, 0) + 1
        ops = sorted(counts)  # by name: on CUDA the events' order depends on when the device ran them
        return PathRecord(f"ops/{self.kernel_name}/" + "|".join(ops), tuple(counts[o] for o in ops))

    def profile(self, problem: ExpertProblem) -> PathRecord:
        if problem.rows == 0:  # an expert without rows computes nothing worth replaying (whatever ops it runs)
            return PathRecord(f"ops/{self.kernel_name}/no rows", ())
        runs = [self._once(problem) for _ in range(3)]
        if any(r != runs[0] for r in runs[1:]):
            raise RuntimeError(f"unstable operator record for {problem}: {runs}")
        return runs[0]


def import_kernel(spec: str | None) -> Callable[..., Any]:
    """``package.module:function`` (``scout catalog build --kernel``): the expert code the user asked to profile,
    imported from the current directory or the installed packages, as ``python -m`` finds modules."""
    if not spec or ":" not in spec:
        raise ValueError(f"--profiler ops needs --kernel package.module:function, got {spec!r}")
    module, _, attrs = spec.partition(":")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    target: Any = importlib.import_module(module)
    for name in attrs.split("."):
        target = getattr(target, name)
    if isinstance(target, type) or not callable(target):
        raise ValueError(f"--kernel {spec}: {type(target).__name__} is not callable as kernel(x, up, down)")
    return target


def _product(xs: Any) -> int:
    out = 1
    for x in xs or ():
        out *= int(x)
    return out


def catalog_environment(spec: MoESpec, profiler: Any, device: torch.device | None = None) -> dict[str, Any]:
    """The facts a catalog is valid under."""
    return {**runtime_environment(device or torch.device("cpu")),
            "model": asdict(spec) | {"layers": list(spec.layers)}, "profiler": profiler.name,
            "tiles": profiler.tiles()}


def runtime_environment(device: torch.device) -> dict[str, Any]:
    """The part of :func:`catalog_environment` a training job can check without the model's MoE spec."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu/{_cpu_capability()}"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda or ""}


def _cpu_capability() -> str:
    cap = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return cap() if cap is not None else "unknown"


@dataclass(kw_only=True)
class Catalog:
    """Representatives per (layer, EP position, expert group), with the environment they were found in."""

    environment: dict[str, Any]
    entries: list[dict[str, Any]] = field(default_factory=list)
    """One per (layer, position, first expert of the kernel group): ``admitted`` (how many shapes),
    ``groups`` ({fingerprint: [rows of each representative]}) and ``representatives`` (all, in order)."""

    @property
    def admitted(self) -> int:
        return sum(e["admitted"] for e in self.entries)

    @property
    def selected(self) -> int:
        return sum(len(e["representatives"]) for e in self.entries)

    def representatives(self, layer: str, position: int) -> list[int]:
        """The row counts to replay, in rotation order, for ``layer`` at EP ``position`` (its first group)."""
        for e in self.entries:
            if e["layer"] == layer and e["position"] == position:
                return list(e["representatives"])
        raise KeyError(f"no catalog entry for layer {layer!r} at EP position {position}")

    def check_runtime(self, layers: list[str], device: torch.device, *, position: int = 0,
                      hidden: int | None = None, local_experts: int | None = None,
                      ep_size: int | None = None) -> None:
        """Raise unless this catalog serves a job replaying ``layers`` on ``device`` at EP ``position``:
        every layer has an entry for the position; the live model's expert width, local experts per position
        and EP size (where known) are the catalog's (another capacity cannot be seen from the model: it is
        the builder's to keep); and a catalog profiled on a device (CUDA, or the ops profiler anywhere) was
        profiled on this device with this torch and CUDA. The reference path model depends on the tile
        configuration alone, so its catalogs serve any device."""
        missing = sorted({name for name in layers} - {e["layer"] for e in self.entries})
        if missing:
            raise ValueError(f"the shape catalog has no entries for MoE layer(s) {missing}; it lists "
                             f"{sorted({e['layer'] for e in self.entries})} (scout catalog build --layers ...)")
        for name in layers:
            self.representatives(name, position)  # KeyError: built for fewer EP positions
        model = self.environment.get("model", {})
        live = {"hidden": hidden, "local experts": local_experts, "ep_size": ep_size}
        built = {"hidden": model.get("hidden"), "ep_size": model.get("ep_size"),
                 "local experts": (model["experts"] // model["ep_size"]) if "experts" in model else None}
        wrong = [f"{k}: built {built[k]}, now {v}" for k, v in live.items() if v is not None and built[k] != v]
        if wrong:
            raise CatalogDrift(f"the shape catalog was built for another MoE configuration ({'; '.join(wrong)}); "
                               "rebuild it with `scout catalog build` for this model")
        if self.environment.get("profiler") != "reference":
            now = runtime_environment(device)
            changed = sorted(k for k in now if self.environment.get(k) != now[k])
            if changed:
                detail = "; ".join(f"{k}: built {self.environment.get(k)!r}, now {now[k]!r}" for k in changed)
                raise CatalogDrift(f"the shape catalog was profiled elsewhere ({detail}); rebuild it with "
                                   f"`scout catalog build --profiler {self.environment.get('profiler')}`")

    def save(self, path: str | os.PathLike[str]) -> None:
        from scout_core.durable_files import atomic_write  # written whole and fsynced, or not at all

        body = {"format": CATALOG_FORMAT, "version": CATALOG_VERSION, "environment": self.environment,
                "entries": self.entries}
        atomic_write(os.fspath(path), json.dumps(body, indent=1, sort_keys=True).encode())

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, expect: dict[str, Any] | None = None) -> Catalog:
        """Read a catalog; with ``expect`` (:func:`catalog_environment` now, or the part of it the caller
        knows, e.g. device and versions at run time), reject it when any of those facts changed."""
        with open(path, "rb") as fh:
            try:
                body = json.loads(fh.read())
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise ValueError(f"{path}: not a SCOUT catalog (invalid JSON: {exc})") from None
        fmt = body.get("format") if isinstance(body, dict) else None
        if fmt != CATALOG_FORMAT:
            raise ValueError(f"{path}: not a SCOUT catalog (format {fmt!r})")
        if body.get("version") != CATALOG_VERSION:
            raise ValueError(f"{path}: catalog version {body.get('version')}, this SCOUT reads "
                             f"{CATALOG_VERSION}")
        problem = _shape_problem(body)
        if problem:
            raise ValueError(f"{path}: not a SCOUT catalog ({problem})")
        catalog = cls(environment=body["environment"], entries=body["entries"])
        if expect is not None:
            changed = sorted(k for k in expect if catalog.environment.get(k) != expect[k])
            if changed:
                detail = "; ".join(f"{k}: built {catalog.environment.get(k)!r}, now {expect.get(k)!r}"
                                   for k in changed)
                raise CatalogDrift(f"{path}: the catalog was built for another environment ({detail}); "
                                   f"rebuild it with `scout catalog build`")
        return catalog


def _shape_problem(body: dict[str, Any]) -> str:
    """What is wrong with a catalog file's fields ("" when nothing): it is read at start-up, and may be foreign."""
    if not isinstance(body.get("environment"), dict):
        return "environment is not an object"
    entries = body.get("entries")
    if not isinstance(entries, list):
        return "entries is not a list"
    for e in entries:
        if not (isinstance(e, dict) and isinstance(e.get("layer"), str) and isinstance(e.get("position"), int)
                and isinstance(e.get("admitted"), int) and list_of(int)(e.get("representatives"))
                and isinstance(e.get("groups", {}), dict)):
            return f"an entry without layer, position, admitted and representatives: {json.dumps(e)[:80]}"
    return ""


def admitted_problems(spec: MoESpec) -> Iterator[tuple[str, int, int, ExpertProblem]]:
    """(layer, EP position, first expert of the group, problem) for every admitted shape."""
    local = spec.experts // spec.ep_size
    for layer in spec.layers:
        for position in range(spec.ep_size):
            for first in range(position * local, (position + 1) * local, spec.experts_per_kernel):
                for rows in range(spec.capacity + 1):
                    yield layer, position, first, ExpertProblem(rows, spec.hidden, spec.ffn, spec.experts_per_kernel)


def build_catalog(spec: MoESpec, profiler: PathProfiler | None = None, *, device: torch.device | None = None,
                  progress: Callable[[int, int], None] | None = None) -> Catalog:
    """Enumerate, profile and compress. Identical problems are profiled once (experts of one layer share their
    dimensions); ``progress(done, total)`` is called as shapes are profiled."""
    profiler = profiler or ReferencePathProfiler()
    device = device or getattr(profiler, "device", None)  # where a device profiler ran is what the catalog binds
    problems = list(admitted_problems(spec))
    seen: dict[ExpertProblem, PathRecord] = {}
    by_entry: dict[tuple[str, int, int], dict[str, dict[int, tuple[int, ...]]]] = {}
    for i, (layer, position, first, problem) in enumerate(problems):
        if problem not in seen:
            seen[problem] = profiler.profile(problem)
        record = seen[problem]
        by_entry.setdefault((layer, position, first), {}).setdefault(record.fingerprint, {})[problem.rows] = \
            record.counts
        if progress is not None:
            progress(i + 1, len(problems))
    entries = []
    for (layer, position, first), groups in by_entry.items():
        kept = {fp: [int(r) for r in compress(shapes)] for fp, shapes in groups.items()}
        entries.append({"layer": layer, "position": position, "first_expert": first,
                        "admitted": sum(len(s) for s in groups.values()), "groups": kept,
                        "representatives": sorted(r for reps in kept.values() for r in reps)})
    return Catalog(environment=catalog_environment(spec, profiler, device), entries=entries)
