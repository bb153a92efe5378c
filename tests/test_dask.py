"""numba_ops.dask against the documented contract ("Scale-out (Dask)"): the threaded scheduler and a
LocalCluster of processes give the one-call results; bad arguments fail while the
graph is built, with the one-call ops' own errors; weights enter the graph once;
the launchers' internal output origin computes any region of the one-call result."""
import itertools
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import numba_ops
from numba_ops._dispatch import launcher
from numba_ops.deform_conv import parse_params
from numba_ops.kernels.cpu import _deform_plan as dc_plan
from helpers import FLOATS, FULL, in_default, param
from reference import assert_api_close, deform_conv_ref, in_threads

da = pytest.importorskip("dask.array")
import numba_ops.dask as nd  # noqa: E402
from dask.array.core import normalize_chunks  # noqa: E402

DTYPES = FLOATS


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    # the workers import this numba_ops (an installed package, or this source tree)
    root = os.path.dirname(os.path.dirname(os.path.abspath(numba_ops.__file__)))
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    try:
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                      dashboard_address=None) as cluster, \
                distributed.Client(cluster, set_as_default=False) as c:
            yield c
    finally:
        os.environ["PYTHONPATH"] = path
        if not path:
            del os.environ["PYTHONPATH"]


@pytest.fixture(params=["threads", pytest.param("cluster", marks=FULL)])
def run(request):
    """``run(array)``: computed on the threaded scheduler (4 threads, so blocks run
    concurrently) or on the LocalCluster (with ``--full``; the default run computes
    each op there once, ``test_each_op_on_the_cluster``)."""
    if request.param == "threads":
        return lambda a: a.compute(scheduler="threads", num_workers=4)
    c = request.getfixturevalue("client")
    return lambda a: c.compute(a).result()


def dask_of(a, chunks):
    return None if a is None else da.from_array(a, chunks=chunks)


# --- affine_grid ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [(5, 2, 4, 6), (5, 1, 3, 4, 2)], ids=["2d", "3d"])
def test_affine_grid(size, dtype, run):
    rng = np.random.default_rng(1)
    nd_ = len(size) - 2
    theta = rng.standard_normal((5, nd_, nd_ + 1)).astype(dtype)
    # uneven N chunks, and chunks along the matrix axes that are joined
    g = nd.affine_grid(dask_of(theta, (2, 1, 2)), size, align_corners=1)
    want = numba_ops.affine_grid(theta, size, True)
    assert g.shape == want.shape and g.dtype == want.dtype
    assert g.chunks == ((2, 2, 1),) + tuple((s,) for s in want.shape[1:])
    assert isinstance(g._meta, np.ndarray) and g._meta.dtype == dtype
    got = run(g)
    assert got.dtype == dtype
    assert_api_close(got, want, dtype)


def test_affine_grid_empty():
    theta = da.ones((3, 2, 3), chunks=2)
    assert nd.affine_grid(theta, [0, 1, 4, 5]).compute().shape == (0, 4, 5, 2)
    assert nd.affine_grid(theta[:0], [0, 1, 4, 5]).compute().shape == (0, 4, 5, 2)
    assert nd.affine_grid(theta, [3, 1, 0, 5]).compute().shape == (3, 0, 5, 2)


# --- deform_conv ------------------------------------------------------------------------------

def make(rng, N=5, C=4, D=(6, 7), oC=4, k=(2, 3), pads=None, strides=None, dil=None, group=1, og=1,
         bias=True, mask=True):
    n = len(D)
    pads = list(pads or [0] * (2 * n))
    strides = list(strides or [1] * n)
    dil = list(dil or [1] * n)
    x = rng.standard_normal((N, C) + tuple(D))
    w = rng.standard_normal((oC, C // group) + tuple(k))
    att = dict(kernel_shape=list(k), pads=pads, strides=strides, dilations=dil, group=group, offset_group=og)
    p = parse_params(x, w, k, strides, pads, dil, group, og)
    K = p.K
    ins = dict(x=x, w=w, offset=1.5 * rng.standard_normal((N, og * K * n) + p.out_spatial),
               b=rng.standard_normal(oC) if bias else None,
               mask=rng.random((N, og * K) + p.out_spatial) if mask else None)
    return ins, att, p.out_spatial


def cast(ins, dtype):
    return {k: (None if v is None else v.astype(dtype)) for k, v in ins.items()}


def one_call(ins, att):
    return numba_ops.deform_conv(ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"], **att)


def lazy(ins, att, nchunks=(2, 2, 1), output_chunks=None, xc=None):
    """The dask call: x, offset, mask chunked along N (x also along C: joined), w, b NumPy."""
    N = ins["x"].shape[0]
    assert sum(nchunks) == N
    xc = xc or (nchunks, 1) + ins["x"].shape[2:]
    off, m = ins["offset"], ins["mask"]
    return nd.deform_conv(dask_of(ins["x"], xc), ins["w"], dask_of(off, (nchunks[::-1],) + off.shape[1:]),
                          ins["b"], dask_of(m, None if m is None else (1,) + m.shape[1:]),
                          output_chunks=output_chunks, **att)


CASES = [  # (case, output_chunks)
    (dict(D=(9,), k=(3,), pads=[1, 2], strides=[2]), None),
    (dict(D=(9,), k=(3,), pads=[1, 2], strides=[2], dil=[2], og=2), (2,)),
    (dict(), None),
    (dict(), (2, 3)),
    (dict(C=4, oC=6, D=(7, 6), k=(3, 2), pads=[1, 0, 2, 1], strides=[2, 1], dil=[1, 2], group=2, og=2), (3, 4)),
    (dict(C=6, oC=3, D=(5, 5), k=(2, 3), pads=[0, 2, 1, 0], strides=[1, 2], group=3, og=3, mask=False,
          bias=False), (None, 2)),
    (dict(C=2, oC=2, D=(4, 5, 3), k=(2, 2, 2), pads=[1, 0, 1, 0, 1, 1], strides=[1, 2, 1], dil=[2, 1, 1], og=2),
     (2, 2, (1, 3))),
    (dict(C=4, oC=4, D=(3, 4, 4), k=(1, 2, 2), group=2), None),
]


@pytest.mark.parametrize("case,output_chunks", CASES, ids=[f"{len(c.get('D', (0, 0)))}d-{i}-{o}"
                                                           for i, (c, o) in enumerate(CASES)])
def test_deform_conv(case, output_chunks, run):
    ins, att, outs = make(np.random.default_rng(7), **case)
    y = lazy(ins, att, output_chunks=output_chunks)
    want = one_call(ins, att)
    assert y.shape == want.shape and y.dtype == want.dtype and isinstance(y._meta, np.ndarray)
    spatial = nd._spatial_chunks(output_chunks, outs)
    assert y.chunks == ((2, 2, 1), (want.shape[1],)) + spatial
    got = run(y)
    assert_api_close(got, want, np.float64)
    # and the definition, independently of the one-call op
    a = {k: v for k, v in att.items() if k != "kernel_shape"}
    assert_api_close(got, deform_conv_ref(ins["x"], ins["w"], ins["offset"], ins["b"], ins["mask"], **a),
                     np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("output_chunks", [None, (2, 4)])
def test_deform_conv_dtypes(dtype, output_chunks, run):
    ins, att, _ = make(np.random.default_rng(3), pads=[1, 1, 0, 1])
    ins = cast(ins, dtype)
    y = lazy(ins, att, output_chunks=output_chunks)
    assert y.dtype == dtype
    got = run(y)
    assert got.dtype == dtype
    assert_api_close(got, one_call(ins, att), dtype)


def test_deform_conv_dask_weights_and_nonfinite():
    """w and b given as (multi-chunk) dask arrays are joined; NaN/huge offsets behave
    per block as in the one-call op; N = 0 gives an empty result."""
    ins, att, _ = make(np.random.default_rng(4), N=3)
    ins["offset"][1, 0, 0, 0] = np.nan
    ins["offset"][2, 3, 1, 1] = 1e30
    want = one_call(ins, att)
    y = nd.deform_conv(dask_of(ins["x"], 1), dask_of(ins["w"], 2), dask_of(ins["offset"], 2),
                       dask_of(ins["b"], 3), ins["mask"], output_chunks=(3, 3), **att)
    assert_api_close(y.compute(scheduler="threads"), want, np.float64)
    empty = {k: (None if v is None else v[:0]) if k in ("x", "offset", "mask") else v for k, v in ins.items()}
    e = lazy(empty, att, nchunks=(0,), xc=(0,) + ins["x"].shape[1:])
    assert e.compute().shape == (0,) + want.shape[1:]


# --- bad arguments fail while the graph is built, with the one-call op's errors -----------------

BAD = [
    dict(strides=[0, 1]),
    dict(pads=[1, 1]),
    dict(group=3),
    dict(offset_group=0),
    dict(kernel_shape=[3, 3]),
    dict(dilations=[1.5, 1]),
    dict(device="gpu"),
    dict(stream_typo=1),
    dict(offset=lambda i: i["offset"][:4]),
    dict(offset=lambda i: i["offset"][:, :, :3]),
    dict(mask=lambda i: i["mask"][:, :5]),
    dict(mask=lambda i: i["mask"][:3]),
    dict(b=lambda i: i["b"][:3]),
    dict(w=lambda i: i["w"].astype(np.float32)),
    dict(x=lambda i: i["x"].astype(np.int32)),
    dict(x=lambda i: i["x"][0]),
    dict(w=lambda i: i["w"][:, :, 0]),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: ",".join(b))
def test_deform_conv_bad_arguments(bad):
    ins, att, _ = make(np.random.default_rng(5))
    kw = dict(att)
    for k, v in bad.items():
        if callable(v):
            ins[k] = v(ins)
        else:
            kw[k] = v
    with pytest.raises((ValueError, TypeError)) as one:
        one_call(ins, kw)
    dk = {k: (None if v is None else da.from_array(v, chunks=2)) for k, v in ins.items()}
    with pytest.raises(one.type) as lazy_err:
        nd.deform_conv(dk["x"], dk["w"], dk["offset"], dk["b"], dk["mask"], **kw)
    assert str(lazy_err.value) == str(one.value)


@pytest.mark.parametrize("output_chunks", [(2,), (2, 0), (2, 2.5), (2, (3, 3)), "2", (True, 2)])
def test_output_chunks_bad(output_chunks):
    ins, att, outs = make(np.random.default_rng(5))
    with pytest.raises(ValueError, match=r"output_chunks"):
        lazy(ins, att, output_chunks=output_chunks)


@pytest.mark.parametrize("args", [
    dict(size=(4, 2, 4, 6)), dict(size=(5, 2, 4)), dict(size=(5, 2, 4, 6.5)), dict(size=(5, 2, -1, 6)),
    dict(size=(5, 2, 1, 4, 6)), dict(align_corners=2), dict(device="tpu"),
    dict(theta=lambda t: t.astype(np.int64)), dict(theta=lambda t: t[:, :1]),
])
def test_affine_grid_bad_arguments(args):
    theta = np.ones((5, 2, 3))
    kw = dict(size=(5, 2, 4, 6))
    for k, v in args.items():
        if k == "theta":
            theta = v(theta)
        else:
            kw[k] = v
    with pytest.raises((ValueError, TypeError)) as one:
        numba_ops.affine_grid(theta, **kw)
    with pytest.raises(one.type) as lazy_err:
        nd.affine_grid(da.from_array(theta, chunks=2), **kw)
    assert str(lazy_err.value) == str(one.value)


# --- the graph: one task per block, w and b once, x blocks never copied --------------------------

def test_graph_weights_enter_once():
    rng = np.random.default_rng(6)
    ins, att, outs = make(rng, N=4, C=8, oC=16, D=(8, 8), k=(3, 3), pads=[1, 1, 1, 1])
    by_image = {k: dask_of(ins[k], (1,) + ins[k].shape[1:]) for k in ("x", "offset", "mask")}
    x = by_image["x"]
    y = nd.deform_conv(x, ins["w"], by_image["offset"], ins["b"], by_image["mask"], output_chunks=(4, 4), **att)
    graph = dict(y.__dask_graph__())
    blocks = [k for k in graph if k[0] == y.name]
    assert len(blocks) == 4 * 2 * 2  # one task per output block
    # w and b: one key each, holding the array; every block task names those keys
    holders = {name: [k for k, v in graph.items() if _holds(v, ins[name])] for name in ("w", "b")}
    assert all(len(v) == 1 for v in holders.values()), holders
    for k in blocks:
        deps = _deps(graph[k])
        assert holders["w"][0] in deps and holders["b"][0] in deps
        # image i's x block is one key, named by its 4 spatial blocks: no task holds data
        assert (x.name, k[1], 0, 0, 0) in deps
        assert len(pickle.dumps(graph[k])) < 4096
    # the whole graph holds each input's data once (the rest: keys, slicing, functions)
    data = sum(a.nbytes for a in ins.values())
    assert sum(len(pickle.dumps(v)) for v in graph.values()) < 1.05 * data + 1024 * len(graph)
    assert y.compute().shape == (4, 16) + outs


def _holds(task, arr):
    v = getattr(task, "value", task)  # a dask DataNode, or the array itself
    return isinstance(v, np.ndarray) and v.shape == arr.shape and np.array_equal(v, arr)


def _deps(task):
    deps = getattr(task, "dependencies", None)
    if deps is not None:
        return set(deps)
    return {a for a in task[1:] if isinstance(a, tuple)}


# --- threads on distributed workers --------------------------------------------------------------

def _cases_inputs():
    from numba_ops.benchmark import cases as _cases
    return _cases.deform_inputs("dc_r50_c64_56", small=True)


def _threads_in_task():
    import numba
    nd._share_threads(1)
    return numba.get_num_threads()


def test_cluster_threads_share_the_cores(client):
    """Two one-thread workers on one machine: numba's pool in each task gets half the
    cores (at least 1), so the two workers together use the machine's cores."""
    import numba
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    want = max(1, min(numba.config.NUMBA_NUM_THREADS, cores // 2))
    workers = list(client.scheduler_info()["workers"])
    got = [client.submit(_threads_in_task, pure=False, workers=[w]).result() for w in workers]
    assert got == [want, want]


def test_each_op_on_the_cluster(client):
    """Each op's float32 graph computed by the LocalCluster's worker processes is the
    one-call result (with ``--full`` every case of this file runs there too)."""
    rng = np.random.default_rng(15)
    compute = lambda a: client.compute(a).result()  # noqa: E731
    theta = rng.standard_normal((5, 2, 3)).astype(np.float32)
    want = numba_ops.affine_grid(theta, (5, 2, 4, 6))
    assert_api_close(compute(nd.affine_grid(dask_of(theta, (2, 2, 3)), (5, 2, 4, 6))), want, np.float32)
    ins, att, _ = make(rng)
    ins = cast(ins, np.float32)
    assert_api_close(compute(lazy(ins, att, output_chunks=(2, 4))), one_call(ins, att), np.float32)
    x = _x(rng, (5, 3, 5, 6), np.float32)
    g = _grid(rng, 5, (4, 7), np.float32)
    want = numba_ops.grid_sample(x, g, mode="cubic", padding_mode="reflection")
    got = compute(nd.grid_sample(dask_of(x, (2, 2, 5, 6)), dask_of(g, (2, 3, 4, 2)), mode="cubic",
                                 padding_mode="reflection"))
    _assert_same(got, want)
    want = numba_ops.affine_warp(x, theta, (5, 3, 4, 9))
    _assert_same(compute(nd.affine_warp(dask_of(x, (2, 1, 5, 6)), dask_of(theta, (3, 2, 3)), (5, 3, 4, 9))), want)


def test_in_process_workers_share_one_pool():
    """Workers in one process (processes=False) share numba's one pool: together they
    get the machine's cores."""
    import numba
    distributed = pytest.importorskip("distributed")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                                  dashboard_address=None) as cluster, \
            distributed.Client(cluster, set_as_default=False) as c:
        workers = list(c.scheduler_info()["workers"])
        got = [c.submit(_threads_in_task, pure=False, workers=[w]).result() for w in workers]
    assert got == [max(1, min(numba.config.NUMBA_NUM_THREADS, cores))] * 2


def test_synchronous_scheduler_leaves_threads_alone():
    """Tasks run on the calling thread: numba's setting there is the caller's."""
    import numba
    before = numba.get_num_threads()
    assert _threads_in_task() == before
    x = np.arange(2 * 2 * 8 * 8, dtype=np.float32).reshape(2, 2, 8, 8)
    theta = np.tile(np.array([[1, 0.1, 0], [0, 1, 0]], np.float32), (2, 1, 1))
    nd.affine_warp(da.from_array(x, chunks=1), theta).compute(scheduler="synchronous")
    assert numba.get_num_threads() == before


def _threads_of_tasks(blocks, workers):
    """numba's thread count inside the tasks of a ``blocks``-task graph on the threaded
    scheduler with ``workers`` threads."""
    import dask
    import numba
    seen = []

    def probe(b):
        seen.append(numba.get_num_threads())
        return np.array([b])

    graph = nd._graph("probe-threads", {("probe-threads", i): (probe, i) for i in range(blocks)}, [],
                      ((1,) * blocks,), np.empty(0, np.int64))
    with dask.config.set(num_workers=workers):
        graph.compute(scheduler="threads")
    return seen


@pytest.mark.parametrize("blocks,workers", [(4, 2), (1, 2), (3, 8)])
def test_threaded_scheduler_tasks_share_the_cores(blocks, workers):
    """On the threaded scheduler the tasks that can run at once (the fewer of the
    graph's tasks and the scheduler's threads) split the cores between them, so that
    concurrent calls run side by side rather than queue for numba's one pool."""
    import numba
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    want = max(1, min(numba.config.NUMBA_NUM_THREADS, cores // min(blocks, workers)))
    assert _threads_of_tasks(blocks, workers) == [want] * blocks


def test_threaded_scheduler_one_thread_calls_run_concurrently():
    """Calls at one numba thread (a threaded-scheduler task's share on 2 cores) take
    neither the pool lock nor each other's BLAS setting: results equal one call."""
    import numba
    (x, w, off, b, m), attrs, _ = _cases_inputs()
    want = numba_ops.deform_conv(x, w, off, b, m, **attrs)

    def run(i):
        numba.set_num_threads(1)
        return numba_ops.deform_conv(x, w, off, b, m, **attrs)

    for g in in_threads(run, 4):
        np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


def test_import_numba_ops_does_not_import_dask():
    code = "import sys, numba_ops; assert 'dask' not in sys.modules and 'distributed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- device arrays: blocks on the GPU (numba's simulator in CI) --------------------------------

def test_device_blocks(device):
    """Blocks holding device arrays run on the GPU (Devices: device=None follows
    them); NumPy blocks run on the CPU unless device= says otherwise."""
    ins, att, outs = make(np.random.default_rng(8), N=3)
    ins = cast(ins, np.float32)
    want = one_call(ins, att)
    if device == "cuda":
        from numba import cuda
        # chunked along N only: dask joins chunks with NumPy's concatenate, which numba's
        # device arrays do not take (CuPy's do)
        to_dev = lambda a: None if a is None else dask_of(a, (1,) + a.shape[1:]).map_blocks(  # noqa: E731
            cuda.to_device, meta=a[:0])
        host = lambda y: y.map_blocks(lambda b: b.copy_to_host(), meta=want[:0])  # noqa: E731
    else:
        to_dev = lambda a: None if a is None else dask_of(a, 1)  # noqa: E731
        host = lambda y: y  # noqa: E731
    for oc in (None, (2, 3)):
        y = nd.deform_conv(to_dev(ins["x"]), ins["w"], to_dev(ins["offset"]), ins["b"], to_dev(ins["mask"]),
                           output_chunks=oc, **att)
        assert_api_close(host(y).compute(scheduler="sync"), want, np.float32)
    theta = np.random.default_rng(9).standard_normal((3, 2, 3)).astype(np.float32)
    g = nd.affine_grid(to_dev(theta), (3, 1, 4, 5))
    ghost = g if device == "cpu" else g.map_blocks(lambda b: b.copy_to_host(), meta=theta[:0, :0])
    assert_api_close(ghost.compute(scheduler="sync"), numba_ops.affine_grid(theta, (3, 1, 4, 5)), np.float32)


# --- the launchers' output origin: any region equals that region of the one-call result ---------

REGION_CASES = [
    ((1, 2, (9,), 2, (3,), [1, 2], [2], [1], 1, 1), (2,)),
    ((2, 4, (7, 8), 4, (2, 3), [1, 0, 2, 1], [2, 1], [1, 2], 2, 2), (2, 3)),
    ((1, 2, (4, 5, 6), 2, (2, 2, 2), [1, 0, 1, 0, 1, 1], [1, 2, 1], [2, 1, 1], 1, 2), (2, 2, 3)),
    ((1, 2, (4, 3, 3, 4), 2, (2, 1, 2, 2), [0, 1, 0, 0, 1, 0, 0, 1], [1, 1, 2, 1], [1] * 4, 1, 1), (2, 3, 1, 2)),
]


@pytest.mark.parametrize("device,path", [("cpu", "direct"), ("cpu", "tiled")]
                         + [("cuda", "kernel")] * ("cuda" in numba_ops.devices()))
@pytest.mark.parametrize("case,blk", REGION_CASES, ids=[f"{len(c[0][2])}d" for c in REGION_CASES])
def test_launch_origin(case, blk, device, path, monkeypatch):
    """Each CPU path (the direct loops, the tiled plans: 32-bit in 2-D/3-D, general
    otherwise) and the CUDA kernel."""
    if device == "cpu":
        monkeypatch.setattr(dc_plan, "DIRECT_MAX", 1 << 62 if path == "direct" else -1)
        monkeypatch.setattr(dc_plan, "STATES", {})
    N, C, D, oC, k, pads, strides, dil, group, og = case
    rng = np.random.default_rng(10)
    x = rng.standard_normal((N, C) + D)
    w = rng.standard_normal((oC, C // group) + k)
    p = parse_params(x, w, None, strides, pads, dil, group, og)
    off = 2 * rng.standard_normal((N, og * p.K * p.nd) + p.out_spatial)
    off.flat[::7] = 40.0  # far outside
    m = rng.random((N, og * p.K) + p.out_spatial)
    b = rng.standard_normal(oC)
    whole = numba_ops.deform_conv(x, w, off, b, m, strides=strides, pads=pads, dilations=dil, group=group,
                                  offset_group=og, device=device)
    run = launcher("deform_conv", device, x.dtype)
    for org in itertools.product(*(range(0, o, s) for o, s in zip(p.out_spatial, blk))):
        sl = (slice(None),) * 2 + tuple(slice(a, min(a + s, o)) for a, s, o in zip(org, blk, p.out_spatial))
        pb = p._replace(out_spatial=tuple(s.stop - s.start for s in sl[2:]))
        y = run(x, w, np.ascontiguousarray(off[sl]), b, np.ascontiguousarray(m[sl]), pb, origin=org)
        assert_api_close(y, whole[sl], np.float64)


# --- grid_sample and affine_warp ---------------------------------------------------------------

def _grid(rng, N, outs, dtype):
    return (1.2 * rng.uniform(-1, 1, (N,) + tuple(outs) + (len(outs),))).astype(dtype)


def _x(rng, shape, dtype):
    if np.dtype(dtype) == np.uint8:
        return rng.integers(0, 256, shape).astype(np.uint8)
    return rng.standard_normal(shape).astype(dtype)


def _assert_same(got, want):
    if want.dtype == np.uint8:
        np.testing.assert_array_equal(got, want)
    else:
        assert_api_close(got, want, want.dtype)


GRID_SAMPLE_CASES = [
    ((7,), (5,), (2,), dict(mode="cubic", padding_mode="reflection")),
    ((5, 6), (4, 7), (3, 4), dict(mode="linear", padding_mode="zeros", align_corners=True)),
    ((3, 4, 5), (2, 3, 4), (1, 3, 2), dict(mode="nearest", padding_mode="zeros")),
]


@pytest.mark.parametrize("spatial,outs,gchunks,kw,dtype", [
    param(in_default(len(case[0]), case[3]["mode"], case[3]["padding_mode"], dtype), *case, dtype,
          id=f"{len(case[0])}d-{dtype}")
    for case in GRID_SAMPLE_CASES for dtype in DTYPES + [np.dtype(np.uint8)]])
def test_grid_sample(spatial, outs, gchunks, kw, dtype, run):
    rng = np.random.default_rng(11)
    x = _x(rng, (5, 3) + spatial, dtype)
    g = _grid(rng, 5, outs, np.float32 if dtype == np.uint8 else dtype)
    want = numba_ops.grid_sample(x, g, **kw)
    # x chunked along N and C (joined), the grid along N and its output axes
    y = nd.grid_sample(dask_of(x, (2, 2) + spatial), dask_of(g, ((1, 3, 1),) + gchunks + (1,)), **kw)
    assert y.shape == want.shape and y.dtype == want.dtype and isinstance(y._meta, np.ndarray)
    assert y.chunks[:2] == ((2, 2, 1), (3,)) and y.chunks[2:] == normalize_chunks(gchunks, outs)
    _assert_same(run(y), want)


@pytest.mark.parametrize("shape,size,dtype", [
    param(in_default(len(shape) - 2, dtype=dtype), shape, size, dtype, id=f"{name}-{dtype}")
    for shape, size, name in [((5, 2, 6, 7), None, "2d-same"), ((5, 2, 6, 7), (5, 2, 4, 9), "2d"),
                              ((5, 2, 3, 4, 5), (5, 2, 4, 3, 2), "3d")]
    for dtype in DTYPES + [np.dtype(np.uint8)]])
def test_affine_warp(shape, size, dtype, run):
    rng = np.random.default_rng(12)
    r = len(shape) - 2
    x = _x(rng, shape, dtype)
    theta = (np.eye(r, r + 1) + 0.3 * rng.standard_normal((5, r, r + 1))).astype(
        np.float32 if dtype == np.uint8 else dtype)
    kw = dict(mode="linear", padding_mode="zeros", align_corners=False)
    want = numba_ops.affine_warp(x, theta, size, **kw)
    y = nd.affine_warp(dask_of(x, (2, 1) + shape[2:]), dask_of(theta, (3, 1, r + 1)), size, **kw)
    assert y.shape == want.shape and y.dtype == want.dtype
    assert y.chunks == ((2, 2, 1),) + tuple((s,) for s in want.shape[1:])
    _assert_same(run(y), want)


SAMPLING_BAD = [
    ("grid_sample", dict(mode="bicubic")),
    ("grid_sample", dict(padding_mode="wrap")),
    ("grid_sample", dict(align_corners=3)),
    ("grid_sample", dict(device="tpu")),
    ("grid_sample", dict(grid=lambda x, g: g[:3])),
    ("grid_sample", dict(grid=lambda x, g: g[..., :1])),
    ("grid_sample", dict(grid=lambda x, g: g.astype(np.float32))),
    ("grid_sample", dict(x=lambda x, g: x[:, :, :0])),
    ("grid_sample", dict(x=lambda x, g: x.astype(np.int16))),
    ("affine_warp", dict(size=(4, 2, 3, 3))),
    ("affine_warp", dict(size=(5, 3, 3, 3))),
    ("affine_warp", dict(size=(5, 2, 3))),
    ("affine_warp", dict(size=(5, 2, 3, 3.5))),
    ("affine_warp", dict(theta=lambda x, t: t[:, :, :2])),
    ("affine_warp", dict(theta=lambda x, t: t[:4])),
    ("affine_warp", dict(mode="area")),
]


@pytest.mark.parametrize("op,bad", SAMPLING_BAD, ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_sampling_bad_arguments(op, bad):
    rng = np.random.default_rng(13)
    x = rng.standard_normal((5, 2, 4, 5))
    other = _grid(rng, 5, (3, 3), np.float64) if op == "grid_sample" else np.ones((5, 2, 3))
    args, kw = [x, other], {}
    for k, v in bad.items():
        if k in ("x", "grid", "theta"):
            i = 0 if k == "x" else 1
            args[i] = v(*args)
        else:
            kw[k] = v
    with pytest.raises((ValueError, TypeError)) as one:
        getattr(numba_ops, op)(*args, **kw)
    with pytest.raises(one.type) as lazy_err:
        getattr(nd, op)(*(da.from_array(a, chunks=2) for a in args), **kw)
    assert str(lazy_err.value) == str(one.value)


def test_launch_origin_32bit_limit():
    """A region is planned in 32 bits only when the whole output's positions fit there
    (its end, origin + size, decides, not its size): a stride of 2**28 on a padded axis
    puts the second output's positions at 2**28 and more, past the 2**29 bound the 32-bit
    plans keep for the kernels' positions."""
    rng = np.random.default_rng(14)
    x = rng.standard_normal((1, 2, 4, 8))
    w = rng.standard_normal((2, 2, 2, 2))
    s = 1 << 28
    p = parse_params(x, w, None, [1, s], [0, 0, 0, s], None, 1, 1)
    assert p.out_spatial == (3, 2) and p.strides == (1, s)
    off = 0.7 * rng.standard_normal((1, 8, 3, 2))
    whole = numba_ops.deform_conv(x, w, off, strides=[1, s], pads=[0, 0, 0, s])
    fast = lambda st: st.tilings[1].plan.fast  # noqa: E731  (the 32-bit plans' rank, or 0)
    pb = p._replace(out_spatial=(1, 1))
    assert fast(dc_plan.State(x, w, pb, (0, 1))) == 0  # ends at output 2: 2 * 2**28
    q = parse_params(x, w, None, [1, 2], [0, 0, 0, 2], None, 1, 1)
    assert fast(dc_plan.State(x, w, q._replace(out_spatial=(1, 1)), (0, 1))) == 2
    run = launcher("deform_conv", "cpu", x.dtype)
    for h in range(3):
        y = run(x, w, np.ascontiguousarray(off[:, :, h:h + 1, 1:]), None, None, pb, origin=(h, 1))
        assert_api_close(y, whole[:, :, h:h + 1, 1:], np.float64)
