"""A node of several ranks (torch.distributed, gloo on CPU; real processes).

The K ranks of a node take the step one process takes on the same batch (DDP splits it), and
whatever rank 0 writes between steps (a commit, a round end, a restore, a rollback) reaches
the other ranks before the next step: the replicas stay bit-identical.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gasloc_p2p.node.launch import describe, free_port, rank_env
from gasloc_p2p.node.runtime import checkpoint as ckpt
from gasloc_p2p.node.runtime.lock import TrainingLock
from gasloc_p2p.node.runtime.ranks import checksum, distributed_env, rank_device, split_rows
from gasloc_p2p.node.runtime.trainer import Trainer
from gasloc_p2p.node.stats import TrainStats
from tests import ranks_schedule
from tests.daemon_helpers import write_corpus
from tests.node_helpers import moment_elements_per_file, scaled

ROOT = Path(__file__).resolve().parents[1]


_ONE_PROCESS: dict[tuple[int, str, bool], dict] = {}  # the reference runs, shared by the tests


def _schedule(tmp: Path, corpus: Path, accum: int, world: int, device: str = "cpu",
              sharding: str = "ddp", compiled: bool = False) -> dict:
    if world == 1 and (accum, device, compiled) in _ONE_PROCESS:
        return _ONE_PROCESS[(accum, device, compiled)]
    out = tmp / f"out-{world}-{accum}-{sharding}{'-compiled' if compiled else ''}.pt"
    cmd = [sys.executable, "-m", "tests.ranks_schedule", str(out), str(corpus), str(accum),
           device, sharding, "compile" if compiled else "eager"]
    base = dict(os.environ, PYTHONPATH=str(ROOT))
    if world == 1:
        envs = [base]
    else:
        port = free_port()
        envs = [rank_env(base, r, world, port) for r in range(world)]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for env in envs]
    try:
        logs = [p.communicate(timeout=scaled(180))[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"rank {r} of {world} exited {p.returncode}:\n{log[-4000:]}"
    found = torch.load(out)
    if world == 1:
        _ONE_PROCESS[(accum, device, compiled)] = found
    return found


@pytest.mark.parametrize("accum, sharding", [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_two_ranks_take_one_process_steps_and_stay_identical(tmp_path, accum, sharding,
                                                             device="cpu"):
    """DDP: two replicas; FSDP2: each rank holds half the rows of every parameter, and rank
    0's full copy (what the exchange engine and the outer state see) is filled from them and
    handed back around every write (a commit, a round end, the restore, the rollback); the
    AdamW state is saved by each rank (its rows, torch.distributed.checkpoint) and read back in
    rows at the restore."""
    corpus = write_corpus(tmp_path / "corpus")
    one = _schedule(tmp_path, corpus, accum, 1, device)
    two = _schedule(tmp_path, corpus, accum, 2, device, sharding)
    assert two["agree"] is True  # DDP: rank 1's parameters' bits are rank 0's at the stop
    if sharding == "fsdp":  # rank 1 built its model on the meta device and holds its rows
        rank1 = torch.load(tmp_path / f"out-2-{accum}-fsdp.pt.rank1")
        assert rank1["full_copy"] is False
        assert rank1["rows_bytes"] == pytest.approx(4 * two["theta"].numel() / 2, rel=0.05)
        _check_sharded_checkpoint(corpus, accum, one, two)
        # a checkpoint the ranks could not write failed in one line, and the schedule went on
        assert "the ranks could not write their AdamW state" in two["failed_save"]
        assert "\n" not in two["failed_save"], two["failed_save"]
    # the schedule ran: round ends, one rollback, the restore went back in steps
    assert (one["rollbacks"], one["rounds"]) == (two["rollbacks"], two["rounds"]) == (1, 3)
    assert one["step"] == two["step"] == 26
    assert torch.isfinite(two["theta"]).all()
    # the same steps as one process on the node's whole batch, within float rounding (AdamW's
    # normalised steps carry a rounding of a tiny gradient to a parameter: measured 0.01-0.05%
    # of the largest move at this size; a rank on other rows would be as far as the move)
    diff = (one["theta"] - two["theta"]).abs().max().item()
    moved = (one["theta"] - one["theta0"]).abs().max().item()
    print(f"max |theta_1 - theta_2| {diff:.3g}, largest move {moved:.3g}")
    assert diff < 0.01 * moved, f"a 2-rank node drifted {diff} from a 1-rank node"
    # the drift probe measured the same inner-step moves per round (sharded: sampled from
    # the rank holding each coordinate)
    assert len(one["drifts"]) == len(two["drifts"]) == 3
    # the validation loss before the save: each rank its rows of every batch (sharded: the
    # evaluation leaves the model's rows in place, which the AdamW state gathered next needs)
    assert abs(one["val"] - two["val"]) < 1e-4 * one["val"], (one["val"], two["val"])
    # (the round of the injected NaN measures NaN on both)
    for a, b in zip(one["drifts"], two["drifts"], strict=True):
        assert a.keys() == b.keys()
        assert all(math.isnan(a[k]) == math.isnan(b[k]) for k in a), (a, b)
        assert all(abs(a[k] - b[k]) < 0.01 * a[k] for k in a if not math.isnan(a[k])), (a, b)
    assert sum(not math.isnan(v) and v > 0 for d in one["drifts"] for v in d.values()) == 2


@pytest.mark.long  # a cold compiler on two cores: 1.5 minutes (make test-long)
def test_two_compiled_ranks_take_one_compiled_process_steps(tmp_path, sharding="fsdp"):
    """``--compile --sharding fsdp``: torch.compile over the FSDP2-sharded model (its
    all-gathers and reduce-scatters between the compiled pieces) takes the steps one compiled
    process takes, through the same writes, restore and rollback, within the eager pair's
    float tolerance. (DDP compiled passed the same, 5.4e-5 of a 0.075 move; left out of the
    suite: each compiled schedule costs 15-40 s of a cold compiler on CI's two cores.)"""
    corpus = write_corpus(tmp_path / "corpus")
    one = _schedule(tmp_path, corpus, 2, 1, compiled=True)
    two = _schedule(tmp_path, corpus, 2, 2, sharding=sharding, compiled=True)
    assert two["agree"] is True
    assert (one["rollbacks"], one["rounds"]) == (two["rollbacks"], two["rounds"]) == (1, 3)
    assert one["step"] == two["step"] == 26 and torch.isfinite(two["theta"]).all()
    assert one["graphs"] > 0 and two["graphs"] > 0, (one["graphs"], two["graphs"])
    diff = (one["theta"] - two["theta"]).abs().max().item()
    moved = (one["theta"] - one["theta0"]).abs().max().item()
    print(f"compiled: max |theta_1 - theta_2| {diff:.3g}, largest move {moved:.3g}")
    assert diff < 0.01 * moved, f"a compiled 2-rank node drifted {diff} from one process"
    assert abs(one["val"] - two["val"]) < 1e-4 * one["val"], (one["val"], two["val"])


def _check_sharded_checkpoint(corpus: Path, accum: int, one: dict, two: dict) -> None:
    """The sharded node's checkpoint: each rank wrote its rows of the AdamW state (DCP, one
    file per rank, nothing gathered); a node of one rank resumes it and holds the moments the
    one-process run held at the same step."""
    saved = ckpt.load(two["checkpoint"])
    name = ckpt.sharded_name(saved["optimizer"])
    assert name is not None, saved["optimizer"].keys()
    where = Path(two["checkpoint"]) / name
    files = sorted(f.name for f in where.iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"], files
    per_file = moment_elements_per_file(where)  # each rank its rows: about half
    assert sum(per_file.values()) == 2 * two["theta"].numel(), per_file
    assert all(0.4 < v / (2 * two["theta"].numel()) < 0.6 for v in per_file.values()), per_file
    cfg = ranks_schedule.schedule_config(corpus, accum, "cpu", "ddp")
    trainer = Trainer(cfg, ranks_schedule.OUTER, 1, TrainingLock(), TrainStats())
    trainer.checkpoint_dir = two["checkpoint"]
    ckpt.validate(saved, trainer.fingerprint, trainer.flat.numel,
                  ckpt.checkpoint_path(two["checkpoint"]))
    trainer.restore(saved)
    got = trainer.optimizer.state_dict()["state"]
    want = ckpt.load(one["checkpoint"])["optimizer"]["state"]
    assert got.keys() == want.keys() and len(got) == len(list(trainer.model.parameters()))
    for i in want:
        assert float(got[i]["step"]) == float(want[i]["step"]) == ranks_schedule.SAVE_AT
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = got[i][key], want[i][key]
            assert a.shape == b.shape
            scale = b.abs().max().item()
            assert (a - b).abs().max().item() <= 1e-3 * scale + 1e-30, (i, key)


def test_rows_split_each_micro_batch_over_the_ranks():
    x = torch.arange(8 * 3).view(8, 3)
    parts = [split_rows(x, 2, r, 2) for r in range(2)]
    # micro-batches are rows 0-3 and 4-7; rank 0 takes 0-1 and 4-5, rank 1 2-3 and 6-7
    assert parts[0][:, 0].tolist() == [0, 3, 12, 15]
    assert parts[1][:, 0].tolist() == [6, 9, 18, 21]
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        split_rows(x, 2, 0, 3)


def test_checksum_sees_one_changed_bit():
    t = torch.randn(1000)
    before = int(checksum(t, chunk=64))
    assert before == int(checksum(t.clone()))
    t.view(torch.int32)[500] ^= 1  # the last bit of one float
    assert int(checksum(t, chunk=64)) != before


def test_environment_and_devices_are_checked():
    assert distributed_env({}) is None
    assert distributed_env({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert distributed_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == (1, 2, 1)
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        distributed_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="cuda:1"):
        rank_device("cuda:1", 0)
    assert rank_device("cpu", 1) == torch.device("cpu")
    assert describe(-9) == "signal SIGKILL" and describe(3) == "exit code 3"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_a_rank_takes_its_local_gpu():
    assert rank_device("auto", 0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="lower --nproc-per-node"):
        rank_device("cuda", torch.cuda.device_count())


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL ranks); make gpu-check runs it there")
def test_two_gpu_ranks_take_one_gpu_steps_and_stay_identical(tmp_path):
    test_two_ranks_take_one_process_steps_and_stay_identical(tmp_path, 2, "ddp", device="cuda")


@pytest.mark.skipif(torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL ranks); make gpu-check runs it there")
def test_two_gpu_ranks_sharded_take_one_gpu_steps(tmp_path):
    test_two_ranks_take_one_process_steps_and_stay_identical(tmp_path, 2, "fsdp", device="cuda")


def _join(*flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gasloc_p2p.cli", "join", *flags],
                          capture_output=True, text=True, timeout=scaled(60), cwd=ROOT,
                          env=dict(os.environ, **(env or {})))


def _check(*flags: str) -> subprocess.CompletedProcess[str]:
    """``gasloc-node join --check FLAGS`` in this process (it starts nothing)."""
    from gasloc_p2p.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["join", *flags])
        except SystemExit as exc:
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(flags, code, out.getvalue(), err.getvalue())


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_in_one_line():
    out = _check("--check", "--nproc-per-node", "3", "--batch-size", "8")
    assert out.returncode == 2
    assert out.stderr == ("gasloc-node join: error: --batch-size=8: must split over "
                          "--nproc-per-node=3 ranks (a multiple of it)\n")
    gpu = _check("--check", "--nproc-per-node", "2", "--device", "cuda:1")
    assert gpu.returncode == 2 and gpu.stderr.count("\n") == 1
    assert "--device='cuda:1'" in gpu.stderr and "use --device cuda or auto" in gpu.stderr
    ok = _check("--check", "--nproc-per-node", "2")
    assert ok.returncode == 0 and ", 2 ranks (DDP)" in ok.stdout, ok.stderr
    sharded = _check("--check", "--nproc-per-node", "2", "--sharding", "fsdp")
    assert sharded.returncode == 0 and ", 2 ranks (FSDP)" in sharded.stdout, sharded.stderr
    compiled = _check("--check", "--nproc-per-node", "2", "--sharding", "fsdp", "--compile")
    assert compiled.returncode == 0 and ", 2 ranks (FSDP)" in compiled.stdout, compiled.stderr
    wrong = _check("--check", "--sharding", "zero3")
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "ddp" in wrong.stderr


def test_sharding_a_node_of_one_rank_is_a_warning_naming_the_missing_flag(caplog):
    with caplog.at_level(logging.WARNING):
        out = _check("--check", "--sharding", "fsdp")
    assert out.returncode == 0, out.stderr
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("--sharding fsdp: a node of one rank") and "--nproc-per-node" in m
               for m in said), said
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        _check("--check", "--sharding", "fsdp", "--nproc-per-node", "2")
    assert not [r for r in caplog.records if "--sharding fsdp" in r.getMessage()]


def test_torchrun_with_another_world_size_than_the_flag_is_refused():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    out = _join("--nproc-per-node", "4", "--open", "--no-init-from-swarm", env=env)
    assert out.returncode == 2
    assert out.stderr.strip().endswith("--nproc-per-node=4 but torchrun started WORLD_SIZE=2 "
                                       "ranks"), out.stderr


class _Ended:
    """A child process that has ended with ``code`` (what ``_watch`` polls)."""

    def __init__(self, code: int) -> None:
        self.returncode = code

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


@pytest.mark.parametrize("codes", [(1, -9), (0, -9), (-15, 0, -9)])
def test_the_launcher_names_the_rank_that_died_even_when_rank_0_went_down_with_it(codes,
                                                                                   capsys):
    """A rank killed mid-step fails rank 0's collective: by the time the launcher looks both
    may be gone (CI run 72), and the line must still name the rank that died."""
    from gasloc_p2p.node import launch

    code = launch._watch([_Ended(c) for c in codes], len(codes))  # type: ignore[list-item]
    died = len(codes) - 1
    assert code == 1
    assert capsys.readouterr().err.strip() == (
        f"gasloc-node join: rank {died} of {len(codes)} died (signal SIGKILL); the node stops;"
        " run the same command again to resume from its checkpoint")


def test_the_launcher_returns_rank_0s_code_when_no_other_rank_failed(capsys):
    from gasloc_p2p.node import launch

    assert launch._watch([_Ended(3), _Ended(0)], 2) == 3  # type: ignore[list-item]
    assert capsys.readouterr().err == ""
