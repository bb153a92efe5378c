"""What the whole-model benchmark scripts share (``onnx_session.py``,
``registration_session.py``, ``torch_training_step.py``): OpenBLAS unpinned, a worker
process per side spoken to line by line in JSON, and the versions they print."""
import json
import os
import subprocess
import sys

#: the variables that pin NumPy's/SciPy's OpenBLAS to an older kernel on some machines
UNPIN = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def unpin():
    """Re-execute this script without ``UNPIN`` in its environment (call it before NumPy
    loads OpenBLAS): a user's machine has no such pin."""
    if any(k in os.environ for k in UNPIN):
        os.execve(sys.executable, [sys.executable] + sys.argv, {k: v for k, v in os.environ.items() if k not in UNPIN})


class Worker:
    """A worker process (``python *argv``) that answers each line written to its stdin
    with one JSON line, the first once it is ready (``info``). ``stderr``: a file path
    to keep its stderr in, shown if it dies."""

    def __init__(self, argv, stderr=None):
        self.err = open(stderr, "w+") if stderr else None
        self.p = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True)
        self.info = self.ask(None)

    def ask(self, cmd):
        if cmd is not None:
            self.p.stdin.write(cmd + "\n")
            self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            self.p.wait()
            why = ""
            if self.err is not None:
                self.err.seek(0)
                why = ":\n" + self.err.read()[-3000:]
            raise RuntimeError(f"a benchmark worker died{why}")
        return json.loads(line)

    def close(self):
        self.p.stdin.close()
        self.p.wait()
        if self.err is not None:
            self.err.close()


def cpu_model():
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    import platform
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def version(dist):
    """An installed distribution's version, or "?"."""
    from importlib.metadata import PackageNotFoundError, version as _v
    try:
        return _v(dist)
    except PackageNotFoundError:
        return "?"
