"""torchtitan's layouts rebuilt with torch's own APIs, compiled with backend="overlapc" and
compared with eager on every rank, forward and every gradient (real gloo worlds).

FSDP2 + TP on a 2-D mesh (dp 2 x tp 2, world 4), in torchtitan's order: TP+SP
(parallelize_module), then per-block compile, then fully_shard of each block and the root.
Only the TP group's collectives are in the compiled graphs; FSDP's parameter all-gathers
and gradient reduce-scatters run in its hooks, outside them, and are left alone.

The first block stays eager: torch 2.13's AOTAutograd, with aot_eager as with overlapc,
routes the gradient of a compiled block's input that is DTensor.to_local()'s view (the
embedding's output) past to_local's backward (docs/limitations.md#training-stacks).

Tolerance, fp32: chunked GEMMs and chunked reduce-scatters change blocking and summation
order only (1e-5 relative and absolute, as tests/test_models_distributed.py argues).
"""

from __future__ import annotations

import eager_check
import pytest
import torch

SMALL = dict(n_layers=2, dim=64, n_heads=4, ffn_dim=128, vocab_size=64, seq=16)


def check_fsdp_tp(inner: str):
    """Job (world 4): the 2-D layout, eager against per-block compiled blocks 1.."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import overlapc
    from overlapc.models import llama

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = dict(SMALL, n_layers=3)
    ref, inputs = llama.build_tp_sp(mesh["tp"], **cfg)
    model, _ = llama.build_tp_sp(mesh["tp"], **cfg)
    g = torch.Generator().manual_seed(mesh.get_local_rank("dp"))  # each dp rank its own batch
    inputs = (torch.randint(0, SMALL["vocab_size"], inputs[0].shape, generator=g),)
    overlapc.reset_report()
    for m in (ref, model):
        for i, block in enumerate(m.layers):
            if m is model and i > 0:
                block.compile(backend="overlapc", options={"strategy": "decompose", "inner": inner})
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    want = {"forward": eager_check.step(ref, inputs, seed=7), **eager_check.grads(ref)}
    got = {"forward": eager_check.step(model, inputs, seed=7), **eager_check.grads(model)}
    eager_check.assert_matches(got, want, dict(rtol=1e-5, atol=1e-5))
    sites = [s for s in overlapc.last_report().sites if s.pattern != "collective"]
    return {
        "sites": sorted((s.graph, s.name, s.status) for s in sites),
        "on_tp_group": all(s.group == mesh["tp"].get_group().group_name for s in sites),
    }


@pytest.mark.distributed
def test_fsdp2_tp_2d_mesh_per_block_compile(world4):
    for res in world4.run(check_fsdp_tp, "eager"):
        sites = res["sites"]
        # attention's q/k/v gather and wo's scatter, the MLP's pair, and their backward
        # mirrors, in blocks 1 and 2: dynamo compiles one graph for both, and each call finds
        # its block by its parameters (FSDP's unsharded ones)
        assert len(sites) == 16, sites
        assert {name.split(":")[1].split(".")[1] for _, name, _ in sites} == {"1", "2"}, sites
        assert all(status == "rewritten" for _, _, status in sites), sites
        assert {g for g, _, _ in sites} == {"forward", "backward"}, sites
        assert res["on_tp_group"], "a site on the dp group: only TP collectives are matmul sites"


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
    """Job (world 2): a torchtitan-style model (closure forwards, blocks 1.. compiled one by
    one, torch.compile's wrapper for one of them, activation checkpointing around compiled
    blocks) with one override naming one block's site, and one naming no site."""
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
        if name == "0":
            continue
        if name == "3":
            block = torch.compile(block, backend="overlapc", options=opts)
        else:
            block.compile(backend="overlapc", options=opts)
        # Checkpointing a compiled block: checkpoint_wrapper first and compile after fails in
        # torch 2.13 itself (docs/limitations.md#training-stacks).
        model.layers.register_module(name, checkpoint_wrapper(block))

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
        # 4 sites a block in each direction, blocks 1..3 (block 0 runs eager)
        assert len(sites) == 24, sites
        assert {m.split(".")[1] for m in modules} == {"1", "2", "3"}, modules
        for m in modules:  # every module a site names is one the user can see
            assert any(
                n.replace("._checkpoint_wrapped_module", "").replace("._orig_mod", "") == m for n in res["names"]
            ), m
        named = [(n, s) for n, _, s in sites if fnmatch.fnmatchcase(n, ONE_BLOCK)]
        assert sorted(n.split(":")[0] for n, _ in named) == ["backward", "forward"], named
        assert all(s == "found" for _, s in named), named
        assert all(s == "rewritten" for n, _, s in sites if not fnmatch.fnmatchcase(n, ONE_BLOCK)), sites
        # blocks 1 and 3 share one program; block 2 runs its own (every call finds its block)
        ran = dict(res["ran"])
        assert ran.get("2") is None and ran["layers.2"] == "layers.2", res["ran"]
        assert None not in ran, res["ran"]
        assert any("'*:layers.9.*'" in w for w in res["warnings"]), res["warnings"]
        assert not any(ONE_BLOCK in w for w in res["warnings"]), res["warnings"]
