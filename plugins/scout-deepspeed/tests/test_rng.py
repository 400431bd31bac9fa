"""DeepSpeed's activation-checkpointing RNG tracker: each of its streams is a replay RNG provider."""

from __future__ import annotations

import torch

from scout_deepspeed.adapter import rng_providers


def test_every_tracker_stream_is_a_provider_that_gets_and_sets_its_state():
    from deepspeed.runtime.activation_checkpointing import checkpointing

    tracker = checkpointing.get_cuda_rng_tracker()
    tracker.reset()
    assert rng_providers() == {}
    try:
        tracker.add("model-parallel-rng", 1234)
        providers = rng_providers()
        assert list(providers) == ["deepspeed:model-parallel-rng"]
        get, set_ = providers["deepspeed:model-parallel-rng"]
        saved = get().clone()
        with tracker.fork("model-parallel-rng"):
            first = torch.rand(4)
        set_(saved)  # replay puts the source's state back: the same draws again
        with tracker.fork("model-parallel-rng"):
            assert torch.equal(torch.rand(4), first)
    finally:
        tracker.reset()
