"""Run the cells of configs/cells.yaml under pytest, and prove their checks can fail.

Cells without a matrix place run here in `nox -s tests`; the matrix cells (marked `matrix`) run in the same session
through `scout cells matrix`. Every other test here is a guard (marked `guards` by conftest.py): it re-runs a cell
with one mechanism removed and must see it turn red. CI runs every guard (docker/test.sh): those marked `waits`
(their cell mostly sleeps) three at a time, the others one at a time; `nox -s guards` runs them all the same way.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scout_core.consensus import C3Status
from scout_core.testing.cells import load_cells, run_cells
from scout_core.testing.lanes import WAITS_TAG
from scout_core.topology import Localization

ROOT = Path(__file__).resolve().parents[1]
SPECS = load_cells(ROOT / "configs" / "cells.yaml")


def _params():
    for name, spec in SPECS.items():
        marks = [] if "fast" in spec.tags else [pytest.mark.cells]
        if spec.matrix is not None:  # nox -s tests runs these through scout cells matrix (its summary and plot)
            marks.append(pytest.mark.matrix)
        if WAITS_TAG in spec.tags:  # it mostly sleeps: CI runs it side by side with other waiting tests
            marks.append(pytest.mark.waits)
        yield pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", list(_params()))
def test_cell_passes(name):
    (report,) = run_cells([SPECS[name]], root=ROOT)  # also holds run_cells' reporting_problem rule
    assert report.verdict == "PASS", report.details


def _missed(report, named: str = "named ranks []") -> bool:
    """The cell is red because the defect went unnamed (``named``), in a run that ended normally: a crash or a
    timeout also names nobody, and would prove nothing about the mechanism the guard removed."""
    return (report.verdict == "FAIL" and named in report.details
            and "timed out after" not in report.details and " (exit " not in report.details)


def _shift_blame(real):
    """A broken C3 that blames the next peer instead of the real outlier."""

    def wrapper(*args, **kwargs):
        results = real(*args, **kwargs)
        if results is None:  # c3_exchange_unless_failed: a member had failed, nothing was compared
            return None
        out = []
        for r in results:
            if r.status is C3Status.ATTRIBUTED:
                r = dataclasses.replace(r, bitmap=r.bitmap[-1:] + r.bitmap[:-1])
            out.append(r)
        return out

    return wrapper


# The exchanges a replay check makes: the evidence exchange (which a member that failed joins with None) and the
# replica exchange. A guard that breaks C3 breaks both.
_CHECK_EXCHANGES = ("c3_exchange", "c3_exchange_unless_failed")


def test_sdc_cell_fails_when_nothing_is_detected(monkeypatch):
    """The guard of ddp-sdc-two-ranks: a C3 that finds every surface in agreement turns it red."""
    from scout_core.replay import protocol

    def blinded(real):
        def blind(local, **kwargs):
            results = real(local, **kwargs)
            return None if results is None else [
                dataclasses.replace(r, status=C3Status.AGREE) if r.status is C3Status.ATTRIBUTED else r
                for r in results]
        return blind

    for name in _CHECK_EXCHANGES:
        monkeypatch.setattr(protocol, name, blinded(getattr(protocol, name)))
    (report,) = run_cells([SPECS["ddp-sdc-two-ranks"]], root=ROOT)
    assert _missed(report), report.details


def test_clean_cell_fails_on_a_false_positive(monkeypatch):
    """The guard of ddp-clean: one rank's first replayed surface signed differently turns it red."""
    from scout_core.replay import protocol

    def noised(real):
        def noisy(local, **kwargs):
            import torch.distributed as dist

            if dist.get_rank() == 5 and local and isinstance(local[0], tuple):  # a signature, not a time
                local = [(0, 0)] + list(local[1:])
            return real(local, **kwargs)
        return noisy

    for name in _CHECK_EXCHANGES:
        monkeypatch.setattr(protocol, name, noised(getattr(protocol, name)))
    (report,) = run_cells([SPECS["ddp-clean"]], root=ROOT)
    assert report.verdict == "FAIL" and "named ranks [5]" in report.details


def test_comm_straggler_cell_fails_when_the_wrong_machine_is_named(monkeypatch):
    """The guard of hsdp-comm-straggler (paper Figure 3's intersection): a localization that names rank 5's
    machine instead of the slow rank's turns it red."""
    from scout_core.replay import timing

    real = timing.localize_slow_groups

    def wrong(observations, host_of):
        loc = real(observations, host_of)
        if loc.scope == "machine":
            return Localization("machine", (5,), (host_of[5],), loc.slow_groups, "wrong")
        return loc

    monkeypatch.setattr(timing, "localize_slow_groups", wrong)
    (report,) = run_cells([SPECS["hsdp-comm-straggler"]], root=ROOT)
    assert report.verdict == "FAIL"


def test_hsdp_optimizer_cell_fails_when_shard_mates_are_blamed(monkeypatch):
    """The guard of hsdp-sdc-optimizer: without setting aside what a mate's corrupted shard explains, the ranks
    that gathered rank 9's shard (8, 10, 11) are named too."""
    from scout_core.replay import verdicts

    monkeypatch.setattr(verdicts, "explained_by_shard_mates", list)
    (report,) = run_cells([SPECS["hsdp-sdc-optimizer"]], root=ROOT)
    assert report.verdict == "FAIL" and "named ranks [8, 9, 10, 11]" in report.details


def test_hsdp_received_cell_fails_when_a_bad_receipt_is_taken_for_the_owners_shard(monkeypatch):
    """The guard of hsdp-sdc-received: without the comparison of each mate's copy with its owner's (every receipt
    empty), rank 8's corrupted copy of rank 9's shard is set aside as rank 9's, and nobody is named."""
    from scout_core.replay import recipe

    real = recipe.gathered_shard_surfaces

    def no_receipt(*args, **kwargs):
        return [(n, () if n.endswith(".gathered_receipt") else v) for n, v in real(*args, **kwargs)]

    monkeypatch.setattr(recipe, "gathered_shard_surfaces", no_receipt)
    (report,) = run_cells([SPECS["hsdp-sdc-received"]], root=ROOT)
    assert _missed(report), report.details


def test_fsdp2_kernel_cell_fails_without_the_source_slice_replay(monkeypatch):
    """The guard of fsdp2-sdc-optimizer-kernel: without every peer replaying the source's slice, rank 9's
    defective kernel agrees with itself in its self-check, and nobody is named."""
    from scout_core.replay import recipe

    monkeypatch.setattr(recipe, "source_slice_surface", lambda *args, **kwargs: [])
    (report,) = run_cells([SPECS["fsdp2-sdc-optimizer-kernel"]], root=ROOT)
    assert _missed(report), report.details


def test_surfaces_defaults_cell_fails_without_the_rotation(monkeypatch):
    """The guard of ddp-sdc-surfaces-defaults: a hidden recipe that always samples block 0 never reaches the
    defects of blocks 1 and 2 (ranks 5 and 9)."""
    from scout_core.replay.schedule import Schedule

    monkeypatch.setattr(Schedule, "layer_index", lambda self: 0)
    (report,) = run_cells([SPECS["ddp-sdc-surfaces-defaults"]], root=ROOT)
    assert report.verdict == "FAIL" and "named ranks [3, 12]" in report.details


@pytest.mark.parametrize("layout", ["fsdp2", "hsdp"])
def test_sdc_defaults_cell_fails_without_the_rotation(monkeypatch, layout):
    """The guard of {fsdp2,hsdp}-sdc-defaults: a hidden recipe that always samples block 0 never reaches the
    defect of block 1, and nobody is named."""
    from scout_core.replay.schedule import Schedule

    monkeypatch.setattr(Schedule, "layer_index", lambda self: 0)
    (report,) = run_cells([SPECS[f"{layout}-sdc-defaults"]], root=ROOT)
    assert _missed(report), report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_hang_cell_fails_when_the_wrong_rank_is_blamed(monkeypatch, forked_observers):
    from scout_core.progress import episode
    from scout_core.progress.classify import HangClass, HangVerdict

    def blame_rank_zero(summaries, hosts=None):
        return [HangVerdict(HangClass.LAGGING, (0,), tuple(summaries[0]["group"]), "wrong on purpose")]

    monkeypatch.setattr(episode, "merge", blame_rank_zero)
    (report,) = run_cells([SPECS["hang-frozen-rank"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected" in report.details
    assert any(i["kind"] == "hang" and i["ranks"] == [0] for i in report.reported), report.details  # not a timeout


def test_hang_clean_cell_fails_on_a_spurious_verdict(monkeypatch, forked_observers):
    from scout_core.progress.record import ProgressRecord

    real_read = ProgressRecord.read

    def stale_read(self, *args, **kwargs):  # an observer that believes nothing ever moves
        snap = real_read(self, *args, **kwargs)
        return dataclasses.replace(snap, t_publish=snap.t_publish - 3600)

    monkeypatch.setattr(ProgressRecord, "read", stale_read)
    spec = dataclasses.replace(SPECS["hang-clean"], params={**SPECS["hang-clean"].params, "steps": 200})
    (report,) = run_cells([spec], root=ROOT)
    assert report.verdict == "FAIL"


def test_recovery_cell_fails_when_the_restore_is_not_bitwise(monkeypatch):
    from scout_core.checkpoint import restart as restart_mod

    real = restart_mod.restore_state

    def forgetful(chunks, optimizers, snap, **kwargs):  # restores the model but drops optimizer state
        real(chunks, optimizers, {**snap, "optim": [{"state": {}, "param_groups": o["param_groups"]}
                                                    for o in snap["optim"]]}, **kwargs)

    monkeypatch.setattr(restart_mod, "restore_state", forgetful)
    (report,) = run_cells([SPECS["ddp-recovery-straggler"]], root=ROOT)
    assert report.verdict == "FAIL" and "not bitwise" in report.details


def test_recovery_cell_fails_when_sdc_resumes_from_latest(monkeypatch):
    from scout_core.checkpoint import coordinator
    from scout_core.checkpoint.certify import decide_retrieval

    def reckless(certifier, failure, *, sweep=None):  # always "latest", as if a sweep had found it clean
        return decide_retrieval(certifier, "other", sweep=lambda: True)

    monkeypatch.setattr(coordinator, "decide_retrieval", reckless)
    (report,) = run_cells([SPECS["ddp-recovery-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected ('verified'" in report.details


@pytest.mark.parametrize("layout", ["ddp", "fsdp2", "hsdp"])
def test_recovery_defaults_cell_fails_with_the_last_check_rule(layout):
    """The guard of {ddp,fsdp2,hsdp}-recovery-sdc-defaults: with the paper's K = 1 rule (``checkpoint.certify:
    last_check_only``) the capture of step 180, after 19 steps of the defect, is verified by the clean check of
    block 0 and restored: the clean run's state differs from it."""
    spec = SPECS[f"{layout}-recovery-sdc-defaults"]
    # Flushed after every step: on a loaded machine the captures of steps 140-180 may still be in flight at the
    # stop, and K = 1 then restores step 120, clean by luck (seen once in a guard run; reproduced with two busy
    # loops beside it). The cell itself runs unflushed, as a user's loop does.
    spec = dataclasses.replace(spec, params={**spec.params, "certify": "last_check_only", "flush_each_step": True})
    (report,) = run_cells([spec], root=ROOT)
    assert report.verdict == "FAIL" and "carries the corruption" in report.details, report.details


def test_straggler_sdc_cell_fails_when_a_straggler_restores_latest_unswept(monkeypatch):
    """The guard of ddp-recovery-straggler-sdc-defaults: with the paper's straggler policy (latest, no sweep:
    "slowness is not numerical divergence") the restart restores the capture of step 200, which carries the SDC
    no check had reached yet."""
    from scout_core.checkpoint import resume
    from scout_core.checkpoint.certify import FailureKind, RetrievalDecision

    real = resume.decide_retrieval

    def paper(certifier, failure, *, sweep=None):
        if FailureKind(failure) is FailureKind.STRAGGLER:
            return RetrievalDecision("latest", certifier.latest, "straggler: not divergence", "straggler")
        return real(certifier, failure, sweep=sweep)

    monkeypatch.setattr(resume, "decide_retrieval", paper)
    (report,) = run_cells([SPECS["ddp-recovery-straggler-sdc-defaults"]], root=ROOT)
    assert report.verdict == "FAIL" and "carries the corruption" in report.details, report.details


def test_nonfinite_cell_fails_without_the_finite_state_check(monkeypatch):
    """Without the check, every replica's NaN weights agree: no verdict stops the job, and NaN states are certified."""
    import scout_core.boundary as boundary

    monkeypatch.setattr(boundary, "state_is_finite", lambda modules: True)
    (report,) = run_cells([SPECS["ddp-recovery-nonfinite-defaults"]], root=ROOT)
    assert report.verdict == "FAIL" and "phase A should stop" in report.details, report.details


def test_recovery_coverage_cell_fails_with_the_last_check_rule():
    spec = SPECS["recovery-coverage-8"]
    spec = dataclasses.replace(spec, params={**spec.params, "certify": "last_check_only"})
    (report,) = run_cells([spec], root=ROOT)
    assert report.verdict == "FAIL" and "restored [('verified', 8)]" in report.details, report.details


def test_machine_lost_cell_fails_without_the_peer_replica_fetch(monkeypatch):
    from scout_core.checkpoint.resume import Restarter

    monkeypatch.setattr(Restarter, "_exchange_replicas", lambda self, gen, fetch: None)
    (report,) = run_cells([SPECS["recovery-machine-lost"]], root=ROOT)
    assert report.verdict == "FAIL" and "fetched" in report.details


def test_replay_error_cell_fails_when_a_diagnosis_error_reaches_training(monkeypatch):
    from scout_core.replay.guard import DiagnosisGuard

    def unguarded(self, where, fn):  # a guard that lets SCOUT's exception escape into the training step
        return fn()

    monkeypatch.setattr(DiagnosisGuard, "run", unguarded)
    (report,) = run_cells([SPECS["replay-error-isolated"]], root=ROOT)
    assert report.verdict == "FAIL" and "with SCOUT" in report.details


def test_replay_cell_fails_when_blame_shifts(monkeypatch):
    from scout_core.replay import protocol, sweep

    for module in (protocol, sweep):  # the check's exchanges and the emergency sweep's compare alike
        for name in _CHECK_EXCHANGES:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, _shift_blame(getattr(module, name)))
    (report,) = run_cells([SPECS["ddp-sdc-output"]], root=ROOT)
    assert report.verdict == "FAIL" and "named ranks" in report.details


def test_scratch_oom_cell_fails_when_the_allocation_is_not_guarded(monkeypatch):
    from scout_core.replay.guard import DiagnosisGuard

    real = DiagnosisGuard.run

    def unguarded_scratch(self, where, fn):  # out of memory escapes into training before the agreement
        return fn() if where.startswith("scratch memory") else real(self, where, fn)

    monkeypatch.setattr(DiagnosisGuard, "run", unguarded_scratch)
    (report,) = run_cells([SPECS["fsdp2-scratch-oom-isolated"]], root=ROOT)
    assert report.verdict == "FAIL" and "with SCOUT" in report.details


# -- the hang cells of real-job conditions turn red for the behaviour each guards ----------------------


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_rank0_killed_cell_fails_when_rank_0_serves_the_control_store(monkeypatch):
    """The first design: the store lived in a rank-0 process and died with it."""
    import socket
    import threading

    from scout_core.progress import control
    from scout_core.progress.store_server import StoreServer

    def in_rank0(world_size, port=0, idle_exit_s=0.0, *, secret="", bind="", clientless_s=0.0):
        server = StoreServer(socket.create_server((bind, port)), secret)

        def serve_forever():
            while True:
                server.serve(1.0)

        threading.Thread(target=serve_forever, daemon=True).start()
        return server.listener.getsockname()[1]  # served by a thread of rank 0's trainer: dies with it

    monkeypatch.setattr(control, "start_store_daemon", in_rank0)
    # Without a store nobody can report: the cell times out (shortened: the real cell passes in 14-16 s, also beside
    # two other waiting cells).
    (report,) = run_cells([dataclasses.replace(SPECS["hang-rank0-killed"], timeout_s=30)], root=ROOT)
    assert report.verdict == "FAIL" and "expected" in report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_machine_lost_cell_fails_when_lost_ranks_are_not_grouped_by_machine(monkeypatch, forked_observers):
    from scout_core.progress import classify

    real = classify._lost_verdicts
    monkeypatch.setattr(classify, "_lost_verdicts", lambda lost, hosts, answered: real(lost, {}, answered))
    (report,) = run_cells([SPECS["hang-machine-lost"]], root=ROOT)
    assert report.verdict == "FAIL" and "'scope': 'rank'" in report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_onset_spread_cell_fails_when_only_silent_observers_answer(monkeypatch, forked_observers):
    """The first design: working peers did not post, and the frozen rank's observer named them lost."""
    from scout_core.progress.episode import EpisodeProtocol

    monkeypatch.setattr(EpisodeProtocol, "opened", lambda self: False)
    (report,) = run_cells([SPECS["hang-onset-spread"]], root=ROOT)
    assert report.verdict == "FAIL" and any(i["evidence"].get("class") == "lost" for i in report.reported)


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_equal_stall_asymmetric_cell_fails_when_marks_move_the_coordinate(monkeypatch):
    """The first design: every publish advanced one running count, so rank 0's extra work shifted it."""
    from scout_core.progress.hooks import ProgressTracker

    real = ProgressTracker.mark

    def counting_mark(self, phase):
        with self._lock:
            self.launched += 1
        real(self, phase)

    monkeypatch.setattr(ProgressTracker, "mark", counting_mark)
    (report,) = run_cells([SPECS["hang-equal-stall-asymmetric"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected" in report.details and report.reported, report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_frozen_after_launch_cell_fails_without_completion_tracking(monkeypatch):
    """The first design: only the launch was published, so the stopped rank looked pending in its bucket."""
    from scout_core.progress.hooks import ProgressTracker

    monkeypatch.setattr(ProgressTracker, "track", lambda self, key, result, tensor: None)
    (report,) = run_cells([SPECS["hang-frozen-after-launch"]], root=ROOT)
    # every collective then looks pending forever: rank 9 is no longer told apart as the one stopped outside
    assert report.verdict == "FAIL" and report.reported and not any(  # a wrong verdict, not a timeout
        i["ranks"] == [9] and i["evidence"].get("class") == "lagging" for i in report.reported), report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_frozen_rank_cell_fails_without_the_ddp_backward_marks(monkeypatch):
    """As shipped, DDP's buckets are not published: each backward is one collective. Without it, peers waiting in
    DDP's bucket all-reduce look like a rank frozen in forward, and rank 9 is no longer named."""
    from scout_core.progress.hooks import ProgressTracker

    monkeypatch.setattr(ProgressTracker, "install_ddp_backward_marks", lambda self, models: None)
    # A name of its own: under xdist the other guard of this cell may run at once, and the run id (the cell's
    # name) names the job's control folder.
    spec = dataclasses.replace(SPECS["hang-frozen-rank"], name="hang-frozen-rank-no-ddp-marks")
    (report,) = run_cells([spec], root=ROOT)
    assert report.verdict == "FAIL" and report.reported and not any(
        i["ranks"] == [9] and i["evidence"].get("class") == "lagging" for i in report.reported), report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_mismatch_async_cell_fails_when_only_the_last_launch_is_compared(monkeypatch):
    from scout_core.progress.hooks import ProgressTracker

    def last_launch_only(self):
        if self._inflight:
            (step, i), fp = next(reversed(self._inflight.items()))
            self.record.publish(step, i, self._phase, True, self.launched, fp)
        else:
            self.record.publish(self.step, self.launched, self._phase, False, self.launched)

    monkeypatch.setattr(ProgressTracker, "_publish_locked", last_launch_only)
    (report,) = run_cells([SPECS["hang-mismatch-async"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected" in report.details and report.reported, report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_slow_not_stalled_cell_fails_without_the_adaptive_threshold(monkeypatch, forked_observers):
    from scout_core.progress import observer as observer_mod

    real = observer_mod.silence_threshold
    fixed = lambda spec, snap: real(spec, snap) if snap.step < 2 else spec.silence_threshold_s  # noqa: E731
    monkeypatch.setattr(observer_mod, "silence_threshold", fixed)
    (report,) = run_cells([SPECS["hang-slow-not-stalled"]], root=ROOT)
    assert report.verdict == "FAIL" and any(i["kind"] == "hang" for i in report.reported)  # a false hang


def test_straggler_at_defaults_cell_fails_with_a_blind_rule(monkeypatch):
    """A rule whose ratio floor sits above the injected slowdown names nobody: red."""
    from scout_core.consensus import StatisticalRule

    monkeypatch.setattr(StatisticalRule, "from_config",
                        classmethod(lambda cls, cfg: cls(kappa=6.0, min_ratio=4.0, min_delta=0.005)))
    (report,) = run_cells([SPECS["ddp-straggler-defaults"]], root=ROOT)
    assert _missed(report, "named ranks [], expected [9]"), report.details


def test_hsdp_straggler_cell_fails_without_the_job_wide_comparison(monkeypatch):
    """HSDP compute compared only within a replica group (8 ranks, not 16): red."""
    from scout_core.replay import recipe

    monkeypatch.setattr(recipe, "time_hsdp_collectives", lambda *a, **k: None)  # no cross-group timing round
    (report,) = run_cells([SPECS["hsdp-straggler-defaults"]], root=ROOT)
    assert report.verdict == "FAIL" and "compared among [8] ranks, expected 16" in report.details


def test_clean_at_defaults_cell_fails_on_a_false_straggler(monkeypatch):
    """A rule too tight for this machine's noise (no ratio or absolute floor, no noise floor) names healthy
    ranks: red."""
    from scout_core.consensus import NoiseFloor, StatisticalRule
    from scout_core.replay import judge

    monkeypatch.setattr(StatisticalRule, "from_config",
                        classmethod(lambda cls, cfg: cls(kappa=0.5, min_ratio=1.0, min_delta=0.0)))
    monkeypatch.setattr(judge, "NoiseFloor", lambda window: NoiseFloor(0))  # the rule alone
    spec = SPECS["ddp-clean-defaults"]
    short = dataclasses.replace(spec, params={**spec.params, "steps": 12})
    (report,) = run_cells([short], root=ROOT)
    assert report.verdict == "FAIL" and "straggler" in report.details


def test_nondeterministic_cell_fails_without_vetting(monkeypatch):
    """Without the determinism check, a nondeterministic rank is reported as SDC."""
    from scout_core.replay import trust

    monkeypatch.setattr(trust, "vet_due", lambda *a, **k: False)
    (report,) = run_cells([SPECS["ddp-nondeterministic"]], root=ROOT)
    assert report.verdict == "FAIL" and "sdc" in report.details


def test_environment_mismatch_cell_fails_without_the_environment_check(monkeypatch):
    """Without the fingerprint, a rank whose different kernels give consistently different bits is SDC."""
    from scout_core.replay import trust

    real = trust.split_vetting

    def no_environment(results):
        kept, untrusted = real(results)
        return kept, {r: why for r, why in untrusted.items() if why != "environment"}

    monkeypatch.setattr(trust, "split_vetting", no_environment)
    (report,) = run_cells([SPECS["ddp-environment-mismatch"]], root=ROOT)
    assert report.verdict == "FAIL" and "sdc" in report.details


def test_moe_expert_cell_fails_without_the_expert_recipe(monkeypatch):
    """The dense recipe alone never compares an expert among its replicas: the stuck expert weight goes unseen."""
    from scout_core.moe.replay import ExpertReplay

    monkeypatch.setattr(ExpertReplay, "boundary", lambda self, step: None)
    (report,) = run_cells([SPECS["moe-sdc-expert"]], root=ROOT)
    assert _missed(report, "named ranks [], expected [9]"), report.details


def test_moe_defaults_cell_fails_without_the_expert_recipe(monkeypatch):
    """The guard of moe-sdc-defaults: at the shipped cadences too, the dense recipe alone names the router's rank
    and never the expert's."""
    from scout_core.moe.replay import ExpertReplay

    monkeypatch.setattr(ExpertReplay, "boundary", lambda self, step: None)
    # 120 steps, not the cell's 180: the cell names the expert's rank at step 100, so by 120 it is missed.
    spec = SPECS["moe-sdc-defaults"]
    (report,) = run_cells([dataclasses.replace(spec, params={**spec.params, "steps": 120})], root=ROOT)
    assert report.verdict == "FAIL" and "named ranks [3], expected [3, 9]" in report.details, report.details


def test_moe_shape_cell_fails_with_a_catalog_missing_the_few_rows_shape():
    """Replaying only the GEMM's shape (32 rows) never runs the defective matrix-vector path: red."""
    spec = SPECS["moe-sdc-shape-dependent"]
    blind = dataclasses.replace(spec, params={**spec.params, "representatives": [32]})
    (report,) = run_cells([blind], root=ROOT)
    assert _missed(report, "named ranks [], expected [9]"), report.details


def test_moe_shape_cell_fails_without_the_catalog():
    """Replaying the shapes training routed (~24 rows) never runs the defective matrix-vector path: red."""
    spec = SPECS["moe-sdc-shape-dependent"]
    blind = dataclasses.replace(spec, params={**spec.params, "catalog": False})
    (report,) = run_cells([blind], root=ROOT)
    assert _missed(report, "named ranks [], expected [9]"), report.details


def test_moe_a2a_cell_fails_without_the_intersection(monkeypatch):
    """AllToAll timings never intersected across EP and expert-DP groups: the slow endpoint goes unnamed."""
    from scout_core.moe.alltoall import AllToAllReplay

    monkeypatch.setattr(AllToAllReplay, "_localize", lambda self, times: None)
    (report,) = run_cells([SPECS["moe-a2a-straggler"]], root=ROOT)
    assert _missed(report, "named ranks [], expected [9]"), report.details


def test_moe_recovery_cell_fails_when_certification_ignores_the_recipe_cycle(monkeypatch):
    """A cycle of 1 instead of the expert recipe's 2 (the cell's whole coverage): a later candidate is promoted and
    restored."""
    from scout_core.moe.replay import ExpertReplay

    monkeypatch.setattr(ExpertReplay, "cycle", property(lambda self: 1))
    (report,) = run_cells([SPECS["moe-recovery-two-cycle"]], root=ROOT)
    assert report.verdict == "FAIL" and "restored" in report.details


def test_moe_sweep_cell_fails_when_the_sweep_skips_the_experts(monkeypatch):
    """An emergency sweep of the dense recipes only passes the latest state, whose expert holds the fault."""
    from scout_core.moe.replay import ExpertReplay

    monkeypatch.setattr(ExpertReplay, "sweep", lambda self, step: "clean")
    (report,) = run_cells([SPECS["moe-recovery-sweep"]], root=ROOT)
    assert report.verdict == "FAIL" and "restored [('latest', 15)]" in report.details


def test_moe_nondeterministic_cell_fails_without_expert_vetting(monkeypatch):
    """Without the expert recipe's determinism check, a nondeterministic expert kernel reads as SDC."""
    from scout_core.moe import replay

    monkeypatch.setattr(replay, "vet_due", lambda *a, **k: False)
    (report,) = run_cells([SPECS["moe-nondeterministic-expert"]], root=ROOT)
    assert report.verdict == "FAIL" and "kinds ['sdc'], expected ['inconclusive']" in report.details


def test_moe_a2a_sender_cell_fails_when_receivers_are_judged_alone(monkeypatch):
    """Judging each receiver among its replicas names the corrupting sender's receivers: red."""
    from scout_core.moe import alltoall

    monkeypatch.setattr(alltoall, "attribute_transfers", lambda odd, carried=None: [
        alltoall.TransferVerdict((q,), "rank", ((q, s),), "receiver") for q, s in sorted(odd)])
    (report,) = run_cells([SPECS["moe-a2a-sdc-sender"]], root=ROOT)
    assert report.verdict == "FAIL" and "named ranks [8, 9, 10, 11], expected [9]" in report.details


def test_moe_clean_cell_fails_when_the_optimizer_slice_compares_experts(monkeypatch):
    """The optimizer recipe comparing an expert's update across EP positions (different experts): red."""
    from scout_core.moe.binding import MoEBinding

    monkeypatch.setattr(MoEBinding, "expert_parameters", lambda self: [])
    (report,) = run_cells([SPECS["moe-clean"]], root=ROOT)
    assert report.verdict == "FAIL" and "scopes ['peer_group']" in report.details  # 4 groups of 4: no majority


def test_comm_straggler_cell_fails_when_a_group_is_called_slow_a_round_early(monkeypatch):
    """The guard of the comm-straggler cells: a temporal check confirmed at two slow rounds (as spatial consensus
    is) records the slowdown before its third slow round, which the cell refuses."""
    import scout_core.replay.timing as timing_module

    monkeypatch.setattr(timing_module, "TEMPORAL_EXTRA_ROUNDS", 0)
    (report,) = run_cells([SPECS["ddp-comm-straggler"]], root=ROOT)
    assert report.verdict == "FAIL" and "group slowdown recorded at steps" in report.details


def test_comm_straggler_cell_fails_when_timing_stays_sparse_through_a_slow_streak(monkeypatch):
    """The guard of ddp-comm-straggler at the shipped ``replay.comm_timing_every``: timing only every second
    check after the history is learned, also while the group reads slow, confirms the slowdown two checks late
    (or after the cell's last step), which the cell refuses."""
    from scout_core.replay.timing import CommTiming

    real = CommTiming.all_reduce_due

    def sparse_through_streaks(self, *args):
        saved, self.slow_group_rounds = self.slow_group_rounds, 0  # as if no streak ran
        try:
            return real(self, *args)
        finally:
            self.slow_group_rounds = saved

    monkeypatch.setattr(CommTiming, "all_reduce_due", sparse_through_streaks)
    (report,) = run_cells([SPECS["ddp-comm-straggler"]], root=ROOT)
    assert report.verdict == "FAIL" and "group slowdown recorded at steps" in report.details


def test_comm_straggler_cell_fails_when_every_check_times_the_all_reduce(monkeypatch):
    """The guard of ddp-comm-straggler's sparse timing: a job whose every check asks to time the scratch
    all-reduce (or one that never lets the buffer go) times it in every round, which the cell refuses."""
    from scout_core.replay.timing import CommTiming

    monkeypatch.setattr(CommTiming, "all_reduce_due", lambda self, *args: True)
    (report,) = run_cells([SPECS["ddp-comm-straggler"]], root=ROOT)
    assert report.verdict == "FAIL" and "every round timed the scratch all-reduce" in report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_hsdp_data_stall_cell_fails_when_ranks_waiting_behind_a_fetch_are_named(monkeypatch, forked_observers):
    """The guard of hsdp-data-stall: without the deferral while a rank is still inside its data fetch, the
    shard-group mates that wait behind it (they cross their threshold first) are named protocol mismatches."""
    import scout_core.progress.episode as episode

    real = episode.classify_group

    def without_the_deferral(group, evidence):
        return {**real(group, evidence), "in_io": False}

    monkeypatch.setattr(episode, "classify_group", without_the_deferral)
    (report,) = run_cells([SPECS["hsdp-data-stall"]], root=ROOT)
    assert report.verdict == "FAIL", report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_data_stall_cell_fails_without_the_named_ranks_stacks(monkeypatch):
    """The guard of data-stall's stack check: a trainer that armed no dump leaves the record naming no stack file."""
    import scout_core.assembly as assembly

    monkeypatch.setattr(assembly, "arm_trainer_stacks", lambda: None)
    (report,) = run_cells([SPECS["data-stall"]], root=ROOT)
    assert report.verdict == "FAIL" and "no record names a stack file for rank 9" in report.details, report.details


def test_moe_attention_straggler_cell_fails_when_other_kinds_of_work_reset_the_streak(monkeypatch):
    """The guard of moe-attention-straggler: counted over all rounds only, the router rounds reset the streak of a
    rank slow in attention alone, and it is never named."""
    from scout_core.consensus import Confirmation

    real = Confirmation.update
    monkeypatch.setattr(Confirmation, "update", lambda self, result, kind=None: real(self, result))
    (report,) = run_cells([SPECS["moe-attention-straggler"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected [9]" in report.details, report.details


# The plugins' guards come last: they import their frameworks into this process, and the core guards' ranks
# fork from a parent without them (as the core cells do in docker/test.sh).


def test_titan_recovery_cell_fails_when_torchtitan_loads_its_newest_checkpoint(monkeypatch):
    """The guard of titan-recovery-sdc: without the plugin's choice TorchTitan loads its newest checkpoint, the
    step-5 one saved after the SDC verdict, and the cell must say so."""
    from scout_torchtitan import cpu

    cpu.stub_triton_kernels()
    from scout_torchtitan.checkpointer import ScoutCheckpointManager

    monkeypatch.setattr(ScoutCheckpointManager, "_restart_plan", lambda self, asked, restored=None: None)
    (report,) = run_cells([SPECS["titan-recovery-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "the restart loaded step 5" in report.details, report.details


def test_titan_recovery_cell_fails_when_scout_restarts_its_count_from_zero(monkeypatch):
    """The guard of the restarted run's labels: if SCOUT's step count and certification started over at 0 after
    TorchTitan loaded step 4, the restarted run's checkpoints would never be verified."""
    from scout_core.handle import ScoutHandle

    monkeypatch.setattr(ScoutHandle, "continue_from", lambda self, step, verified, abandon_newer=True: None)
    (report,) = run_cells([SPECS["titan-recovery-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "labels after the restarted run" in report.details, report.details


def test_titan_moe_clean_cell_fails_when_expert_parallel_blocks_replay_whole(monkeypatch):
    """The guard of titan-moe-ep-clean: replaying whole MoE blocks under expert parallelism (each EP position
    holds other experts) makes the peers disagree with nothing injected, and the clean cell must turn red."""
    import dataclasses

    from scout_torchtitan import cpu

    cpu.stub_triton_kernels()
    from scout_torchtitan import attach

    monkeypatch.setattr(attach, "dense_parts", lambda layers, names, ep: (layers, names))
    monkeypatch.setattr(attach, "expert_binding", lambda trainer, chunks: None)  # (with it, scout_core refuses)
    spec = SPECS["titan-moe-ep-clean"]
    (report,) = run_cells([dataclasses.replace(spec, params={**spec.params, "steps": 4})], root=ROOT)
    assert report.verdict == "FAIL", report.details
    assert "named ranks [0, 1, 2, 3], expected []" in report.details and "kinds ['sdc'], expected []" in \
        report.details, report.details


def test_titan_snapshots_cell_fails_when_the_plugin_drops_scout_snapshots(monkeypatch):
    """The guard of titan-snapshots-clean: if ``--scout.checkpoint.enabled`` did not reach SCOUT, no rank would
    hold an in-memory snapshot, and the cell must say so."""
    import dataclasses

    from scout_torchtitan import cpu

    cpu.stub_triton_kernels()
    from scout_torchtitan import attach

    real = attach.to_core

    def without_snapshots(section):
        core = real(section)
        return dataclasses.replace(core, checkpoint=dataclasses.replace(core.checkpoint, enabled=False))

    monkeypatch.setattr(attach, "to_core", without_snapshots)
    spec = SPECS["titan-snapshots-clean"]
    (report,) = run_cells([dataclasses.replace(spec, params={**spec.params, "steps": 4})], root=ROOT)
    assert report.verdict == "FAIL" and "in-memory snapshots held by ranks []" in report.details, report.details


def test_titan_expert_cell_fails_without_the_expert_binding(monkeypatch):
    """The guard of titan-moe-expert-sdc: without the plugin's binding of TorchTitan's grouped experts nothing
    replays the experts, and the corrupted expert goes unnamed."""
    from scout_torchtitan import cpu

    cpu.stub_triton_kernels()
    from scout_torchtitan import attach

    monkeypatch.setattr(attach, "expert_binding", lambda trainer, chunks: None)
    (report,) = run_cells([SPECS["titan-moe-expert-sdc"]], root=ROOT)
    assert _missed(report, "named ranks [], expected [1]"), report.details


def test_titan_snapshot_recovery_cell_fails_when_scout_does_not_restore_its_snapshot(monkeypatch):
    """The guard of titan-recovery-snapshots: if the restart ignored SCOUT's snapshots (TorchTitan's own verified
    checkpoint loaded instead), SCOUT's resume record is missing and the cell must say so."""
    from scout_core.checkpoint.resume import ResumeResult
    from scout_core.handle import ScoutHandle

    monkeypatch.setattr(ScoutHandle, "resume", lambda self, failure=None: ResumeResult(step=None, reason="ignored"))
    (report,) = run_cells([SPECS["titan-recovery-snapshots"]], root=ROOT)
    assert report.verdict == "FAIL" and "SCOUT's resume records []" in report.details, report.details


def test_megatron_sdc_cell_fails_without_the_replica_groups(monkeypatch):
    """The guard of megatron-tp2-dp2-sdc: rank 1's peer group is two data-parallel replicas; without the
    tensor-parallel partners' comparison the two cannot outvote each other and only the group is named."""
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import attach

    monkeypatch.setattr(attach, "replica_groups", lambda model_config: None)
    (report,) = run_cells([SPECS["megatron-tp2-dp2-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "named ranks [1, 3], expected [1]" in report.details, report.details


def test_megatron_clean_cell_fails_when_replay_touches_training(monkeypatch):
    """The guard of megatron-tp2-dp2-clean's bitwise check: a replay that nudged a live parameter (identically
    on every rank, so no peer disagrees) must leave training in another state, and the cell must say so."""
    import torch

    from scout_core.replay import recipe

    real = recipe.replay_layer

    def meddling(forward, layer, *args, **kwargs):
        done = real(forward, layer, *args, **kwargs)
        with torch.no_grad():
            next(layer.parameters()).add_(1e-3)
        return done

    monkeypatch.setattr(recipe, "replay_layer", meddling)
    (report,) = run_cells([SPECS["megatron-tp2-dp2-clean"]], root=ROOT)
    assert report.verdict == "FAIL" and "ended in another state than without it" in report.details, report.details


def test_megatron_recovery_cell_fails_when_megatron_loads_its_newest_iteration(monkeypatch):
    """The guard of megatron-recovery-sdc: without the plugin's restart plan Megatron loads the iteration its
    tracker names (the rejected one), and the cell must say so."""
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import checkpoints

    monkeypatch.setattr(checkpoints, "plan_restart", lambda load_dir, ckpt_step=None, **_: None)
    (report,) = run_cells([SPECS["megatron-recovery-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "loaded iteration [5]" in report.details, report.details


@pytest.mark.parametrize(("cell", "undo"), [("megatron-distopt-clean", "boundary"),
                                             ("megatron-distopt-overlap-clean", "param_sync")])
def test_megatron_distopt_cells_fail_without_the_plugins_boundary_or_param_sync(monkeypatch, cell, undo):
    """The guards of the distributed-optimizer cells: at the inner optimizer's step each data-parallel rank
    holds its own updated shard and the others' old ones; under --overlap-param-gather the replicas differ until
    the next forward gathers. Either way the replicas would disagree with nothing wrong."""
    import contextlib

    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import attach

    if undo == "param_sync":
        monkeypatch.setattr(attach, "param_gather_paused", lambda chunks: contextlib.nullcontext())
    else:  # the boundary at the last inner optimizer's step, scout_core's default
        from scout_core.adapter import FrameworkAdapter

        monkeypatch.setattr(FrameworkAdapter, "step_owner", property(lambda self: None, lambda self, v: None),
                            raising=False)
    (report,) = run_cells([SPECS[cell]], root=ROOT)
    assert report.verdict == "FAIL" and "kinds ['sdc'], expected []" in report.details, report.details


def test_megatron_moe_cell_fails_without_the_expert_binding(monkeypatch):
    """The guard of megatron-moe-sdc: without the plugin's binding of Megatron's experts the expert recipe does
    not run, and the corrupted expert is not named as such."""
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import attach

    monkeypatch.setattr(attach, "moe_binding", lambda inner: None)
    (report,) = run_cells([SPECS["megatron-moe-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "no incident on a surface containing 'decoder.layers.1.mlp.experts.2'" in \
        report.details, report.details


@pytest.mark.parametrize("broken", ["no_alltoall", "peers_across_positions"])
def test_megatron_ep_cell_fails_without_the_ep_binding(monkeypatch, broken):
    """The guard of megatron-moe-ep2-clean: the plugin binds experts per EP position with the AllToAll replay.
    Without the EP groups no check replays the token exchange; with expert peers that span EP positions, experts
    that hold other weights are compared, and the clean job is reported."""
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import moe

    real = moe.MoEBinding

    def binding(**kwargs):
        if broken == "no_alltoall":
            kwargs["ep_groups"] = None
        else:
            kwargs["expert_peer_groups"] = [[r for g in kwargs["expert_peer_groups"] for r in g]]
        return real(**kwargs)

    monkeypatch.setattr(moe, "MoEBinding", binding)
    (report,) = run_cells([SPECS["megatron-moe-ep2-clean"]], root=ROOT)
    expected = "no expert check replayed the AllToAll" if broken == "no_alltoall" else "expected []"
    assert report.verdict == "FAIL" and expected in report.details, report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_megatron_bucket_hang_cell_fails_when_coalesced_buckets_are_not_observed(monkeypatch):
    """The guard of megatron-tp2-dp2-bucket-hang: with Megatron's coalescing manager left as bound at its import,
    a bucket's queued collectives show done at once: rank 2's one data-parallel peer, waiting in a bucket, looks
    stopped outside any collective like rank 2, and rank 2 is not named alone."""
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import attach

    monkeypatch.setattr(attach, "_BUCKET_FUNCS", ("dist_all_gather_func", "dist_reduce_scatter_func"))
    # A name of its own: under xdist its cell may run at once, and the run id (the cell's name) names the job's
    # control folder.
    spec = dataclasses.replace(SPECS["megatron-tp2-dp2-bucket-hang"], name="megatron-tp2-dp2-bucket-hang-unobserved")
    (report,) = run_cells([spec], root=ROOT)
    assert report.verdict == "FAIL" and "expected [2]" in report.details, report.details


def test_megatron_ep_clean_cell_fails_when_router_replays_reach_megatrons_logged_losses(monkeypatch):
    """The guard of megatron-moe-ep2-clean's router checks: a replayed router records its auxiliary loss in
    Megatron's MoE metrics tracker; without the plugin putting the tracker back, the losses Megatron logs are no
    longer training's, and the job differs from the one without SCOUT."""
    import contextlib

    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import attach

    monkeypatch.setattr(attach, "moe_metrics_kept", contextlib.nullcontext)
    (report,) = run_cells([SPECS["megatron-moe-ep2-clean"]], root=ROOT)
    assert report.verdict == "FAIL" and "another state than without it" in report.details, report.details


@pytest.mark.waits  # its cell mostly sleeps: CI runs these side by side (docker/test.sh)
def test_megatron_data_stall_cell_fails_without_the_data_marks(monkeypatch):
    """The guard of megatron-dp4-data-stall: without the plugin marking Megatron's data fetches, rank 2 waiting for
    its data looks like a rank stopped in compute: a hang, not a data stall."""
    from scout_megatron import cpu as megatron_cpu

    megatron_cpu.allow_python_311()
    megatron_cpu.stub_triton_ops()
    from scout_megatron import attach

    monkeypatch.setattr(attach, "mark_data", lambda handle, iterators: iterators)
    spec = dataclasses.replace(SPECS["megatron-dp4-data-stall"], name="megatron-dp4-data-stall-unmarked")  # as above
    (report,) = run_cells([spec], root=ROOT)
    assert report.verdict == "FAIL" and "expected ['data_stall']" in report.details, report.details


def test_deepspeed_zero3_clean_cell_fails_when_replay_runs_deepspeeds_hooks(monkeypatch):
    """The guard of deepspeed-zero3-clean: with DeepSpeed's module hooks left on while a gathered ZeRO-3 layer
    replays, its fetch and release run inside SCOUT's gather, outside training's order: the checks fail (seen:
    every rank's replay raises, diagnosis errors until the recipe is switched off), and the cell turns red."""
    import contextlib

    import scout_deepspeed.zero3 as zero3

    monkeypatch.setattr(zero3, "module_hooks_set_aside", lambda _module: contextlib.nullcontext())
    (report,) = run_cells([SPECS["deepspeed-zero3-clean"]], root=ROOT)
    assert report.verdict == "FAIL", report.details


def test_deepspeed_zero3_sdc_cell_fails_without_the_gather(monkeypatch):
    """The guard of deepspeed-zero3-sdc: with DeepSpeed's hooks set aside (as they must be) but nothing gathered, a
    ZeRO-3 layer replays on its empty partitions; every check fails and nothing is named."""
    import scout_deepspeed.zero3 as zero3

    monkeypatch.setattr(zero3, "_zero3_params", lambda _module: [])
    (report,) = run_cells([SPECS["deepspeed-zero3-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected [3]" in report.details, report.details


def test_deepspeed_zero3_optimizer_sdc_cell_fails_when_the_slice_is_taken_in_every_sub_group(monkeypatch):
    """The guard of deepspeed-zero3-optimizer-sdc: a slice taken in every inner step ends in the last sub-group at
    every check, and the wrong update in the second is never seen."""
    from scout_core.replay.optimizer import OptimizerSlice

    monkeypatch.setattr(OptimizerSlice, "inner_step", lambda self: True)
    (report,) = run_cells([SPECS["deepspeed-zero3-optimizer-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected [2]" in report.details, report.details


def test_hf_recovery_cell_fails_without_the_restart_plan(monkeypatch):
    """The guard of hf-trainer-recovery-sdc: without the plan the callback makes when the Trainer is built,
    ``resume_from_checkpoint=True`` finds the newest folder, which the SDC verdict rejected."""
    import scout_hf.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "_plan", lambda output_dir: None)
    (report,) = run_cells([SPECS["hf-trainer-recovery-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "the restart failed" in report.details, report.details


def test_lightning_clean_cell_fails_without_the_closure_run_first(monkeypatch):
    """The guard of lightning-ddp-clean: with Lightning's closure left inside the optimizer's step, SCOUT's pre-step
    hooks run before the step's forward and backward (stale gradients in the optimizer check): false verdicts."""
    import scout_lightning.callback as callback

    monkeypatch.setattr(callback, "_closure_first", lambda optimizer: (lambda: None))
    (report,) = run_cells([SPECS["lightning-ddp-clean"]], root=ROOT)
    assert report.verdict == "FAIL" and "expected []" in report.details, report.details


def test_lightning_recovery_cell_fails_without_the_restart_plan(monkeypatch):
    """The guard of lightning-ddp-recovery-sdc: without the plan the callback makes at setup, ckpt_path="last"
    loads last.ckpt as the stopped run left it: the state of step 40, which the SDC verdict rejected."""
    import scout_lightning.checkpoints as checkpoints

    monkeypatch.setattr(checkpoints, "_plan", lambda folder, others, exceptions, resolved: None)
    (report,) = run_cells([SPECS["lightning-ddp-recovery-sdc"]], root=ROOT)
    assert report.verdict == "FAIL" and "loaded step [40]" in report.details, report.details
