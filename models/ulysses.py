"""An attention block with Ulysses sequence parallelism (DeepSpeed-Ulysses).

Plain PyTorch, random weights from a seed; every rank holds the full projection weights
and a shard of the sequence. Attention needs the whole sequence, so the projected
q, k and v go through an all-to-all that trades the sequence shard for a head shard, and
the attention output comes back through the inverse all-to-all before the output
projection::

    x (B, S/P, D) ─ q/k/v projections ─ all_to_all (sequence -> heads) ─ (B, H/P, S, hd)
      ─ attention over the whole sequence, H/P heads ─ all_to_all (heads -> sequence)
      ─ output projection ─ (B, S/P, D)

The all-to-alls are ``all_to_all_single_autograd`` (functional, autograd-aware), so
``torch.compile`` captures them in forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class UlyssesConfig:
    dim: int = 64
    n_heads: int = 8
    """Attention heads; divisible by the sequence-parallel degree."""
    causal: bool = True
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention; None: n_heads); divisible by the
    sequence-parallel degree, and dividing n_heads."""
    gqa: str = "repeat"
    """How query heads share k/v heads: "repeat" (k/v repeated per query head, as Hugging
    Face's and torchtitan's repeat_kv: expand + reshape) or "sdpa" (``enable_gqa=True``)."""
    seed: int = 0


class UlyssesAttention(nn.Module):
    def __init__(self, cfg: UlyssesConfig, group=None):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.sp = 1 if group is None else torch.distributed.get_world_size(group)
        if cfg.dim % cfg.n_heads:
            raise ValueError(f"UlyssesConfig.dim={cfg.dim} is not divisible by n_heads={cfg.n_heads}")
        self.n_kv = cfg.n_kv_heads or cfg.n_heads
        for what, n in (("n_heads", cfg.n_heads), ("n_kv_heads", self.n_kv)):
            if n % self.sp:
                raise ValueError(f"UlyssesConfig.{what}={n} is not divisible by the sequence-parallel degree {self.sp}")
        if cfg.n_heads % self.n_kv:
            raise ValueError(f"UlyssesConfig.n_kv_heads={self.n_kv} does not divide n_heads={cfg.n_heads}")
        if cfg.gqa not in ("repeat", "sdpa"):
            raise ValueError(f"UlyssesConfig.gqa={cfg.gqa!r}: expected 'repeat' or 'sdpa'")
        g = torch.Generator().manual_seed(cfg.seed)
        scale = cfg.dim**-0.5
        kv_dim = self.n_kv * (cfg.dim // cfg.n_heads)
        for name, rows in (("wq", cfg.dim), ("wk", kv_dim), ("wv", kv_dim), ("wo", cfg.dim)):
            setattr(self, name, nn.Parameter(torch.randn(rows, cfg.dim, generator=g) * scale))

    def _all_to_all(self, t):
        if self.group is None:
            return t
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(t, None, None, self.group)

    def _seq_to_heads(self, t):
        """(B, s, H, hd) on each rank's sequence shard -> (B, H/P, P*s, hd) for its heads."""
        b, s, h, hd = t.shape
        p = self.sp
        t = t.reshape(b, s, p, h // p, hd).permute(2, 1, 0, 3, 4).reshape(p * s, b, h // p, hd)
        t = self._all_to_all(t)  # row block r: sequence shard r
        return t.permute(1, 2, 0, 3)

    def _heads_to_seq(self, t):
        """(B, H/P, S, hd) -> (B, s, D): each rank's sequence shard, all heads."""
        b, hp, seq, hd = t.shape
        p = self.sp
        t = self._all_to_all(t.permute(2, 0, 1, 3).reshape(seq, b, hp, hd))  # row block r: head group r
        return t.reshape(p, seq // p, b, hp, hd).permute(2, 1, 0, 3, 4).reshape(b, seq // p, p * hp * hd)

    def forward(self, x):
        b, s, d = x.shape
        h, hd = self.cfg.n_heads, d // self.cfg.n_heads
        q, k, v = (
            self._seq_to_heads(F.linear(x, w).view(b, s, n, hd))
            for w, n in ((self.wq, h), (self.wk, self.n_kv), (self.wv, self.n_kv))
        )
        if self.n_kv != h and self.cfg.gqa == "repeat":
            k, v = _repeat_kv(k, h // self.n_kv), _repeat_kv(v, h // self.n_kv)
        return F.linear(self._heads_to_seq(self.attend(q, k, v)), self.wo)

    def attend(self, q, k, v):
        """Attention over the whole sequence for this rank's heads, (B, H/P, S, hd) each
        (k, v: (B, H_kv/P, S, hd) where ``gqa="sdpa"``)."""
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=self.cfg.causal, **({"enable_gqa": True} if k.shape[1] != q.shape[1] else {})
        )


def _repeat_kv(t, n: int):
    """(B, H_kv, S, hd) -> (B, H_kv * n, S, hd), each k/v head repeated for its n query heads."""
    b, hkv, s, hd = t.shape
    return t[:, :, None].expand(b, hkv, n, s, hd).reshape(b, hkv * n, s, hd)


def build_ulysses(mesh, *, batch: int = 2, seq: int = 32, **cfg_kw):
    """(block, example_inputs) on a 1-D mesh; ``seq`` is the full sequence length."""
    cfg = UlyssesConfig(**cfg_kw)
    p = mesh.size()
    if seq % p:
        raise ValueError(f"seq={seq} is not divisible by the sequence-parallel degree {p}")
    rank = mesh.get_local_rank()
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(batch, seq // p, cfg.dim, generator=g).requires_grad_(True)
    return UlyssesAttention(cfg, mesh.get_group()), (x,)
