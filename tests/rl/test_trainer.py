"""PolicyOptimizer: DeepSpeed (CPU accelerator, gloo) ZeRO stages, recovery state, NaN guard."""

import pytest
import torch

from hacrl.config.schema import TrainerConfig
from hacrl.errors import NonFiniteLossError
from hacrl.rl.trainer import PolicyOptimizer


def _model():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                      resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))


def _loss(opt, ids):
    return opt.model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("backend, zero", [("deepspeed", 0), ("deepspeed", 2), ("torch", 0)])
def test_steps_train_and_state_restores_exactly(tmp_path, backend, zero):
    cfg = TrainerConfig(backend=backend, zero_stage=zero, lr=1e-2, lr_warmup_updates=1)
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    opt = PolicyOptimizer(_model(), cfg, 4)
    first = _loss(opt, ids).item()
    for _ in range(5):
        gn = opt.step(_loss(opt, ids))
        assert gn > 0
    assert _loss(opt, ids).item() < first
    opt.save_state(tmp_path / "state")
    # continue 2 steps from the live optimizer, and 2 steps from a restored one: same weights
    model_b = _model()
    model_b.load_state_dict(opt.module.state_dict())
    for _ in range(2):
        opt.step(_loss(opt, ids))
    restored = PolicyOptimizer(model_b, cfg, 4)
    restored.load_state(tmp_path / "state")
    assert restored.state.updates == 5
    for _ in range(2):
        restored.step(_loss(restored, ids))
    for (n, a), b in zip(opt.module.state_dict().items(), restored.module.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_nan_loss_is_refused_before_any_step():
    opt = PolicyOptimizer(_model(), TrainerConfig(), 4)
    before = {k: v.clone() for k, v in opt.module.state_dict().items()}
    with pytest.raises(NonFiniteLossError):
        opt.step(torch.tensor(float("nan"), requires_grad=True))
    assert all(torch.equal(before[k], v) for k, v in opt.module.state_dict().items())


class _Planted:
    """What an attacker would plant: unpickling it runs a command."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch '{self.marker}'",))


@pytest.mark.parametrize("backend,zero", [("deepspeed", 0), ("deepspeed", 2), ("torch", 0)])
def test_a_planted_pickle_in_the_recovery_state_never_runs(tmp_path, backend, zero):
    import torch

    from hacrl.errors import UnsafeStateError

    cfg = TrainerConfig(backend=backend, zero_stage=zero, lr=1e-2)
    opt = PolicyOptimizer(_model(), cfg, 4)
    opt.save_state(tmp_path / "state")
    victim = sorted((tmp_path / "state").rglob("*.pt"))[-1]
    marker = tmp_path / "pwned"
    torch.save({"optimizer": _Planted(marker), "updates": 1}, victim)
    with pytest.raises(UnsafeStateError, match=f"{victim}: refusing to load this recovery state"):
        PolicyOptimizer(_model(), cfg, 4).load_state(tmp_path / "state")
    assert not marker.exists()


def test_update_to_weight_in_place_is_the_written_out_expression_bit_for_bit(monkeypatch):
    """The figure's in-place arithmetic (no 64 MB temporary per operation) gives the bits of the
    expression it replaced, chunk boundaries included."""
    import hacrl.rl.trainer as trainer

    monkeypatch.setattr(trainer, "UPDATE_CHUNK", 1000)  # several chunks per tensor
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (2500, 700)]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)
    for _ in range(3):
        for q in params:
            q.grad = torch.randn(q.shape, generator=g)
        opt.step()
    acc = torch.zeros(2, dtype=torch.float64)
    gr = opt.param_groups[0]
    lr, wd, eps, (b1, b2) = gr["lr"], gr["weight_decay"], gr["eps"], gr["betas"]
    for q in params:
        st = opt.state[q]
        t = float(st["step"])
        bc1, bc2 = 1 - b1 ** t, (1 - b2 ** t) ** 0.5
        for th, m, v in zip(q.detach().split(1000), st["exp_avg"].split(1000), st["exp_avg_sq"].split(1000)):
            u = (m.float() / bc1) / (v.float().sqrt() / bc2 + eps)
            prev = (th.float() + lr * u) / (1 - lr * wd)
            acc[0] += (lr * u + lr * wd * prev).pow(2).sum(dtype=torch.float64)
            acc[1] += prev.pow(2).sum(dtype=torch.float64)
    d2, w2 = acc.tolist()
    assert trainer.update_to_weight(opt, partitioned=False) == (d2 ** 0.5) / (w2 ** 0.5)


def test_adamw_foreach_takes_the_steps_of_the_one_tensor_loop():
    """The trainer's AdamW runs foreach (one pass per operation over all tensors); on a CPU it
    takes the same steps, bit for bit, as torch's default one-tensor-at-a-time loop."""
    out = []
    for foreach in (False, True):
        g = torch.Generator().manual_seed(5)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in ((300, 20), (20,), (7, 7))]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach)
        for _ in range(4):
            for q in params:
                q.grad = torch.randn(q.shape, generator=g)
            opt.step()
        out.append([q.detach().clone() for q in params])
    assert all(torch.equal(a, b) for a, b in zip(*out))


@pytest.mark.parametrize("backend, zero, wd", [("deepspeed", 0, 0.0), ("deepspeed", 2, 0.1), ("torch", 0, 0.1)])
def test_update_to_weight_is_the_step_measured_on_a_copy_of_the_weights(backend, zero, wd):
    """The "small step" figure, recovered from AdamW's state, equals ||theta_t - theta_{t-1}|| /
    ||theta_{t-1}|| measured on copies of the weights (which the trainer does not keep)."""
    cfg = TrainerConfig(backend=backend, zero_stage=zero, lr=1e-2, lr_warmup_updates=1, weight_decay=wd)
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(1))
    opt = PolicyOptimizer(_model(), cfg, 4)
    assert opt.last_update_to_weight is None
    for _ in range(3):
        before = torch.cat([p.detach().reshape(-1).clone() for p in opt.module.parameters()])
        opt.step(_loss(opt, ids))
        after = torch.cat([p.detach().reshape(-1) for p in opt.module.parameters()])
        measured = float((after - before).norm() / before.norm())
        assert measured > 1e-4
        assert opt.last_update_to_weight == pytest.approx(measured, rel=1e-3)
