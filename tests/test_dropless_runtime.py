"""The run-time chunking of the dropless pipeline (overlapc/runtime/dropless.py), single process."""
from __future__ import annotations

import random

import torch

from overlapc.runtime.dropless import _chunk_offsets, _place, _starts, _take, boundaries, chunk_weights


def _rows(starts, bounds, c) -> torch.Tensor:
    """Indices (in the full received buffer) of the rows of chunk ``c``, in chunk order."""
    return torch.cat([torch.arange(s + b[c], s + b[c + 1]) for s, b in zip(starts, bounds)])


def test_boundaries_cover_every_row_once():
    for n in (0, 1, 2, 5, 17, 100):
        for chunks in (1, 2, 3, 4, 8):
            b = boundaries(n, chunk_weights(chunks))
            assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in zip(b, b[1:])), (n, chunks, b)
    assert boundaries(12, chunk_weights(4)) == [0, 2, 6, 10, 12]  # weights 1, 2, 2, 1


def test_chunk_offsets_count_each_group_in_each_chunk():
    """Brute force: label every received row with its group, take chunk c's rows, count."""
    rng = random.Random(0)
    for _ in range(200):
        world, n_local, chunks = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 6)
        counts = [rng.choice([0, 0, 1, 2, 7]) for _ in range(world * n_local)]  # groups (src, expert)
        splits = [sum(counts[r * n_local:(r + 1) * n_local]) for r in range(world)]
        ends = torch.cumsum(torch.tensor(counts), 0)
        label = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        starts, bounds = _starts(splits), [boundaries(n, chunk_weights(chunks)) for n in splits]
        seen = []
        for c in range(chunks):
            idx = _rows(starts, bounds, c)
            seen.append(idx)
            assert torch.equal(_take(label, starts, bounds, c), label[idx])
            want = torch.cumsum(torch.bincount(label[idx], minlength=len(counts)), 0)
            assert torch.equal(_chunk_offsets(ends, starts, bounds, c), want), (counts, c)
            assert torch.equal(label[idx], label[idx].sort().values)  # groups stay in order
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(sum(splits)))
        # _place puts chunk rows back where they came from
        data = torch.arange(sum(splits)).float().unsqueeze(1)
        assert torch.equal(_place([data[i] for i in seen], starts, bounds, sum(splits)), data)
