"Grad mode and training: sketches stay out of autograd, gradients equal the plain model's, the weight cache sees every write."
import numpy as np
import pandas as pd
import torch
import torch.nn as nn
import torch.nn.functional as F

from opscope.sketch import STATS
from opscope.sites import trace
from opscope.inject import inject_matmul_stats, refresh_static
from opscope.recorder import decode_stats
from opscope.miner import cross_step, mine
from opscope.zoo import mlp, transformer, make_tensor


def _train_model(seed):
    return transformer(layers=1, d=32, heads=2, seed=seed).train().requires_grad_(True)


def test_gradients_equal_plain_in_train_mode_with_stats_returned():
    m = _train_model(11)
    x = make_tensor('gaussian', (3, 12, 32), seed=12)
    inj = inject_matmul_stats(trace(m, x))
    y, stats = inj(x)                                   # outside no_grad: no autograd error
    assert stats and not any(t.requires_grad for t in stats.values())
    (y ** 2).sum().backward()
    got = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    (m(x) ** 2).sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert torch.isfinite(stats['layers.0.ffn.up/out/absmax'])


def test_grad_mode_mlp_with_nonfinite_input_counts():
    m = mlp(layers=2, d_in=24, hidden=32, d_out=8, seed=13).train().requires_grad_(True)
    x = make_tensor('gaussian', (8, 24), seed=14)
    x[0, 0] = float('nan')
    inj = inject_matmul_stats(trace(m, x))
    y, stats = inj(x)
    key = next(k for k in stats if k.endswith('/lhs/nan_count'))
    assert stats[key].item() == 1


def test_data_write_invalidates_the_weight_sketch():
    lin = nn.Linear(16, 16, bias=False)
    x = torch.randn(4, 16)
    inj = inject_matmul_stats(trace(lin, x))
    key = next(k for k in inj(x)[1] if k.endswith('/rhs/absmax'))
    lin.weight.data.mul_(10)                            # bumps no version counter
    torch.testing.assert_close(inj(x)[1][key], lin.weight.abs().max())
    with torch.no_grad(): lin.weight[0, 0] = 1e3        # an in-place write
    torch.testing.assert_close(inj(x)[1][key], torch.tensor(1e3))
    lin.weight.data = torch.randn(16, 16) * 7           # a new .data
    torch.testing.assert_close(inj(x)[1][key], lin.weight.abs().max())
    w = lin.weight.data.clone(); lin.weight.data.copy_(w.flip(1))    # a permutation keeps every value
    torch.testing.assert_close(inj(x)[1][key.replace('absmax', 'chan_absmax')], lin.weight.abs().amax(0))
    assert refresh_static(inj) == 0                     # nothing changed since the last call


def test_version_mode_skips_the_value_read():
    lin = nn.Linear(8, 8, bias=False)
    x = torch.randn(2, 8)
    inj = inject_matmul_stats(trace(lin, x), cache_weights='version')
    key = next(k for k in inj(x)[1] if k.endswith('/rhs/absmax'))
    before = inj(x)[1][key].clone()
    with torch.no_grad(): lin.weight.mul_(3)            # in-place: seen by the version counter
    torch.testing.assert_close(inj(x)[1][key], 3 * before)


def test_training_steps_recorded_weights_not_stationary():
    torch.manual_seed(15)
    m = _train_model(15)
    xs = [make_tensor('gaussian', (4, 12, 32), seed=100 + s) for s in range(6)]
    inj = inject_matmul_stats(trace(m, xs[0]))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    frames = []
    for step, x in enumerate(xs):
        y, stats = inj(x)
        frames.append(decode_stats(stats, run_id='train', step=step, backend='cpu', dist='gaussian'))
        opt.zero_grad(); (y ** 2).mean().backward(); opt.step()
    df = pd.concat(frames, ignore_index=True)
    weights = set(inj.manifest[inj.manifest.static & (inj.manifest.role == 'rhs')].site)
    assert len(weights) == 6                            # q, k, v, o, up, down
    cs = cross_step(df).reset_index()
    rhs = cs[(cs.role == 'rhs') & cs.site.isin(weights)]
    assert len(rhs) and not rhs.stationary.any(), rhs
    found = mine(df)
    stat_rhs = found[(found.exploit == 'stationary') & (found.role == 'rhs')]
    assert stat_rhs.empty, stat_rhs
    # frozen weights (eval, no optimizer) are still stationary
    frozen = pd.concat([decode_stats(inj(x)[1], run_id='frozen', step=s, backend='cpu', dist='gaussian') for s, x in enumerate(xs)])
    cf = cross_step(frozen).reset_index()
    assert cf[(cf.role == 'rhs') & cf.site.isin(weights)].stationary.all()
