"""Log lines a peer cannot forge: escaping of peer-supplied strings, and a one-line formatter.

A peer id, an Abort message or a run id comes from the network. Logged raw, a newline in it
starts what looks like another log line (forged by the peer), and escape sequences can rewrite
a terminal. :func:`safe` escapes such a string for one log field; :class:`OneLineFormatter` (the
CLI's) escapes line breaks in every message as a second line of defence, and prints what gRPC's
own loggers report (a malformed protobuf from a peer, for one) as one line, without the
traceback: it is the peer's fault, not a bug of this node.
"""

from __future__ import annotations

import logging

_LIMIT = 120


def safe(text: object, limit: int = _LIMIT) -> str:
    """``text`` with control and non-printable characters escaped, cut at ``limit`` chars."""
    s = str(text)
    if s.isprintable() and len(s) <= limit:
        return s
    escaped = s.encode("unicode_escape", "backslashreplace").decode("ascii")
    return escaped if len(escaped) <= limit else escaped[:limit] + "..."


class OneLineFormatter(logging.Formatter):
    """Each record on one line: CR/LF in messages escaped; gRPC's tracebacks cut to their last
    line (the exception) at WARNING at most, since they report peer input, not bugs here."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name.startswith("grpc") and record.exc_info:
            exc = record.exc_info[1]
            level = min(record.levelno, logging.WARNING)  # the peer's fault, not ours
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                            "msg": f"{record.getMessage()} ({exc!r})",
                                            "args": None, "levelno": level,
                                            "levelname": logging.getLevelName(level)})
        return super().format(record)  # our own tracebacks stay multi-line

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        record.message = record.message.replace("\r", "\\r").replace("\n", "\\n")
        return super().formatMessage(record)
