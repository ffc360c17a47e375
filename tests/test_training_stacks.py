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
    ref, inputs = llama.build_tp_sp(mesh["tp"], **SMALL)
    model, _ = llama.build_tp_sp(mesh["tp"], **SMALL)
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
        # attention's q/k/v gather and wo's scatter, the MLP's pair, and their backward mirrors
        assert len(sites) == 8, sites
        assert all(status == "rewritten" for _, _, status in sites), sites
        assert {g for g, _, _ in sites} == {"forward", "backward"}, sites
        assert res["on_tp_group"], "a site on the dp group: only TP collectives are matmul sites"
