"""The GPU queue (issue 38): its plan, its records, its budget, its tables, and the whole queue
at smoke size on this CPU, so it cannot rot between the rare GPU windows."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_arm, gpu_queue, gpu_tables
from benchmarks.gpu_plan import QUEUE
from benchmarks.gpu_queue import ROOT, SLICE_MAX_MIN, Arm, Slice
from tests.node_helpers import SCALE


def _record(sl: Slice, arm: str, seed: int, loss: float, **extra) -> dict:
    figures = {"val_loss": loss, "consensus": 0.1, "bytes_per_worker": 2e6, "tokens": 1e6,
               "tokens_per_s": 5e3, "history": [{"steps": 0, "tokens": 0, "val_loss": loss,
                                                 "consensus": 0.0}]}
    return {"slice": sl.id, "group": sl.group, "arm": arm, "seed": seed, "status": "ok",
            "digest": sl.digest(), "smoke": False, "device": "NVIDIA H100", "torch": "2.11",
            "commit": "abc", "when": "2026-11-28T00:00:00", "slice_wall_s": 240.0,
            "figures": figures, **extra}


def test_the_queue_holds_the_issues_slices_in_order_each_within_six_minutes():
    ids = [sl.id for sl in QUEUE]
    first = {kind: min(k for k, sl in enumerate(QUEUE) if sl.kind == kind)
             for kind in ("sim", "swarm", "throughput")}
    assert ids.index("ladder-5m-s0") < first["swarm"] < ids.index("ring16-h1") \
        < first["throughput"]  # a, b, c, d
    assert {"swarm-gasloc", "swarm-diloco-nesterov", "swarm-diloco-avg"} <= set(ids)
    assert len(set(ids)) == len(ids)
    for sl in QUEUE:
        assert 0 < sl.minutes <= SLICE_MAX_MIN, sl.id
        assert sl.basis.startswith(("estimated", "measured")), sl.id
    ladder = [sl for sl in QUEUE if sl.group == "ladder-25m"]
    assert [sl.seed for sl in ladder] == [0, 1, 2, 3, 4]  # seeds accumulate across windows
    assert all(len(sl.arms) == 5 for sl in ladder)  # all five arms side by side


def test_a_slice_is_done_when_every_arm_of_its_present_configuration_has_a_record(tmp_path):
    sl = next(s for s in QUEUE if s.id == "ladder-5m-s0")
    assert not gpu_queue.is_done(sl, tmp_path)
    gpu_queue.append(tmp_path, sl.id, [_record(sl, a.label, 0, 3.0) for a in sl.arms[:-1]])
    assert not gpu_queue.is_done(sl, tmp_path)  # one arm missing
    gpu_queue.append(tmp_path, sl.id, [_record(sl, sl.arms[-1].label, 0, 3.0)])
    assert gpu_queue.is_done(sl, tmp_path)
    resized = Slice(sl.id, sl.group, sl.title, sl.kind, sl.minutes, sl.basis,
                    (*sl.arms[:-1], Arm(sl.arms[-1].label, {**sl.arms[-1].config, "steps": 9})))
    assert resized.digest() != sl.digest() and not gpu_queue.is_done(resized, tmp_path)


def test_plan_prints_every_slice_with_its_minutes_and_status_and_measured_time(tmp_path):
    sl = QUEUE[1]
    gpu_queue.append(tmp_path, sl.id, [_record(sl, a.label, 0, 3.0) for a in sl.arms])
    lines = gpu_queue.plan(tmp_path)
    assert len(lines) == len(QUEUE) + 2
    row = next(line for line in lines if f" {sl.id} " in line)
    assert "done" in row and "measured on NVIDIA H100" in row and " 4.0 " in row  # 240 s
    assert all("pending" in line for line in lines[1:-1] if f" {sl.id} " not in line
               and sl.group not in line)


def test_merge_adds_what_came_back_once(tmp_path):
    sl = QUEUE[1]
    back = tmp_path / "out.jsonl"
    back.write_text("\n".join(json.dumps(_record(sl, a.label, 0, 3.0)) for a in sl.arms))
    where = tmp_path / "records"
    assert gpu_queue.merge([back], where) == len(sl.arms)
    assert gpu_queue.merge([back], where) == 0
    assert gpu_queue.is_done(sl, where)


def test_the_tables_pair_seeds_and_say_not_run_yet(tmp_path):
    slices = [s for s in QUEUE if s.group == "ladder-5m"][:3]
    for seed, sl in enumerate(slices):
        gpu_queue.append(tmp_path, sl.id, [
            _record(sl, a.label, seed, 3.0 + 0.1 * k + 0.01 * seed, corpus_sha256="c0ffee")
            for k, a in enumerate(sl.arms)])
    page = gpu_tables.page(tmp_path)
    ladder = page.split("## ladder-5m")[1].split("## ")[0]
    first, second = slices[0].arms[0].label, slices[0].arms[1].label
    assert f"| {first} | 3 | 3.010 ± 0.025 | (reference) |" in ladder
    assert f"| {second} | 3 | 3.110 ± 0.025 | +0.100 ± 0.000 |" in ladder  # paired by seed
    assert "corpus c0ffee" in ladder and "3 of 5 run" in ladder
    assert page.split("## ring16-h1")[1].split("## ")[0].count("Not run yet.") == 1
    assert "make gpu-wheels" in page  # how to contribute a window


def test_an_arm_projected_past_its_deadline_stops_and_says_so():
    watch = gpu_arm.Watch(deadline_s=100.0, calibrate_s=1.0, write=lambda line: None)
    watch(0, 1000)  # the first round end: the steady rate starts here
    watch.t0 -= 10.0  # ten seconds later, 10 steps of 1000: about 1000 s to go
    with pytest.raises(gpu_arm.TooLong, match="projected"):
        watch(10, 1000)
    fine = gpu_arm.Watch(deadline_s=100.0, calibrate_s=1.0, write=lambda line: None)
    fine(0, 1000)
    fine.t0 -= 10.0
    fine(500, 1000)  # about 20 s in all


def test_next_skips_a_slice_that_does_not_fit_the_budget(tmp_path, monkeypatch):
    ran = []

    def fake(sl, left_s, smoke, scratch):
        ran.append((sl.id, left_s))
        return [{"arm": a.label, "status": "ok", "config": {}, "figures": {}}
                for a in sl.arms]

    from benchmarks import gpu_slices

    monkeypatch.setattr(gpu_slices, "run_slice", fake)
    monkeypatch.setattr(gpu_slices, "corpus_built", lambda: True)
    monkeypatch.setattr(gpu_queue, "write_tables", lambda *a, **k: None)
    out = tmp_path / "records"
    assert gpu_queue.run_next(3.8, [], out, smoke=False) == 0
    fits = [sl.id for sl in QUEUE if sl.minutes <= 3.8]
    assert [r[0] for r in ran] == fits[:1] or [r[0] for r in ran] == fits  # at least one fits
    assert all(left <= 3.8 * 60 for _, left in ran)
    assert all(gpu_queue.is_done(sl, out) for sl in QUEUE if sl.id in dict(ran))


def test_a_stopped_attempt_counts_by_its_projection_for_every_seed_of_its_shape(tmp_path,
                                                                                 monkeypatch):
    # the first window's ladder arms stopped after half a minute each, projecting 330-400 s:
    # that projection, not the half minute, is what the next window must budget for
    s0, s1 = (next(s for s in QUEUE if s.id == f"ladder-5m-s{k}") for k in (0, 1))
    stopped = [{**_record(s0, a.label, 0, 3.0, slice_wall_s=54.0), "status": "too long",
                "why": f"{300 + 20 * k} s projected (rate 5.5 steps/s), deadline 229 s"}
               for k, a in enumerate(s0.arms)]
    stopped[-1]["projected_s"] = 402.0  # a record of this code carries the number itself
    gpu_queue.append(tmp_path, s0.id, stopped)
    for sl in (s0, s1):  # the next seed is the same shape
        minutes, basis = gpu_queue.measured_minutes(sl, tmp_path)
        assert minutes == pytest.approx((402.0 + gpu_queue.START_S) / 60)
        assert basis.startswith("projected on NVIDIA H100")
    row = next(line for line in gpu_queue.plan(tmp_path) if f" {s1.id} " in line)
    assert " 7.2 " in row and "pending" in row
    # a resized slice starts over: records of its old configuration time nothing
    resized = Slice(s0.id, s0.group, s0.title, s0.kind, s0.minutes, s0.basis,
                    (*s0.arms[:-1], Arm(s0.arms[-1].label, {**s0.arms[-1].config, "steps": 9})))
    assert gpu_queue.measured_minutes(resized, tmp_path) is None
    # the window skips the slice it cannot finish, the corpus's build counted on a bare machine
    from benchmarks import gpu_slices

    ran = []
    monkeypatch.setattr(gpu_slices, "run_slice", lambda sl, *a: ran.append(sl.id) or [])
    monkeypatch.setattr(gpu_queue, "write_tables", lambda *a, **k: None)
    monkeypatch.setattr(gpu_slices, "corpus_built", lambda: False)
    gpu_queue.run_next(7.5, [s0.id], tmp_path, smoke=False)
    assert ran == []  # 7.2 minutes and the corpus's minute do not fit 7.5
    monkeypatch.setattr(gpu_slices, "corpus_built", lambda: True)
    gpu_queue.run_next(7.5, [s0.id], tmp_path, smoke=False)
    assert ran == [s0.id]


def test_an_attempt_that_finished_some_arms_leaves_only_the_rest_to_run(tmp_path,
                                                                        monkeypatch):
    # the second window's ladder-25m-s0 finished 3 of its 5 arms; the other 2 stopped early
    s0, s1 = (next(s for s in QUEUE if s.id == f"ladder-25m-s{k}") for k in (0, 1))
    done, stopped = s0.arms[:3], s0.arms[3:]
    gpu_queue.append(tmp_path, s0.id, [
        *(_record(s0, a.label, 0, 4.0, slice_wall_s=252.0) for a in done),
        *({**_record(s0, a.label, 0, 6.0, slice_wall_s=252.0), "status": "too long",
           "projected_s": 370.0, "why": "370 s projected"} for a in stopped)])
    assert gpu_queue.arms_left(s0, tmp_path) == stopped and not gpu_queue.is_done(s0, tmp_path)
    from benchmarks import gpu_slices

    ran: list[tuple[str, ...]] = []

    def run_slice(sl, *a):
        ran.append(tuple(arm.label for arm in sl.arms))
        return [{"arm": arm.label, "status": "ok", "figures": {}} for arm in sl.arms]

    monkeypatch.setattr(gpu_slices, "run_slice", run_slice)
    monkeypatch.setattr(gpu_queue, "write_tables", lambda *a, **k: None)
    monkeypatch.setattr(gpu_slices, "corpus_built", lambda: True)
    gpu_queue.run_next(9.5, [s0.id], tmp_path, smoke=False)
    assert ran == [tuple(a.label for a in stopped)]  # not the 3 that have records
    assert gpu_queue.is_done(s0, tmp_path)
    rest = [r for r in gpu_queue.records_of(s0.id, tmp_path) if r.get("arms_run") is not None]
    assert {r["arms_run"] for r in rest} == {2} and {r["digest"] for r in rest} == {s0.digest()}
    # the 2-arm rerun's wall is no slice's length: the next seed keeps the projection
    minutes, basis = gpu_queue.measured_minutes(s1, tmp_path)
    assert minutes == pytest.approx((370.0 + gpu_queue.START_S) / 60) and "projected" in basis


def test_an_unknown_slice_is_one_line():
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_queue", "next", "--only",
                           "nope", "--smoke"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "gpu-next: --only: unknown slice(s) ['nope']; `make gpu-plan` lists them")


def test_the_whole_queue_runs_at_smoke_size_on_a_cpu(tmp_path):
    """``make gpu-next`` without CUDA: every slice end to end (real node processes for the
    swarm slices, arm processes for the concurrency slice), records and tables."""
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_queue", "next", "--smoke",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for sl in QUEUE:
        rows = gpu_queue.records_of(sl.id, tmp_path)
        assert rows and all(r["status"] == "ok" and r["smoke"] for r in rows), (sl.id, rows)
        assert {a.label for a in sl.arms_at(True)} <= {r["arm"] for r in rows}
    page = (tmp_path / "gpu-queue.md").read_text()
    assert "SMOKE SIZE" in page and "Not run yet." not in page
    print(f"the whole queue at smoke size: {took:.0f} s")
    assert took < 300 * SCALE  # the issue's bound on the full smoke command


def test_every_record_says_where_and_from_what_it_ran():
    facts = gpu_queue.facts()
    assert {"commit", "device", "torch", "host_cores", "when"} <= set(facts)
    assert facts["commit"] != "" and Path(ROOT / "docs" / "results").is_dir()
