"""torchtitan's layouts rebuilt with torch's own APIs, compiled with backend="overlapc" and
compared with eager on every rank, forward and every gradient (real gloo worlds).

FSDP2 + TP on a 2-D mesh (dp 2 x tp 2, world 4), in torchtitan's order: TP+SP
(parallelize_module), then per-block compile, then fully_shard of each block and the root.
Only the TP group's collectives are in the compiled graphs; FSDP's parameter all-gathers
and gradient reduce-scatters run in its hooks, outside them, and are left alone.

Every block is compiled, the first too: its input is DTensor.to_local() of the embedding's
reduce-scatter, an AsyncCollectiveTensor, which overlapc compiles for as a plain tensor
(overlapc/repairs.py; torch 2.13's aot_eager fails there).

Tolerance, fp32: chunked GEMMs and chunked reduce-scatters change blocking and summation
order only (1e-5 relative and absolute, as tests/test_models_distributed.py argues).
"""

from __future__ import annotations

import eager_check
import pytest
import torch

SMALL = dict(n_layers=2, dim=64, n_heads=4, ffn_dim=128, vocab_size=64, seq=16)


def check_fsdp_tp(inner: str, policy: str | None = None):
    """Job (world 4): the 2-D layout, eager against per-block compiled blocks, each block
    checkpointed first where ``policy`` ("full" or "selective") says so."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.fsdp import fully_shard

    import overlapc
    from overlapc.models import llama
    from overlapc.passes.ops import strip_wrappers

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = dict(SMALL, n_layers=3)
    ref, inputs = llama.build_tp_sp(mesh["tp"], **cfg)
    model, _ = llama.build_tp_sp(mesh["tp"], **cfg)
    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # each dp rank its own batch
    inputs = (torch.randint(0, SMALL["vocab_size"], inputs[0].shape, generator=g),)
    overlapc.reset_report()
    kw = {"context_fn": selective_policy} if policy == "selective" else {}
    for m in (ref, model):
        for name, block in list(m.layers.named_children()):
            if m is model and policy is not None:
                block = checkpoint_wrapper(block, **kw)
                m.layers.register_module(name, block)
            if m is model:
                block.compile(backend="overlapc", options={"strategy": "decompose", "inner": inner})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    want = {"forward": eager_check.step(ref, inputs, seed=7), **eager_check.grads(ref)}
    out = eager_check.step(model, inputs, seed=7)
    got = {"forward": out, **{strip_wrappers(k): g for k, g in eager_check.grads(model).items()}}
    eager_check.assert_matches(got, want, dict(rtol=1e-5, atol=1e-5))
    sites = [s for s in overlapc.last_report().sites if s.pattern != "collective"]

    def ranks(group: str) -> list[int]:
        return dist.get_process_group_ranks(_resolve_process_group(group))

    return {
        "sites": sorted((s.graph, s.name, s.status) for s in sites),
        # by ranks: dynamo reuses a block's compiled graph (and its rows) for a later job's
        # model in this world, whose mesh made new groups over the same ranks
        "on_tp_group": all(ranks(s.group) == ranks(mesh["tp"].get_group().group_name) for s in sites),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(
    "inner,policy",
    [
        ("eager", None),
        ("eager", "selective"),
        pytest.param("eager", "full", marks=pytest.mark.extended),
        pytest.param("inductor", "selective", marks=[pytest.mark.slow, pytest.mark.extended]),
    ],
)
def test_fsdp2_tp_2d_mesh_per_block_compile(world4, inner, policy):
    """torchtitan's order: TP, activation checkpointing (``policy``), per-block compile, FSDP."""
    for res in world4.run(check_fsdp_tp, inner, policy):
        sites = res["sites"]
        # attention's q/k/v gather and wo's scatter, the MLP's pair, and their backward
        # mirrors, in blocks 0..2: dynamo compiles one graph for blocks 1 and 2, and each call
        # finds its block by its parameters (FSDP's unsharded ones); checkpointing adds the
        # sites its recomputation reruns (RECOMPUTED)
        extra = {None: 0, "selective": 2, "full": 3}[policy]
        assert 3 * (8 + extra) <= len(sites) <= 3 * (8 + extra + 1), sites
        assert {name.split(":")[1].split(".")[1] for _, name, _ in sites} == {"0", "1", "2"}, sites
        assert all(status == "rewritten" for _, _, status in sites), sites
        assert {g for g, _, _ in sites} == {"forward", "backward"}, sites
        assert res["on_tp_group"], "a site on the dp group: only TP collectives are matmul sites"


def selective_policy():
    """torchtitan's op-level selective checkpointing policy, rebuilt: save the outputs of
    attention and of reduce-scatters, save every other matmul, recompute the rest (the
    all-gathers among them). A fresh counter per checkpointed call, as torchtitan's."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_efficient_attention.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
    count = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op is aten.mm.default:
            key = "recompute" if ctx.is_recompute else "forward"
            count[key] += 1
            return CheckpointPolicy.MUST_SAVE if count[key] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


AC_LAYERS = 3


def check_activation_checkpointing(inner: str, policy: str, scope: str):
    """Job (world 2): TP+SP, every block checkpointed (``policy`` "full" or "selective"), then
    compiled in torchtitan's order: the whole model (``scope`` "model") or each block
    ("block"). Eager reference without checkpointing: recomputation reruns the
    same ops on the same values."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.models import llama
    from overlapc.passes.ops import strip_wrappers

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    cfg = dict(SMALL, n_layers=AC_LAYERS)
    ref, inputs = llama.build_tp_sp(mesh, **cfg)
    model, _ = llama.build_tp_sp(mesh, **cfg)
    opts = {"strategy": "decompose", "inner": inner}
    kw = {"context_fn": selective_policy} if policy == "selective" else {}
    for name, block in list(model.layers.named_children()):
        block = checkpoint_wrapper(block, **kw)
        if scope == "block":
            block.compile(backend="overlapc", options=opts)
        model.layers.register_module(name, block)
    run = torch.compile(model, backend="overlapc", options=opts) if scope == "model" else model
    overlapc.reset_report()
    want = {"forward": eager_check.step(ref, inputs, seed=5), **eager_check.grads(ref)}
    out = eager_check.step(run, inputs, seed=5)
    got = {"forward": out, **{strip_wrappers(k): g for k, g in eager_check.grads(model).items()}}
    eager_check.assert_matches(got, want, dict(rtol=1e-5, atol=1e-5))
    return sorted((s.graph, s.module, s.pattern, s.status) for s in overlapc.last_report().sites)


def _closure_forward(module: torch.nn.Module) -> None:
    """Replace ``module.forward`` with a closure over the bound method, as torchtitan's
    parallelize does: dynamo's module paths then pass through ``forward.__closure__``."""
    bound = module.forward

    def forward(*args, **kwargs):
        return bound(*args, **kwargs)

    module.forward = forward


NAMED = dict(SMALL, n_layers=4)
ONE_BLOCK = "*:layers.2.attention.wo:*"


def check_names_and_overrides(inner: str):
    """Job (world 2): a torchtitan-style model (closure forwards, every block compiled one by
    one, torch.compile's wrapper for one of them, activation checkpointing inside the compile
    and, for block 1, around it) with one override naming one block's site, and one naming no
    site."""
    import logging

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc import blocks
    from overlapc.models import llama
    from overlapc.passes.ops import strip_wrappers

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    ref, inputs = llama.build_tp_sp(mesh, **NAMED)
    model, _ = llama.build_tp_sp(mesh, **NAMED)
    opts = {
        "strategy": "decompose",
        "inner": inner,
        "overrides": {ONE_BLOCK: {"strategy": "none"}, "*:layers.9.*": {"chunks": 3}},
    }
    for name, block in list(model.layers.named_children()):
        _closure_forward(block.attention)
        if name == "1":  # checkpointing around a compiled block
            block.compile(backend="overlapc", options=opts)
            block = checkpoint_wrapper(block)
        else:  # torchtitan's order: checkpointing, then compile (one block through the wrapper)
            block = checkpoint_wrapper(block)
            if name == "3":
                block = torch.compile(block, backend="overlapc", options=opts)
            else:
                block.compile(backend="overlapc", options=opts)
        model.layers.register_module(name, block)

    ran = []  # (block a call was for, block whose program it ran)
    program = blocks.PerBlock.program

    def spy(self, args):
        path, serving = program(self, args)
        ran.append((path, serving.prefix))
        return path, serving

    warnings = []

    class Keep(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    handler = Keep()
    logging.getLogger("overlapc").addHandler(handler)
    blocks.PerBlock.program = spy
    overlapc.reset_report()
    try:
        want = {"forward": eager_check.step(ref, inputs, seed=3), **eager_check.grads(ref)}
        out = eager_check.step(model, inputs, seed=3)
        # parameter names as the user sees them: without the wrappers' attributes
        got = {"forward": out, **{strip_wrappers(k): g for k, g in eager_check.grads(model).items()}}
    finally:
        blocks.PerBlock.program = program
        logging.getLogger("overlapc").removeHandler(handler)
    eager_check.assert_matches(got, want, dict(rtol=1e-5, atol=1e-5))
    sites = [s for s in overlapc.last_report().sites if s.pattern != "collective"]
    return {
        "sites": sorted((s.name, s.module, s.status) for s in sites),
        "ran": sorted(set(ran)),
        "warnings": warnings,
        "names": [n for n, _ in model.named_modules()],
    }


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.extended])])
def test_override_glob_names_one_block_of_per_block_compile(world2, inner):
    """Site names are module paths as model.named_modules() shows them (no closure or wrapper
    attributes), with the block's path in the model although dynamo compiles one graph for
    every block; an override naming one block's site changes exactly its sites."""
    import fnmatch

    for res in world2.run(check_names_and_overrides, inner):
        sites = res["sites"]
        modules = {m for _, m, _ in sites}
        # 4 sites a block in each direction, blocks 0..3, and the 3 that full checkpointing
        # inside the compile reruns in backward (RECOMPUTED), blocks 0, 2, 3
        assert len(sites) == 4 * 8 + 3 * 3, sites
        assert {m.split(".")[1] for m in modules} == {"0", "1", "2", "3"}, modules
        for m in modules:  # every module a site names is one the user can see
            assert any(
                n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "") == m for n in res["names"]
            ), m
        named = [(n, s) for n, _, s in sites if fnmatch.fnmatchcase(n, ONE_BLOCK)]
        # wo's reduce-scatter, its gradient's gather, and the reduce-scatter recomputed
        assert sorted(n.split(":")[0] for n, _ in named) == ["backward", "backward", "forward"], named
        assert all(s == "found" for _, s in named), named
        assert all(s == "rewritten" for n, _, s in sites if not fnmatch.fnmatchcase(n, ONE_BLOCK)), sites
        # blocks 1 and 3 share one program; block 2 runs its own (every call finds its block)
        ran = dict(res["ran"])
        assert ran.get("2") is None and ran["layers.2"] == "layers.2", res["ran"]
        assert None not in ran, res["ran"]
        assert any("'*:layers.9.*'" in w for w in res["warnings"]), res["warnings"]
        assert not any(ONE_BLOCK in w for w in res["warnings"]), res["warnings"]


# Sites a checkpointed block's backward recomputes, beside its own four (the gradients' wo and
# w2 gathers, the q/k/v and w1/w3 input-gradient reduce-scatters): full checkpointing reruns
# the q/k/v and w1/w3 gathers with their matmuls and wo's reduce-scatter (w2's output is not
# needed again); the selective policy saves odd matmuls and reduce-scatters, so only wk and w3
# (even matmuls) rerun, from recomputed gathers.
RECOMPUTED = {
    "full": {
        ("attention", "all_gather_matmul"),
        ("attention.wo", "matmul_reduce_scatter"),
        ("feed_forward", "all_gather_matmul"),
    },
    "selective": {("attention.wk", "all_gather_matmul"), ("feed_forward.w3", "all_gather_matmul")},
}
OWN_BACKWARD = {
    ("attention.wo", "all_gather_matmul"),
    ("attention", "matmul_reduce_scatter"),
    ("feed_forward.w2", "all_gather_matmul"),
    ("feed_forward", "matmul_reduce_scatter"),
}


@pytest.mark.distributed
@pytest.mark.parametrize(
    "inner,policy,scope",
    [
        ("eager", "full", "model"),
        ("eager", "selective", "block"),
        pytest.param("eager", "full", "block", marks=pytest.mark.extended),
        pytest.param("eager", "selective", "model", marks=pytest.mark.extended),
        pytest.param("inductor", "full", "model", marks=[pytest.mark.slow, pytest.mark.extended]),
        pytest.param("inductor", "selective", "block", marks=[pytest.mark.slow, pytest.mark.extended]),
    ],
)
def test_activation_checkpointing_inside_compile(world2, inner, policy, scope):
    """Checkpointing inside the compiled region (torchtitan's order): the backward graph reruns
    part of the forward, and the sites in that recomputation are found and rewritten like the
    forward's. Where the recomputation holds attention, torch 2.13's runtime fails without
    overlapc's partition repair (overlapc/repairs.py), with aot_eager too."""
    for sites in world2.run(check_activation_checkpointing, inner, policy, scope):
        matmul = [s for s in sites if s[2] != "collective"]
        assert all(status == "rewritten" for *_, status in matmul), sites
        for i in range(AC_LAYERS):
            prefix = f"layers.{i}."
            back = {(m[len(prefix) :], p) for g, m, p, _ in matmul if g == "backward" and m.startswith(prefix)}
            want = OWN_BACKWARD | RECOMPUTED[policy]
            # the min-cut partitioner may also rerun w2's matmul and reduce-scatter
            assert want <= back <= want | {("feed_forward.w2", "matmul_reduce_scatter")}, (i, sorted(back))
