"""A Llama-style decoder (RMSNorm, attention with RoPE, SwiGLU MLP) and its parallel plans.

Plain PyTorch, random weights from a seed, no downloads. Parallelized the way users do it,
with DTensor's ``parallelize_module``:

- ``tp_sp_plan``: tensor + sequence parallel (Megatron-SP / torchtitan layout). Norms run
  on sequence shards; each attention/MLP block all-gathers its input along the sequence
  (dim 1) before the column-parallel projections and reduce-scatters the row-parallel
  output back to sequence shards.
- ``tp_plan``: tensor parallel only. Activations between blocks are replicated; each
  row-parallel projection is followed by an all-reduce.

``build_tp_sp(mesh)`` / ``build_tp(mesh)`` return ``(model, example_inputs)``: the form
``overlapc explain MODULE:CALLABLE`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class LlamaConfig:
    dim: int = 128
    """Model (hidden) width."""
    n_layers: int = 2
    """Number of decoder blocks."""
    n_heads: int = 8
    """Attention heads; must be divisible by the tensor-parallel degree."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None means n_heads."""
    ffn_dim: int = 256
    """Hidden width of the SwiGLU MLP."""
    vocab_size: int = 256
    """Vocabulary size."""
    max_seq_len: int = 256
    """Longest sequence the rotary table covers."""
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    seed: int = 0
    """Seed of the random weights; every rank builds the same full model from it."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, max_seq_len: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # (max_seq_len, head_dim)


def apply_rope(x, rope):
    """x: (B, S, H, Dh); rope: (S, Dh) holding [cos | sin] of the half dims."""
    half = x.shape[-1] // 2
    cos = rope[:, :half].unsqueeze(1).to(x.dtype)
    sin = rope[:, half:].unsqueeze(1).to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, rope):
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = apply_rope(q, rope[:s]), apply_rope(k, rope[:s])
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, rope):
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(cfg.seed)
        try:
            self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        finally:
            torch.random.set_rng_state(gen_state)
        self.register_buffer(
            "rope",
            rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta),
            persistent=False,
        )

    def forward(self, tokens):
        if tokens.shape[1] > self.rope.shape[0]:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds LlamaConfig.max_seq_len={self.rope.shape[0]}")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h))


def _check_tp(cfg: LlamaConfig, tp: int):
    kv = cfg.n_kv_heads or cfg.n_heads
    for what, n in (
        ("n_heads", cfg.n_heads),
        ("n_kv_heads", kv),
        ("ffn_dim", cfg.ffn_dim),
        ("vocab_size", cfg.vocab_size),
    ):
        if n % tp:
            raise ValueError(f"LlamaConfig.{what}={n} is not divisible by the tensor-parallel degree {tp}")


def tp_sp_plan(model: Llama, mesh):
    """Tensor + sequence parallel: activations between blocks are sharded on the sequence (dim 1)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    _check_tp(model.cfg, mesh.size())
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model


def tp_plan(model: Llama, mesh):
    """Tensor parallel only: replicated activations, an all-reduce after each row-parallel linear."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    _check_tp(model.cfg, mesh.size())
    parallelize_module(
        model,
        mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        parallelize_module(
            block,
            mesh,
            {
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
    return model


def example_tokens(cfg: LlamaConfig, batch: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


def _model(cfg, dtype: str):
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    model = Llama(cfg)
    return model if dtype == "float32" else model.to(getattr(torch, dtype))


def build_tp_sp(mesh, *, batch: int = 2, seq: int = 64, dtype: str = "float32", **cfg_kw):
    """(model, example_inputs) for the TP+SP plan on a 1-D mesh."""
    cfg = LlamaConfig(**{"max_seq_len": max(seq, LlamaConfig.max_seq_len), **cfg_kw})
    if seq % mesh.size():
        raise ValueError(f"sequence length {seq} is not divisible by the mesh size {mesh.size()}")
    return tp_sp_plan(_model(cfg, dtype), mesh), (example_tokens(cfg, batch, seq),)


def build_tp(mesh, *, batch: int = 2, seq: int = 64, dtype: str = "float32", **cfg_kw):
    """(model, example_inputs) for the TP-only plan on a 1-D mesh."""
    cfg = LlamaConfig(**{"max_seq_len": max(seq, LlamaConfig.max_seq_len), **cfg_kw})
    return tp_plan(_model(cfg, dtype), mesh), (example_tokens(cfg, batch, seq),)
