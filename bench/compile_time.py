"""Where a PyTorch user's first calls spend their compile time, function by function.

The four first calls of issue #49, in one fresh process with a new empty
``NUMBA_CACHE_DIR``, each followed by the backward of ``.sum()`` (so eight steps
are timed: each forward, then its backward):

- ``DeformConv2d(16, 16, 3, padding=1)`` on a 1x16x24x24 input with offsets and a
  mask (offsets, mask and input require grad);
- ``grid_sample`` of a 1x16x24x24 input at a 1x24x24x2 grid (linear, zeros; input
  and grid require grad).

numba's compiler events (``numba.core.event``) are recorded while each step runs:
every ``numba:compile`` of a dispatcher (nested: compiling a caller types, and so
compiles, its callees), the ``numba:run_pass`` of each compiler pass inside it and the
``numba:llvm_lock`` sections (the time spent in LLVM: IR parsing, optimisation and
code generation). A step's time is split into self times: each function's (time in
its own compilation, less its callees'), each pass's, and the time outside any
compilation (imports, the op itself). A warm run (the same calls in another fresh
process, over the cache the first one filled) gives each first call's time once
every kernel is on disk, and how many compiled functions each loaded.

    python bench/compile_time.py [--top 15] [--no-warm] [--json FILE]

numba compiles on the calling thread, so the times are that thread's CPU seconds
(``time.thread_time``): on a loaded machine the wall seconds beside them are not to
be trusted. numba itself is imported before the first step (for the listener): its
import time, which a user's first call pays, is reported on its own.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time
w0, c0 = time.perf_counter(), time.process_time()
import torch
t_torch = time.perf_counter() - w0
w1 = time.perf_counter()
import numba_ops.torch as nt
t_nt = time.perf_counter() - w1
w2 = time.perf_counter()
from numba.core import event
t_numba = time.perf_counter() - w2

clock = time.thread_time  # compiling runs on the calling thread: its CPU time, whatever the load

class Recorder(event.Listener):
    # one stack of open frames, [kind, key, start, nested compiles, nested frames, llvm];
    # a function's self time is its compilation less its callees' (compiled while typing
    # it), a pass's its time less the compilations inside it; LLVM time goes to the
    # innermost function
    def __init__(self):
        self.stack, self.funcs, self.passes = [], {}, {}

    def on_start(self, ev):
        now = clock()
        if ev.kind == "numba:llvm_lock":
            self.llvm_start = now
        elif ev.kind == "numba:compile":
            f = ev.data["dispatcher"].py_func
            self.stack.append(["c", (f.__module__, f.__qualname__, str(ev.data["args"])), now, 0.0, 0.0, 0.0])
        else:
            self.stack.append(["p", ev.data["name"].split(" [")[0], now, 0.0, 0.0, 0.0])

    def on_end(self, ev):
        now = clock()
        if ev.kind == "numba:llvm_lock":
            if self.stack:
                self.stack[-1][5] += now - self.llvm_start
            return
        kind, key, start, ncomp, nany, llvm = self.stack.pop()
        dt = now - start
        parent = self.stack[-1] if self.stack else None
        if kind == "c":
            top = not any(f[0] == "c" for f in self.stack)
            row = self.funcs.setdefault(key, [0, 0.0, 0.0, 0.0, top])
            row[0] += 1
            row[1] += dt
            row[2] += dt - ncomp
            row[3] += llvm
            if parent:
                parent[3] += dt
                parent[4] += dt
        else:
            self.passes[key] = self.passes.get(key, 0.0) + dt - nany
            if parent:
                parent[3] += ncomp
                parent[4] += dt
                parent[5] += llvm

rec = Recorder()
for kind in ("numba:compile", "numba:run_pass", "numba:llvm_lock"):
    event.register(kind, rec)

def hits():
    import numba.core.dispatcher as nd
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("numba_ops"):
            for v in vars(mod).values():
                if isinstance(v, nd.Dispatcher):
                    n += sum(v.stats.cache_hits.values())
    return n

torch.manual_seed(0)
layer = nt.DeformConv2d(16, 16, 3, padding=1)
x = torch.randn(1, 16, 24, 24, requires_grad=True)
off = (torch.randn(1, 18, 24, 24) * 2).requires_grad_()
mask = torch.rand(1, 9, 24, 24, requires_grad=True)
xg = torch.randn(1, 16, 24, 24, requires_grad=True)
grid = (torch.rand(1, 24, 24, 2) * 2.2 - 1.1).requires_grad_()
held = {}
STEPS = [
    ("deform_conv2d forward", lambda: held.__setitem__("y", layer(x, off, mask))),
    ("deform_conv2d backward", lambda: held.pop("y").sum().backward()),
    ("grid_sample forward", lambda: held.__setitem__("y", nt.grid_sample(xg, grid))),
    ("grid_sample backward", lambda: held.pop("y").sum().backward()),
]
out = {"import_torch_s": t_torch, "import_numba_ops_torch_s": t_nt, "import_numba_s": t_numba, "steps": []}
for name, fn in STEPS:
    rec.funcs, rec.passes = {}, {}
    h0, m0 = hits(), set(sys.modules)
    w, c, t = time.perf_counter(), time.process_time(), clock()
    fn()
    wall, cpu, thread = time.perf_counter() - w, time.process_time() - c, clock() - t
    funcs = [[*k, *v] for k, v in rec.funcs.items()]
    out["steps"].append({"name": name, "wall_s": wall, "cpu_s": cpu, "thread_s": thread, "cache_loads": hits() - h0,
                         "imported": sorted(set(sys.modules) - m0), "funcs": funcs, "passes": rec.passes})
print("@@" + json.dumps(out))
"""

#: numba's compiler passes (``numba:run_pass`` names), as the table groups them
PASS_GROUPS = (
    ("type inference", ("nopython_type_inference",)),
    ("parfor passes", ("parfor_pass", "parfor_fusion_pass", "parfor_prelowering_pass", "pre_parfor_pass")),
    ("lowering and LLVM", ("native_lowering", "native_parfor_lowering", "nopython_backend")),
)


def group_of(pass_name):
    for group, names in PASS_GROUPS:
        if pass_name in names:
            return group
    return "bytecode/IR passes"


def run_child(cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    p = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, cwd=root)
    if p.returncode:
        raise RuntimeError(p.stderr[-4000:])
    return json.loads(p.stdout.split("@@")[-1])


def short(module, qualname):
    """A function's name in the table: numba_ops' without the package, numba's own marked."""
    name = f"{module}.{qualname}"
    if name.startswith("numba_ops.kernels."):
        return name[len("numba_ops.kernels."):]
    if name.startswith("numba."):
        return "(numba) " + name.split(".")[-3] + "." + qualname.split(".")[0]
    return name


def by_function(funcs):
    """The step's records summed per function (its signatures together):
    ``[name, signatures, compilations, inclusive s, self s, llvm s]``, by self time."""
    rows = {}
    for module, qualname, sig, n, incl, own, llvm, top in funcs:
        row = rows.setdefault(short(module, qualname), [short(module, qualname), set(), 0, 0.0, 0.0, 0.0])
        row[1].add(sig)
        row[2] += n
        row[3] += incl
        row[4] += own
        row[5] += llvm
    return sorted(([r[0], len(r[1]), *r[2:]] for r in rows.values()), key=lambda r: -r[4])


def packages(modules):
    """The packages among newly imported ``modules`` worth naming (numba_ops' own by module)."""
    if not modules:
        return "nothing"
    top = sorted({m.split(".")[0] for m in modules if not m.startswith(("numba_ops", "torch", "_"))}
                 - set(sys.stdlib_module_names) | {m for m in modules if m == "torch._dynamo"})
    own = [m for m in modules if m.startswith("numba_ops")]
    return f"{len(modules)} modules ({len(own)} of numba_ops)" + (": " + ", ".join(top) if top else "")


def report(cold, warm, top):
    print(f"import torch {cold['import_torch_s']:.2f} s; then import numba_ops.torch "
          f"{cold['import_numba_ops_torch_s']:.2f} s; then numba (unless it was imported already) "
          f"{cold['import_numba_s']:.2f} s (wall)")
    total_w = sum(s["wall_s"] for s in cold["steps"])
    total_c = sum(s["thread_s"] for s in cold["steps"])
    print(f"first calls, empty cache: {total_w:.1f} s wall, {total_c:.1f} s CPU in all "
          "(CPU: the calling thread's, where numba compiles)")
    for step in cold["steps"]:
        funcs = step["funcs"]
        compiling = sum(f[4] for f in funcs if f[7])
        groups = {}
        for name, t in step["passes"].items():
            groups[group_of(name)] = groups.get(group_of(name), 0.0) + t
        rows = by_function(funcs)
        print(f"\n== {step['name']}: {step['wall_s']:.2f} s wall, {step['thread_s']:.2f} s CPU: compiling "
              f"{compiling:.2f} s ({len(rows)} functions, {sum(f[3] for f in funcs)} compilations), "
              f"the rest {step['thread_s'] - compiling:.2f} s")
        if not funcs:
            continue
        print("   self time by pass: " + ", ".join(
            f"{g} {t:.2f}" for g, t in sorted(groups.items(), key=lambda i: -i[1]))
            + f"; of all self time in LLVM {sum(f[6] for f in funcs):.2f}")
        print(f"   {'self s':>7s} {'llvm s':>7s} {'incl s':>7s} {'sigs':>5s}  function")
        for name, nsig, n, incl, own, llvm in rows[:top]:
            print(f"   {own:7.2f} {llvm:7.2f} {incl:7.2f} {nsig:5d}  {name}")
        rest = rows[top:]
        if rest:
            print(f"   {sum(r[4] for r in rest):7.2f} {sum(r[5] for r in rest):7.2f} {'':7s} "
                  f"{sum(r[1] for r in rest):5d}  ({len(rest)} more functions)")
    if warm:
        print("\nwarm cache (a fresh process over the filled cache):")
        for step in warm["steps"]:
            print(f"   {step['name']:24s} {step['wall_s']:6.3f} s wall, {step['thread_s']:6.3f} s CPU, "
                  f"{step['cache_loads']} functions loaded, {sum(f[3] for f in step['funcs'])} compiled; "
                  f"imported {packages(step['imported'])}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=15, help="functions listed per step (by self time)")
    ap.add_argument("--no-warm", action="store_true", help="skip the warm-cache run")
    ap.add_argument("--json", help="also write both runs' records here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        cold = run_child(cache)
        warm = None if args.no_warm else run_child(cache)
    report(cold, warm, args.top)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cold": cold, "warm": warm}, f)


if __name__ == "__main__":
    main()
