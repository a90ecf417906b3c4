"kernel_int8's compiled graph (fused_int8) against its eager ops: same outputs and verdicts at any size, the eager fallbacks, one compile per variant and thread count."
import warnings
import pytest
import torch
import torch.nn.functional as F
import opscope.kernels as K
from opscope.kernels import kernel_int8


def _both(k, x, limit):
    "(eager, fused) results of `k.rows(x, limit)` and `k.fn(x)`."
    out = {}
    for fuse in (False, True):
        K.FUSE_INT8 = fuse
        try: out[fuse] = (k.rows(x, limit), k.fn(x))
        finally: K.FUSE_INT8 = True
    return out[False], out[True]


@pytest.mark.parametrize('M,Kd,N,outliers,bias', [(1, 64, 48, None, True), (3, 96, 40, [0, 7], True), (17, 160, 8, [5], False),
                                                  (40, 32, 200, None, False), (64, 384, 384, [1, 2, 3], True)])
def test_fused_matches_eager(M, Kd, N, outliers, bias):
    g = torch.Generator().manual_seed(M * 1000 + Kd)
    w, b = torch.randn(N, Kd, generator=g), (torch.randn(N, generator=g) if bias else None)
    x = torch.randn(M, Kd, generator=g)
    if M > 2: x[1, 3], x[2] = float('nan'), 0.          # a NaN row and an all-zero row
    k = kernel_int8(w, b, outliers)
    ((ye, ve), fe), ((yf, vf), ff) = _both(k, x, 6.)
    fin = x.isfinite().all(1)
    torch.testing.assert_close(yf[fin], ye[fin], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ff[fin], fe[fin], rtol=1e-5, atol=1e-4)
    assert not yf[~fin].isfinite().any()                 # a NaN row comes out non-finite, as from the dense op
    assert vf.rows().tolist() == ve.rows().tolist() and vf.all() == ve.all()
    ref = F.linear(x, w, b)
    assert float((yf - ref)[fin].norm() / ref[fin].norm()) < 0.05
    assert K._FUSED[outliers is not None, bias, True, torch.get_num_threads()] is not None   # it ran compiled


def test_inputs_the_graph_does_not_take_run_eager():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 64, generator=g), torch.randn(24, generator=g)
    k = kernel_int8(w, b)
    x = torch.randn(64, 6, generator=g).t()              # a strided view: made contiguous first
    torch.testing.assert_close(k.fn(x), k.fn(x.contiguous()), rtol=0, atol=0)
    xg = torch.randn(6, 64, generator=g, requires_grad=True)   # needs a gradient: the eager ops
    torch.testing.assert_close(k.fn(xg).detach(), k.fn(xg.detach()), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(k.fn(x.double()), k.fn(x.contiguous()), rtol=1e-5, atol=1e-4)   # float64: the eager ops
    assert k.fn(torch.empty(0, 64)).shape == (0, 24)


def test_a_graph_that_cannot_compile_falls_back_with_one_warning(monkeypatch):
    def broken(*a): raise RuntimeError('no C++ compiler')
    monkeypatch.setattr(K, '_compile_int8', broken)
    monkeypatch.setattr(K, '_FUSED', {})
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(16, 32, generator=g), torch.randn(4, 32, generator=g)
    k = kernel_int8(w, None)
    with pytest.warns(UserWarning, match='runs as eager ops.*no C\\+\\+ compiler'): y = k.fn(x)
    with warnings.catch_warnings():
        warnings.simplefilter('error'); y2 = k.fn(x)       # warned once: the None is kept
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    monkeypatch.setattr(K, 'FUSE_INT8', False)
    torch.testing.assert_close(k.fn(x), y, rtol=0, atol=0)


def test_one_graph_per_thread_count():
    g = torch.Generator().manual_seed(2)
    k, x = kernel_int8(torch.randn(16, 32, generator=g), torch.randn(16, generator=g)), torch.randn(4, 32, generator=g)
    n = torch.get_num_threads()
    try:
        y1 = k.fn(x)
        torch.set_num_threads(2 if n != 2 else 1)
        y2 = k.fn(x)
        assert (False, True, False, torch.get_num_threads()) in K._FUSED and (False, True, False, n) in K._FUSED
    finally: torch.set_num_threads(n)
    torch.testing.assert_close(y1, y2, rtol=0, atol=0)


def test_a_tracer_sees_the_eager_ops():
    from torch.fx.experimental.proxy_tensor import make_fx
    g = torch.Generator().manual_seed(3)
    k, x = kernel_int8(torch.randn(16, 32, generator=g), torch.randn(16, generator=g)), torch.randn(4, 32, generator=g)
    gm = make_fx(k.fn)(x)
    assert any(n.target is torch.ops.aten._int_mm.default for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), k.fn(x), rtol=1e-5, atol=1e-4)
