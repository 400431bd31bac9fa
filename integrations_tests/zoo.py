"""Small decoder-only transformers in the call style of HuggingFace ``transformers``.

SCOUT has to cope with the models users actually bring, not only with the
tensor-in/tensor-out ``TinyModel`` of ``models.py``. These two models copy the
awkward parts of the HF interfaces that a hook-based tool meets in practice:

* GPT-2 blocks take ``layer_past``/``use_cache``/``output_attentions`` and
  return a tuple whose tail entries are ``None`` or not depending on flags, and
  use dropout, so a replayed forward in train mode draws from the RNG;
* Llama blocks take keyword-only ``position_embeddings=(cos, sin)`` computed
  once by the top-level model, use grouped-query attention and return tuples;
* both top-level models return a ``@dataclass`` rather than a tensor.

Everything is pure torch, deterministic given ``torch.manual_seed`` and small
(vocab 64, hidden 32, 4 heads, sequence 16), so a CPU step takes milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CausalLMOutput", "GPT2Block", "GPT2LM", "LlamaBlock", "LlamaLM", "LlamaRMSNorm", "LlamaRotaryEmbedding",
    "SIZES", "ZOO", "blocks", "build_zoo_model", "embedding", "head", "zoo_batches",
]

VOCAB, HIDDEN, HEADS, KV_HEADS, SEQ, DEPTH = 64, 32, 4, 2, 16, 3
ZOO = ("gpt2", "llama")


@dataclass
class CausalLMOutput:
    """What the top-level models return; a dataclass, as HF returns ``ModelOutput`` rather than a tensor."""

    loss: Tensor | None
    logits: Tensor
    hidden_states: tuple | None = None


def _causal_mask(q_len: int, k_len: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Additive mask, 0 where a query may attend and the dtype's minimum elsewhere (HF's convention)."""
    keep = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(diagonal=k_len - q_len)
    return torch.zeros(q_len, k_len, dtype=dtype, device=device).masked_fill(~keep, torch.finfo(dtype).min)


def _padding_mask(attention_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """HF's 1/0 padding mask of shape (batch, seq) as an additive (batch, 1, 1, seq) mask."""
    if attention_mask is None:
        return None
    return (1.0 - attention_mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


def _lm_loss(logits: Tensor, labels: Tensor | None) -> Tensor | None:
    """Next-token cross-entropy; labels are the inputs themselves and the shift happens here, as in HF."""
    if labels is None:
        return None
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))


class GPT2Block(nn.Module):
    """Pre-norm block with dropout on attention weights, attention output and MLP output."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, attn_pdrop: float = 0.1,
                 resid_pdrop: float = 0.1) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.ln_1 = nn.LayerNorm(hidden)
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)
        self.attn_dropout = nn.Dropout(attn_pdrop)
        self.resid_dropout = nn.Dropout(resid_pdrop)
        self.ln_2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * hidden, hidden), nn.Dropout(resid_pdrop))

    def forward(self, hidden_states: Tensor, layer_past: tuple[Tensor, Tensor] | None = None,
                attention_mask: Tensor | None = None, head_mask: Tensor | None = None, use_cache: bool = False,
                output_attentions: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor] | None, Tensor | None]:
        b, t, c = hidden_states.shape
        q, k, v = self.c_attn(self.ln_1(hidden_states)).split(c, dim=-1)
        q, k, v = (x.view(b, t, self.heads, self.head_dim).transpose(1, 2) for x in (q, k, v))
        if layer_past is not None:
            k, v = torch.cat((layer_past[0], k), dim=-2), torch.cat((layer_past[1], v), dim=-2)
        present = (k, v) if use_cache else None
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores + _causal_mask(t, k.size(-2), scores.dtype, scores.device)
        if attention_mask is not None:
            scores = scores + attention_mask
        weights = self.attn_dropout(scores.softmax(dim=-1))
        if head_mask is not None:
            weights = weights * head_mask
        attn = (weights @ v).transpose(1, 2).reshape(b, t, c)
        hidden_states = hidden_states + self.resid_dropout(self.c_proj(attn))
        hidden_states = hidden_states + self.mlp(self.ln_2(hidden_states))
        return hidden_states, present, (weights if output_attentions else None)


class LlamaRMSNorm(nn.Module):
    """RMSNorm with its own weight, computed in float32 as HF does."""

    def __init__(self, hidden: int = HIDDEN, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class LlamaRotaryEmbedding(nn.Module):
    """(cos, sin) for given positions; ``inv_freq`` is a non-persistent buffer, absent from the state dict."""

    inv_freq: Tensor

    def __init__(self, head_dim: int = HIDDEN // HEADS, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        freqs = position_ids[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    """Pre-RMSNorm block: rotary grouped-query attention (4 query heads share 2 KV heads) and a SwiGLU MLP."""

    def __init__(self, hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.input_layernorm = LlamaRMSNorm(hidden)
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(hidden)
        self.gate_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up_proj = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down_proj = nn.Linear(2 * hidden, hidden, bias=False)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, *, position_embeddings: tuple[Tensor, Tensor],
                past_key_value: tuple[Tensor, Tensor] | None = None, use_cache: bool = False,
                **kwargs: object) -> tuple[Tensor, ...]:
        """``(hidden,)``, plus ``None`` for attention weights when ``output_attentions`` is passed (as HF's
        SDPA path does), plus the ``(k, v)`` cache when ``use_cache``."""
        b, t, _ = hidden_states.shape
        x = self.input_layernorm(hidden_states)
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = (e.unsqueeze(1) for e in position_embeddings)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past_key_value is not None:
            k, v = torch.cat((past_key_value[0], k), dim=-2), torch.cat((past_key_value[1], v), dim=-2)
        present = (k, v)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        scores = scores + _causal_mask(t, k.size(-2), scores.dtype, scores.device)
        if attention_mask is not None:
            scores = scores + attention_mask
        attn = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, -1)
        hidden_states = hidden_states + self.o_proj(attn)
        x = self.post_attention_layernorm(hidden_states)
        hidden_states = hidden_states + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        outputs: tuple[Tensor, ...] = (hidden_states,)
        if kwargs.get("output_attentions"):
            outputs += (None,)  # type: ignore[assignment]
        if use_cache:
            outputs += (present,)  # type: ignore[assignment]
        return outputs


class GPT2LM(nn.Module):
    """GPT-2 shaped LM: token and learned position embeddings, blocks ``h``, ``ln_f`` and an untied head."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, heads: int = HEADS, depth: int = DEPTH,
                 max_seq: int = SEQ, embd_pdrop: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(max_seq, hidden)
        self.drop = nn.Dropout(embd_pdrop)
        self.h = nn.ModuleList(GPT2Block(hidden, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                output_hidden_states: bool = False) -> CausalLMOutput:
        pos = torch.arange(input_ids.size(1), device=input_ids.device)
        h = self.drop(self.wte(input_ids) + self.wpe(pos)[None])
        mask = _padding_mask(attention_mask, h.dtype)
        states = [h]
        for block in self.h:
            h = block(h, layer_past=None, attention_mask=mask, use_cache=False)[0]
            states.append(h)
        logits = self.lm_head(self.ln_f(h))
        return CausalLMOutput(_lm_loss(logits, labels), logits, tuple(states) if output_hidden_states else None)


class LlamaLM(nn.Module):
    """Llama shaped LM: ``embed_tokens``, rotary tables computed once and passed to every layer, ``norm``."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN, heads: int = HEADS, kv_heads: int = KV_HEADS,
                 depth: int = DEPTH) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.rotary_emb = LlamaRotaryEmbedding(hidden // heads)
        self.layers = nn.ModuleList(LlamaBlock(hidden, heads, kv_heads) for _ in range(depth))
        self.norm = LlamaRMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                output_hidden_states: bool = False) -> CausalLMOutput:
        h = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.size(1), device=input_ids.device)[None].expand(input_ids.size(0), -1)
        cos, sin = self.rotary_emb(h, pos)
        mask = _padding_mask(attention_mask, h.dtype)
        states = [h]
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=(cos, sin))[0]
            states.append(h)
        logits = self.lm_head(self.norm(h))
        return CausalLMOutput(_lm_loss(logits, labels), logits, tuple(states) if output_hidden_states else None)


SIZES = {
    # The default: a CPU step takes milliseconds, so multi-rank tests stay fast.
    "tiny": {"vocab": VOCAB, "hidden": HIDDEN, "heads": HEADS, "depth": DEPTH, "seq": SEQ},
    # Several ranks sharing one GPU over gloo: gradients small enough to all-reduce through host memory.
    "small": {"vocab": 4096, "hidden": 512, "heads": 8, "depth": 4, "seq": 256},
    # Big enough that a GPU step is dominated by matrix work rather than launch latency (timing on CUDA).
    "medium": {"vocab": 8192, "hidden": 1024, "heads": 16, "depth": 8, "seq": 512},
}


def build_zoo_model(name: str, seed: int, size: str = "tiny") -> nn.Module:
    """The named model with weights drawn after ``torch.manual_seed(seed)``, so every rank builds the same one."""
    if name not in ZOO:
        raise ValueError(f"zoo model must be one of {ZOO}, got {name!r}")
    if size not in SIZES:
        raise ValueError(f"zoo size must be one of {tuple(SIZES)}, got {size!r}")
    dims = SIZES[size]
    torch.manual_seed(seed)
    if name == "gpt2":
        return GPT2LM(vocab=dims["vocab"], hidden=dims["hidden"], heads=dims["heads"], depth=dims["depth"],
                      max_seq=dims["seq"])
    return LlamaLM(vocab=dims["vocab"], hidden=dims["hidden"], heads=dims["heads"], kv_heads=dims["heads"] // 2,
                   depth=dims["depth"])


def _inner(model: nn.Module) -> nn.Module:
    """Look through DDP's ``.module``; FSDP2's ``fully_shard`` keeps the class, so nothing to unwrap there."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks, whatever the library names their ``ModuleList`` (``h`` or ``layers``)."""
    inner = _inner(model)
    return list(inner.h if isinstance(inner, GPT2LM) else inner.layers)


def embedding(model: nn.Module) -> nn.Embedding:
    """The token embedding (``wte`` or ``embed_tokens``)."""
    inner = _inner(model)
    return inner.wte if isinstance(inner, GPT2LM) else inner.embed_tokens


def head(model: nn.Module) -> nn.Linear:
    """The LM head."""
    return _inner(model).lm_head


def zoo_batches(rank: int, steps: int, *, batch: int = 4, seq: int = SEQ, vocab: int = VOCAB,
                seed: int = 0) -> Iterator[tuple[Tensor, Tensor]]:
    """Per-rank ``(input_ids, labels)`` from a private generator, so ranks differ but reruns match.

    Each row is an arithmetic sequence mod ``vocab`` with a random start and stride: learnable from
    context, so the loss falls over a few steps and a broken run shows in it.
    """
    gen = torch.Generator().manual_seed(seed * 100_003 + rank)
    steps_t = torch.arange(seq)
    for _ in range(steps):
        start = torch.randint(vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        ids = (start + stride * steps_t) % vocab
        yield ids, ids.clone()
