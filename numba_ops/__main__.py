"""``python -m numba_ops``: the same as the ``numba-ops`` command (see numba_ops/cli.py)."""
import sys

from .cli import main

sys.exit(main())
