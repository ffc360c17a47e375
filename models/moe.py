"""A mixture-of-experts layer (router, top-k, SwiGLU experts) with expert parallelism.

Plain PyTorch, random weights from a seed. Each rank of the expert-parallel group holds
``n_experts / ep`` experts and its own tokens. Tokens travel to the rank that owns their
expert and back through ``all_to_all_single`` (the functional, autograd-aware form, so
``torch.compile`` captures it in forward and backward):

    x ─ router ─ top-k ─ pack per expert ─ all_to_all (dispatch) ─ expert GEMMs
      ─ all_to_all (combine) ─ unpack, weight by gate ─ y

The capacity form packs up to ``capacity`` tokens per expert, so every all-to-all has
even splits and static shapes: the form that compiles without graph breaks. Tokens over
capacity are dropped (their output is zero), as in GShard/Switch.

``expert_form`` chooses how the expert GEMMs are written: ``"bmm"`` (one batched matmul
over local experts), ``"loop"`` (a Python loop of per-expert matmuls) or ``"grouped"``
(``torch._grouped_mm`` of the (experts, slots, dim) buffer by the stacked weights, no
offsets: bf16 only on CPU, as below).

The dropless form (``form="dropless"``) drops nothing: tokens are sorted by expert, the
per-expert counts are exchanged first, and the all-to-alls move an uneven number of rows
(split sizes from ``.tolist()``: capture them with
``torch._dynamo.config.capture_scalar_outputs = True``, or dynamo breaks the graph there).
The experts run over the received rows, one group per (source rank, local expert), as
grouped matmuls (``torch._grouped_mm``, ``expert_form="grouped"``: torch's meta kernel of
``_grouped_mm`` accepts only bf16 on CPU, so compile it in bf16) or as a Python loop over
the groups (``expert_form="loop"``, any dtype: ``recv.split(sizes)``, a matmul chain per
group, ``cat``, as Megatron's SequentialMLP).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(kw_only=True)
class MoEConfig:
    dim: int = 64
    """Token width."""
    hidden: int = 128
    """Hidden width of each SwiGLU expert."""
    n_experts: int = 8
    """Experts in total, across the expert-parallel group."""
    top_k: int = 2
    """Experts per token."""
    capacity_factor: float = 2.0
    """Slots per expert = ceil(capacity_factor * tokens * top_k / n_experts)."""
    expert_form: str = "bmm"
    """How expert GEMMs are written: "bmm", "loop" or "grouped" (capacity form), "grouped"
    or "loop" (dropless form)."""
    form: str = "capacity"
    """"capacity" (padded slots, even all-to-alls) or "dropless" (uneven, run-time splits)."""
    dispatch: str = "index"
    """Capacity form only: how tokens are packed into expert slots and back. "index"
    (index_add into the slots, gather back) or "einsum" (GShard: a (tokens, experts, slots)
    dispatch mask, ``einsum("tec,td->ecd")``, and its combine mask weighted by the gates,
    ``einsum("tec,ecd->td")``). The two drop the same tokens and compute the same layer."""
    skew: float = 0.0
    """Router logit bias: +skew for expert 0, -skew for the upper half of the experts.
    Large values send most tokens to expert 0 (over capacity: dropped) and none to the
    upper half: the skewed routing real routers show early in training."""
    seed: int = 0

    def __post_init__(self):
        if self.form not in ("capacity", "dropless"):
            raise ValueError(f"MoEConfig.form={self.form!r}; allowed: 'capacity', 'dropless'")
        if self.form == "dropless" and self.expert_form == "bmm":
            self.expert_form = "grouped"  # the default, adapted to the form
        allowed = ("bmm", "loop", "grouped") if self.form == "capacity" else ("grouped", "loop")
        if self.expert_form not in allowed:
            raise ValueError(
                f"MoEConfig.expert_form={self.expert_form!r} with form={self.form!r}; "
                f"allowed: {', '.join(map(repr, allowed))}"
            )
        if self.dispatch not in ("index", "einsum"):
            raise ValueError(f"MoEConfig.dispatch={self.dispatch!r}; allowed: 'index', 'einsum'")
        if self.dispatch == "einsum" and self.form != "capacity":
            raise ValueError("MoEConfig.dispatch='einsum' needs form='capacity' (dropless routing has no slots)")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be in 1..n_experts={self.n_experts}")


def capacity(cfg: MoEConfig, tokens: int) -> int:
    return max(1, -(-int(cfg.capacity_factor * tokens * cfg.top_k) // cfg.n_experts))


def _expert_weights(cfg: MoEConfig, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert ``e``'s (w1, w3, w2), from a generator of its own: the same on every rank and
    at every expert-parallel degree."""
    g = torch.Generator().manual_seed(cfg.seed * 100_003 + 1 + e)
    scale_in, scale_h = cfg.dim**-0.5, cfg.hidden**-0.5
    return (
        torch.randn(cfg.dim, cfg.hidden, generator=g) * scale_in,
        torch.randn(cfg.dim, cfg.hidden, generator=g) * scale_in,
        torch.randn(cfg.hidden, cfg.dim, generator=g) * scale_h,
    )


class MoE(nn.Module):
    """Expert-parallel MoE over ``group`` (None: a single process holding every expert)."""

    def __init__(self, cfg: MoEConfig, group=None):
        super().__init__()
        self.cfg = cfg
        self.group = group
        ep = 1 if group is None else torch.distributed.get_world_size(group)
        rank = 0 if group is None else torch.distributed.get_rank(group)
        if cfg.n_experts % ep:
            raise ValueError(f"MoEConfig.n_experts={cfg.n_experts} is not divisible by the expert-parallel degree {ep}")
        self.ep = ep
        self.n_local = cfg.n_experts // ep
        # The router from the seed; each expert from its own generator (seed, expert), so a
        # rank draws only its own experts and the layer equals the single-process layer
        # whatever the degree. (Drawing the full set on every rank took 10 s and 3 GiB per
        # rank at 32 experts of 2048 x 4096.)
        router = torch.randn(cfg.dim, cfg.n_experts, generator=torch.Generator().manual_seed(cfg.seed))
        self.router = nn.Parameter(router * cfg.dim**-0.5)
        lo, hi = rank * self.n_local, (rank + 1) * self.n_local
        w1, w3, w2 = (torch.stack(ws) for ws in zip(*(_expert_weights(cfg, e) for e in range(lo, hi))))
        bias = torch.zeros(cfg.n_experts)
        bias[0] = cfg.skew
        bias[cfg.n_experts // 2 :] = -cfg.skew
        if cfg.n_experts == 1:
            bias.zero_()
        # A buffer, not a constant: tests change the routing without recompiling.
        self.register_buffer("router_bias", bias)
        self.w1, self.w3, self.w2 = nn.Parameter(w1), nn.Parameter(w3), nn.Parameter(w2)

    def _all_to_all(self, x):
        if self.group is None:
            return x
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(x, None, None, self.group)

    def _experts(self, x):
        """x: (n_local, slots, dim) -> (n_local, slots, dim)."""
        if self.cfg.expert_form == "bmm":
            h = F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3)
            return torch.bmm(h, self.w2)
        if self.cfg.expert_form == "grouped":
            mm = torch._grouped_mm
            return mm(F.silu(mm(x, self.w1)) * mm(x, self.w3), self.w2)
        outs = []
        for e in range(self.n_local):
            h = F.silu(x[e] @ self.w1[e]) * (x[e] @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.stack(outs)

    def _route(self, x):
        probs = torch.softmax(x.float() @ self.router.float() + self.router_bias, dim=-1)
        gate, expert = torch.topk(probs, self.cfg.top_k, dim=-1)  # (t, k)
        return (gate / gate.sum(-1, keepdim=True)).to(x.dtype), expert

    def forward(self, x):
        """x: (tokens, dim) local to this rank -> (tokens, dim)."""
        if self.cfg.form == "dropless":
            return self._forward_dropless(x)
        cfg = self.cfg
        t, d = x.shape
        cap = capacity(cfg, t)
        gate, expert = self._route(x)
        # Position of each (token, choice) in its expert's slots, in token order.
        onehot = F.one_hot(expert.reshape(-1), cfg.n_experts)  # (t*k, E)
        pos = ((torch.cumsum(onehot, 0) - 1) * onehot).sum(-1)  # (t*k,)
        keep = pos < cap
        if cfg.dispatch == "einsum":
            return self._forward_einsum(x, gate, onehot, pos, keep, cap)
        slot = torch.where(keep, expert.reshape(-1) * cap + pos, torch.full_like(pos, cfg.n_experts * cap))
        tok = torch.arange(t, device=x.device).repeat_interleave(cfg.top_k)
        # One spare row collects dropped tokens and is cut off.
        packed = x.new_zeros(cfg.n_experts * cap + 1, d).index_add(0, slot, x[tok])
        packed = packed[: cfg.n_experts * cap]  # (E*cap, d) by expert
        out = self._exchange(packed, cap)
        back = out.reshape(cfg.n_experts * cap, d)
        back = torch.cat([back, back.new_zeros(1, d)])
        y = back[slot] * (gate.reshape(-1, 1) * keep.unsqueeze(1).to(x.dtype))
        return y.view(t, cfg.top_k, d).sum(1)

    def _exchange(self, packed, cap):
        """packed: the slots of every expert, (E * cap, d) or (E, cap, d), by global expert ->
        the experts' outputs for them, same shape: dispatch all-to-all, local experts,
        combine all-to-all."""
        d = packed.shape[-1]
        # Dispatch: rank r receives, from every rank, the slots of r's local experts.
        recv = self._all_to_all(packed.contiguous())
        recv = recv.reshape(self.ep, self.n_local, cap, d).transpose(0, 1).reshape(self.n_local, self.ep * cap, d)
        out = self._experts(recv)
        out = out.reshape(self.n_local, self.ep, cap, d).transpose(0, 1).reshape(packed.shape)
        # Combine: the results go back to the ranks the tokens came from.
        return self._all_to_all(out.contiguous())

    def _forward_einsum(self, x, gate, onehot, pos, keep, cap):
        """GShard's dispatch and combine: one-hot (token, expert, slot) masks and einsums."""
        t, k, n_e = x.shape[0], self.cfg.top_k, self.cfg.n_experts
        chosen = (onehot * keep.unsqueeze(1)).to(x.dtype).view(t, k, n_e)  # (t, k, E): kept choices
        at = F.one_hot(pos.clamp(0, cap - 1), cap).to(x.dtype).view(t, k, 1, cap)
        dispatch = (chosen.unsqueeze(-1) * at).sum(1)  # (t, E, cap)
        combine = ((gate.unsqueeze(-1) * chosen).unsqueeze(-1) * at).sum(1)  # (t, E, cap), gate-weighted
        xe = torch.einsum("tec,td->ecd", dispatch, x)  # (E, cap, d)
        return torch.einsum("tec,ecd->td", combine, self._exchange(xe, cap))

    def _dropless_loop(self, recv, counts_recv):
        """The experts as a Python loop over the (source rank, local expert) groups of the
        received rows, one matmul chain per group (as Megatron's SequentialMLP)."""
        sizes = counts_recv.tolist()
        outs = []
        for g, rows in enumerate(recv.split(sizes)):
            e = g % self.n_local
            h = F.silu(rows @ self.w1[e]) * (rows @ self.w3[e])
            outs.append(h @ self.w2[e])
        return torch.cat(outs)

    def _forward_dropless(self, x):
        cfg, ep, n_local = self.cfg, self.ep, self.n_local
        t, d = x.shape
        gate, expert = self._route(x)
        flat = expert.reshape(-1)  # (t*k,)
        order = torch.argsort(flat, stable=True)  # by global expert
        tok = order // cfg.top_k
        xs = x[tok]  # (t*k, d)
        counts = F.one_hot(flat, cfg.n_experts).sum(0)  # tokens per expert
        if self.group is None:
            counts_recv, in_splits, out_splits = counts, None, None
            recv = xs
        else:
            from torch.distributed import _functional_collectives as fc

            # counts_recv[r * n_local + e]: tokens rank r sends to my local expert e.
            counts_recv = fc.wait_tensor(fc.all_to_all_single(counts, None, None, self.group))
            if cfg.expert_form == "loop":
                # The loop splits the received rows by these sizes: the all-to-all's splits
                # are their sums, so that the pieces add up to the rows received.
                sent, got = counts.tolist(), counts_recv.tolist()
                in_splits = [sum(sent[r * n_local : (r + 1) * n_local]) for r in range(ep)]
                out_splits = [sum(got[r * n_local : (r + 1) * n_local]) for r in range(ep)]
            else:
                in_splits = counts.view(ep, n_local).sum(1).tolist()
                out_splits = counts_recv.view(ep, n_local).sum(1).tolist()
            recv = fc.all_to_all_single_autograd(xs, out_splits, in_splits, self.group)
        # One group per (source rank, local expert), in the order rows arrive.
        if cfg.expert_form == "loop":
            out = self._dropless_loop(recv, counts_recv)
        else:
            offs = torch.cumsum(counts_recv, 0).to(torch.int32)
            w1, w3, w2 = (w.repeat(ep, 1, 1) for w in (self.w1, self.w3, self.w2))
            h = F.silu(torch._grouped_mm(recv, w1, offs=offs)) * torch._grouped_mm(recv, w3, offs=offs)
            out = torch._grouped_mm(h, w2, offs=offs)
        if self.group is not None:
            from torch.distributed._functional_collectives import all_to_all_single_autograd

            out = all_to_all_single_autograd(out, in_splits, out_splits, self.group)
        weighted = out * gate.reshape(-1)[order].unsqueeze(1)
        return x.new_zeros(t, d).index_add(0, tok, weighted)


def example_tokens(cfg: MoEConfig, tokens: int, seed: int = 1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, cfg.dim, generator=g).to(dtype)


def build_ep(mesh, *, tokens: int = 64, dtype: str = "float32", **cfg_kw):
    """(model, example_inputs) for the expert-parallel MoE layer on a 1-D mesh.

    ``dtype``: "float32" or "bfloat16" (the dropless form's grouped matmuls take only bf16
    on the CPU)."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    cfg = MoEConfig(**cfg_kw)
    rank = mesh.get_local_rank()
    dt = getattr(torch, dtype)
    x = example_tokens(cfg, tokens, seed=1 + rank, dtype=dt).requires_grad_(True)
    return MoE(cfg, mesh.get_group()).to(dt), (x,)
