"""TorchTitan cells: real TorchTitan training (its llama3 debug model, or ``model:`` another registered config
such as ``deepseek_v3_debugmodel``, ``Trainer.train()``) with SCOUT switched on by the plugin's ``scout`` config
section, exactly as ``--module scout_torchtitan --scout.enable`` does.

Each rank builds the config from the plugin's registry, made runnable on this host by :mod:`scout_torchtitan.cpu`,
with the cell's parallelism (``fsdp``: dp_shard = world; ``hsdp``: dp_replicate x dp_shard; ``ep``: expert
parallelism), builds the ``ScoutTrainer`` through TorchTitan's own ``config.build()`` and calls ``train()``.

Faults (``faults`` in configs/cells.yaml) act inside a block, so in training and in SCOUT's replay alike:

* ``layers.<i>.output``: a value of block i's feed-forward (or MoE) output (bit flip, set, scale);
  ``layers.any.output``: the same in every block (a faulty device corrupts whatever it computes);
  ``layers.<i>.attention.output`` / ``layers.<i>.moe.output``: that part's output; ``layers.<i>.experts.output``:
  every grouped GEMM of the layer's experts (TorchTitan's ``GroupedExperts._grouped_mm``, a faulty unit);
* ``compute`` (``slow``): every block's attention and feed-forward take ``factor`` times their own CPU time on
  that rank (a slow device is slow in everything it computes);
* ``layers.<i>.forward`` (``freeze``): the rank stops in block i's forward.

``titan-recovery-sdc`` runs the job twice: the first run stops on an SDC verdict (exit status 75) with its
TorchTitan checkpoints labelled, the restart must load the newest verified one, bitwise.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from integrations_tests.training_jobs import bitwise_problems, cell_report, run_job
from scout_core.report import read_incidents
from scout_core.runtime import HOSTNAME_ENV
from scout_core.signature import sign_many
from scout_core.testing.cells import CellReport, CellSpec
from scout_core.testing.inject import Injector
from scout_core.testing.launcher import RankContext, init_gloo, launch, prepare_parent

__all__ = ["titan_cell"]


def _prepare() -> None:
    """Import TorchTitan in the parent, once: forked ranks start with it loaded."""
    prepare_parent()
    from scout_torchtitan import cpu

    cpu.stub_triton_kernels()
    import torchtitan.trainer

    import scout_torchtitan.config_registry  # noqa: F401

    # TorchTitan's train() ends with rank 0 asleep for 2 s "for other ranks to complete"; the cell's ranks meet at a
    # barrier right after it (_titan_rank), so the pause only costs every launch 2 s. torchrun tests keep it.
    torchtitan.trainer.time = _WithoutSleep()


class _WithoutSleep:
    """The ``time`` module as torchtitan.trainer sees it, but for ``sleep``."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        return None


def _config(a: dict[str, Any], rank: int) -> Any:
    """TorchTitan's debug-model config with SCOUT on, in one of the two forms a user writes: the plugin's
    registry (``--module scout_torchtitan --config llama3_debugmodel --scout.*``), or TorchTitan's own registry
    with ``--override.imports scout_torchtitan.override.scout={...}``."""
    import yaml
    from torchtitan.models.llama3 import config_registry as titan_registry

    from scout_torchtitan import config_registry, cpu
    from scout_torchtitan.override import section_from

    if a["scout"] is None:  # the same job without SCOUT (the plugin's registry, --scout.enable off)
        cfg = getattr(config_registry, a["model"])()
    elif a["model"] != "llama3_debugmodel":
        cfg = getattr(config_registry, a["model"])()
        cfg.scout = section_from({k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a["scout"])})
    elif a["form"] == "override":
        keys = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a["scout"])}
        cfg = titan_registry.llama3_debugmodel()
        cfg.override.imports = [("scout_torchtitan.override.scout", keys)]
    else:
        keys = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in a["scout"])}
        cfg = config_registry.llama3_debugmodel()
        cfg.scout = section_from(keys)  # what --scout.enable --scout.<key> VALUE ... builds
    cpu.on_cpu(cfg, steps=a["steps"], seq_len=64, local_batch_size=2, seed=a["seed"])
    cfg.dump_folder = os.path.join(a["workdir"], "titan")
    par = cfg.parallelism
    par.data_parallel_replicate_degree = a["replicate"]
    par.data_parallel_shard_degree = -1
    par.expert_parallel_degree = a["ep"]
    cfg.debug.seed = a["seed"]  # the same initial weights on every run (the restart's bitwise check relies on it)
    cfg.metrics.log_freq = 1000  # TorchTitan's own per-step loss logging (a collective) off the hot path
    cfg.checkpoint.enable = a["titan_checkpoints"]
    cfg.checkpoint.interval = 1
    cfg.checkpoint.keep_latest_k = 0
    return cfg


def _install(trainer: Any, injector: Injector, rank: int) -> None:
    step = lambda: trainer.step  # noqa: E731 - TorchTitan counts steps from 1
    for name, block in trainer.model_parts[0].layers.items():
        inner = _inner(block)

        def timed(module: torch.nn.Module, part: str, name: str = name, last: bool = False) -> None:
            """A slow device is slow in everything it computes: attention and feed-forward each take ``factor``
            times their own CPU time (in training and replay alike)."""
            started: dict[str, float] = {}

            def enter(_m: Any, _a: Any) -> None:
                if last:
                    injector.freeze(f"layers.{name}.forward", rank=rank, step=step())
                started["t"] = time.thread_time()

            def leave(_m: Any, _a: Any, out: torch.Tensor) -> None:
                elapsed = time.thread_time() - started.pop("t", time.thread_time())
                injector.slow("compute", rank=rank, step=step(), compute_s=elapsed)
                with torch.no_grad():
                    injector.corrupt(f"layers.{name}.{part}.output", out, rank=rank, step=step())
                    if last:
                        injector.corrupt(f"layers.{name}.output", out, rank=rank, step=step())
                        injector.corrupt("layers.any.output", out, rank=rank, step=step())

            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)

        timed(inner.attention, "attention")
        # A dense block's feed-forward, or an MoE block's MoE layer (DeepSeek-V3's blocks hold one or the other).
        ffn = getattr(inner, "feed_forward", None) or inner.moe
        timed(ffn, "feed_forward" if ffn is getattr(inner, "feed_forward", None) else "moe", last=True)
        experts = getattr(getattr(getattr(inner, "moe", None), "routed_experts", None), "inner_experts", None)
        if experts is not None:
            # A faulty unit in the experts' grouped GEMM: TorchTitan's own ``_grouped_mm`` seam, which training and
            # SCOUT's expert replay both compute with.
            def corrupt_gemm(*, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor, name: str = name,
                             gemm: Any = experts._grouped_mm) -> torch.Tensor:
                out = gemm(A=A, B_t=B_t, offs=offs)
                with torch.no_grad():
                    injector.corrupt(f"layers.{name}.experts.output", out, rank=rank, step=step())
                return out

            experts._grouped_mm = corrupt_gemm


def _inner(block: torch.nn.Module) -> torch.nn.Module:
    """The block inside TorchTitan's activation-checkpoint wrapper."""
    return getattr(block, "_checkpoint_wrapped_module", block)


def _signature(trainer: Any) -> list[int]:
    """A bitwise signature of this rank's model and optimizer shards (what TorchTitan's checkpoint holds)."""
    from torch.distributed.tensor import DTensor

    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    tensors = [local(p) for m in trainer.model_parts for p in m.parameters()]
    for opt in trainer.optimizers.optimizers:
        for p in (p for g in opt.param_groups for p in g["params"]):
            tensors += [local(v) for _k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor)]
    return [s.signature for s in sign_many([t.detach() for t in tensors])]


def _titan_rank(ctx: RankContext) -> dict[str, Any]:
    a = ctx.args
    os.environ.update(RANK=str(ctx.rank), LOCAL_RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    os.environ[HOSTNAME_ENV] = f"node{ctx.rank // a['ranks_per_machine']}"
    init_gloo(ctx, timeout_s=120)  # TorchTitan keeps a process group that already exists
    from scout_torchtitan import cpu

    cpu.use_cpu()
    trainer = _config(a, ctx.rank).build()
    _install(trainer, Injector(a["faults"], seed=a["seed"]), ctx.rank)
    sigs: dict[int, list[int]] = {}
    loaded: list[int] = []
    if a["titan_checkpoints"]:
        save, load_ = trainer.checkpointer.save, trainer.checkpointer.load

        def save_signed(curr_step: int, last_step: bool = False) -> bool:
            sigs[curr_step] = _signature(trainer)
            with open(os.path.join(a["workdir"], f"sigs-{a['phase']}-r{ctx.rank}.json"), "w") as fh:
                json.dump(sigs, fh)
            return save(curr_step, last_step)

        def load_signed(step: int = -1) -> bool:
            done = load_(step)
            loaded.extend([trainer.step, *_signature(trainer)] if done else [])
            with open(os.path.join(a["workdir"], f"loaded-{a['phase']}-r{ctx.rank}.json"), "w") as fh:
                json.dump(loaded, fh)  # kept for a failure's diagnosis
            return done

        trainer.checkpointer.save, trainer.checkpointer.load = save_signed, load_signed
    trainer.train()
    handle = getattr(trainer.checkpointer, "scout", None)
    hist = [(r.step, sorted(r.recipes), r.skipped) for r in handle.replay.history] if handle is not None else []
    if handle is not None and handle.experts is not None:
        hist += [(c.step, ["expert"], c.skipped) for c in handle.experts.history]
    final = _signature(trainer)
    dist.barrier()
    trainer.close()
    return {"checks": hist, "loaded": loaded, "steps": trainer.step, "final": final}


def titan_cell(spec: CellSpec, world_size: int, workdir: str) -> CellReport:
    _prepare()
    p = spec.params
    hang, recovery = bool(p.get("hang", False)), bool(p.get("recovery", False))
    snapshots = bool(p.get("snapshots", False))  # SCOUT's own snapshots beside TorchTitan's checkpoints
    jsonl = os.path.join(workdir, "incidents.jsonl")
    scout = [f"report.jsonl_path={jsonl}", f"report.run_id={spec.name}", "report.log_level=ERROR",
             *(["observer.silence_threshold_s=2.0", "observer.gather_timeout_s=4.0"] if hang else []),
             # SCOUT certifies TorchTitan's checkpoints without snapshots of its own: with them, a boundary
             # that finds SCOUT's previous snapshot still being written certifies nothing (by design), and
             # which boundaries do would depend on this host's timing.
             *(["actions.on_verdict=stop"] if recovery else []),
             *(["checkpoint.enabled=true", f"checkpoint.directory={workdir}/scout-checkpoints",
                f"checkpoint.memory_dir={workdir}/scout-memory"] if snapshots else []),
             *p.get("overrides", [])]
    args = {"faults": list(spec.faults), "seed": spec.seed, "steps": int(p.get("steps", 8)), "workdir": workdir,
            "replicate": int(p.get("replicate", 1)), "ranks_per_machine": int(p.get("ranks_per_machine", 8)),
            "scout": scout, "titan_checkpoints": recovery or snapshots, "phase": "a", "form": p.get("form", "module"),
            "model": p.get("model", "llama3_debugmodel"), "ep": int(p.get("ep", 1))}
    run = run_job(_titan_rank, spec, world_size, workdir, args, hang=hang, stop=recovery)
    if p.get("bitwise_without_scout") and run.result.ok and not run.problems:
        run.problems += bitwise_problems(_titan_rank, spec, world_size, args, run)
    if snapshots and run.result.ok:
        run.problems += _snapshot_problems(workdir, world_size, args["steps"])
    if recovery and not run.problems:
        run.problems += _restart(spec, world_size, workdir, args, p)
    return cell_report(spec, world_size, run, hang=hang)


def _snapshot_problems(workdir: str, world_size: int, steps: int) -> list[str]:
    """With SCOUT's snapshots on beside TorchTitan's checkpoints: every rank holds an in-memory snapshot of a
    recent step, SCOUT certified a generation, and TorchTitan's checkpoints are labelled, some verified, none
    rejected (a busy persist may delay a verification, never reject one)."""
    from scout_core.checkpoint.durable import LABELS_FILE

    problems = []
    slots = [f for _root, _dirs, files in os.walk(os.path.join(workdir, "scout-memory")) for f in files
             if f.startswith("own-")]
    owners = sorted({int(f.split("-")[1][1:]) for f in slots})
    if owners != list(range(world_size)):
        problems.append(f"in-memory snapshots held by ranks {owners}, expected every rank: {sorted(slots)[:8]}")
    newest = max((int(f.split("-")[2][1:]) for f in slots), default=0)
    if newest < steps - 2:
        problems.append(f"the newest in-memory snapshot is of step {newest}, expected one of the last steps")
    with open(os.path.join(workdir, "titan", "checkpoint", LABELS_FILE)) as fh:
        labels = {int(k): v["label"] for k, v in json.load(fh)["checkpoints"].items()}
    if "verified" not in labels.values() or "rejected" in labels.values():
        problems.append(f"TorchTitan's checkpoints labelled {labels}: expected some verified, none rejected")
    return problems


def _restart(spec: CellSpec, world_size: int, workdir: str, args: dict[str, Any], p: dict[str, Any]) -> list[str]:
    """The restart of ``titan-recovery-sdc``: the labels of the stopped run, then TorchTitan must load the
    newest verified checkpoint (bitwise the state that run saved at that step) and train on cleanly."""
    from scout_core.checkpoint.durable import LABELS_FILE

    problems = []
    with open(os.path.join(workdir, "titan", "checkpoint", LABELS_FILE)) as fh:
        labels = {int(k): v["label"] for k, v in json.load(fh)["checkpoints"].items()}
    if "labels" in p and labels != {int(k): v for k, v in p["labels"].items()}:
        problems.append(f"labels after the stop {labels}, expected {p['labels']}")
    first = os.path.join(workdir, "incidents.jsonl")
    os.replace(first, os.path.join(workdir, "incidents-first-run.jsonl"))
    restart = {**args, "faults": [], "phase": "b"}
    result = launch(_titan_rank, world_size, timeout_s=spec.timeout_s, args=restart, failure_grace_s=10.0)
    if not result.ok:
        return problems + [f"the restart failed: {result.failures()}"]
    # The step restored: TorchTitan's chosen checkpoint, or (with SCOUT's snapshots on) SCOUT's verified snapshot,
    # whose step depends on which checks certified before the verdict (a busy persist delays one): any allowed.
    want = int(result.values()[0]["loaded"][0]) if result.values()[0]["loaded"] else -1
    allowed = p.get("restart_steps", [p.get("restart_step")])
    if want not in allowed:
        problems.append(f"the restart loaded step {want}, expected one of {allowed}")
        return problems
    for rank, value in enumerate(result.values()):
        with open(os.path.join(workdir, f"sigs-a-r{rank}.json")) as fh:
            saved = json.load(fh)[str(want)]
        if value["loaded"] != [want, *saved]:
            problems.append(f"rank {rank} loaded {value['loaded'][:1]} (signature equal to the run's step {want}: "
                            f"{value['loaded'][1:] == saved}), expected step {want} bitwise")
    if "resume_source" in p:  # SCOUT restored its own snapshot: its resume record says which and from where
        from scout_core.checkpoint.coordinator import read_records

        resumes = [r for r in read_records(os.path.join(workdir, "scout-checkpoints", "decisions.jsonl"))
                   if r.get("record") == "resume"]
        got = [(r.get("source"), r.get("generation")) for r in resumes]
        if got != [(p["resume_source"], want)]:
            problems.append(f"SCOUT's resume records {got}, expected [({p['resume_source']!r}, {want})]")
    again = list(read_incidents(first)) if os.path.exists(first) else []
    if again:
        problems.append(f"the restart reported {[(i.kind.value, i.ranks, i.step) for i in again]}, expected nothing")
    # The restarted run's checks go on from the loaded step: its own checkpoints are verified in turn, and the
    # rejected one is out of TorchTitan's reach.
    with open(os.path.join(workdir, "titan", "checkpoint", LABELS_FILE)) as fh:
        body = json.load(fh)
    after = {int(k): v["label"] for k, v in body["checkpoints"].items()}
    expected = {int(k): v for k, v in p["labels_after_restart"].items()}
    lagging = sorted(s for s, label in after.items() if s > want and label in ("latest", "candidate"))
    if p.get("snapshots") and lagging and all(expected.get(s) == "verified" for s in lagging) and (
            lagging == list(range(lagging[0], max(after) + 1)) and any(
                after[s] == "verified" for s in after if want < s < lagging[0])):
        # With SCOUT's snapshots on, a boundary that finds the previous snapshot still being written certifies
        # nothing (training never waits for it): the restarted run's last steps may stay unverified on a loaded
        # machine, as no later step catches them up. It must still have verified a step of its own before them.
        expected.update((s, after[s]) for s in lagging)
    if after != expected:
        problems.append(f"labels after the restarted run {after}, expected {p['labels_after_restart']}")
    aside = [os.path.basename(x).split("-")[1] for x in body.get("set_aside", [])]
    expected_aside = p["set_aside"] if "set_aside" in p else list(range(int(p["saved_through"]), want, -1))
    if aside != [str(s) for s in expected_aside]:
        problems.append(f"set aside {body.get('set_aside')}, expected the steps {expected_aside}")
    return problems
