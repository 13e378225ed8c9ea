"""The home-link bench's table (no nodes run): times to the reference's final loss, the loss
at the most steps every run reached, and the guard's clip figures read from node logs."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_home_gossip import codec_name, guard_weights, loss_at, table  # noqa: E402


def samples(losses: list[float], steps_per_s: float) -> list[dict[str, float]]:
    """One repetition polled every 10 s: a loss per poll, 8 MB and 4 exchanges a poll."""
    return [{"t": 10.0 * (i + 1), "loss": loss, "bytes_per_node": 8e6 * (i + 1),
             "exchanges_per_node": 4.0 * (i + 1), "steps": 10.0 * (i + 1) * steps_per_s}
            for i, loss in enumerate(losses)]


def test_the_table_compares_codecs_at_their_final_loss_and_at_equal_steps() -> None:
    runs = {"int8": [samples([3.0, 2.5, 2.0], steps_per_s=20.0)],  # 600 steps at the end
            "half2": [samples([math.nan, 2.4, 1.9], steps_per_s=10.0)]}  # slower: 300
    guard = {"int8": [{"clipped": 3, "clip_factor": 0.5}], "half2": []}
    lines = table(runs, guard, {"rate_mbit": 0.5, "nodes": 3})
    assert "loss at step 300" in lines[0]
    int8, half2 = (line.split(" | ") for line in lines[2:])
    assert int8[1] == "2.000" and half2[1] == "1.900"  # final losses
    assert int8[2] == "2.500" and half2[2] == "1.900"  # at step 300: the slower run's end
    assert half2[7].startswith("30 (1/1)") and half2[8] == "1.00x"  # int8's 2.0 at 30 s too
    assert int8[9] == "8%" and int8[10].startswith("0.50")  # 3 of 36 sides (12 x 3), x0.5
    assert half2[9] == "n/a"  # no guard figures recorded


def test_loss_at_skips_polls_before_every_node_was_evaluated() -> None:
    run = samples([math.nan, 2.4, 1.9], steps_per_s=10.0)
    assert loss_at(run, 50) == 2.4  # the first poll (100 steps) had no loss yet
    assert math.isnan(loss_at(run, 1e6))


def test_guard_weights_read_the_clip_lines_of_every_node(tmp_path: Path) -> None:
    line = ("2026-11-29 07:41:21,464 INFO gasloc_p2p.node.transport.exchange: exchange to "
            "g1vq clipped: its distance exceeds this node's soft limit, weight x{}\n")
    (tmp_path / "n0.err").write_text(line.format("0.25") + "other line\n")
    (tmp_path / "n1.err").write_text(line.format("0.75"))
    assert guard_weights(tmp_path) == {"clipped": 2, "clip_factor": pytest.approx(0.5)}


def test_a_free_arm_runs_its_codec_unshaped_and_is_timed_against_the_reference() -> None:
    assert codec_name("int8@free") == "int8" and codec_name("half2") == "half2"
    runs = {"int8": [samples([3.0, 2.5, 2.0], steps_per_s=20.0)],
            "int8@free": [samples([2.6, 2.0, 1.8], steps_per_s=20.0)]}
    lines = table(runs, {}, {"rate_mbit": 0.5, "nodes": 3})
    int8, free = (line.split(" | ") for line in lines[2:])
    assert int8[5] == "32.0" and free[5] == "0.0"  # 2 MB a payload at 0.5 Mbit/s; unshaped
    assert free[7].startswith("20 (1/1)") and free[8] == "0.67x"  # int8's 2.0: 20 s vs 30 s
