"""The line protocol of the benchmark's worker processes, both kinds: the table's
(``harness.worker``, one implementation per process) and the rounds' (``abworker.py``,
the timing script of ``--against`` and of saved runs).

A worker writes one JSON object per line on stdout, prefixed by ``MARK``; any
other output (a library's chatter, a traceback) is kept only as the tail that
says why a worker died. It reads the names of the cases to time on stdin, one a
line, and answers each with one event that names the case.

Standard library only: ``abworker.py`` runs as a script, from the current tree,
also against an old tree whose ``numba_ops`` must not be imported, and loads this
file by its path.
"""
import contextlib
import json
import subprocess
import sys

MARK = "@@numba-ops "


def emit(obj, stream=None):
    """Write one event line (and flush: the reader waits for it)."""
    stream = sys.stdout if stream is None else stream
    stream.write(MARK + json.dumps(obj) + "\n")
    stream.flush()


def parse(line):
    """The event of a worker's output line, or None for any other line."""
    if not line.startswith(MARK):
        return None
    return json.loads(line[len(MARK):])


class Worker:
    """A worker process: ``event()`` reads its next event, ``ask(name)`` sends a case
    name and reads the answer, ``died()`` says why one did not come. stderr joins
    stdout, so that a chatty worker cannot fill an unread pipe and stall."""

    TAIL = 40  # lines of other output kept for ``died``

    def __init__(self, label, argv, env=None, cwd=None):
        self.label, self.tail = label, []
        self.p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, bufsize=1, env=env, cwd=cwd)

    def event(self):
        """The next event; None when the worker exited first."""
        for line in self.p.stdout:
            ev = parse(line)
            if ev is not None:
                return ev
            self.tail = (self.tail + [line])[-self.TAIL:]
        return None

    def died(self):
        return f"the {self.label} worker exited: {''.join(self.tail).strip()[-1500:]}"

    def ask(self, name):
        """The worker's answer for case ``name`` (an error event naming it if it died)."""
        try:
            self.p.stdin.write(name + "\n")
            self.p.stdin.flush()
        except OSError:
            return {"case": name, "error": self.died()}
        ev = self.event() or {"case": name, "error": self.died()}
        ev.setdefault("case", name)
        return ev

    def close(self):
        with contextlib.suppress(OSError):
            self.p.stdin.close()
        try:
            self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
