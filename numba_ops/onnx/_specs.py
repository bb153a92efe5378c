"""A session node's spec (its ``numba_ops`` attribute, parsed once) and the errors
nodes record for their session's ``run`` to raise: shared by both routes (``_ort``,
``_capi``)."""
import json
import threading

from . import CALL_OF


class _Spec:
    """What a node runs: its op, the function, attributes, name, session, output shape and
    thread counts."""
    __slots__ = ("op", "call", "attrs", "node", "session", "shape", "threads", "pool")


_SPECS = {}  # attribute text -> _Spec
local_run = threading.local()  # .run: (session token, [recorded exceptions]) while a run is under way
_PENDING = {}  # session token -> exceptions recorded outside a guarded run (run_async, other threads)
_PENDING_LOCK = threading.Lock()


def spec_of(text):
    """The ``_Spec`` of a node's ``numba_ops`` attribute text (parsed once)."""
    return _SPECS.get(text) or _parse(text)


def _parse(text):
    d = json.loads(text)
    s = _Spec()
    s.op, s.attrs, s.node, s.session, s.shape = d["op"], d["attrs"], d["node"], d["session"], d["shape"]
    s.threads, s.pool = d.get("threads"), d.get("pool") or 1
    s.call = CALL_OF[s.op]
    _SPECS[text] = s
    return s


def record(spec, text, exc):
    """Keep ``exc``, raised by the node of ``spec`` (or of the attribute ``text``), for its
    session's ``run`` to raise."""
    token = spec.session if spec is not None else json.loads(text).get("session")
    if isinstance(exc, Exception) and spec is not None and hasattr(exc, "add_note"):
        exc.add_note(f"(raised by numba_ops running {spec.op} node {spec.node!r} in onnxruntime)")
    run = getattr(local_run, "run", None)
    if run is not None and run[0] == token:
        run[1].append(exc)
        return
    with _PENDING_LOCK:
        if token in _PENDING:
            _PENDING[token].append(exc)


def take_pending(token):
    with _PENDING_LOCK:
        errs = _PENDING.get(token)
        if errs:
            exc = errs[0]
            del errs[:]
            return exc
    return None


def new_token():
    with _PENDING_LOCK:
        token = new_token.count = getattr(new_token, "count", 0) + 1
        _PENDING[token] = []
    return token


def drop(token):
    """Forget a session that is gone: its pending errors and its nodes' specs."""
    with _PENDING_LOCK:
        _PENDING.pop(token, None)
    for text, spec in list(_SPECS.items()):
        if spec.session == token:
            _SPECS.pop(text, None)
