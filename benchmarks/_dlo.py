"""Dropless MoE, world 2 unshaped gloo: overlapc's extra compute (comm is cheap here)."""
import statistics, sys, torch, torch.distributed as dist
from benchmarks import common, harness
from overlapc.world import World

KW = dict(tokens=1024, dim=1024, hidden=2048, n_experts=8, top_k=2, capacity_factor=1.25,
          form="dropless", expert_form="grouped", dtype="bfloat16")

def job(mode, chunks_list, prof):
    torch._dynamo.config.capture_scalar_outputs = True
    from overlapc import Backend, Options
    from torch.distributed.device_mesh import init_device_mesh
    from overlapc.models import moe
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    steps = {}
    vs = {"base": Options(inner="eager", strategy="none", schedule=False)}
    for n in chunks_list:
        vs[f"n{n}"] = Options(inner="eager", strategy="decompose", chunks=n)
    for k, o in vs.items():
        torch.manual_seed(0)
        model, inputs = moe.build_ep(mesh, **KW)
        steps[k] = harness._step_fn(torch.compile(model, backend=Backend(o)), model, inputs, mode)
        steps[k](); steps[k]()
    t = common.interleaved(steps, 9)
    out = {k: round(statistics.median(v) * 1e3, 1) for k, v in t.items()}
    if prof and dist.get_rank() == 0:
        from torch.profiler import profile
        res = {}
        for k in ("base", prof):
            with profile(record_shapes=False) as p:
                steps[k]()
            res[k] = p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18)
        out["prof"] = res
    elif prof:
        steps["base"](); steps[prof]()
    return out

if __name__ == "__main__":
    mode = sys.argv[1]; prof = sys.argv[2] if len(sys.argv) > 2 else None
    with World(2) as w:
        r = w.run(job, mode, [2, 3, 4], prof)[0]
    p = r.pop("prof", None)
    print(r)
    if p:
        for k, v in p.items(): print("=====", k); print(v)
