"""CPU stand-ins for CUDA's fused attention kernels, so that graphs holding them run here.

On a GPU, ``F.scaled_dot_product_attention`` becomes ``_scaled_dot_product_flash_attention``,
``_scaled_dot_product_efficient_attention`` or ``_scaled_dot_product_cudnn_attention``
(and their backwards) in the traced graph; those ops have no CPU kernel. These stand-ins
compute the same attention by its definition (softmax(q k^T * scale) v, causal from the
top left, logsumexp of the scores) and return their results in the order and, for the tensors
overlapc chunks (output, logsumexp, gradients), the shapes of the ops' meta functions (torch
2.13's; empty tensors where those return None). Tracing uses the meta functions, so a model
that calls the ops directly traces, compiles and runs on the CPU: tests check that overlapc's
regions carry these ops (the structure a GPU graph has) and that the chunked graph computes
what the unchunked one does. Equal head counts only (no grouped-query attention). They say
nothing about the CUDA kernels' own numerics (the ulysses stage of tests/gpu/checks.py runs those).
"""

from __future__ import annotations

import math

import torch

_LIB = None


def _probs(q, k, causal, scale):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q.float() @ k.float().transpose(-2, -1)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1), torch.logsumexp(s, -1), scale


def _attend(q, k, v, causal, scale):
    p, lse, _ = _probs(q, k, causal, scale)
    return (p @ v.float()).to(q.dtype), lse


def _grads(grad_out, q, k, v, causal, scale):
    """Attention's gradients written out (a kernel runs below autograd: no autograd.grad here)."""
    p, _, scale = _probs(q, k, causal, scale)
    g = grad_out.float()
    dv = p.transpose(-2, -1) @ g
    dp = g @ v.float().transpose(-2, -1)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq, dk = (ds @ k.float()) * scale, (ds.transpose(-2, -1) @ q.float()) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _check(dropout_p):
    if dropout_p:
        raise NotImplementedError("sdpa_doubles: dropout is not modelled")


def flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    _check(dropout_p)
    out, lse = _attend(q, k, v, is_causal, scale)
    empty = q.new_empty(0, dtype=torch.int32)
    return (
        out,
        lse,
        empty,
        empty,
        q.shape[2],
        k.shape[2],
        torch.zeros(2, dtype=torch.uint64),
        torch.zeros((), dtype=torch.uint64),
        q.new_empty(0),
    )


def flash_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
):
    _check(dropout_p)
    return _grads(grad_out, q, k, v, is_causal, scale)


def efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    _check(dropout_p)
    assert attn_bias is None
    out, lse = _attend(q, k, v, is_causal, scale)
    rows = math.ceil(q.shape[2] / 32) * 32 if compute_log_sumexp else 0
    padded = lse.new_zeros((*lse.shape[:2], rows))
    padded[..., : min(rows, lse.shape[2])] = lse[..., :rows]
    return out, padded, torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)


def efficient_backward(
    grad_out,
    q,
    k,
    v,
    attn_bias,
    out,
    lse,
    philox_seed,
    philox_offset,
    dropout_p,
    grad_input_mask,
    is_causal=False,
    *,
    scale=None,
):
    _check(dropout_p)
    return (*_grads(grad_out, q, k, v, is_causal, scale), None)


def cudnn(
    q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
):
    _check(dropout_p)
    assert attn_bias is None
    out, lse = _attend(q, k, v, is_causal, scale)
    empty = q.new_empty(0, dtype=torch.int32)
    return (
        out,
        lse.unsqueeze(-1),
        empty,
        empty,
        q.shape[2],
        k.shape[2],
        torch.zeros((), dtype=torch.long),
        torch.zeros((), dtype=torch.long),
        q.new_empty(0),
    )


def cudnn_backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    philox_seed,
    philox_offset,
    attn_bias,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    *,
    scale=None,
):
    _check(dropout_p)
    return _grads(grad_out, q, k, v, is_causal, scale)


OPS = {
    "flash": "_scaled_dot_product_flash_attention",
    "efficient": "_scaled_dot_product_efficient_attention",
    "cudnn": "_scaled_dot_product_cudnn_attention",
}


def register() -> None:
    """Register the stand-ins as the ops' CPU kernels (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901
    for kind, op in OPS.items():
        lib.impl(op, globals()[kind], "CPU")
        lib.impl(op + "_backward", globals()[kind + "_backward"], "CPU")
    _LIB = lib


def fused_ulysses(kind: str):
    """models/ulysses.UlyssesAttention with its attention the fused op ``kind`` (set an
    instance's ``__class__`` to it)."""
    from overlapc.models import ulysses

    class Fused(ulysses.UlyssesAttention):
        def attend(self, q, k, v):
            return call(kind, q, k, v, self.cfg.causal)

    return Fused


def call(kind: str, q, k, v, causal: bool):
    """The attention output of the fused op ``kind`` ("flash", "efficient", "cudnn"), called as
    SDPA calls it on a GPU (the op itself: autograd takes its backward op)."""
    op = getattr(torch.ops.aten, OPS[kind])
    if kind == "flash":
        return op(q, k, v, 0.0, causal)[0]
    return op(q, k, v, None, True, 0.0, causal)[0]
