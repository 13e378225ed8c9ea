"""A short fuzz run against a live node process (the full one: `make bench-fuzz`).

200 generated streams, most from an authenticated member whose signed headers pass, so the
payload, guard and commit checks are exercised, not only the header ones: no crash, no hang,
no Ready to a bad payload, only the valid Commits after both Ready messages committed,
finite parameters, no traceback or forged line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.tools.fuzz_member import fuzz_node
from benchmarks.tools.fuzz_streams import Counts

pytestmark = pytest.mark.slow


def test_fuzzed_streams_reach_the_payload_path_and_change_nothing(tmp_path: Path):
    r = fuzz_node(tmp_path, streams=200, concurrency=2, seed=1, member_share=0.8)
    c = r["counts"]
    assert isinstance(c, Counts)
    print({k: v for k, v in r.items() if k != "counts"}, dict(c.stages), dict(c.ready_to))
    assert c.streams == 200
    assert not r["crashed"] and r["finite"], r
    assert c.hangs == 0 and c.accepted_bad == 0, (c.hangs, dict(c.ready_to))
    assert r["committed"] == c.notes["valid-commit-sent"], (r, dict(c.notes))
    assert r["tracebacks"] == 0 and r["forged"] == 0, r
    # coverage: most streams get past the signed headers, and each later check is reached
    assert c.past_header() >= 0.5 * c.streams, dict(c.stages)
    for stage in ("header-auth", "proof", "framing", "payload-decode", "guard", "commit"):
        assert c.stages[stage] > 0, (stage, dict(c.stages))
    assert c.ready_to["mirror"] > 0, dict(c.ready_to)  # valid payloads are still taken
