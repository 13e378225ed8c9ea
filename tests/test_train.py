"""The shared training package: schedule, parameter groups, inner step and evaluation."""

from __future__ import annotations

import math

import pytest
import torch

from gasloc_p2p.data import DataError
from gasloc_p2p.model import GPTConfig, build_model
from gasloc_p2p.train import AdamWConfig, InnerLoop, LRSchedule, evaluate, param_groups

TINY = GPTConfig(vocab_size=256, seq_len=16, n_layer=1, n_embd=16, n_head=2)


def test_schedule_warmup_cosine_floor():
    s = LRSchedule(lr=1e-3, warmup_steps=10, min_lr_ratio=0.1, horizon_steps=110)
    assert s.at(0) == 1e-4 and s.at(9) == 1e-3 and s.at(10) == 1e-3
    assert s.at(60) == pytest.approx(0.55e-3, abs=1e-15)  # halfway down the cosine
    assert s.at(110) == pytest.approx(1e-4, abs=1e-15) and s.at(10_000) == s.at(110)
    lrs = [s.at(k) for k in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))


def test_schedule_matches_the_old_simulator_formula():
    """The simulator's former schedule: cosine over the run down to 10%, no separate floor."""
    lr, warmup, total = 3e-3, 20, 200
    s = LRSchedule(lr, warmup, min_lr_ratio=0.1, horizon_steps=total)
    for step in range(warmup, total + 5):
        progress = min(1.0, (step - warmup) / (total - warmup))
        old = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert s.at(step) == pytest.approx(old, rel=1e-14)


def test_schedule_rejects_nonsense():
    with pytest.raises(ValueError, match="min_lr_ratio"):
        LRSchedule(1e-3, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="horizon_steps"):
        LRSchedule(1e-3, horizon_steps=0)
    with pytest.raises(ValueError, match="weight_decay"):
        AdamWConfig(weight_decay=-0.1)


def test_param_groups_decay_matrices_only_unless_asked():
    model = build_model(TINY, 0)
    groups = param_groups(model, AdamWConfig(weight_decay=0.1))
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(p.dim() >= 2 for p in groups[0]["params"])
    assert all(p.dim() < 2 for p in groups[1]["params"]) and groups[1]["params"]
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    (everything,) = param_groups(model, AdamWConfig(weight_decay=0.1, decay_vectors=True))
    assert len(everything["params"]) == len(list(model.parameters()))


def test_inner_loop_sets_the_lr_and_learns():
    model = build_model(TINY, 0)
    loop = InnerLoop(model, LRSchedule(3e-3, warmup_steps=4, horizon_steps=40))
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 8, (8, TINY.seq_len), generator=gen)  # a tiny, learnable language
    y = (x + 1) % 8
    first = loop.step(x, y, 0)
    assert loop.optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 / 4)
    assert not first.requires_grad
    for step in range(1, 41):  # step 40 is the end of the horizon: the floor
        last = loop.step(x, y, step)
    assert loop.optimizer.param_groups[1]["lr"] == pytest.approx(3e-4)
    assert float(last) < float(first) - 1.0
    assert evaluate(model, [(x, y)]) < float(first) - 1.0


def test_evaluate_needs_batches_and_restores_the_mode():
    model = build_model(TINY, 0)
    with pytest.raises(DataError):
        evaluate(model, [])
    model.eval()
    evaluate(model, [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))])
    assert not model.training


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA device (make gpu-check runs it there)"))])
@pytest.mark.parametrize("bucket", [None, 3000], ids=["default-buckets", "small-buckets"])
def test_adamw_in_backward_takes_the_steps_of_one_adamw(bucket, device, monkeypatch):
    """BackwardAdamW (fused AdamW over buckets of parameters, stepped by the
    gradient-accumulation hook of each bucket's last one; the CUDA path) against one fused
    AdamW over the same groups: the same parameters bit for bit, no gradient left after the
    step, and a state dict one AdamW loads. Small buckets: many of them, and one holding a
    parameter the loss never reaches (stepped by ``step`` after the backward)."""
    from gasloc_p2p.model import GPT, GPTConfig
    from gasloc_p2p.train import optim
    from gasloc_p2p.train.optim import AdamWConfig, BackwardAdamW, param_groups

    if bucket is not None:
        monkeypatch.setattr(optim, "BUCKET_ELEMS", bucket)
    cfg = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_embd=32, n_head=2)
    torch.manual_seed(0)
    a = GPT(cfg)
    b = GPT(cfg)
    for m in (a, b):
        m.unused = torch.nn.Parameter(torch.ones(3))  # no gradient ever
    b.load_state_dict(a.state_dict())
    a, b = a.to(device), b.to(device)
    whole = torch.optim.AdamW(param_groups(a, AdamWConfig()), lr=1e-2, betas=(0.9, 0.95),
                              fused=True)
    hooked = BackwardAdamW(param_groups(b, AdamWConfig()), 1e-2, (0.9, 0.95))
    assert (len(hooked.optimizers) == 2) == (bucket is None)  # one bucket per group, or many
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randint(0, 64, (2, 16), generator=gen).to(device)
        _, loss = a(x, x)
        loss.backward()
        whole.step()
        whole.zero_grad()
        _, loss = b(x, x)
        loss.backward()
        hooked.step()
        assert all(p.grad is None for p in b.parameters())  # stepped and dropped
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    saved = hooked.state_dict()
    assert saved["state"].keys() == whole.state_dict()["state"].keys()
    other = torch.optim.AdamW(param_groups(a, AdamWConfig()), lr=1e-2)
    other.load_state_dict(saved)
    fresh = GPT(cfg)
    fresh.unused = torch.nn.Parameter(torch.ones(3))
    fresh.to(device)
    restored = BackwardAdamW(param_groups(fresh, AdamWConfig()), 1e-2, (0.9, 0.95))
    restored.load_state_dict(whole.state_dict())
    assert len(restored.state) == len(list(a.parameters())) - 1  # the unused one has none
    restored.state.clear()
    assert len(restored.state) == 0


def test_a_dropped_adamw_in_backward_frees_its_state_and_parameters():
    """The gradient hooks live where the garbage collector cannot see them: a hook holding
    the optimizer strongly kept it, its moments and the parameters alive after the node was
    dropped (1.5 GiB of a 135M node on a GPU)."""
    import gc
    import weakref

    from gasloc_p2p.model import GPT, GPTConfig
    from gasloc_p2p.train.optim import AdamWConfig, BackwardAdamW, param_groups

    model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_embd=32, n_head=2))
    hooked = BackwardAdamW(param_groups(model, AdamWConfig()), 1e-2, (0.9, 0.95))
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    assert len(hooked.state) > 0
    refs = [weakref.ref(hooked), weakref.ref(next(model.parameters()))]
    del model, hooked
    gc.collect()
    assert [r() is None for r in refs] == [True, True]
