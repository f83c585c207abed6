"""The CPU Muon variant against torch.optim.Muon and an FP64 Newton-Schulz reference."""

import torch

from megatron_geo.optim import MuonNS, newton_schulz5


def _ns_fp64(u, steps=5):
    a, b, c = 3.4445, -4.7750, 2.0315
    x = u.double()
    tall = x.shape[0] > x.shape[1]
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def test_newton_schulz_fp32_matches_fp64():
    g = torch.Generator().manual_seed(0)
    for shape in [(16, 40), (40, 16), (24, 24)]:
        u = torch.randn(shape, generator=g)
        out = newton_schulz5(u, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
        torch.testing.assert_close(out.double(), _ns_fp64(u), rtol=1e-4, atol=1e-5)


def _muon_fp64(w0, grads, lr=0.02, wd=0.1, m=0.95):
    """Muon's update written out in FP64 (Jordan et al. 2024; lr' = 0.2 sqrt(max(A, B)) lr)."""
    w, buf = w0.double().clone(), torch.zeros_like(w0, dtype=torch.float64)
    for gr in grads:
        gr = gr.double()
        buf = m * buf + (1 - m) * gr
        upd = (1 - m) * gr + m * buf
        w = w * (1 - lr * wd) - 0.2 * max(w.shape) ** 0.5 * lr * _ns_fp64(upd)
    return w


def test_muon_ns_fp32_matches_fp64_muon_and_torch_muon():
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(32, 48, generator=g)
    grads = [torch.randn(32, 48, generator=g) for _ in range(3)]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ref64 = _muon_fp64(w0, grads)
    upd = (ref64 - w0.double()).norm()
    ours, torch_w = w0.clone(), w0.clone()
    opt_a, opt_b = MuonNS([ours], **kw), torch.optim.Muon([torch_w], **kw)
    for gr in grads:
        ours.grad, torch_w.grad = gr.clone(), gr.clone()
        opt_a.step()
        opt_b.step()
    assert (ours.double() - ref64).norm() / upd < 1e-4  # FP32 Newton-Schulz: FP32-accurate
    assert (torch_w.double() - ref64).norm() / upd < 0.05  # torch's BF16 Newton-Schulz: a few percent
    assert torch.equal(opt_a.state[ours]["momentum_buffer"], opt_b.state[torch_w]["momentum_buffer"])


def test_gram_muon_ns_fp32_matches_fp64_muon():
    """``ns="gram"`` (Gram Newton-Schulz) follows the same FP64 Muon trajectory, on a wide and a tall matrix."""
    g = torch.Generator().manual_seed(2)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    for shape in ((32, 48), (48, 32)):
        w0 = torch.randn(*shape, generator=g)
        grads = [torch.randn(*shape, generator=g) for _ in range(3)]
        ref64 = _muon_fp64(w0, grads)
        w = w0.clone()
        opt = MuonNS([w], ns="gram", **kw)
        for gr in grads:
            w.grad = gr.clone()
            opt.step()
        assert (w.double() - ref64).norm() / (ref64 - w0.double()).norm() < 1e-4, shape
