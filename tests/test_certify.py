"""Algorithm 3: the certification state machine and the retrieval policy."""

from __future__ import annotations

import pytest

from scout_core.checkpoint.certify import Action, BoundaryEvidence, Certifier, FailureKind, decide_retrieval

OK = BoundaryEvidence(covered=True)  # an accepted check after which every rank's coverage is complete
PART = BoundaryEvidence()  # an accepted check, coverage not complete yet
SDC = BoundaryEvidence(sdc=True)


def cycle(k: int, i: int) -> BoundaryEvidence:
    """The ``i``-th accepted check (from 1) when coverage takes ``k`` checks."""
    return OK if i % k == 0 else PART


def test_paper_two_recipe_example():
    # 8 ranks, coverage in 2 checks, a check every step: step 2 becomes candidate, is promoted after the
    # clean check at step 4, SDC at step 5, recovery loads step 2.
    c = Certifier()
    assert c.on_boundary(1, PART) is Action.CAPTURE
    assert c.on_boundary(2, OK) is Action.CAPTURE_AND_PERSIST and c.candidate == 2 and c.verified is None
    assert c.on_boundary(3, PART) is Action.CAPTURE
    assert c.on_boundary(4, OK) is Action.CAPTURE_AND_PERSIST
    assert (c.verified, c.candidate, c.latest) == (2, 4, 4)
    assert c.verified_after == 2 and "2 steps from capture to verified" in c.history[-2][1]
    assert c.on_boundary(5, SDC) is Action.RECOVER
    assert c.candidate is None and c.verified == 2
    d = decide_retrieval(c, FailureKind.SDC)
    assert (d.source, d.generation) == ("verified", 2)


def test_a_candidate_is_promoted_only_after_a_whole_coverage_after_its_capture():
    c = Certifier()
    for step in range(1, 4):
        c.on_boundary(step, cycle(3, step))
    assert c.candidate == 3 and c.verified is None  # one coverage: candidate only
    c.on_boundary(4, PART)
    c.on_boundary(5, SDC)  # inside the second coverage: the candidate is rejected
    assert c.candidate is None and c.verified is None
    for i, step in enumerate(range(6, 12), start=1):
        c.on_boundary(step, cycle(3, i))
    assert (c.candidate, c.verified) == (11, 8)


def test_missing_evidence_skips_and_straggler_counts_as_accepted():
    c = Certifier()
    assert c.on_boundary(1, BoundaryEvidence(missing=True, covered=True)) is Action.SKIP
    assert c.latest is None and c.candidate is None
    assert c.on_boundary(2, BoundaryEvidence(straggler=True)) is Action.CAPTURE
    assert c.latest == 2 and c.candidate is None
    assert c.on_boundary(3, BoundaryEvidence(straggler=True, covered=True)) is Action.CAPTURE_AND_PERSIST
    assert c.on_boundary(4, BoundaryEvidence(busy=True)) is Action.SKIP and c.verified is None


def test_a_busy_boundary_that_completes_the_coverage_promotes_and_the_next_free_one_captures():
    """A write still in flight delays the capture of the next candidate, not the promotion the finished checks
    earned: an SDC verdict before the next free boundary no longer rejects a candidate they vouched for."""
    c = Certifier()
    assert c.on_boundary(1, BoundaryEvidence(covered=True)) is Action.CAPTURE_AND_PERSIST
    assert c.on_boundary(2, BoundaryEvidence(busy=True)) is Action.SKIP
    assert c.on_boundary(3, BoundaryEvidence(busy=True, covered=True)) is Action.PROMOTE
    assert (c.verified, c.verified_after, c.candidate, c.latest) == (1, 2, None, 1)
    assert c.on_boundary(4, BoundaryEvidence(busy=True, covered=True)) is Action.SKIP  # nothing left to promote
    assert c.on_boundary(5, SDC) is Action.RECOVER and c.verified == 1
    c = Certifier()
    c.on_boundary(1, BoundaryEvidence(covered=True))
    c.on_boundary(2, BoundaryEvidence(busy=True, covered=True))
    assert c.on_boundary(3, BoundaryEvidence(covered=True)) is Action.CAPTURE_AND_PERSIST  # the new candidate
    assert (c.verified, c.candidate) == (1, 3)
    static = Certifier(static=True)  # K = 1 vouches only for a capture it makes: busy, it makes none
    assert static.on_boundary(1, BoundaryEvidence(busy=True, covered=True)) is Action.SKIP


def test_inconclusive_rejects_like_sdc():
    c = Certifier()
    c.on_boundary(1, OK)
    assert c.on_boundary(2, BoundaryEvidence(inconclusive=True)) is Action.RECOVER
    assert c.candidate is None


def test_last_check_only_certifies_every_capture_after_a_layer_check():
    c = Certifier(static=True)
    assert c.on_boundary(1, OK) is Action.CAPTURE_AND_PERSIST
    assert c.verified == 1 and c.latest == 1 and c.verified_after == 0
    assert c.on_boundary(2, PART) is Action.SKIP and c.latest == 1  # no layer replayed: vouches for nothing
    c.on_boundary(3, SDC)
    assert decide_retrieval(c, "sdc").generation == 1


def test_retrieval_policy_per_failure():
    c = Certifier()
    for step in (1, 2, 3):
        c.on_boundary(step, OK)
    assert (c.latest, c.verified) == (3, 2)
    assert decide_retrieval(c, FailureKind.SDC).generation == 2
    assert decide_retrieval(c, FailureKind.MACHINE_UNREACHABLE).generation == 2
    # A straggler is not divergence, but the latest state may carry an SDC no check reached yet: swept first.
    d = decide_retrieval(c, FailureKind.STRAGGLER)
    assert (d.source, d.generation) == ("verified", 2) and "straggler" in d.reason and "restart" in d.reason
    d = decide_retrieval(c, FailureKind.STRAGGLER, sweep=lambda: True)
    assert (d.source, d.generation, d.sweep_clean) == ("latest", 3, True) and "straggler" in d.reason
    d = decide_retrieval(c, FailureKind.STRAGGLER, sweep=lambda: False)
    assert (d.source, d.generation, d.sweep_clean) == ("verified", 2, False)
    calls = []
    d = decide_retrieval(c, FailureKind.OTHER, sweep=lambda: calls.append(1) or True)
    assert (d.source, d.generation, d.sweep_clean) == ("latest", 3, True) and calls == [1]
    d = decide_retrieval(c, FailureKind.OTHER, sweep=lambda: False)
    assert (d.source, d.generation, d.sweep_clean) == ("verified", 2, False)
    assert decide_retrieval(c, FailureKind.OTHER).source == "verified"


def test_sweep_not_run_for_classified_failures():
    c = Certifier()
    c.on_boundary(1, OK)

    def boom():
        raise AssertionError("sweep must not run")

    for kind in (FailureKind.SDC, FailureKind.MACHINE_UNREACHABLE):
        decide_retrieval(c, kind, sweep=boom)


def test_no_generation_yet_is_explicit():
    d = decide_retrieval(Certifier(), FailureKind.SDC)
    assert d.generation is None and "no verified generation" in d.reason


def test_a_generation_some_rank_could_not_make_durable_is_never_offered_to_a_restart():
    """Durability and evidence are apart: a generation some rank could not write is never what a restart is
    offered (``retrievable``), yet the evidence still promotes it (the framework's labels read ``verified``)."""
    c = Certifier()
    c.on_boundary(1, OK)
    c.on_boundary(2, OK)  # 1 promoted, 2 candidate
    c.confirm(3, 1)  # every rank wrote 1 and labelled it verified
    assert c.durable == 1
    c.not_durable(3, 2, "rank 1 could not write it")
    assert (c.candidate, c.verified, c.retrievable) == (2, 1, 1)
    c.on_boundary(3, OK)  # the evidence promotes 2; SCOUT's store still offers 1
    assert (c.candidate, c.verified, c.retrievable) == (3, 2, 1)
    assert decide_retrieval(c, FailureKind.SDC).generation == 1
    c.confirm(4, 2)  # never confirmed: some rank does not hold it
    assert c.durable == 1
    c.on_boundary(4, OK)
    assert (c.candidate, c.verified, c.retrievable) == (4, 3, 3)
    c.confirm(5, 3)
    c.on_boundary(5, OK)
    c.not_durable(5, 4, "rank 0 could not label it verified")  # the newest durable one is offered
    assert (c.verified, c.durable, c.retrievable) == (4, 3, 3)
    assert "verified 4 is not durable on every rank" in c.history[-1][1]
    s = Certifier(static=True)
    s.on_boundary(1, OK)
    s.confirm(2, 1)
    s.on_boundary(2, OK)
    s.not_durable(3, 2, "rank 2 could not write it")  # static shapes: written as verified, not offered
    assert (s.verified, s.durable, s.retrievable) == (2, 1, 1)
    s.confirm(3, 2)
    assert s.durable == 1
    s.on_boundary(3, OK)  # a later generation is offered again as soon as it is verified
    assert (s.verified, s.retrievable) == (3, 3)


def test_a_state_that_is_not_finite_rejects_the_candidate():
    import torch

    from scout_core.checkpoint.finite import state_is_finite

    c = Certifier()
    c.on_boundary(1, OK)
    c.on_boundary(2, OK)
    assert c.on_boundary(3, BoundaryEvidence(nonfinite=True, covered=True)) is Action.RECOVER
    assert (c.candidate, c.verified) == (None, 1)
    net = torch.nn.Linear(3, 3)
    assert state_is_finite([net])
    with torch.no_grad():
        net.weight[1, 2] = float("nan")
    assert not state_is_finite([net])


def test_the_finite_check_covers_optimizer_state_and_buffers_and_float8():
    """An exponent flip in one rank's gradient, averaged, leaves AdamW's exp_avg_sq inf while the parameter stays
    finite (m / sqrt(inf) = 0): the check must see it. A -inf mask buffer is legitimate; a NaN buffer is not."""
    import torch

    from scout_core.checkpoint.finite import state_is_finite

    net = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    net.register_buffer("mask", torch.full((2, 2), float("-inf")).triu(1))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(2, 3)).sum().backward()
    net[0].weight.grad[0, 0] = 3.4e36  # its square overflows float32
    opt.step()
    assert all(torch.isfinite(p).all() for p in net.parameters())
    assert not torch.isfinite(opt.state[net[0].weight]["exp_avg_sq"]).all()
    assert state_is_finite([net]) and not state_is_finite([net], [opt])
    opt.state[net[0].weight]["exp_avg_sq"].zero_()
    assert state_is_finite([net], [opt])  # the -inf mask is fine
    net.mask[0, 0] = float("nan")
    assert not state_is_finite([net], [opt])
    f8 = torch.nn.Linear(4, 4)
    f8.weight.data = f8.weight.data.to(torch.float8_e4m3fn)
    assert state_is_finite([f8])
    f8.weight.data.view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
    assert not state_is_finite([f8])


def test_the_finite_check_leaves_out_what_it_cannot_test_and_chunks_large_tensors(monkeypatch):
    """An optimizer-state tensor without an isfinite kernel is named and left out (the rest still counts); a
    parameter that cannot be tested raises (the boundary then counts the check as missing); a tensor larger than
    one chunk is tested chunk by chunk, a NaN in its last chunk included."""
    import torch

    import scout_core.checkpoint.finite as finite

    net = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    net(torch.randn(2, 3)).sum().backward()
    opt.step()
    real = finite._finite

    def picky(t, *, nan_only=False):
        if t.data_ptr() == opt.state[net.bias]["exp_avg"].data_ptr():
            raise NotImplementedError("no isfinite kernel for this subclass")
        return real(t, nan_only=nan_only)

    monkeypatch.setattr(finite, "_finite", picky)
    skipped: list[str] = []
    assert finite.state_is_finite([net], [opt], skipped=skipped)
    assert len(skipped) == 1 and "optimizer state 'exp_avg'" in skipped[0] and "NotImplementedError" in skipped[0]
    opt.state[net.weight]["exp_avg_sq"][0, 0] = float("inf")
    assert not finite.state_is_finite([net], [opt], skipped=[])  # the rest still counts
    monkeypatch.setattr(finite, "_finite", real)
    monkeypatch.setattr(finite, "_CHUNK", 4)
    big = torch.nn.Linear(5, 5)
    assert finite.state_is_finite([big])
    with torch.no_grad():
        big.weight[4, 4] = float("nan")  # the last chunk
    assert not finite.state_is_finite([big])
    monkeypatch.setattr(finite, "_finite", lambda t, nan_only=False: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError):
        finite.state_is_finite([big])


def test_the_finite_check_reads_a_module_whose_wrapper_shadows_buffers():
    """Megatron's DistributedDataParallel keeps a list named ``buffers``: the check uses nn.Module's own methods."""
    import torch

    from scout_core.checkpoint.finite import state_is_finite

    class Wrapper(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = torch.nn.Linear(2, 2)
            self.buffers = [object()]  # shadows nn.Module.buffers, as Megatron's DDP does
            self.parameters = [object()]

    w = Wrapper()
    assert state_is_finite([w])
    with torch.no_grad():
        w.module.weight[0, 0] = float("nan")
    assert not state_is_finite([w])


def test_the_finite_check_leaves_out_an_optimizer_without_a_state_mapping():
    import torch

    from scout_core.checkpoint.finite import state_is_finite

    class Odd:
        @property
        def state(self):
            raise AttributeError("no state here")

    skipped: list[str] = []
    assert state_is_finite([torch.nn.Linear(2, 2)], [Odd()], skipped=skipped)
    assert skipped and "Odd" in skipped[0]
