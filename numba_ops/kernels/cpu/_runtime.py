"""How CPU kernels go parallel: the threshold below which a kernel runs serially,
and the lock that keeps concurrent callers off the thread pool at the same time.

The threading layer is numba's workqueue unless the user set
NUMBA_THREADING_LAYER: it wakes in ~0.2 ms where the OpenMP layer can take ~8 ms
on small VMs. The workqueue must not be entered by two threads at once, so parallel launches from different Python
threads are serialised here; serial kernels run without the lock.
"""
import os
import threading

import numba

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = "workqueue"  # takes effect unless a pool already started

#: below this many output elements (times work per element) a kernel runs serially:
#: waking the pool costs more than the work.
PARALLEL_MIN_WORK = 1 << 16

#: held by every parallel launch (affine_grid via ``run``, deform_conv directly)
POOL_LOCK = threading.Lock()


def run(serial, parallel, work, *args):
    """``serial(*args)`` for small work, else ``parallel(*args, nchunks)`` under the pool
    lock, ``nchunks`` being a few pieces per thread for balance."""
    if work < PARALLEL_MIN_WORK:
        return serial(*args)
    with POOL_LOCK:
        return parallel(*args, 4 * numba.get_num_threads())

