"""Property tests of the signature fold: 10,000 random corruptions of each kind, every one must be seen (CI draws
2,000 of each: ``SCOUT_SIGNATURE_CASES``, set by docker/test.sh).

The kinds are the ones a plain wrapping sum of words misses (docs/signatures.md): several flips, two flips of
one bit with opposite polarity, two sign bits, stuck lanes and swapped elements, each placed in one fold row
(the hard case: positions that share an accumulator) or anywhere. ``test_the_cases_defeat_a_plain_sum`` shows
that the generated cases are not trivially caught: a plain per-row wrapping sum misses many of them.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable

import pytest
import torch

from scout_core.signature import _GEMM_ROWS, sign_many

CASES = int(os.environ.get("SCOUT_SIGNATURE_CASES", "10000"))
BATCH = 500
SIZES = (4096, 65_536, 69_992, 262_144)  # bytes: rows of 8, 128, 144 (a partial last row) and 512 bytes
DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def _row_bytes(nbytes: int) -> int:
    return max(8, (-(-nbytes // _GEMM_ROWS) + 7) // 8 * 8)


def _base(rng: random.Random, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    return torch.randn(nbytes // torch.tensor([], dtype=dtype).element_size(), generator=gen).to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _two_positions(rng: random.Random, nbytes: int, same_row: bool) -> tuple[int, int]:
    if same_row:
        rb = _row_bytes(nbytes)
        row = rng.randrange(nbytes // rb)
        a, b = rng.sample(range(rb), 2)
        return row * rb + a, row * rb + b
    a, b = rng.sample(range(nbytes), 2)
    return a, b


def _flip(b: torch.Tensor, pos: int, bit: int) -> None:
    b[pos] ^= 1 << bit


# Each corruption returns False when it happened to leave the bytes unchanged (then it is drawn again).

def single(rng: random.Random, t: torch.Tensor) -> bool:
    b = _bytes(t)
    _flip(b, rng.randrange(b.numel()), rng.randrange(8))
    return True


def double(rng: random.Random, t: torch.Tensor) -> bool:
    b = _bytes(t)
    p, q = _two_positions(rng, b.numel(), rng.random() < 0.5)
    _flip(b, p, rng.randrange(8))
    _flip(b, q, rng.randrange(8))
    return True


def multi(rng: random.Random, t: torch.Tensor) -> bool:
    b = _bytes(t)
    rb = _row_bytes(b.numel())
    row = rng.randrange(b.numel() // rb)
    flips = {(row * rb + rng.randrange(rb), rng.randrange(8)) for _ in range(rng.randrange(3, 9))}
    for pos, bit in flips:
        _flip(b, pos, bit)
    return True


def _two_words_same_offset(rng: random.Random, nbytes: int) -> tuple[int, int]:
    """Byte positions at the same offset in two 8-byte words of one row (of several rows for tiny rows)."""
    rb = max(_row_bytes(nbytes), 64)
    row = rng.randrange(nbytes // rb)
    i, j = rng.sample(range(rb // 8), 2)
    o = rng.randrange(8)
    return row * rb + 8 * i + o, row * rb + 8 * j + o


def opposite_polarity(rng: random.Random, t: torch.Tensor) -> bool:
    """The same bit of two words of a row goes 0 -> 1 in one and 1 -> 0 in the other: a plain sum cancels it."""
    b = _bytes(t)
    bit = rng.randrange(8)
    p, q = _two_words_same_offset(rng, b.numel())
    bp, bq = (int(b[p]) >> bit) & 1, (int(b[q]) >> bit) & 1
    if bp == bq:
        return False
    _flip(b, p, bit)
    _flip(b, q, bit)
    return True


def sign_pair(rng: random.Random, t: torch.Tensor) -> bool:
    """Two elements' sign bits flipped (the top bit of a word: a plain sum of words cancels any two)."""
    size = t.element_size()
    b = _bytes(t)
    rb = _row_bytes(b.numel())
    per_row = max(2, rb // size)
    start = rng.randrange(t.numel() // per_row) * per_row if rng.random() < 0.5 else 0
    span = per_row if start or per_row == t.numel() else t.numel()
    i, j = rng.sample(range(start, min(t.numel(), start + span)), 2)
    for e in (i, j):
        _flip(b, e * size + size - 1, 7)
    return True


def stuck_lane(rng: random.Random, t: torch.Tensor) -> bool:
    """One byte lane of every element in a stretch stuck at one value (a stuck wire or SIMD lane)."""
    size = t.element_size()
    lane, value = rng.randrange(size), rng.randrange(256)
    n = rng.randrange(2, 65)
    start = rng.randrange(t.numel() - n)
    view = _bytes(t).view(-1, size)[start : start + n, lane]
    if bool((view == value).all()):
        return False
    view.fill_(value)
    return True


def permutation(rng: random.Random, t: torch.Tensor) -> bool:
    """Two elements of one row swapped (half the time at the same offset of two words: a plain sum cancels
    that), or a short stretch rotated by one."""
    size = t.element_size()
    b = _bytes(t).view(-1, size)
    per_row = max(64 // size, _row_bytes(t.numel() * size) // size)
    start = rng.randrange(max(1, t.numel() // per_row)) * per_row
    idx = list(range(start, min(t.numel(), start + per_row)))
    if len(idx) < 2:
        return False
    r = rng.random()
    if r < 0.5:
        p, q = _two_words_same_offset(rng, t.numel() * size)
        where = [p // size, q // size]
        order = where[::-1]
    elif r < 0.75:
        i, j = rng.sample(idx, 2)
        order = [j, i]
        where = [i, j]
    else:
        k = rng.randrange(2, min(len(idx), 16) + 1)
        where = idx[:k]
        order = where[1:] + where[:1]
    before = b[where].clone()
    b[where] = before[[where.index(o) for o in order]]
    return not torch.equal(before, b[where])


KINDS: dict[str, Callable[[random.Random, torch.Tensor], bool]] = {
    "single": single, "double": double, "multi": multi, "opposite_polarity": opposite_polarity,
    "sign_pair": sign_pair, "stuck_lane": stuck_lane, "permutation": permutation,
}


def _cases(kind: str, seed: int, count: int, sizes: tuple[int, ...] = SIZES):
    """(base, corrupted) pairs, grouped per base tensor."""
    rng = random.Random(seed)
    corrupt = KINDS[kind]
    made = 0
    while made < count:
        base = _base(rng, rng.choice(DTYPES), rng.choice(sizes))
        batch = []
        while len(batch) < min(BATCH, count - made):
            t = base.clone()
            if corrupt(rng, t) and not torch.equal(_bytes(t), _bytes(base)):
                batch.append(t)
        made += len(batch)
        yield base, batch


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_corruption_changes_the_signature(kind):
    seen = 0
    for base, batch in _cases(kind, seed=sum(map(ord, kind)), count=CASES):
        ref = sign_many([base])[0].signature
        sigs = sign_many(batch)
        missed = sum(s.signature == ref for s in sigs)
        assert missed == 0, f"{kind}: {missed} of {len(batch)} corruptions left the signature unchanged"
        seen += len(batch)
    assert seen == CASES


def _plain_row_sums(t: torch.Tensor) -> tuple[int, ...]:
    """The first fold: a wrapping int64 sum of words per row (what these kinds were chosen to defeat)."""
    b = _bytes(t.contiguous().view(-1))
    words = b[: b.numel() // 8 * 8].view(torch.int64)
    rows = min(512, words.numel())
    return tuple(words[: words.numel() // rows * rows].view(rows, -1).sum(dim=1).tolist())


@pytest.mark.parametrize("kind", ["opposite_polarity", "sign_pair", "permutation"])
def test_the_cases_defeat_a_plain_sum(kind):
    missed = total = 0
    for base, batch in _cases(kind, seed=7, count=1_000, sizes=(262_144,)):  # rows of 64 words, like the plain sum
        ref = _plain_row_sums(base)
        missed += sum(_plain_row_sums(t) == ref for t in batch)
        total += len(batch)
    assert missed >= total // 10, f"{kind}: a plain sum missed only {missed} of {total}"
