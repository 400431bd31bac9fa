"""The step boundary's state machine: replay, certification evidence, the actions on a verdict, settle and stop.

At each optimizer step (the LAST inner optimizer's post-hook) :meth:`StepBoundary.on_step` runs the replay
boundary, turns its result into certification evidence, combines the evidence job-wide, lets the coordinator
capture and persist what the certifier asks for, and acts on verdicts (``actions.*``). The training step ends at
the next settle point (:meth:`StepBoundary.settle`): the caller's state joins the snapshot, and a stop a verdict
asked for is carried out.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch.distributed as dist

from scout_core.actions import (
    ScoutStop,
    actionable,
    exclude_hosts_path,
    record_exclusions,
    stop_message,
    verdict_summary,
    write_launcher_error,
)
from scout_core.checkpoint.certify import Action, BoundaryEvidence, Certifier, FailureKind
from scout_core.checkpoint.coordinator import combine_evidence
from scout_core.checkpoint.coverage import required_units
from scout_core.checkpoint.finite import nonfinite_incident, nonfinite_ranks, state_is_finite
from scout_core.checkpoint.loadable import CallerStateCheck
from scout_core.live_control import LiveControl
from scout_core.parts import ScoutParts
from scout_core.progress.record import Phase
from scout_core.replay.engine import BoundaryResult
from scout_core.report import Incident, IncidentKind, IncidentScope
from scout_core.wire import all_gather_data

__all__ = ["StepBoundary"]

_log = logging.getLogger("scout")


class StepBoundary:
    """What happens at each step boundary, and what it leaves for the end of the step."""

    def __init__(self, parts: ScoutParts, live: LiveControl) -> None:
        self.parts = parts
        self.live = live
        self.last_result: BoundaryResult | None = None
        self.last_expert: Any = None  # the expert check of the last boundary (scout_core.moe.replay.ExpertCheck)
        self.last_decision: Any = None
        self.stopped = False
        self.stop_on_verdict = parts.config.actions.on_verdict == "stop"
        self.exit_code = parts.config.actions.exit_code
        self._stop_code: int | None = None  # a verdict asked to stop: raised at the next settle point
        self._stop_summaries: list[dict[str, Any]] = []  # what it was, for the launcher's summary
        self._settle_extra = False  # a capture waits for the caller's end-of-step state
        self.caller_check = CallerStateCheck()  # can a restart load the caller's state? (first capture per keys)
        self._finite_skips_said = False  # tensors the finite-state check cannot test were named (once)
        self._finite_error_said = False  # the finite-state check failed and said so (once: it fails the same way)
        self._nonfinite_episode = False  # the job's state was not finite at the last check (recorded once)

    def set_stop_on_verdict(self, _key: str, value: Any) -> None:
        """``scout ctl set actions.on_verdict=...``: what the next verdict does."""
        self.stop_on_verdict = value == "stop"

    # -- every optimizer step ------------------------------------------------------------------------

    def on_step(self) -> BoundaryResult | None:
        """The boundary, then rank 0's ``scout ctl`` commands where this boundary looks for them."""
        result = self._boundary()
        control = self.parts.control
        if control is not None and control.tick():
            self.live.steer(control, self.parts.step() or control.steps)
        return result

    def _boundary(self) -> BoundaryResult | None:
        p = self.parts
        self.settle()  # a previous step's snapshot is complete before this boundary (manual callers too)
        if p.observer is not None:
            p.observer.check()
        if p.replay is None:
            return None
        if p.snapshots is not None:
            p.snapshots.reserve_host_memory()  # once, now that the optimizer state exists
        # SCOUT's local work is guarded stage by stage inside the boundary; what is left are collectives,
        # and a collective that fails means the job's communication failed: that propagates, as the
        # training job's own next collective would.
        result = self.last_result = p.replay.boundary()
        paused = p.control is not None and p.control.paused
        expert = self.last_expert = (p.experts.boundary(result.step) if p.experts is not None and not paused
                                     else None)
        if expert is not None:
            result.incidents_global += expert.incidents  # each expert-peer group's own verdicts
        if not result.checked and expert is None:
            return result
        verdicts = actionable(result.incidents + result.incidents_global)
        cert = p.certifier
        # Every check's boundary, certifying or not: a state gone NaN on every replica is invisible to replay, and a
        # job without SCOUT's checkpoints must hear of it too.
        finite = self._finite(result.step)
        nonfinite = finite is False
        local = BoundaryEvidence(sdc=result.sdc or bool(expert and expert.sdc),
                                 inconclusive=result.inconclusive or bool(expert and expert.inconclusive),
                                 missing=result.missing or bool(expert and expert.skipped) or finite is None,
                                 straggler=any(i.kind is IncidentKind.STRAGGLER for i in verdicts),
                                 nonfinite=nonfinite)
        job, action = self._certify(cert, result, expert, local)
        # The same on every rank. A state that is not finite stays so until a restart: one record and one round of
        # the verdict's actions per episode, not one at every check (certification still rejects every boundary).
        newly_nonfinite = job.nonfinite and not self._nonfinite_episode
        self._nonfinite_episode = job.nonfinite
        if newly_nonfinite:
            verdicts.append(self._nonfinite(result.step, nonfinite))
        numerical = job.sdc or job.inconclusive or job.nonfinite
        failure = (FailureKind.SDC if numerical else FailureKind.STRAGGLER) if numerical or job.straggler else None
        if cert is not None and p.labels is not None:
            p.labels.on_boundary(result.step, action, cert, failure=failure, stopping=self.stop_on_verdict,
                                 on_error=lambda exc: p.guard.report(result.step, "checkpoint", exc,
                                                                     "framework checkpoint labels"))
        if job.sdc or job.inconclusive or job.straggler or newly_nonfinite:
            self._act(result, verdicts, job, expert=actionable(expert.incidents) if expert else [])
        return result

    def _finite(self, step: int) -> bool | None:
        """Whether this rank's model state is finite; None when the check itself failed (reported): that counts as
        missing evidence, so nothing is captured or promoted at this boundary, and training goes on."""
        p = self.parts
        skipped: list[str] = []
        try:
            # Without certification, the parameters and buffers only: a NaN loss reaches every weight within the
            # step, and optimizer state (three times the weights, maybe offloaded to the host) is not read at
            # every check of every job for it.
            optimizers = p.adapter.optimizers if p.certifier is not None else ()
            finite = state_is_finite(p.adapter.chunks, optimizers, skipped=skipped)
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            if not self._finite_error_said:
                self._finite_error_said = True
                p.guard.report(step, "checkpoint", exc, "the finite-state check")
            return None
        if skipped and not self._finite_skips_said:  # once: the same tensors are left out at every boundary
            self._finite_skips_said = True
            why = (f"{len(skipped)} tensor(s) of this rank's state cannot be tested for NaN or inf and are left out "
                   f"of the finite-state check (the rest is still checked): {'; '.join(skipped[:3])}")
            _log.warning("rank %d: SCOUT %s", p.rank, why)
            if p.reporter is not None:
                p.reporter.emit(Incident(kind=IncidentKind.DIAGNOSIS_ERROR, scope=IncidentScope.RANK, ranks=[p.rank],
                                         hosts=[], step=step, surface="checkpoint:the finite-state check",
                                         reason=why, evidence={"skipped": skipped[:20]}))
        return finite

    def _nonfinite(self, step: int, mine: bool) -> Incident:
        """The record of a state that is not finite somewhere (rank 0 writes it), naming the ranks."""
        p = self.parts
        incident = nonfinite_incident(step, nonfinite_ranks(mine, p.groups.world_control),
                                      certifying=p.certifier is not None)
        if p.rank == 0 and p.reporter is not None:
            p.reporter.emit(incident)
        return incident

    def _certify(self, cert: Certifier | None, result: BoundaryResult, expert: Any,
                 local: BoundaryEvidence) -> tuple[BoundaryEvidence, Action | None]:
        """This rank's evidence combined job-wide, and what the certifier makes of it (None: nothing certifies).
        SCOUT's coordinator also captures or persists what the certifier asks for. The evidence says whether
        every rank's coverage is complete with this boundary's units; they count only if the job accepted it."""
        p = self.parts
        if cert is None:
            return combine_evidence(local, p.groups.world_control), None
        units = result.units + ((("expert", expert.unit),) if expert is not None and not expert.skipped else ())
        coverage = p.coverage
        coverage.need(required_units(p.replay, p.experts))
        local = dataclasses.replace(local, covered=coverage.would_complete(units))
        if p.checkpoint is not None:
            action, job = p.checkpoint.on_boundary(result.step, local)
            self._settle_extra = action in (Action.CAPTURE, Action.CAPTURE_AND_PERSIST)
        else:  # certification of the framework's checkpoints alone: nothing to capture
            job = combine_evidence(local, p.groups.world_control)
            action = cert.on_boundary(result.step, job)
        if action in (Action.CAPTURE_AND_PERSIST, Action.RECOVER):
            coverage.reset()  # a new candidate (or none): nothing is vouched for after it yet
        elif action is Action.CAPTURE or (job.busy and not (job.missing or job.sdc or job.inconclusive)):
            # A busy boundary captures nothing, but its checks were clean: its units count (dropping them would
            # drop the same units of the rotation each time a write outlasts a check interval).
            coverage.add(units)
        return job, action

    def _act(self, result: BoundaryResult, verdicts: list[Incident], job: BoundaryEvidence,
             expert: list[Incident] | None = None) -> None:
        """A verdict somewhere in the job: decision, hosts to exclude, and maybe stop. Same on every rank.
        Each peer group's lowest rank contributes its group's verdicts, and each expert-peer group's lowest rank
        its expert verdicts (an expert SDC is known only inside the expert's replicas)."""
        p = self.parts
        expert_ids = {id(i) for i in expert or []}
        dense = [i for i in verdicts if id(i) not in expert_ids]
        mine = [verdict_summary(i) for i in dense] if p.rank == min(p.groups.peer_ranks) else []
        if expert and p.experts is not None and p.rank == min(p.experts.peers):
            mine += [verdict_summary(i) for i in expert]
        everyone = all_gather_data(mine, p.groups.world_control, what="verdict summaries")
        summaries = list({(v["kind"], v["scope"], tuple(v["ranks"]), v["step"]): v
                          for vs in everyone for v in vs}.values())
        failure = FailureKind.SDC if (job.sdc or job.inconclusive or job.nonfinite) else FailureKind.STRAGGLER
        try:
            if p.checkpoint is not None:
                self.last_decision = p.checkpoint.decide(failure, incident=summaries[0] if summaries else None,
                                                         binding=self.stop_on_verdict)
            path = exclude_hosts_path(p.config)
            if p.rank == 0 and path is not None and any(v["scope"] != "job" for v in summaries):
                record_exclusions(path, summaries)  # a job-scoped record (a state not finite) excludes no host
        except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
            p.guard.report(result.step, "actions", exc, "verdict actions")
        if self.stop_on_verdict:
            self._stop_code = self.exit_code  # at the end of this step (see settle)
            self._stop_summaries = summaries

    # -- the end of the training step ----------------------------------------------------------------

    def settle(self) -> None:
        """End of the training step, as seen from the next data fetch or the next optimizer step: the
        caller's state joins the snapshot taken at the boundary, then a pending stop is carried out."""
        p = self.parts
        self.complete_caller_state()
        if self._stop_code is not None and not self.stopped:
            if p.checkpoint is not None:
                with p.own_checkpoint_io("write"):  # the observer sees a checkpoint write, not a silent rank
                    p.checkpoint.flush()  # the snapshot of this boundary is written and replicated
            dist.barrier(group=p.groups.world_control)  # rank 0's records are durable before anyone exits
            self.stopped = True
            if p.tracker is not None:  # a deliberate end: the observer need not answer for a dead trainer
                p.tracker.mark(Phase.CLOSED)
            if p.metrics is not None:  # the verdict stays readable; no stall alert for a job that stopped
                p.metrics.stopped()
            # torchrun's "Root Cause" then names the verdict, not the exit status of whichever rank it saw first.
            write_launcher_error(stop_message(self._stop_summaries, how=f"exit status {self._stop_code}",
                                              records=p.config.report.jsonl_path))
            raise ScoutStop(self._stop_code)

    def flush(self) -> None:
        """The training step is over: complete the snapshot with the caller's state and wait until it is
        written and replicated (a pending stop is carried out here too)."""
        self.settle()
        if self.parts.checkpoint is not None:
            with self.parts.own_checkpoint_io("write"):
                self.parts.checkpoint.flush()

    def complete_caller_state(self) -> None:
        """The caller's state joins the snapshot, unless a restart could not load it: then the snapshot is not kept,
        and a diagnosis_error record (once per problem) names the ``state`` key, the key path and the type."""
        p = self.parts
        if self._settle_extra and p.snapshots is not None:
            self._settle_extra = False
            caller = p.caller_state()
            try:
                problem = self.caller_check.check(caller)
            except Exception as exc:  # noqa: BLE001 - diagnosis never breaks training
                problem = f"the caller's state could not be checked ({type(exc).__name__}: {exc})"
            if problem is not None and self.caller_check.first_report(problem):
                p.guard.report(p.step(), "checkpoint", ValueError(problem), "caller state for the snapshot")
            p.snapshots.complete_extra({"caller": caller}, unusable=problem)
