"""The CUDA resource report (benchmark/resources.py, ``numba-ops info --cuda``):
every kernel compiled for sm_80 and sm_90 at its launch bounds and assembled by
ptxas spills nothing. Needs libNVVM and a PTX assembler (the CUDA toolkit's or
the nvidia-cuda-nvcc wheel's ptxas, or nvJitLink), not a GPU."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from numba_ops import _dispatch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _assemblers():
    try:
        from numba_ops.benchmark import resources
    except ImportError as exc:  # numba-cuda is not installed
        return None, f"numba-cuda is not installed ({exc})"
    found = resources.assemblers()
    return found, None if found else "no PTX assembler here (ptxas or nvJitLink)"


ASSEMBLERS, WHY = _assemblers()


def test_occupancy_arithmetic():
    pytest.importorskip("numba.cuda")
    from numba_ops.benchmark.resources import occupancy
    # 256 threads, 128 registers: 8 warps x 4096 registers each = 32768 per block: 2 blocks
    assert occupancy((9, 0), 256, 128, 15000) == (2, 16, "registers")
    # 32 registers: 8 blocks of 256 threads fill the 2048 threads (and the registers exactly)
    assert occupancy((9, 0), 256, 32, 0) == (8, 64, "registers/threads")
    # registers go per warp in units of 256: 33 registers count as 40
    assert occupancy((8, 0), 256, 33, 0)[0] == 6
    # shared memory binds: 48 KB + 1 KB reserved per block, 164 KB (A100) / 228 KB (H100) per SM
    assert occupancy((8, 0), 128, 32, 48 * 1024)[:1] == (3,)
    assert occupancy((9, 0), 128, 32, 48 * 1024)[:1] == (4,)
    assert occupancy((9, 0), 32, 16, 0) == (32, 32, "blocks")


#: the kernel specialisations each CUDA kernel module lists (``compile_jobs``): GridSample
#: 3 ranks x 3 modes x 4 dtypes x x's dtype (the grid's or uint8), its backward's 36 and the
#: buffer helpers (2 fills, 5 narrowings); affine_warp 2 ranks, its backward's 24; AffineGrid's
#: coordinates and grid; DeformConv's tile variants x 32/64-bit indices and the weights; the
#: packing of 5 dtypes x 3 ranks; ms_deform_attn one kernel per dtype (the rank is a run-time
#: value). The builds take minutes: a test per module, which pytest-xdist spreads over its workers.
JOBS = {"_device": 15, "affine_grid": 16, "affine_grid_backward": 8, "affine_warp": 48,
        "affine_warp_backward": 24, "deform_conv": 20, "deform_conv_backward": 20, "grid_sample": 72,
        "grid_sample_backward": 43, "ms_deform_attn": 4, "ms_deform_attn_backward": 4}
CCS = [(8, 0), (9, 0)]


def test_every_kernel_module_is_built():
    modules = {f[:-3] for f in os.listdir(os.path.join(ROOT, "numba_ops", "kernels", "cuda"))
               if f.endswith(".py") and not f.startswith("__")}
    assert modules == set(JOBS)


@pytest.mark.full  # NVVM and ptxas: with --full
@pytest.mark.skipif(ASSEMBLERS is None or not ASSEMBLERS, reason=str(WHY))
@pytest.mark.parametrize("module", sorted(JOBS))
def test_no_kernel_spills(module):
    """Every kernel specialisation of each kernel module type-checks and compiles for sm_80
    and sm_90 at its launch bounds (libNVVM, no GPU), with zero spill bytes under every
    assembler found (nvJitLink's ptxas is the one numba-cuda links kernels with), and room
    for at least two blocks of each launch on an SM. Both architectures in one process: the
    second reuses the first's typing (a third of the time)."""
    code = textwrap.dedent(f"""
        import json
        from numba_ops.benchmark import resources
        print(json.dumps([r._asdict() for r in resources.measure(ccs={CCS!r}, module={module!r})]))
    """)
    if _dispatch.cuda_simulator():  # the simulator replaces numba-cuda's compiler in this process
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", PYTHONPATH=os.pathsep.join(
            [ROOT, os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
        assert proc.returncode == 0, proc.stderr[-4000:]
        rows = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        from numba_ops.benchmark import resources
        rows = [r._asdict() for r in resources.measure(ccs=CCS, module=module)]
    labels = {r["label"] for r in rows}
    assert len(labels) == JOBS[module], sorted(labels)
    for dt in ("float16", "bfloat16", "float32", "float64"):
        assert any(label.endswith("/" + dt) for label in labels), dt
    assert len(rows) == len(labels) * len(CCS) * len(ASSEMBLERS)
    assert {tuple(r["cc"]) for r in rows} == set(map(tuple, CCS))
    spilled = [(r["label"], r["cc"], r["tool"], r["spill_stores"], r["spill_loads"]) for r in rows
               if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, spilled
    assert all(r["blocks"] >= 2 for r in rows), [(r["label"], r["blocks"]) for r in rows if r["blocks"] < 2]


def test_info_cuda_calls_the_report(monkeypatch):
    pytest.importorskip("numba.cuda")
    from numba_ops import cli
    from numba_ops.benchmark import resources
    calls = []
    monkeypatch.setattr(resources, "report", lambda argv=(): calls.append(argv) or 0)
    assert cli.main(["info", "--cuda"]) == 0 and calls == [()]


@pytest.mark.full  # NVVM and ptxas: with --full
@pytest.mark.skipif(ASSEMBLERS is None or not ASSEMBLERS, reason=str(WHY))
def test_report_table():
    """The printed report (one kernel, to stay quick): a block per architecture and
    assembler, the kernel's registers, spills and occupancy."""
    # NUMBA_ENABLE_CUDASIM as this run has it: in the simulator pass the report
    # re-runs itself without the simulator
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "numba_ops.benchmark.resources", "affine_grid.grid/2d/float32"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for cc, gpu in (("sm_80", "A100"), ("sm_90", "H100/H200")):
        assert f"{cc} ({gpu})" in out, out
    rows = [ln.split() for ln in out.splitlines() if ln.strip().startswith("affine_grid.grid/2d/float32")]
    assert len(rows) == 2 * len(ASSEMBLERS), out
    for r in rows:
        threads, regs, spills = int(r[1]), int(r[2]), r[3]
        assert threads == 128 and 0 < regs <= 255 and spills == "0/0", r
    assert out.strip().endswith("with spills"), out


def test_roofline_of_the_bench_cases():
    """The roofline on paper (README, "GPU") covers every bench case with the case
    table's own work figures."""
    pytest.importorskip("numba.cuda")
    from numba_ops.benchmark import cases as _cases
    from numba_ops.benchmark.resources import roofline
    rows = {r["case"]: r for r in roofline()}
    assert set(rows) == set(_cases.AFFINE) | set(_cases.DEFORM) | set(_cases.SAMPLE)
    for name in _cases.AFFINE:
        assert rows[name]["bytes"] == _cases.affine_inputs(name)[2]
    for name in _cases.SAMPLE:
        assert rows[name]["bytes"] == _cases.sample_inputs(name)[2]
    for name in _cases.DEFORM:
        r = rows[name]
        assert r["gemm_flops"] == _cases.deform_inputs(name)[2]
        assert r["flops"] >= r["gemm_flops"] and r["implied"] >= max(r["t_hbm"], r["t_lds"])
    assert rows["dc_r50_c64_56"]["blocks"] == 49  # 1 image x 1 channel tile x ceil(56*56 / 64) position tiles
    assert rows["dc_r50_c64_56"]["gemm_flops"] == 2 * 64 * 56 * 56 * 64 * 9
