"""transformers' own tensor-parallel plan (``tp_plan="auto"``), compiled with backend="overlapc".

A tiny ``LlamaForCausalLM`` is saved once and loaded on every rank with transformers' TP
plan (DTensor colwise/rowwise, TP without sequence parallelism), as a user would load a
checkpoint. One training step (logits and loss, then every parameter's gradient) is compared
with the eagerly run model on every rank. Tolerances: fp32, rtol = atol = 1e-5, as in
tests/test_models_distributed.py (chunked GEMMs and coalesced all-reduces change only the
order of each element's sums: last-bit differences).

transformers and accelerate are optional test dependencies (scripts/setup.sh installs them).
"""

from __future__ import annotations

import eager_check
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

LAYERS = 2


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _load(path):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    world = dist.get_world_size()
    return LlamaForCausalLM.from_pretrained(
        path,
        distributed_config=DistributedConfig(tp_size=world, tp_plan="auto"),
        device_mesh=init_device_mesh("cpu", (world,)),
        dtype=torch.float32,
    )


def check_hf(path: str, inner: str, options: dict) -> dict:
    import overlapc

    ref, model = _load(path), _load(path)
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor", "TP plan not applied"
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.logits.detach(), out.loss.detach()

    overlapc.reset_report()
    compiled = torch.compile(model, backend="overlapc", options={"inner": inner, **options})
    want, got = step(ref), step(compiled)
    ref_g = eager_check.grads(ref)
    assert len(ref_g) == len(list(ref.parameters()))
    eager_check.assert_matches(
        {"logits": got[0], "loss": got[1], **eager_check.grads(model)},
        {"logits": want[0], "loss": want[1], **ref_g},
        dict(rtol=1e-5, atol=1e-5),
    )
    report = overlapc.last_report()
    return {
        "coalesced": sorted(s.module for s in report.by(pattern="all_reduce_sum", status="rewritten")),
        "rewritten": sorted(f"{s.graph}:{s.pattern}" for s in report.sites if s.status == "rewritten"),
        "report": str(report),
    }


EXPECT_COALESCED = sorted(f"model.layers.{i}.{m}" for i in range(LAYERS) for m in ("mlp", "self_attn"))


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world_name",
    ["world2", pytest.param("world4", marks=pytest.mark.extended)],  # the reference models run world 4 by default
)
def test_transformers_tp_plan_decompose(world_name, tiny_llama, request):
    """Every site rewritten: q/k/v and gate/up input grads coalesced, then chunked."""
    world = request.getfixturevalue(world_name)
    for r in world.run(check_hf, tiny_llama, "eager", {"strategy": "decompose"}):
        assert r["coalesced"] == EXPECT_COALESCED, r["report"]
        if "forward:all_reduce_rows" in r["rewritten"]:
            # Automatic sequence parallelism (16 rows a rank at world 2): each all-reduce is a
            # reduce-scatter under its matmul, and the norms' outputs are gathered into the next.
            # Forward: o_proj and down_proj scatter; the two norms and the final one gather.
            # Backward: the two coalesced sums and lm_head's dgrad scatter; the o_proj and
            # down_proj dgrads gather.
            assert r["rewritten"].count("forward:matmul_reduce_scatter") == 2 * LAYERS, r["report"]
            assert r["rewritten"].count("forward:all_gather_matmul") == 2 * LAYERS + 1, r["report"]
            assert r["rewritten"].count("backward:matmul_reduce_scatter") == 2 * LAYERS + 1, r["report"]
            assert r["rewritten"].count("backward:all_gather_matmul") == 2 * LAYERS, r["report"]
            assert not any(":matmul_all_reduce" in x for x in r["rewritten"]), r["report"]
            continue
        # per layer: o_proj and down_proj forward; the two coalesced sums backward; lm_head's dgrad
        assert r["rewritten"].count("forward:matmul_all_reduce") == 2 * LAYERS, r["report"]
        assert r["rewritten"].count("backward:matmul_all_reduce") == 2 * LAYERS + 1, r["report"]


@pytest.mark.distributed
def test_transformers_tp_plan_defaults(world2, tiny_llama):
    """Default options: coalescing does not depend on the cost model's verdict on chunking."""
    for r in world2.run(check_hf, tiny_llama, "inductor", {}):
        assert r["coalesced"] == EXPECT_COALESCED, r["report"]
