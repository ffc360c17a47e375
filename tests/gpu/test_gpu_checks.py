"""The fused kernels and the ops built on them on a CUDA device (``pytest -m gpu``; skipped
without one). Each stage of tests/gpu/checks.py runs in a process of its own with its deadline:
a kernel that never returns wedges its process's GPU context, so a hang fails one test and the
next starts on a fresh context. On the CPU the same stages run under Triton's interpreter in
the default suite (tests/test_fused_kernels.py::test_gpu_checks_smoke_runs_every_stage)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from tests.gpu.checks import STAGES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def run_stage(stage: str, seconds: float) -> dict:
    """Stage ``stage``'s result, from its own process; the process and any it started (the
    ops stage's ranks) are killed after ``seconds``."""
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.gpu.checks", "--stage", stage],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, so that the kill reaches the ranks
    )
    try:
        text = p.communicate(timeout=seconds)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        text = p.communicate()[0]
        pytest.fail(f"{stage}: not done after {seconds} s (a hung kernel?)\n{text[-4000:]}")
    results = [json.loads(t[len("RESULT ") :]) for t in text.splitlines() if t.startswith("RESULT ")]
    assert results, f"{stage}: exit {p.returncode}, no result\n{text[-4000:]}"
    return results[-1]


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage(stage):
    """workspace: flags raised from the host, device-to-device chunks with their flags and nine
    back-to-back calls each land in a spinning grid, and the watchdog's abort ends one.
    pipe: ten AG consumer calls, each with its producer on a side stream, match cat @ B.
    ag / rs: every candidate config of the AG consumer and of the RS producer + consumer, on an
    LLM shape and a ragged one, matches torch. ops: the fused ops between two GPUs.
    grouped: grouped_mm equals the loop it replaces. ulysses: SDPA's CUDA kernel stays inside
    the head-chunked region, once per chunk, and the compiled block matches eager."""
    if stage == "ops" and torch.cuda.device_count() < 2:
        pytest.skip("the ops stage takes one GPU per rank (2)")
    res = run_stage(stage, STAGES[stage][1])
    assert res["problems"] == [], json.dumps(res, indent=1, default=str)[-4000:]
