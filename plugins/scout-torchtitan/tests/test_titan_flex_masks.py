"""TorchTitan's own FlexAttention masks travel through SCOUT's call shipping and rebuild exactly (the masks every
block of a default TorchTitan job receives; the flex kernel itself has no CPU backward and is not run here)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, create_mask

from scout_core.replay.calls import flatten_call, rebuild
from scout_core.replay.spec_codec import (
    allow_call_closures,
    allow_call_packages,
    spec_from_tensor,
    spec_to_tensor,
)

attention = pytest.importorskip("torchtitan.models.common.attention")


def _positions(batch: int, seq: int = 128, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < 0.06
    starts[:, 0] = True
    doc = torch.cumsum(starts.int(), dim=1)
    first = torch.zeros_like(doc)
    for b in range(batch):
        for s in range(seq):
            first[b, s] = s if starts[b, s] else first[b, s - 1]
    return torch.arange(seq)[None].expand(batch, -1) - first


@pytest.mark.parametrize("batch", [1, 2])  # the packed-document mask defines a different closure for batch 1
@pytest.mark.parametrize("kind", ["packed", "document", "sliding"])
def test_torchtitans_masks_rebuild_exactly_on_a_peer(batch, kind):
    pos = _positions(batch)
    if kind == "packed":  # TorchTitan's default: causal and packed documents (Decoder.get_attention_masks)
        mods = [attention.get_causal_mask_mod(), attention.get_efficient_causal_mask_mod_for_packed_document(pos)]
    elif kind == "document":
        mods = [attention.get_causal_mask_mod(), attention.get_document_mask_mod(pos)]
    else:
        mods = [attention.get_causal_mask_mod(), attention.get_sliding_window_mask_mod(16)]
    mask_mod = and_masks(*mods)
    block_mask = create_block_mask(mask_mod, batch, None, 128, 128, device="cpu")
    tensors, spec = flatten_call(((torch.ones(1), block_mask, pos), {}))
    allow_call_packages("torchtitan")  # what the replay runtime declares for a TorchTitan model's layers
    allow_call_closures("torchtitan.models.common.attention")  # what scout_torchtitan.attach registers
    shipped = spec_from_tensor(spec_to_tensor(spec))
    (_, rebuilt, _), _ = rebuild(shipped, [t.clone() for t in tensors])
    assert torch.equal(create_mask(rebuilt.mask_mod, batch, 1, 128, 128),
                       create_mask(mask_mod, batch, 1, 128, 128))
