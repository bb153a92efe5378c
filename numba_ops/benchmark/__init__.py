"""The benchmark behind ``numba-ops bench`` (``numba_ops.cli`` parses and dispatches).

- ``harness``: the table: one worker process per implementation (numba_ops and
  the peers) plus one for the machine's limits, warm and cold timings, the
  figures, the table; saved runs (``--json``) and ``--compare`` with one;
- ``against``: ``--against REV``, the current tree against a git revision in a
  temporary worktree, rounds of fresh paired worker processes (``abworker.py``,
  a self-contained script, times both sides); the same rounds, one side, are a
  saved run's samples;
- ``protocol``: the line protocol of every worker process;
- ``stats``: the ratio of two versions with its confidence interval, and the verdict;
- ``machine``: the machine's metadata saved with each run, the BLAS and the
  ``OPENBLAS_CORETYPE`` warning;
- ``plot``: ``--plot FILE.png`` (matplotlib);
- ``cases``: the case table (bench cases, conformance cases) that drives every part;
- ``resources``: the CUDA kernels' registers, spills and occupancy, and the roofline
  of the bench cases (``numba-ops info --cuda``).
"""
