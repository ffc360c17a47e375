"""torchtitan's own Llama 3 and TP+SP code, compiled per block with backend="overlapc".

Optional: runs where torchtitan 0.3.0 is installed (README, "Testing against torchtitan"),
skipped elsewhere. torchtitan is not a dependency of overlapc.

torchtitan 0.3.0 refuses SDPA for language models, and its FlexAttention has no CPU
backward: the test builds its debug model with torchtitan's ScaledDotProductAttention
module. Its mesh helper picks CUDA at import; the test points it at the CPU.

Tolerance, fp32: chunked GEMMs and chunked reduce-scatters change blocking and summation
order only (1e-5 relative and absolute, as tests/test_models_distributed.py argues).
"""

from __future__ import annotations

import fnmatch

import eager_check
import pytest
import torch

VERSION = "0.3.0"
ONE_SITE = "*:layers.1.attention.wo:*"


def _installed() -> bool:
    try:
        from importlib.metadata import version

        return version("torchtitan") == VERSION
    except Exception:  # noqa: BLE001 - not installed, or no metadata
        return False


pytestmark = pytest.mark.skipif(not _installed(), reason=f"torchtitan {VERSION} is not installed")


def _build(parallel_dims, n_layers: int):
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    cfg = llama3.llama3_configs["debugmodel"](attn_backend="sdpa")
    cfg.layers = cfg.layers[:n_layers]
    set_llama3_sharding_config(cfg, enable_sp=True)
    model = cfg.build()
    torch.manual_seed(42)
    model.init_weights(buffer_device=torch.device("cpu"))
    model.parallelize(parallel_dims)  # torchtitan's TP+SP
    return model


def check_torchtitan_llama(inner: str, ac: str | None = None) -> dict:
    """Job (world 2): eager against every block compiled on its own (apply_compile's way),
    with an override naming one block's site; each block first checkpointed by torchtitan's
    own policy where ``ac`` ("full" or "selective") says so, as its trainer orders them."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as titan_utils

    import overlapc

    titan_dims.device_type = "cpu"
    dims = ParallelDims(
        dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=2, spmd_backend="partial_dtensor"
    )
    titan_utils.set_spmd_backend("partial_dtensor")
    dims.build_mesh()
    ref, model = _build(dims, 3), _build(dims, 3)
    if ac is not None:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        policy = FullAC if ac == "full" else SelectiveAC
        policy(policy.Config()).apply(model)
    opts = {"strategy": "decompose", "inner": inner, "overrides": {ONE_SITE: {"strategy": "none"}}}
    for block in model.layers.values():
        block.compile(backend="overlapc", options=opts, fullgraph=True)
    tokens = torch.randint(0, 2048, (2, 32), generator=torch.Generator().manual_seed(0))
    overlapc.reset_report()
    want = {"forward": eager_check.step(ref, (tokens,), seed=3), **eager_check.grads(ref)}
    got = {"forward": eager_check.step(model, (tokens,), seed=3), **eager_check.grads(model)}
    # parameter names as the user sees them: without the checkpoint wrapper's attribute
    got = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in got.items()}
    eager_check.assert_matches(got, want, dict(rtol=1e-5, atol=1e-5))
    return {"sites": sorted((s.name, s.status) for s in overlapc.last_report().sites if s.pattern != "collective")}


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_torchtitan_llama3_per_block_compile(world2, inner):
    for res in world2.run(check_torchtitan_llama, inner):
        sites = res["sites"]
        # per block: qkv's gather and wo's scatter, the MLP's pair, and their backward mirrors
        assert len(sites) == 24, sites
        assert {n.split(":")[1].split(".")[1] for n, _ in sites} == {"0", "1", "2"}, sites
        named = [s for n, s in sites if fnmatch.fnmatchcase(n, ONE_SITE)]
        assert named == ["found", "found"], sites
        assert all(s == "rewritten" for n, s in sites if not fnmatch.fnmatchcase(n, ONE_SITE)), sites


@pytest.mark.distributed
@pytest.mark.parametrize("ac", ["full", "selective"])
def test_torchtitan_llama3_activation_checkpointing(world2, ac):
    """torchtitan's FullAC / SelectiveAC, then per-block compile: the backward's recomputed
    sites are found and rewritten too, and the step equals eager."""
    for res in world2.run(check_torchtitan_llama, "eager", ac):
        sites = res["sites"]
        assert len(sites) > 24, sites  # the 24 of the test above, and the recomputed ones
        assert {n.split(":")[1].split(".")[1] for n, _ in sites} == {"0", "1", "2"}, sites
        named = [s for n, s in sites if fnmatch.fnmatchcase(n, ONE_SITE)]
        assert named and all(s == "found" for s in named), sites
        assert all(s == "rewritten" for n, s in sites if not fnmatch.fnmatchcase(n, ONE_SITE)), sites
