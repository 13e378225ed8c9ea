"""The external-baseline suite's cheap parts: arguments, the corpus, log parsing, the
aggregation into curves, times to target and ratios; and 2-node loopback runs of the runners
(torchft's skips when torchft is not installed: only `make bench-external` installs it)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_external import case_rates, paired, parse_args  # noqa: E402
from benchmarks.external.aggregate import (  # noqa: E402
    curve,
    markdown,
    summarize,
    time_to_target,
)
from benchmarks.external.common import (  # noqa: E402
    Spec,
    flag_list,
    gasloc_evals,
    gasloc_sent_bytes,
    make_corpus,
    read_records,
)
from benchmarks.external.exchange import exchange_figures  # noqa: E402
from benchmarks.external.runners import (  # noqa: E402
    LoopbackHost,
    run_system,
    torchft_unavailable,
)


def test_arguments_and_cases():
    args = parse_args([])
    assert args.systems == ["gasloc", "gasloc-diloco", "torchft-diloco", "hivemind"]
    assert args.cases == ["uneven", "uniform"] and args.steps == 300
    assert parse_args(["--quick", "--systems", "gasloc,hivemind"]).systems == ["gasloc",
                                                                              "hivemind"]
    with pytest.raises(SystemExit):
        parse_args(["--systems", "gasloc,pytorch-ddp"])
    with pytest.raises(ValueError, match="unknown case"):
        parse_args(["--cases", "lossy"])
    assert case_rates("uneven", 4, 100.0, 5.0) == [100.0, 100.0, 100.0, 5.0]
    assert case_rates("uniform", 3, 100.0, 5.0) == [100.0] * 3


def test_spec_checks_and_flags():
    with pytest.raises(ValueError, match="multiple"):
        Spec(steps=50, inner_steps=20, eval_every=20)
    spec = Spec(nodes=2, steps=40)
    assert Spec.from_json(spec.to_json()) == spec
    flags = flag_list({"n_layer": 2, "init_from_swarm": False, "compile": True})
    assert flags == ["--n-layer", "2", "--no-init-from-swarm", "--compile"]


def test_corpus_is_generated_once_and_deterministic(tmp_path):
    a = make_corpus(tmp_path / "a.txt", 0.05, seed=3).read_text()
    b = make_corpus(tmp_path / "b.txt", 0.05, seed=3).read_text()
    assert a == b and len(a) >= 50_000 and a != make_corpus(tmp_path / "c.txt", 0.05,
                                                           seed=4).read_text()


def test_log_parsing():
    log = ("2026-11-23 20:27:10,128 INFO gasloc_p2p.node.runtime.trainer: eval step 20 tokens "
           "10240 val_loss 2.8941\n2026-11-23 20:27:12,000 INFO x: step 20 loss 2.9 val 2.89 "
           "tok/s 100 | exchanges ok 3 (init 2 resp 1) failed 0 busy 0 stale 0 | sent 1.76 MB "
           "recv 1.70 MB | peers 1\n")
    (rec,) = gasloc_evals(log)
    assert (rec["step"], rec["tokens"], rec["val_loss"]) == (20, 10240, 2.8941)
    assert gasloc_sent_bytes(log) == 1_760_000
    assert gasloc_sent_bytes("no progress line") is None
    assert read_records('noise\n{"event": "eval", "step": 0}\n{broken\n') == [
        {"event": "eval", "step": 0}]


def _node(times, losses, step=20, tokens=512):
    return {"evals": [{"t": t, "step": k * step, "tokens": k * tokens, "val_loss": v}
                      for k, (t, v) in enumerate(zip(times, losses, strict=True))],
            "veth_tx_bytes": 2_000_000, "program_bytes_sent": 1_000_000,
            "program_bytes_kind": "counted", "rss_peak_bytes": 10**9}


def test_aggregation_curves_targets_and_ratios():
    fast = {"system": "gasloc", "finished": True,
            "nodes": [_node([100, 110, 120], [5.0, 3.0, 2.0]),
                      _node([200, 205, 221], [5.0, 3.2, 2.2])]}
    slow = {"system": "torchft-diloco", "finished": True,
            "nodes": [_node([0, 30, 60], [5.0, 3.0, 2.4]), _node([5, 35, 65], [5.0, 3.0, 2.4])]}
    pts = curve(fast)
    # time: when the slowest node got there, from the last node's first eval; loss: the mean over nodes
    assert [p["t"] for p in pts] == [0, 5, 21]
    assert [round(p["loss"], 6) for p in pts] == [5.0, 3.1, 2.1]
    assert time_to_target(pts, 2.6) == pytest.approx(5 + (3.1 - 2.6) / (3.1 - 2.1) * 16)
    assert time_to_target(pts, 1.0) is None and time_to_target(pts, 6.0) == 0
    summary = summarize([fast, slow, {"system": "hivemind", "skipped": "not installed"}])
    assert summary["target_loss"] == pytest.approx(2.4)  # the worst system's best
    ratio = summary["ratios"]["torchft-diloco"]
    assert ratio["time_to_target_ratio"] == pytest.approx(
        time_to_target(pts, 2.4) / 60.0)
    assert ratio["final_loss_gap"] == pytest.approx((2.1 - 2.4) / 2.4)
    row = summary["rows"][0]
    assert row["veth_tx_mb_per_node"] == 2.0 and row["final_tokens_per_node"] == 1024
    text = markdown("uneven", summary)
    assert "skipped: not installed" in text and "GASLoC / torchft-diloco" in text
    # a node without its first evaluation makes no curve (never a misleading one)
    assert curve({"nodes": [{"evals": [{"t": 1, "step": 20, "tokens": 1, "val_loss": 2}]}]}) == []


def test_exchange_figures():
    sample = {"gasloc_exchange_duration_seconds_count": 4.0,
              "gasloc_exchange_duration_seconds_sum": 4.4, "gasloc_sent_bytes_total": 2.5e6}
    fig = exchange_figures(sample, rate_mbit=5.0)
    assert fig["payload_bytes"] == 625_000 and fig["payload_over_rate_s"] == pytest.approx(1.0)
    assert fig["ratio"] == pytest.approx(1.1)
    assert exchange_figures({}, 5.0) == {"exchanges": 0}


def _loopback_run(system, tmp_path):
    spec = Spec(nodes=2, steps=40, inner_steps=20, eval_every=20)
    data = make_corpus(tmp_path / "corpus.txt", 0.3)
    run = run_system(system, [LoopbackHost(), LoopbackHost()], spec, data, tmp_path / "logs",
                     timeout_s=240)
    logs = "\n".join(p.read_text(errors="replace")[-1500:]
                     for p in sorted((tmp_path / "logs").glob("*.err")))
    assert run["finished"], logs
    pts = curve(run)
    assert [p["step"] for p in pts] == [0, 20, 40], logs
    assert all(math.isfinite(p["loss"]) for p in pts)
    assert pts[-1]["loss"] < pts[0]["loss"] - 1.0  # it trained
    assert all(n["rss_peak_bytes"] > 50e6 for n in run["nodes"])
    assert json.dumps(run)  # the suite writes it as JSON
    return run


@pytest.mark.slow
@pytest.mark.long
def test_gasloc_runner_on_loopback(tmp_path):
    run = _loopback_run("gasloc", tmp_path)
    assert all(n["exit_code"] == 0 for n in run["nodes"])


@pytest.mark.slow
@pytest.mark.skipif(torchft_unavailable() is not None,
                    reason=torchft_unavailable() or "")
def test_torchft_runner_on_loopback(tmp_path):
    run = _loopback_run("torchft-diloco", tmp_path)
    for node in run["nodes"]:
        assert node["exit_code"] == 0
        assert node["program_bytes_sent"] > 0  # two syncs of the model


def test_repetitions_alternate_and_are_paired():
    args = parse_args(["--systems", "gasloc,gasloc-solo", "--cases", "uneven", "--repeat", "3"])
    assert args.cases == ["uneven#1", "uneven#2", "uneven#3"]
    assert case_rates("uneven#2", 4, 100.0, 5.0) == [100.0, 100.0, 100.0, 5.0]
    with pytest.raises(SystemExit):
        parse_args(["--repeat", "0"])

    def rep(a: float, b: float) -> dict:
        return {"rows": [{"system": "gasloc-solo", "final_loss": b},
                         {"system": "gasloc", "final_loss": a}]}

    lines = paired({"uneven#1": rep(2.0, 1.9), "uneven#2": rep(2.1, 2.1),
                    "uneven#3": rep(1.8, 1.6)})
    assert lines[0].startswith("**Paired")
    assert "uneven, 3 repetitions: final val loss gasloc-solo minus gasloc -0.1000 ±" in lines[1]
    assert "-0.100, +0.000, -0.200" in lines[1]
    assert paired({"uneven": rep(2.0, 1.9)}) == []  # no repetitions, nothing to pair
