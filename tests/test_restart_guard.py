"""The restart path never strands a peer, and restores only its own job's in-memory snapshots (real gloo ranks)."""

from __future__ import annotations

import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from scout_core.testing.launcher import RankContext, launch

JOB_ENV = ("SLURM_JOB_ID", "SLURM_STEP_ID", "TORCHELASTIC_RUN_ID", "PBS_JOBID", "LSB_JOBID")


class _Position:
    """A caller's state object. ``needs``: a key its load_state_dict insists on (a later version of the caller's
    code that the snapshots of the first run do not have)."""

    def __init__(self, needs: str = "") -> None:
        self.n, self.needs = 0, needs

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n, **({self.needs: 1} if self.needs else {})}

    def load_state_dict(self, saved: dict[str, int]) -> None:
        if self.needs and self.needs not in saved:
            raise KeyError(f"position state lacks {self.needs!r}")
        self.n = saved["n"]


def _signature(model: torch.nn.Module) -> list[str]:
    from scout_core.signature import sign_many

    return [s.signature for s in sign_many([p.detach() for p in model.parameters()])]


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Everything a put-back must leave bitwise as it was: parameters, the optimizer's state tensors (Adam's
    moments and step counts, by parameter index and name) and the CPU RNG state."""
    from scout_core.signature import sign_many

    named = [(i, k, v) for i, st in sorted(opt.state_dict()["state"].items()) for k, v in sorted(st.items())
             if isinstance(v, torch.Tensor)]
    signed = sign_many([v.detach().reshape(-1) for _, _, v in named])
    return {"params": _signature(model), "optim": [(i, k, s.signature) for (i, k, _), s in zip(named, signed)],
            "rng": bytes(torch.get_rng_state().tolist())}


def _job(ctx: RankContext):
    """Phase "train": 9 steps, a check and a capture at each (coverage of the 3 blocks in 3 checks: verified 3 and
    6, candidate 9, latest 9),
    then the job dies. Phase "resume": other initial weights, perhaps a damaged slot or a caller state that no
    snapshot satisfies, then resume()."""
    import scout_core
    from integrations_tests.models import batches, start_rank
    from scout_core.config import load

    a, _, par, opt = start_rank(ctx)
    for name in JOB_ENV:  # the job's identity is the checkpoint folder's nonce here, whatever runs the tests
        os.environ.pop(name, None)
    phase, d = a["phase"], a["dir"]
    if phase != "train":
        with torch.no_grad():
            for p in par.model.parameters():
                p.add_(1.0)
        if a.get("stepped"):  # Adam state and an RNG state of this run's own, before enable() and resume()
            x, y = next(iter(batches(ctx.rank + 7, 1)))
            torch.nn.functional.mse_loss(par.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            torch.rand(7)
    position = _Position(needs="epoch" if a.get("new_state_on") == ctx.rank else "")
    cfg = load(None, ["replay.cadence.embedding=0", "replay.cadence.hidden=1", "replay.cadence.output=0",
                      "replay.cadence.optimizer=0", "observer.enabled=false", "checkpoint.enabled=true",
                      f"checkpoint.directory={d}/ckpt",
                      f"checkpoint.memory_dir={d}/shm", f"report.jsonl_path={d}/inc.jsonl", "report.log_level=ERROR"])
    handle = scout_core.enable(par.model, opt, config=cfg, state={"position": position})
    memory = handle.checkpoint.memory
    out: dict = {}
    if phase == "train":
        for step, (x, y) in enumerate(batches(ctx.rank, a.get("steps", 9)), start=1):
            torch.nn.functional.mse_loss(par.model(x), y).backward()
            opt.step()
            opt.zero_grad()
            position.n = step
            handle.flush()
            out[step] = _signature(par.model)
    else:
        if a.get("truncate") == ctx.rank:  # this rank's newest slot lost its second half (a torn copy, bad RAM)
            path = memory.path_of("own", ctx.rank, memory.inventory()["own"])
            os.truncate(path, os.path.getsize(path) // 2)
        if a.get("copy_fails") == ctx.rank:  # no host memory left for the copy of the state from before
            from scout_core.checkpoint.restart import Restart

            def no_room(self):
                raise MemoryError("host out of memory copying the state from before resume()")

            Restart.state_now = no_room
        dist.barrier()
        before = _state(par.model, opt)
        start = time.monotonic()
        result = handle.resume(a.get("failure"))
        after = _state(par.model, opt)
        out = {"took": time.monotonic() - start, "step": result.step, "source": result.source,
               "reason": result.reason, "params": after["params"], "unchanged": before["params"] == after["params"],
               "optim_unchanged": bool(before["optim"]) and before["optim"] == after["optim"],
               "rng_unchanged": before["rng"] == after["rng"], "intact": result.intact, "position": position.n}
        dist.barrier()
        out["inventory"] = memory.inventory()
    handle.close()  # no discard: the slots outlive the process, as after a crash
    return out


def _incidents(d) -> list[tuple[str, list[int], str]]:
    from scout_core.report import read_incidents

    path = d / "inc.jsonl"
    return [(i.kind.value, i.ranks, i.surface) for i in read_incidents(path)] if path.exists() else []


def _trained(tmp_path, world: int = 2) -> tuple[dict, dict]:
    """One training job; its folders are kept aside so that each restart starts from the same ones."""
    args = {"faults": [], "seed": 0, "layout": "ddp", "dir": str(tmp_path / "job"), "phase": "train"}
    first = launch(_job, world, timeout_s=180, args=args)
    assert first.ok, first.failures()
    shutil.copytree(tmp_path / "job", tmp_path / "pristine")
    return args, first.values()[0]


def _fresh_copy(tmp_path) -> None:
    shutil.rmtree(tmp_path / "job")
    shutil.copytree(tmp_path / "pristine", tmp_path / "job")


def test_a_slot_that_does_not_load_makes_every_rank_fall_back_together(tmp_path):
    """Rank 1's newest slot is torn. Restoring latest (a straggler's restart), and the emergency sweep of a
    crash's restart, both fail to load it on rank 1 only: every rank returns promptly with the same older
    verified generation, bitwise, and rank 1 says what failed in a diagnosis_error record."""
    args, sigs = _trained(tmp_path)
    for failure, where in (("straggler", "resume:loading the in-memory snapshot of step 9"),
                           (None, "resume:loading the in-memory snapshot of step 9")):
        _fresh_copy(tmp_path)
        second = launch(_job, 2, timeout_s=120, args={**args, "phase": "resume", "truncate": 1, "failure": failure})
        assert second.ok, second.failures()
        for v in second.values():
            assert v["took"] < 60, v["took"]  # far inside the process group's timeout
            assert (v["step"], v["source"]) == (6, "verified"), v["reason"]
            assert v["params"] == sigs[6] and v["position"] == 6
            assert v["inventory"] == {"own": None, "replicas": {}}  # step 9 is gone: it is never offered again
        assert "could not" in second.values()[0]["reason"], second.values()[0]["reason"]
        errors = [i for i in _incidents(tmp_path / "job") if i[0] == "diagnosis_error"]
        assert errors == [("diagnosis_error", [1], where)], errors
        records = [json.loads(line) for line in open(tmp_path / "job" / "ckpt" / "decisions.jsonl")]
        assert (records[-1]["record"], records[-1]["source"], records[-1]["generation"]) == ("resume", "verified", 6)


def test_a_restore_that_fails_on_one_rank_leaves_every_rank_as_it_was(tmp_path):
    """Rank 1's caller state now insists on a key no snapshot holds: its restore raises half-way (after the
    model was loaded) for every generation. Every rank falls back through verified 6 and 3 to nothing, and every
    rank is put back to the state it had before resume(); the fresh start is recorded."""
    args, _ = _trained(tmp_path)
    second = launch(_job, 2, timeout_s=120, args={**args, "phase": "resume", "new_state_on": 1,
                                                  "failure": "straggler", "stepped": True})
    assert second.ok, second.failures()
    for v in second.values():
        assert v["took"] < 60, v["took"]
        assert v["step"] is None and v["unchanged"] and v["position"] == 0 and v["intact"], v
        # Adam's moments and step counts, and the CPU RNG, bitwise as before resume() too (not the snapshots').
        assert v["optim_unchanged"] and v["rng_unchanged"], v
        assert "nothing restored" in v["reason"] and "falling back to verified 3" in v["reason"], v["reason"]
    errors = [i for i in _incidents(tmp_path / "job") if i[0] == "diagnosis_error"]
    assert [e[1:] for e in errors] == [([1], f"resume:restoring step {s}") for s in (9, 6, 3)], errors
    records = [json.loads(line) for line in open(tmp_path / "job" / "ckpt" / "decisions.jsonl")]
    assert (records[-1]["record"], records[-1]["source"]) == ("resume", "none")


def test_a_checkpoint_folder_made_afresh_never_restores_an_older_jobs_memory(tmp_path):
    """Same machines, same configuration: a restart of the job (folder kept) restores its in-memory snapshot;
    once the checkpoint folder is deleted, the next job restores nothing and says why; the old slots go at its
    first capture."""
    args, sigs = _trained(tmp_path)
    again = launch(_job, 2, timeout_s=120, args={**args, "phase": "resume", "failure": "straggler"})
    assert again.ok, again.failures()
    for v in again.values():
        assert (v["step"], v["source"]) == (9, "latest") and v["params"] == sigs[9], v["reason"]
    old = {n for _, _, names in os.walk(tmp_path / "job" / "shm") for n in names if n.endswith(".pt")}
    shutil.rmtree(tmp_path / "job" / "ckpt")
    fresh = launch(_job, 2, timeout_s=120, args={**args, "phase": "resume", "failure": "straggler"})
    assert fresh.ok, fresh.failures()
    for v in fresh.values():
        assert v["step"] is None and v["unchanged"] and v["position"] == 0, v
        assert "fresh start" in v["reason"] and "of another job" in v["reason"], v["reason"]
        assert "made afresh" in v["reason"], v["reason"]
        assert v["inventory"] == {"own": None, "replicas": {}}
    # The old slots go once every rank agreed to go on: at the new job's first capture.
    first = launch(_job, 2, timeout_s=120, args={**args, "steps": 1})
    assert first.ok, first.failures()
    now = {n for _, _, names in os.walk(tmp_path / "job" / "shm") for n in names if n.endswith(".pt")}
    assert old and now and not old & now, (old, now)


def test_slots_belong_to_their_job(tmp_path):
    from scout_core.checkpoint.memory import NONCE, MemorySlots, job_token, read_nonce, write_nonce

    hosts = {0: "h", 1: "h"}
    folder = str(tmp_path / "ckpt")
    assert read_nonce(folder) is None
    assert write_nonce(folder, "a" * 32) and not write_nonce(folder, "b" * 32)  # written once, never replaced
    assert read_nonce(folder) == "a" * 32 and os.listdir(folder) == [NONCE]  # no temporary left behind

    def slots(job: str, nonce: str = "a" * 32, fresh: bool = False) -> MemorySlots:
        return MemorySlots(str(tmp_path / "shm"), rank=0, hosts=hosts, fallback=str(tmp_path / "disk"),
                           token=job_token(job, nonce), fresh=fresh)

    first = slots("slurm-41")
    first.write_own({"step": 4})
    first.write_replica(1, 4, torch.zeros(8, dtype=torch.uint8))
    assert first.inventory() == {"own": 4, "replicas": {1: 4}}
    assert slots("slurm-41").inventory() == {"own": 4, "replicas": {1: 4}}  # a restart of the same job
    other = slots("slurm-42")  # another job, same folder and machines: never offered, kept until it captures
    assert other.inventory() == {"own": None, "replicas": {}}
    assert other.foreign[0] == 2 and "another job's identity" in other.foreign[1]
    assert len(_slot_files(tmp_path)) == 2
    assert other.drop_foreign() == 2 and _slot_files(tmp_path) == []
    other.write_own({"step": 2})
    again = slots("slurm-42", "c" * 32, fresh=True)  # the folder made afresh: the job id alone is not enough
    assert again.inventory() == {"own": None, "replicas": {}}
    assert again.foreign[0] == 1 and "made afresh" in again.foreign[1]
    again.ensure_space(8, copies=2)  # the first capture deletes them
    assert _slot_files(tmp_path) == []


def _slot_files(tmp_path) -> list[str]:
    """The snapshots in the machine's folder (not the marker of the boot they were written on)."""
    return sorted(n for n in os.listdir(tmp_path / "shm" / "h") if n.endswith(".pt"))


def test_every_rank_takes_rank_0s_nonce_and_a_node_local_folder_gets_it(tmp_path):
    """Rank 0 creates the nonce once; every rank gets it over the control group, a rank with a folder of its own
    (node-local) writes it there, and the next launch (same folders) finds the same one on every rank."""
    first = launch(_nonce, 3, timeout_s=60, args={"dir": str(tmp_path)})
    assert first.ok, first.failures()
    nonces = {v["nonce"] for v in first.values()}
    assert len(nonces) == 1 and [v["fresh"] for v in first.values()] == [True] * 3
    again = launch(_nonce, 3, timeout_s=60, args={"dir": str(tmp_path)})
    assert again.ok, again.failures()
    assert {v["nonce"] for v in again.values()} == nonces and not any(v["fresh"] for v in again.values())
    assert {v["file"] for v in again.values()} == nonces  # rank 2's own folder holds it too


def _nonce(ctx: RankContext):
    from scout_core.checkpoint.memory import read_nonce, share_nonce
    from scout_core.testing.launcher import init_gloo

    init_gloo(ctx)
    # Ranks 0 and 1 share a folder; rank 2's is its own (node-local).
    folder = os.path.join(ctx.args["dir"], "shared" if ctx.rank < 2 else "local-2")
    errors: list = []
    nonce, fresh = share_nonce(folder, rank=ctx.rank, group=dist.group.WORLD, on_error=errors.append)
    assert not errors, errors
    return {"nonce": nonce, "fresh": fresh, "file": read_nonce(folder)}
