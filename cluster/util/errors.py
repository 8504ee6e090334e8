"""What an exception was caused by: libraries wrap the error that matters (a refused connection, a preemption, a
signal) in errors of their own."""

from __future__ import annotations


def caused_by(exc: BaseException | None, kinds: type | tuple[type, ...]) -> bool:
    """Whether an exception of `kinds` is anywhere in the chain: the exception, its cause or context, theirs..."""
    while exc is not None:
        if isinstance(exc, kinds):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
