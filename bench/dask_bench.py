"""numba_ops.dask throughput against one call.

A 16-image batch of the shared case ``dc_r50_c64_56`` (numba_ops/benchmark/cases.py: 64 -> 64
channels, 56 x 56, 3 x 3, mask) computed

- as one call of ``numba_ops.deform_conv`` (numba's pool on every core),
- by ``numba_ops.dask.deform_conv`` on the threaded scheduler (``--chunk`` images a
  task), "compute" gathering the blocks into a new array (one more copy of the
  result than the one call makes), "store" writing each block into a preallocated
  array as its task ends (``da.store``, as results written to a file or a buffer),
- on a ``LocalCluster`` of 2 worker processes x 1 thread (inputs persisted on the
  workers first; "persist" leaves the result there, "compute" also gathers it to
  the client), each worker's numba pool at its share of the cores,

in rounds that alternate the three (so load from other processes hits all alike),
and prints the median time of each, its throughput relative to the one call, and
the per-task overhead of each scheduler measured on a graph of no-op tasks (what
decides how small blocks can be, and so how far a batch scales on more machines).

    python bench/dask_bench.py [--images 16] [--rounds 7] [--chunk 1] [--json out.json]
"""
import argparse
import json
import os
import statistics
import time
import uuid

import numpy as np


def _median_time(fn, rounds):
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _noop(b):
    return b


def _task_threads():
    import numba

    import numba_ops.dask as nd
    nd._share_threads(1)
    return numba.get_num_threads()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="dc_r50_c64_56")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=1, help="images per dask block")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)

    import dask
    import dask.array as da
    import numba
    from distributed import Client, LocalCluster, wait

    import numba_ops
    import numba_ops.dask as nd
    from numba_ops.benchmark import cases as _cases

    (X, W, off, B, mask), attrs, flops = _cases.deform_inputs(a.case)
    rep = lambda t: np.ascontiguousarray(np.concatenate([t] * a.images))  # noqa: E731
    X, off, mask = rep(X), rep(off), rep(mask)
    flops *= a.images
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()

    def one_call():
        return numba_ops.deform_conv(X, W, off, B, mask, **attrs)

    def lazy(x, o, m, w=W, b=B):
        return nd.deform_conv(x, w, o, b, m, **attrs)

    by_n = lambda t: da.from_array(t, chunks=(a.chunk,) + t.shape[1:])  # noqa: E731
    xs, offs, masks = by_n(X), by_n(off), by_n(mask)
    threaded = lambda: lazy(xs, offs, masks).compute(scheduler="threads")  # noqa: E731
    stored = np.empty_like(one_call())

    def threaded_store():
        da.store(lazy(xs, offs, masks), stored, lock=False, scheduler="threads")
        return stored
    want = one_call()
    ntasks = len(xs.chunks[0])

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:  # the default client too (wait), threaded runs name their scheduler
        # the data lives on the workers (as data loaded there would); w and b too, so that
        # a graph sent to the scheduler holds only keys
        xc, oc, mc, wc, bc = client.persist([xs, offs, masks, da.from_array(W, chunks=-1),
                                             da.from_array(B, chunks=-1)])
        wait([xc, oc, mc, wc, bc])

        # every round's graph has the same keys (dask's names are deterministic): each run
        # cancels its result, so that the next one computes instead of finding it
        def cluster_persist():
            y = client.persist(lazy(xc, oc, mc, wc, bc))
            wait(y)
            client.cancel(y)

        def cluster_compute():
            f = client.compute(lazy(xc, oc, mc, wc, bc))
            y = f.result()
            client.cancel(f)
            return y

        # warm-up: JIT (or the cache) in every process, and a check of the results
        np.testing.assert_allclose(threaded(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        np.testing.assert_allclose(cluster_compute(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        cluster_persist()
        np.testing.assert_allclose(threaded_store(), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        runs = {"one call": one_call, "threaded": threaded, "threaded store": threaded_store,
                "cluster persist": cluster_persist,
                "cluster compute": cluster_compute}
        times = {k: [] for k in runs}
        cpu = {k: [] for k in runs}
        for _ in range(a.rounds):
            for k, fn in runs.items():
                # libgomp's threads spin ~0.1 s after a parallel call (numba_ops/kernels/cpu/_runtime.py):
                # let them stop, so that no run pays for the previous one's spin
                time.sleep(0.3)
                w0 = client.run(time.process_time) if k.startswith("cluster") else {}
                c0 = time.process_time()
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
                c1 = time.process_time()
                w1 = client.run(time.process_time) if w0 else {}
                cpu[k].append(c1 - c0 + sum(w1[w] - w0[w] for w in w0))

        # per-task overhead: a graph of `n` no-op tasks on one-element blocks
        n = 400
        tiny = da.zeros(n, chunks=1)
        tiny_c = client.persist(tiny)
        wait(tiny_c)
        overhead = {
            "threaded": _median_time(lambda: tiny.map_blocks(_noop).compute(scheduler="threads"), 5) / n,
            "cluster": _median_time(lambda: wait(client.persist(tiny_c.map_blocks(_noop))), 5) / n,
        }
        # per-graph overhead: a graph of `ntasks` no-op tasks, as many as the batch's
        few = client.persist(da.zeros(ntasks, chunks=1))
        wait(few)

        def cluster_graph():  # a new name each time: the scheduler has no result to find
            wait(client.persist(few.map_blocks(_noop, name=f"noop-{uuid.uuid4().hex}")))

        per_graph = {
            "threaded": _median_time(lambda: da.zeros(ntasks, chunks=1).map_blocks(_noop).compute(
                scheduler="threads"), 21),
            "cluster": _median_time(cluster_graph, 21),
        }
        # numba's threads as a task sees them (each task sets its worker's share)
        worker_threads = {w: client.submit(_task_threads, pure=False, workers=[w]).result()
                          for w in client.scheduler_info()["workers"]}
        # the workers' background CPU (heartbeats, system monitor) per second of wall time, idle
        w0, t0 = client.run(time.process_time), time.perf_counter()
        time.sleep(2.0)
        w1, t1 = client.run(time.process_time), time.perf_counter()
        idle_rate = sum(w1[w] - w0[w] for w in w0) / (t1 - t0)

    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["one call"]
    print(f"{a.case} x {a.images} images, {ntasks} tasks of {a.chunk} image(s); {cores} cores, "
          f"numba threads: one call {numba.get_num_threads()}, "
          f"in the cluster's tasks {sorted(worker_threads.values())}")
    cmed = {k: statistics.median(v) for k, v in cpu.items()}
    print(f"{'run':<18}{'median s':>10}{'GFLOP/s':>10}{'vs one call':>13}{'CPU s':>9}{'CPU vs one call':>17}")
    for k, t in med.items():
        print(f"{k:<18}{t:>10.4f}{flops / t / 1e9:>10.1f}{base / t:>12.2f}x{cmed[k]:>9.3f}"
              f"{cmed['one call'] / cmed[k]:>16.2f}x")
    print("(CPU s: CPU time of the client process (the LocalCluster's scheduler runs there too) and, for the "
          "cluster, of both workers; its ratio is the throughput ratio a dedicated machine would show where "
          "every run keeps the cores busy)")
    print(f"workers' idle background: {idle_rate * 1e3:.1f} ms CPU per s of wall time (both together); "
          "without it, cluster persist: CPU "
          f"{cmed['cluster persist'] - idle_rate * med['cluster persist']:.3f} s, "
          f"{cmed['one call'] / (cmed['cluster persist'] - idle_rate * med['cluster persist']):.2f}x the one call's")
    print(f"per-task overhead (no-op tasks): threaded {overhead['threaded'] * 1e6:.0f} us, "
          f"LocalCluster {overhead['cluster'] * 1e6:.0f} us; one image of this case: {base / a.images * 1e3:.1f} ms")
    print(f"per-graph overhead ({ntasks} no-op tasks, wall): threaded {per_graph['threaded'] * 1e3:.1f} ms, "
          f"LocalCluster persist {per_graph['cluster'] * 1e3:.1f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"case": a.case, "images": a.images, "chunk": a.chunk, "cores": cores, "times": times,
                       "per_graph": per_graph,
                       "median": med, "cpu": cpu, "cpu_median": cmed, "idle_cpu_per_s": idle_rate, "ratio": {k: base / t for k, t in med.items()},
                       "task_overhead_s": overhead, "dask": dask.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
