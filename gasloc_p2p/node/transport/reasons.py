"""Why exchanges fail, said once per reason: counters alone (``failed 3``) leave a new swarm's
first failures unexplained, and a line per failure would flood the log of a node whose peer
is gone."""

from __future__ import annotations

import logging
import re

import grpc

from gasloc_p2p.safelog import safe

log = logging.getLogger(__name__)
MAX_REASONS = 256  # distinct reasons remembered (peer text can vary without end)
_NUMBERS = re.compile(r"\d+")


def reason_of(exc: BaseException) -> str:
    """One line: the exception's kind and message (a gRPC error: its code and details)."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        details = exc.details() if hasattr(exc, "details") else ""
        text = f"{exc.code().name}: {details or ''}"
    else:
        text = str(exc).strip()
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return safe(text.splitlines()[0] if text else type(exc).__name__)


class FailureReasons:
    """Logs an exchange failure at INFO the first time its reason is seen (numbers such as
    ports and sizes do not make a new reason), at DEBUG after that."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def __call__(self, kind: str, what: str, exc: BaseException) -> None:
        """``kind``: the side ("outbound", "inbound", ...); ``what``: the exchange as the
        line names it ("exchange with PEER", escaped by the caller)."""
        reason = reason_of(exc)
        key = _NUMBERS.sub("#", f"{kind} {reason}")
        if key in self._seen or len(self._seen) >= MAX_REASONS:
            log.debug("%s failed: %s", what, reason)
            return
        self._seen.add(key)
        log.info("%s failed: %s (said once per reason; counted in "
                 "gasloc_exchanges_total{outcome=\"failed\"})", what, reason)
