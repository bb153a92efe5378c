"""What each CUDA kernel costs an SM, measured without a GPU (``numba-ops info --cuda``).

Every kernel and specialisation that a CUDA module of this package lists in its
``compile_jobs()`` (so kernels added later join by themselves) is compiled with
``numba.cuda.compile_ptx`` (libNVVM; no GPU) for sm_80 and sm_90 at its launch
bounds, and the PTX is assembled with ``ptxas -v``: registers per thread, spill
stores/loads (bytes per thread), stack frame and static shared memory per block.
From those and the threads per block that the launcher uses (the kernel's launch
bound, else ``_device.THREADS``) follow the blocks and warps an SM holds on an
A100 (sm_80) and an H100/H200 (sm_90), and which limit binds.

The assembler: nvJitLink's ptxas (``cuda.bindings.nvjitlink`` with ``-Xptxas=-v``,
the library numba-cuda links kernels with, of the same release as its libNVVM)
and the ``ptxas`` program (on PATH, ``$CUDA_HOME/bin``, ``/usr/local/cuda*/bin`` or
the ``nvidia-cuda-nvcc`` wheel). A ``ptxas`` older than the PTX that libNVVM
writes rejects its ``.version``; the PTX is then given the newest ISA that ptxas
names (the kernels use nothing newer; anything that does fails to assemble and is
reported so).

With ``NUMBA_ENABLE_CUDASIM=1`` numba's compiler is replaced by the simulator in
the process: the report then runs in a fresh process without it.
"""
import functools
import glob
import importlib
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
from typing import NamedTuple

from ..kernels._compat import load_nvvm, pretend_device

#: the package of the CUDA kernel modules
KERNELS = "numba_ops.kernels.cuda"
CCS = ((8, 0), (9, 0))

#: per-SM limits (CUDA C Programming Guide, compute capabilities 8.0 and 9.0)
REGISTERS_PER_SM = 65536
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
WARPS_PER_SM = 64
SMEM_PER_SM = {(8, 0): 164 * 1024, (9, 0): 228 * 1024}
SMEM_RESERVED_PER_BLOCK = 1024  # the runtime's share of each block's shared memory (cc >= 8.0)
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256
GPU_NAMES = {(8, 0): "A100", (9, 0): "H100/H200"}


class Usage(NamedTuple):
    """One kernel specialisation on one architecture."""
    label: str
    cc: tuple
    tool: str
    threads: int  # per block, as launched
    registers: int
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack: int  # bytes per thread
    smem: int  # static shared memory per block, bytes
    blocks: int  # resident blocks per SM
    warps: int  # resident warps per SM
    limiter: str


def occupancy(cc, threads, registers, smem):
    """(blocks per SM, warps per SM, the binding limit) for a launch of ``threads``
    per block, ``registers`` per thread and ``smem`` bytes of shared memory per block."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(registers, 1) * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    limits = {
        "registers": (REGISTERS_PER_SM // regs_per_warp) // warps,
        "threads": min(THREADS_PER_SM // threads, WARPS_PER_SM // warps),
        "blocks": BLOCKS_PER_SM,
    }
    if smem:
        limits["shared memory"] = SMEM_PER_SM[cc] // (smem + SMEM_RESERVED_PER_BLOCK)
    blocks = min(limits.values())
    limiter = "/".join(k for k, v in limits.items() if v == blocks)
    return blocks, blocks * warps, limiter


# --- the assemblers -----------------------------------------------------------

def find_ptxas():
    """The ``ptxas`` program, or None."""
    found = shutil.which("ptxas")
    if found:
        return found
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")] + sorted(glob.glob("/usr/local/cuda*"))
    try:
        import nvidia  # the nvidia-cuda-nvcc wheel: nvidia/cuda_nvcc/bin/ptxas
        roots += [os.path.join(p, "cuda_nvcc") for p in nvidia.__path__]
    except ImportError:
        pass
    for root in filter(None, roots):
        path = os.path.join(root, "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    return None


def _nvjitlink():
    try:
        from cuda.bindings import nvjitlink
        nvjitlink.version()
    except Exception:  # not installed, or the library is missing
        return None
    return nvjitlink


def assemblers():
    """{name: function(ptx, cc) -> ptxas -v text} of the assemblers found here."""
    found = {}
    nvjitlink = _nvjitlink()
    if nvjitlink is not None:
        major, minor = nvjitlink.version()
        found[f"nvJitLink {major}.{minor}"] = _assemble_nvjitlink
    ptxas = find_ptxas()
    if ptxas:
        found[f"ptxas {_ptxas_version(ptxas)}"] = functools.partial(_assemble_ptxas, ptxas)
    return found


def _ptxas_version(ptxas):
    out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else "?"


def _assemble_ptxas(ptxas, ptx, cc):
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        for _ in range(2):
            with open(src, "w") as f:
                f.write(ptx)
            proc = subprocess.run([ptxas, "-v", f"-arch=sm_{cc[0]}{cc[1]}", src, "-o", os.path.join(tmp, "k.cubin")],
                                  capture_output=True, text=True)
            m = re.search(r"Unsupported \.version (\S+); current version is '(\S+)'", proc.stderr)
            if proc.returncode == 0 or not m:
                break
            ptx = re.sub(r"^\.version \S+", f".version {m.group(2)}", ptx, count=1, flags=re.M)
    if proc.returncode:
        raise RuntimeError(f"ptxas failed: {proc.stderr.strip()[-2000:]}")
    return proc.stderr + proc.stdout


def _assemble_nvjitlink(ptx, cc):
    from cuda.bindings import nvjitlink
    opts = [f"-arch=sm_{cc[0]}{cc[1]}", "-Xptxas=-v"]
    h = nvjitlink.create(len(opts), opts)
    try:
        data = ptx.encode()
        nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), "kernel")
        try:
            nvjitlink.complete(h)
        except nvjitlink.nvJitLinkError:
            buf = bytearray(nvjitlink.get_error_log_size(h))
            nvjitlink.get_error_log(h, buf)
            raise RuntimeError(f"nvJitLink failed: {buf.decode(errors='replace')[-2000:]}") from None
        buf = bytearray(nvjitlink.get_info_log_size(h))
        nvjitlink.get_info_log(h, buf)
        return buf.decode(errors="replace")
    finally:
        nvjitlink.destroy(h)


def parse(text, ptx):
    """(registers, spill stores, spill loads, stack, smem) of the entry function in
    ``ptxas -v`` output ``text``; shared memory from the PTX where ptxas omits it."""
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", text)]
    if not regs:
        raise RuntimeError(f"no register count in the assembler's output:\n{text[-2000:]}")
    stack = sum(int(v) for v in re.findall(r"(\d+) bytes stack frame", text))
    st = sum(int(v) for v in re.findall(r"(\d+) bytes spill stores", text))
    ld = sum(int(v) for v in re.findall(r"(\d+) bytes spill loads", text))
    m = re.findall(r"(\d+) bytes smem", text)
    if m:
        smem = max(int(v) for v in m)
    else:  # static .shared declarations: ".shared .align 8 .b8 name[2048];"
        decl = r"\.shared\s+(?:\.align\s+\d+\s+)?\.[bsuf](\d+)\s+\S+\[(\d+)\]"
        smem = sum(int(b) * int(n) for b, n in re.findall(decl, ptx)) // 8
    return max(regs), st, ld, stack, smem


# --- compiling every kernel -----------------------------------------------------

def modules():
    """The CUDA kernel modules of this package that list their kernels (``compile_jobs``)."""
    pkg = importlib.import_module(KERNELS)
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        mod = importlib.import_module(f"{KERNELS}.{info.name}")
        if hasattr(mod, "compile_jobs"):
            found.append(mod)
    return found


def launch_bounds(kern):
    return getattr(kern, "targetoptions", {}).get("launch_bounds")


def threads_per_block(mod, label, kern):
    """The block size the launcher uses: the module's ``block_size(label)`` where
    it has one, else the kernel's launch bound, else the element-wise kernels'
    ``_device.THREADS`` (256 on a GPU)."""
    if hasattr(mod, "block_size"):
        return int(mod.block_size(label))
    lb = launch_bounds(kern)
    if lb:
        return lb[0] if isinstance(lb, tuple) else int(lb)
    from ..kernels.cuda._device import THREADS
    return THREADS


_PTX = {}  # (kernel, argument types, cc) -> PTX: the compile_ptx test and the report share it


def ptx_of(kern, sig, cc):
    """``compile_ptx`` of the kernel ``kern`` for ``sig`` and ``cc`` at its launch bounds
    (under ``pretend_device(cc)`` where no GPU is), memoised per process."""
    from numba import cuda
    key = (kern, tuple(sig), tuple(cc))
    if key not in _PTX:
        _PTX[key] = cuda.compile_ptx(kern.py_func, sig, cc=cc, launch_bounds=launch_bounds(kern))[0]
    return _PTX[key]


def measure(ccs=CCS, tools=None, only=None, module=None):
    """[Usage] of every kernel specialisation for every cc and assembler (of the kernel
    module named ``module`` alone, e.g. ``"grid_sample"``, if given)."""
    tools = assemblers() if tools is None else tools
    if not tools:
        raise RuntimeError("no PTX assembler here: neither ptxas (CUDA toolkit or the nvidia-cuda-nvcc wheel) "
                           "nor nvJitLink (cuda-bindings)")
    mods = modules() if module is None else [importlib.import_module(f"{KERNELS}.{module}")]
    jobs = [(mod, *job) for mod in mods for job in mod.compile_jobs() if only is None or only in job[0]]
    rows = []
    for cc in ccs:
        with pretend_device(cc):
            for mod, label, kern, sig in jobs:
                ptx = ptx_of(kern, sig, cc)
                nt = threads_per_block(mod, label, kern)
                for name, assemble in tools.items():
                    regs, st, ld, stack, smem = parse(assemble(ptx, cc), ptx)
                    blocks, warps, limiter = occupancy(cc, nt, regs, smem)
                    rows.append(Usage(label, cc, name, nt, regs, st, ld, stack, smem, blocks, warps, limiter))
    return rows


def table(rows):
    """The report as text: one block per (assembler, cc)."""
    out = []
    for tool in dict.fromkeys(r.tool for r in rows):
        for cc in dict.fromkeys(r.cc for r in rows):
            sel = [r for r in rows if r.tool == tool and r.cc == cc]
            if not sel:
                continue
            out.append(f"sm_{cc[0]}{cc[1]} ({GPU_NAMES.get(cc, '?')}), {tool}: per thread registers and spill "
                       f"bytes, per block shared memory, per SM resident blocks and warps (of {WARPS_PER_SM})")
            w = max(len(r.label) for r in sel)
            out.append(f"  {'kernel':<{w}}  threads  regs  spill st/ld  stack   smem  blocks  warps  occupancy  limit")
            for r in sel:
                out.append(f"  {r.label:<{w}}  {r.threads:7d}  {r.registers:4d}  "
                           f"{r.spill_stores:5d}/{r.spill_loads:<5d}"
                           f"  {r.stack:5d}  {r.smem:5d}  {r.blocks:6d}  {r.warps:5d}  {r.warps / WARPS_PER_SM:8.0%}   "
                           f"{r.limiter}")
            out.append("")
    return "\n".join(out)


# --- a roofline on paper for the benchmark cases (H200) ---------------------------

H200 = dict(sms=132, fp32=67e12, hbm=4.8e12)  # SMs, FP32 FFMA FLOP/s, HBM bytes/s (H200 SXM)


def _gemm_fraction(tiles):
    """The share of FFMA peak that the register-blocked loop allows: per reduction
    row a thread issues TM + TN shared loads (one wavefront each, one per clock per
    SM) and TM * TN FFMAs (four warp instructions per clock per SM)."""
    return min(1.0, tiles.TM * tiles.TN / 4 / (tiles.TM + tiles.TN))


def roofline(gpu=H200):
    """Per benchmark case (``cases``, float32): the work, the bytes, the
    bounds and the time the kernel design implies on ``gpu``; dicts."""
    import numpy as np

    from .._shapes import out_size
    from ..kernels.cuda import affine_grid as ag, deform_conv as dc
    from . import cases as _cases
    out = []
    for name, case in _cases.AFFINE.items():
        size = case["size"]
        nd = len(size) - 2
        elems = int(np.prod([size[0], *size[2:]])) * nd
        rows = elems // (size[-1] * nd)
        nbytes = elems * 4
        t_hbm = nbytes / gpu["hbm"]
        out.append(dict(case=name, op="affine_grid", flops=elems * (2 if nd == 2 else 3), bytes=nbytes,
                        t_flop=elems * (2 if nd == 2 else 3) / gpu["fp32"], t_hbm=t_hbm, blocks=min(rows, 1 << 16),
                        threads=ag.GPU_THREADS_PER_AXIS * nd, implied=t_hbm,
                        bound="HBM writes" if t_hbm > 1e-6 else "launch latency (a few us)"))
    tiles = dc.GPU_TILES
    TO, TP = tiles.TY * tiles.TM, tiles.TX * tiles.TN
    frac = _gemm_fraction(tiles)
    for name in _cases.DEFORM:
        N, C, spatial, oC, k, pad, stride, dil, group, og, use_mask = _cases.deform_params(name)
        nd = len(spatial)
        P = int(np.prod([out_size(D, pad, pad, k, dil, stride) for D in spatial]))
        K, cpg, ocg, cpo = k ** nd, C // group, oC // group, C // og
        n_ot, n_pt = -(-ocg // TO), -(-P // TP)
        ntiles = N * group * n_ot * n_pt
        # reduction rows as the kernel walks them: chunks of RK that never span two offset groups
        chunks = 0
        for gi in range(group):
            c = gi * cpg
            while c < (gi + 1) * cpg:
                c = min(c + tiles.RK, (c // cpo + 1) * cpo, (gi + 1) * cpg)
                chunks += 1
        flops_tile = 2 * TO * TP * tiles.RK * K * chunks // group  # padded tiles compute zeros too
        gemm = 2 * N * oC * P * cpg * K
        samples = N * group * n_ot * cpg * K * P
        flops = ntiles * flops_tile + samples * 2 * 2 ** nd  # + 2**n corner FMAs per sample
        nbytes = 4 * (N * C * int(np.prod(spatial)) + n_ot * N * og * K * P * (nd + use_mask) + N * oC * P
                      + 3 * oC * cpg * K + oC)
        per_sm = gpu["fp32"] * frac / gpu["sms"]
        t_tiles = -(-ntiles // gpu["sms"]) * flops_tile / per_sm  # each SM works through its tiles
        t_hbm = nbytes / gpu["hbm"]
        out.append(dict(case=name, op="deform_conv", flops=flops, gemm_flops=gemm, bytes=nbytes,
                        t_flop=flops / gpu["fp32"], t_lds=ntiles * flops_tile / (gpu["fp32"] * frac), t_hbm=t_hbm,
                        blocks=ntiles, threads=tiles.TY * tiles.TX, implied=max(t_tiles, t_hbm),
                        bound=("tiles < SMs" if ntiles < gpu["sms"]
                               else "shared loads" if t_tiles >= t_hbm else "HBM")))
    out += _sample_roofline(gpu)
    return out


def _sample_roofline(gpu):
    """The GridSample / affine_warp bench cases: one thread per output position,
    taps^r multiply-adds per output element (plus ~40 operations per position and
    axis for its taps and weights); the bytes are the case's work (x, grid or theta,
    and the result once each: an image fits in L2, so the taps' reuse stays on chip)."""
    import numpy as np

    from ..kernels._sample import MODES, TAPS
    from ..kernels.cuda import grid_sample as gsk
    from . import cases as _cases
    out = []
    for name, case in _cases.SAMPLE.items():
        shape = case["x"]
        r = len(shape) - 2
        mode = MODES[case["mode"]]
        N, C = shape[:2]
        P = int(np.prod(shape[2:]))
        item = 1 if case["x_dtype"] == "uint8" else 4
        pos_bytes = N * P * r * 4 if case["op"] == "grid_sample" else N * r * (r + 1) * 4
        nbytes = 2 * N * C * P * item + pos_bytes
        flops = N * C * P * 2 * TAPS[mode] ** r + N * P * r * 40
        nt = gsk.threads(np.float32, r, mode)
        t_flop, t_hbm = flops / gpu["fp32"], nbytes / gpu["hbm"]
        out.append(dict(case=name, op=case["op"], flops=flops, bytes=nbytes, t_flop=t_flop, t_hbm=t_hbm,
                        blocks=min(-(-N * P // nt), 1 << 16), threads=nt, implied=max(t_flop, t_hbm),
                        bound="HBM" if t_hbm >= t_flop else "FP32"))
    return out


def roofline_table(gpu=H200):
    """``roofline``'s rows as the text ``numba-ops info --cuda`` prints."""
    from ..kernels.cuda.deform_conv import GPU_TILES
    rows = roofline(gpu)
    out = [f"Roofline on paper, float32, H200 ({gpu['sms']} SMs, FP32 FFMA {gpu['fp32'] / 1e12:.0f} TFLOP/s, "
           f"HBM {gpu['hbm'] / 1e12:.1f} TB/s; DeformConv's 4x4 register blocks reach "
           f"{_gemm_fraction(GPU_TILES):.0%} "
           "of FFMA peak, bound by shared loads). Kernel time only: launches, copies and numba's host "
           "overhead (~10-20 us per launch) come on top. Unmeasured: bench/gpu_bench.py measures on a GPU.",
           f"  {'case':<16} {'GFLOP':>8} {'MB':>8} {'FFMA us':>8} {'LDS us':>8} {'HBM us':>8} {'blocks':>7} "
           f"{'threads':>7} {'implied us':>10}  bound"]
    for r in rows:
        lds = f"{r['t_lds'] * 1e6:8.2f}" if "t_lds" in r else f"{'-':>8}"
        out.append(f"  {r['case']:<16} {r['flops'] / 1e9:8.3f} {r['bytes'] / 1e6:8.2f} {r['t_flop'] * 1e6:8.2f} {lds} "
                   f"{r['t_hbm'] * 1e6:8.2f} {r['blocks']:7d} {r['threads']:7d} {r['implied'] * 1e6:10.2f}  "
                   f"{r['bound']}")
    return "\n".join(out)


def simulator_on():
    from .._dispatch import cuda_simulator
    return cuda_simulator()


def report(argv=()):
    """Print the report (``numba-ops info --cuda``); 0 on success, 1 if nothing can be measured."""
    if simulator_on():  # the simulator replaces numba-cuda's compiler here: a fresh process without it
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        return subprocess.run([sys.executable, "-m", f"{__package__}.resources", *argv], env=env).returncode
    try:
        load_nvvm()
    except Exception as exc:
        print(f"CUDA resource report unavailable: numba-cuda's libNVVM cannot be loaded ({exc})")
        return 1
    tools = assemblers()
    if not tools:
        print("CUDA resource report unavailable: no PTX assembler here (ptxas from the CUDA toolkit or the "
              "nvidia-cuda-nvcc wheel, or nvJitLink from cuda-bindings)")
        return 1
    rows = measure(tools=tools, only=argv[0] if argv else None)
    print(table(rows))
    if not argv:
        print(roofline_table())
        print()
    spilled = [r for r in rows if r.spill_stores or r.spill_loads]
    print(f"{len(rows)} kernel builds, {len(spilled)} with spills" + (
        ": " + ", ".join(sorted({r.label for r in spilled})) if spilled else ""))
    return 0


if __name__ == "__main__":
    sys.exit(report(sys.argv[1:]))
