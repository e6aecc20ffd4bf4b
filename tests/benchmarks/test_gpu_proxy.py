"""benchmarks/gpu_proxy.py (issue 30): its quick mode counts the CUDA dispatch of one real
`magi2-preview` forward on the meta device, and every benchmark script starts directly from
its path (`python benchmarks/x.py`, no `benchmarks` package on the path)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_proxy
from headmoe.models.magi2.config import get_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py")
                 if p.name not in ("__init__.py", "common.py"))  # fmt: skip


def test_quick_proxy_counts_the_cuda_dispatch_of_a_272p_sp8_ep4_forward():
    """Attention FLOPs equal 4 L^2 D per head and segment for every layer; the Triton
    kernels and torch ops were both counted; the peak stays under the planner's bound."""
    cfg = get_config("magi2-preview")
    r = gpu_proxy.measure("272p", 8, 4)
    assert r["local_tokens"] == 3709
    seg = 14336 + 250 + 250  # video + audio + text tokens of one branch
    heads = cfg.num_attention_heads // 8
    kernel = r["rows"][("attention", "sink_attention_kernel", True)]
    assert kernel[1] == 4.0 * seg * seg * cfg.head_dim * heads * 2 * cfg.num_layers
    assert kernel[1] <= r["flops"]["attention"] < kernel[1] * 1.001  # + the output cat
    names = {name for (_region, name, _gemm) in r["rows"]}
    assert {"linear_kernel", "sink_attention_kernel", "expert_tile_kernel", "route_kernel",
            "rms_inv_kernel", "rms_norm_kernel", "aten.add"} <= names  # fmt: skip
    assert not {"gate_up_kernel", "down_kernel", "matmul_kernel"} & names  # all fused
    assert kernel[0] == 2 * cfg.num_layers  # one launch per segment and layer
    assert 0 < r["peak_bytes"] < r["plan_activation_bytes"]
    assert r["elementwise_s"] < r["roofline_s"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_scripts_start_from_their_path(script, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout
