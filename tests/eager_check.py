"""One way for the distributed tests to check a compiled step against eager: the outputs and
every gradient, on this rank, each mismatch naming the rank and the tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def step(fn, inputs, seed: int) -> torch.Tensor:
    """One training step's forward and backward: ``fn(*inputs)`` (this rank's part of a
    DTensor output), backward of its sum weighted by a fixed random tensor of seed ``seed``
    (so every output element gets its own gradient). The detached output."""
    out = local(fn(*inputs))
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(out.dtype)
    (out * w).sum().backward()
    return out.detach()


def grads(module: torch.nn.Module, inputs=()) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (this rank's shard), and every input's as ``input{i}``."""
    out = {n: local(p.grad).clone() for n, p in module.named_parameters() if p.grad is not None}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.grad is not None:
            out[f"input{i}"] = x.grad.clone()
    return out


def assert_matches(got: dict, want: dict, tol, where: str = "") -> float:
    """``got[k]`` close to ``want[k]`` for every key (the same keys on both sides); ``tol`` is
    assert_close's rtol/atol dict or a function of the expected tensor returning one. The
    largest absolute difference, for the test's printout."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    worst = 0.0
    for k in want:
        a, b = local(got[k]), local(want[k])
        t = tol(b) if callable(tol) else tol
        torch.testing.assert_close(a, b, **t, msg=lambda m, k=k: f"rank {rank} {where}{k}: {m}")
        if a.numel():
            worst = max(worst, (a.float() - b.float()).abs().max().item())
    return worst
