"""DeformConv on the CPU: what a call's geometry decides before a kernel runs (the
launch policy), kept per geometry, and the workspaces reused between calls.

- ``Geometry`` (per spatial axis) and ``Plan`` (the tiling and the call's options):
  named fields, packed into one int64 vector per call (``pack``) that the kernels'
  entries unpack first (``unpack_geometry``, ``unpack_plan``): every argument costs
  time in numba's dispatcher on tiny calls (an empty entry taking the 6 arrays and
  the vector: 1.1 us a call; the same fields as two NamedTuples: 4.8 us, as two plain
  tuples 2.2-3.4 us).
- ``plan_sizes``: tile length, images per chunk and the parallel split;
  ``reduction_split``: how the channel split's GEMMs share the work.
- ``State``: everything ``launch`` derives from a geometry; ``state`` keeps them.
- ``workspace``: the parallel run's scratch, kept between calls.

The size helpers (``padded_extent``, ``tile_parts``, ``ws_sizes``) are jitted for the
kernels and run as Python here (``ws_sizes_host``), so sizing compiles nothing.
"""
from typing import NamedTuple

import numpy as np
from numba import njit

from .._dtypes import compute, storage
from . import _runtime

#: the scratch budget of one call: padded images plus every thread's tile buffers.
SCRATCH_BYTES = 192 << 20
#: target bytes of one tile's column buffer (about an L2 cache), and the fewest positions.
TILE_BYTES = 512 << 10
TILE_MIN = 256
#: calls with at most this many (sample, output channel, corner) triples take the direct path.
DIRECT_MAX = 1024
#: the parallel run's split: None chooses from the shape (``plan_sizes``), True forces the
#: channel split, False the position split (tests, benchmarks; states made before keep theirs)
SPLIT = None
#: the channel split's GEMM shares: None chooses (``reduction_split``), True forces shares of
#: the reduction, False of the output channels (tests)
KSPLIT = None
#: the 2-D/3-D fast plans compute sites and positions in 32 bits: sizes, sites and the
#: positions' integer parts must stay under this (``border_corner``'s int32 bound)
I32 = 1 << 29


class Geometry(NamedTuple):
    """A call's spatial geometry, one int64 array of ``nd`` per field (axes outermost
    first). ``begin`` has a region's origin folded in (see ``geometry``); ``pstr``:
    the site strides of a padded image (each axis bordered by one zero site a side)."""
    sizes: np.ndarray
    kernel: np.ndarray
    strides: np.ndarray
    begin: np.ndarray
    dilations: np.ndarray
    out: np.ndarray
    pstr: np.ndarray


class Plan(NamedTuple):
    """A call's tiling and options (int64 scalars): channels ``C``, kernel points ``K``,
    ``group``, offset groups ``og``; tile length ``T``, images per chunk ``nb``, threads
    ``nth``; ``fast`` the 32-bit plans' rank (2, 3) or 0; ``sites`` of a padded image
    (its zero tail's first site); ``has_mask``, ``has_b`` (0/1); ``split``: 0 by
    positions, 1 by output channels, 2 by the reduction (both after a shared fill)."""
    C: int
    K: int
    group: int
    og: int
    T: int
    nb: int
    nth: int
    fast: int
    sites: int
    has_mask: int
    has_b: int
    split: int


def pack(geo, plan):
    """``geo`` and ``plan`` as the int64 vector the kernels' entries take: nd, the
    geometry's fields in order, the plan's in order (``unpack_geometry`` and
    ``unpack_plan`` read it back)."""
    nd = len(geo.sizes)
    return np.array([nd] + [int(v) for f in geo for v in f] + [int(v) for v in plan], dtype=np.int64)


@njit(cache=True, inline="always")
def unpack_geometry(meta):
    """The ``Geometry`` of a vector made by ``pack`` (its fields: views of ``meta``).
    (Apart from ``unpack_plan``: numba's array analysis in a parallel entry fails on a
    tuple that holds a NamedTuple, returned by an inlined function and unpacked.)"""
    nd = meta[0]
    a = meta[1:1 + 7 * nd]
    return Geometry(a[:nd], a[nd:2 * nd], a[2 * nd:3 * nd], a[3 * nd:4 * nd], a[4 * nd:5 * nd],
                    a[5 * nd:6 * nd], a[6 * nd:])


@njit(cache=True, inline="always")
def unpack_plan(meta):
    """The ``Plan`` of a vector made by ``pack``."""
    s = meta[1 + 7 * meta[0]:]
    return Plan(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10], s[11])


def geometry(x3shape, p, origin=None):
    """The ``Geometry`` of a call with params ``p`` on input spatial shape ``x3shape``.

    ``origin`` (a region's first output index per axis, see ``launch``) is folded into
    ``begin``: output ``o`` of the region is output ``origin + o`` of the whole, whose
    position base ``(origin + o) * stride - begin`` is ``o * stride - (begin - origin * stride)``."""
    nd = p.nd
    begin = p.pads_begin if origin is None else [pb - o * s for pb, o, s in zip(p.pads_begin, origin, p.strides)]
    pstr = np.ones(nd, np.int64)  # padded site strides
    for ax in range(nd - 2, -1, -1):
        pstr[ax] = pstr[ax + 1] * (x3shape[ax + 1] + 2)
    return Geometry(*(np.array(v, dtype=np.int64).reshape(nd) for v in (
        x3shape, p.kernel_shape, p.strides, begin, p.dilations, p.out_spatial)), pstr)


# --- sizes: jitted for the kernels, run as Python for the launcher ----------------------------

@njit(cache=True, inline="always")
def padded_extent(geo):
    """(rows, sites, tail) of a padded image: its rows (bordered axes but the last),
    its sites, and the zero tail after them (at least as long as the corner offsets)."""
    nd = geo.sizes.shape[0]
    rows = 1
    sites = 1
    tail = 1
    for ax in range(nd):
        sites *= geo.sizes[ax] + 2
        tail += geo.pstr[ax]
        if ax < nd - 1:
            rows *= geo.sizes[ax] + 2
    return rows, sites, tail


@njit(cache=True, inline="always")
def tile_parts(d, nd, ocg):
    """Elements of one thread's tile buffers: columns, GEMM tile (and the 16-position
    block its write-out transposes through), plan weights, plan masks (compute type)
    and plan indices (int64)."""
    plans = d.og * d.K * d.T
    return max(1, d.T * d.K * d.C), ocg * (d.T + 16), plans << nd, plans, plans


@njit(cache=True, inline="always")
def ws_sizes(oC, geo, d):
    """Workspace elements: (reordered weights, padded images, one thread's tile
    buffers) in the compute type, and one thread's plan indices in int64."""
    ocg = oC // d.group
    _, sites, tail = padded_extent(geo)
    ncols, nout, npw, npm, nidx = tile_parts(d, geo.sizes.shape[0], ocg)
    return max(1, oC * d.K * (d.C // d.group)), d.nb * max(1, (sites + tail) * d.C), \
        ncols + nout + npw + npm, nidx


def ws_sizes_host(oC, geo, d):
    """``ws_sizes`` run as Python, for the launcher: sizes need no compile."""
    ocg = oC // d.group
    _, sites, tail = padded_extent.py_func(geo)
    ncols, nout, npw, npm, nidx = tile_parts.py_func(d, geo.sizes.shape[0], ocg)
    return max(1, oC * d.K * (d.C // d.group)), d.nb * max(1, (sites + tail) * d.C), \
        ncols + nout + npw + npm, nidx


# --- the launch policy -------------------------------------------------------------------------

def plan_sizes(N, C, K, oC, P, group, og, nd, S, item, nth, split=None, native=False):
    """(tile length T, images per chunk nb, channel split) for ``S`` sites per padded image.

    Tiles hold about ``TILE_BYTES`` of columns (an L2 cache) but at least
    ``TILE_MIN`` positions, as every tile's GEMM re-packs the weights; when the
    L2 target is under half that, the columns live in L3 anyway and tiles get
    ``2 * TILE_MIN``. Tiles never take more than a quarter of
    ``SCRATCH_BYTES`` over all threads. The padded images of a chunk take the
    rest of the budget (at least one image).

    A parallel run splits the work one of two ways. The position split gives each
    thread whole tiles (a multiple of ``nth`` tiles in all, so that no thread idles
    at the end); each tile's GEMM packs all the weights. The channel split fills
    each tile's columns once (the threads share its positions), then gives each
    thread a share of the output channels, so that each tile's weights are packed
    once in all and each GEMM gets the whole tile. Where positions are few beside
    the weights (deep channels at small spatial sizes: a handful of positions per
    thread, every thread packing megabytes of weights for them) the channel split
    wins. The choice counts the elements each thread's GEMMs pack (weights and
    columns), the work that does not shrink with more threads: the position split
    packs (weights + T columns) per tile, the channel split (weights / nth + T
    columns) per tile; with ``native`` weights (float32/float64: the channel split
    reads them where they lie) the position split also reorders them once per call
    (weights / nth). ``split`` (True/False) forces one way (tests, benchmarks).

    At one thread, True means the same weights-in-place order on the caller's thread
    (``_serial``), chosen for native weights where the column rows (N * P) are fewer
    than the weight rows (oC): each tile's columns are turned into w's order instead
    of all of w into the columns' on every call."""
    kc_all = max(1, K * C)
    per_pos = (kc_all + oC // group) * item + og * K * (((1 << nd) + 1) * item + 8)
    T = TILE_BYTES // (kc_all * item)
    # columns far too wide for a cache-sized tile live in L3 anyway: fewer, bigger GEMMs win
    T = 2 * TILE_MIN if 2 * T < TILE_MIN else max(T, TILE_MIN)
    T = max(1, min(P, T, (SCRATCH_BYTES // 4 // nth) // per_pos))
    osplit = False
    if nth > 1:
        wts = oC * kc_all // max(1, group)
        ntile = -(-P // T)
        To = -(-P // ntile)  # the channel split's tiles: as even as T allows
        while (N * ntile) % nth and ntile < P:
            ntile += 1
        Tp = -(-P // ntile)
        cost_p = -(-N * ntile // nth) * (wts + Tp * kc_all) + (wts // nth if native else 0)
        cost_o = N * -(-P // To) * (wts // nth + To * kc_all)
        osplit = cost_o < cost_p if split is None else bool(split)
        T = To if osplit else Tp
    elif native and split is not False:
        # one thread (small calls, Dask tasks): float32/float64 weights read where they lie
        # (the columns turned into w's order: N * P column rows) rather than reordered
        # (oC rows) where the positions are fewer than the weights' rows
        osplit = N * P * group < oC if split is None else True
    img = max(1, S * C * item)
    budget = SCRATCH_BYTES - nth * (T * per_pos + 16 * (oC // group) * item) - oC * kc_all * item // max(1, group)
    nb = max(1, min(N, budget // img))
    return T, nb, osplit


def reduction_split(oC, group, nth):
    """Whether a channel split's GEMMs take shares of the reduction (each thread all the
    output channels for its share of w's columns, the partial sums added at the
    write-out) instead of shares of the output channels: with one group, where each
    thread's share of the channels would be under 256 rows. There OpenBLAS's GEMM of a
    thread's rows with a long reduction runs well under its rate (1 x 1024 x 7 x 7 ->
    256: 128 rows of 9216 each, against 256 of 4608 for the reduction split: the pair of
    threads' GEMMs 1.39 ms against 1.04, medians of 7 alternating rounds); at 256 rows and
    more the two measured the same. ``KSPLIT`` (True/False) forces it (tests)."""
    if group != 1:
        return False
    return oC < 256 * nth if KSPLIT is None else bool(KSPLIT)


class Tiling(NamedTuple):
    """A state's tiled run at one thread count: its ``Plan`` (without mask and bias), the
    packed vectors of the four (has_mask, has_b) variants (index ``has_mask * 2 + has_b``)
    and the parallel run's workspace elements (compute type, int64)."""
    plan: Plan
    metas: list
    nf: int
    ni: int


class State:
    """Everything ``launch`` derives from a call's geometry, kept per geometry (``state``).
    ``small``: the call runs on the caller's thread, by the ``direct`` loops or the tiled
    path; ``tilings``: a ``Tiling`` per thread count."""
    __slots__ = ("p", "origin", "xshape", "dtype", "oC", "yshape", "empty", "small", "direct", "nob",
                 "tilings", "ctype")

    def __init__(self, x, w, p, origin=None, nth=None):
        N, C = x.shape[0], x.shape[1]
        oC = w.shape[0]
        nd, K, group = p.nd, p.K, p.group
        P = 1
        for o in p.out_spatial:
            P *= o
        geo = geometry(x.shape[2:], p, origin)
        _, S, tail = padded_extent.py_func(geo)  # sites of a padded image, its zero tail
        self.p, self.origin, self.xshape, self.dtype, self.oC = p, origin, x.shape, x.dtype, oC
        self.yshape = (N, oC) + tuple(p.out_spatial)
        self.empty = N == 0 or oC == 0
        self.nob = np.empty(0, x.dtype)  # the kernels' B when there is none
        work = N * P * K * (C + oC * (C // group) // 4 + 4)
        dwork = N * P * K * C * max(1, oC // group) << nd  # samples x corners of the direct path
        # small work runs on the caller's thread: the direct loops when tiny, else the tiled path
        self.small = work < _runtime.PARALLEL_MIN_WORK
        self.direct = self.small and dwork <= DIRECT_MAX
        self.ctype = compute(x.dtype)
        item = self.ctype.itemsize
        # 2-D and 3-D plans compute sites and positions in 32 bits: only when they fit (a
        # region's positions are those of the whole output up to origin + out_spatial)
        ends = p.out_spatial if origin is None else [o0 + o for o0, o in zip(origin, p.out_spatial)]
        fits = (S < I32 and max(x.shape[2:], default=0) < I32 and max(p.pads_begin) < I32
                and max(ends) * max(p.strides) + max(p.kernel_shape) * max(p.dilations) < I32)
        fast = nd if (fits and nd in (2, 3)) else 0
        self.tilings = {}
        for nth in {1, _runtime.num_threads() if nth is None else nth}:
            T, nb, osplit = plan_sizes(N, C, K, oC, P, p.group, p.offset_group, nd, S + tail, item, nth,
                                       SPLIT, storage(x.dtype) == x.dtype)
            split = int(osplit) + int(osplit and nth > 1 and reduction_split(oC, p.group, nth))
            plan = Plan(C, K, p.group, p.offset_group, T, nb, nth, fast, S, 0, 0, split)
            metas = [pack(geo, plan._replace(has_mask=hm, has_b=hb)) for hm in (0, 1) for hb in (0, 1)]
            nw, nxp, ntile_ws, nint = ws_sizes_host(oC, geo, plan)
            # the channel split's shared columns after the threads' tile buffers
            self.tilings[nth] = Tiling(plan, metas, nw + nxp + nth * ntile_ws + (T * K * C if osplit else 0),
                                       nth * nint)

    def tiling(self, nth, x, w):
        """The ``Tiling`` at ``nth`` threads (made when the caller changed numba's thread count,
        or for another pool's threads)."""
        t = self.tilings.get(nth)
        if t is None:
            t = self.tilings[nth] = State(x, w, self.p, self.origin, nth).tilings[nth]
        return t


STATES = {}
STATES_MAX = 256


def state(x, w, p, origin=None):
    """The ``State`` of a call (kept by the identity of its params ``p`` and its origin)."""
    key = id(p) if origin is None else (id(p), origin)
    st = STATES.get(key)
    if (st is None or st.p is not p or st.origin != origin or st.xshape != x.shape or st.dtype is not x.dtype
            or st.oC != w.shape[0]):
        st = State(x, w, p, origin)  # the state holds p, so its id is not reused while it lives
        if len(STATES) >= STATES_MAX:
            STATES.clear()
        STATES[key] = st
    return st


_WORKSPACE = {}


def workspace(dtype, n):
    """A buffer of at least ``n`` elements kept between parallel calls (used under the
    pool lock only): fresh scratch pages fault once each, up to a fifth of a call."""
    a = _WORKSPACE.get(dtype)
    if a is None or a.size < n:
        _WORKSPACE[dtype] = None  # free the old one first
        a = _WORKSPACE[dtype] = np.empty(max(1, n), dtype)
    return a
