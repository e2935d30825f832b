"""Outer Nesterov step, pseudo-gradient and merge against torch and hand-computed values."""

import pytest
import torch

from dilonode.algo.outer import NonFiniteError, OuterState, merge, pseudo_gradient


@pytest.mark.parametrize("nesterov,momentum", [(True, 0.9), (False, 0.9), (False, 0.0)])
def test_outer_step_matches_torch_sgd(nesterov, momentum):
    torch.manual_seed(0)
    init = torch.randn(1000)
    ours = OuterState(init, lr=0.7, momentum=momentum, nesterov=nesterov)
    ref = torch.nn.Parameter(init.clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=momentum, nesterov=nesterov)
    for _ in range(5):
        grad = torch.randn(1000)
        ours.step(grad)
        ref.grad = grad.clone()
        opt.step()
        assert torch.allclose(ours.weights, ref.detach(), atol=0, rtol=1e-6)


def test_hand_computed_nesterov_two_steps():
    s = OuterState(torch.tensor([1.0]), lr=0.5, momentum=0.5, nesterov=True)
    s.step(torch.tensor([1.0]))  # buf = 1; update = 1 + 0.5*1 = 1.5; w = 1 - 0.75 = 0.25
    assert s.weights.item() == pytest.approx(0.25)
    s.step(torch.tensor([2.0]))  # buf = 0.5 + 2 = 2.5; update = 2 + 1.25 = 3.25; w = -1.375
    assert s.weights.item() == pytest.approx(-1.375)


def test_lr1_momentum0_alpha0_gives_plain_average():
    g = torch.tensor([1.0, 2.0, 3.0])
    locals_ = [torch.tensor([0.0, 2.0, 5.0]), torch.tensor([2.0, 4.0, 1.0])]
    mean_d = torch.stack([pseudo_gradient(g, w) for w in locals_]).mean(0)
    new_g = OuterState(g, lr=1.0, momentum=0.0).step(mean_d)
    assert torch.allclose(merge(locals_[0], new_g, 0.0), torch.stack(locals_).mean(0))


def test_merge_alpha():
    w, g = torch.tensor([4.0]), torch.tensor([0.0])
    assert merge(w, g, 0.5).item() == 2.0
    assert merge(w, g, 1.0).item() == 4.0
    assert merge(w, g, 0.0).item() == 0.0


def test_non_finite_average_is_refused_and_state_kept():
    s = OuterState(torch.ones(3), lr=0.7, momentum=0.9)
    with pytest.raises(NonFiniteError, match="1 non-finite"):
        s.step(torch.tensor([0.0, float("nan"), 0.0]))
    assert torch.equal(s.weights, torch.ones(3)) and s.steps == 0
    assert torch.equal(s.momentum_buf, torch.zeros(3))


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_sparse_step_moves_only_its_positions_as_torch_would_them_alone(nesterov):
    torch.manual_seed(1)
    init = torch.randn(100)
    ours = OuterState(init, lr=0.7, momentum=0.9, nesterov=nesterov)
    ours.step(torch.randn(100))  # a dense round: momentum everywhere
    before_w, before_m = ours.weights.clone(), ours.momentum_buf.clone()
    at = torch.tensor([3, 17, 42, 99])
    ref = torch.nn.Parameter(before_w[at].clone())
    opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=nesterov)
    opt.state[ref]["momentum_buffer"] = before_m[at].clone()
    mean = torch.zeros(100)
    mean[at] = torch.randn(4)
    ours.step(mean, positions=at)
    ref.grad = mean[at].clone()
    opt.step()
    assert torch.allclose(ours.weights[at], ref.detach(), atol=0, rtol=1e-6)
    off = torch.ones(100, dtype=torch.bool)
    off[at] = False
    # The round said nothing there: no momentum keeps moving them.
    assert torch.equal(ours.weights[off], before_w[off])
    assert torch.equal(ours.momentum_buf[off], before_m[off])
    assert ours.steps == 2
