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
    assert K._FUSED[outliers is not None, bias, True, torch.get_num_threads()] is not None or torch.backends.cpu.get_cpu_capability() != 'AVX512'   # it ran compiled (or the eager ops where Inductor cannot compile)


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
    mm = torch.ops.aten._int_mm.default if K.int_mm_exact() else torch.ops.aten.mm.default   # where _int_mm is inexact, kernel_int8 multiplies in float32
    assert any(n.target is mm for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), k.fn(x), rtol=1e-5, atol=1e-4)


# fbgemm kernels and the machine (issue 49)
from opscope.kernels import kernel_int8_fbgemm, kernel_fp16_weight, machine, format_machine, capped_env, ISA_CAPS

fbgemm = pytest.mark.skipif('fbgemm' not in torch.backends.quantized.supported_engines, reason='no fbgemm in this torch build')


@fbgemm
@pytest.mark.parametrize('M,Kd,N,outliers,bias', [(1, 64, 48, None, True), (5, 96, 40, [0, 7], True), (40, 160, 24, [5], False)])
def test_int8_fbgemm_scales_each_row(M, Kd, N, outliers, bias):
    "Per-row scales: each row's error is that of the row alone (a row scaled by 1e-3 comes out scaled by 1e-3), the guard refuses NaN, Inf and zero rows, and they leave the other rows alone."
    g = torch.Generator().manual_seed(M + Kd)
    w, b = torch.randn(N, Kd, generator=g) * 0.05, (torch.randn(N, generator=g) if bias else None)
    x = torch.randn(M, Kd, generator=g)
    k = kernel_int8_fbgemm(w, b, outliers)
    y = k.fn(x)
    ref = F.linear(x, w, b)
    assert float((y - ref).norm() / ref.norm()) < 0.06
    y0 = F.linear(x * 1e-3, w)
    got = kernel_int8_fbgemm(w, None, outliers).fn(x * 1e-3)
    assert float((got - y0).norm() / y0.norm()) < 0.06                      # a quiet call keeps its precision
    if M > 2:
        xb = x.clone(); xb[0, 1], xb[1, 2], xb[2] = float('nan'), float('inf'), 0.
        yb, v = k.rows(xb, 1e3)
        assert v.rows().tolist() == [False, False, False] + [True] * (M - 3) and not v.all()
        assert not yb[:2].isfinite().any()
        torch.testing.assert_close(yb[3:], y[3:])                             # untouched by the bad rows
    assert k.rows(x, None)[1] is None and k.limit is None and not k.exact


@fbgemm
def test_fp16_weight_needs_no_guard():
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(32, 64, generator=g), torch.randn(32, generator=g), torch.randn(9, 64, generator=g) * 1e5   # rows far past float16's range
    k = kernel_fp16_weight(w, b)
    ref = F.linear(x, w, b)
    assert k.rows is None and float((k.fn(x) - ref).norm() / ref.norm()) < 1e-3
    with pytest.raises(NotImplementedError, match='beyond float16 range'): kernel_fp16_weight(w * 1e5, b)


def test_fbgemm_kernels_raise_no_warning():
    if 'fbgemm' not in torch.backends.quantized.supported_engines: pytest.skip('no fbgemm')
    w = torch.randn(16, 32)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        kernel_int8_fbgemm(w, None, [3]).fn(torch.randn(4, 32)); kernel_fp16_weight(w, None).fn(torch.randn(4, 32))


def test_machine_says_what_it_has():
    m = machine()
    assert {'cpu', 'isa', 'caps', 'flags', 'bf16_native', 'fbgemm', 'onednn', 'mkl', 'cuda', 'threads', 'torch'} <= set(m)
    assert m['isa'] == torch.backends.cpu.get_cpu_capability() and m['torch'] in format_machine(m)
    env = capped_env('avx2', {'PATH': '/bin'})
    assert env['PATH'] == '/bin' and all(env[k] == v for k, v in ISA_CAPS['avx2'].items())
    with pytest.raises(ValueError, match='isa'): capped_env('sse9')


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ('AVX2', 'AVX512'), reason='an x86 CPU with AVX2 at least')
def test_avx2_cap_takes_effect():
    "A process started with `capped_env('avx2')` dispatches ATen to AVX2 and runs no native bf16 in oneDNN; its machine() says so."
    import json, os, subprocess, sys
    code = "import json, opscope.kernels as k; m = k.machine(); print(json.dumps(dict(isa=m['isa'], bf16=m['bf16_native'], caps=m['caps'])))"
    r = subprocess.run([sys.executable, '-c', code], env=capped_env('avx2', {**os.environ, 'OMP_NUM_THREADS': '1'}), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m['isa'] == 'AVX2' and m['bf16'] is False and m['caps'] == ISA_CAPS['avx2']


@fbgemm
@pytest.mark.parametrize('M,Kd,N,outliers,bias', [(1, 64, 48, None, True), (1, 96, 40, [3], False), (7, 96, 40, [0, 7], True),
                                                  (40, 160, 24, [5], False), (1000, 128, 64, None, False), (1000, 128, 64, [2, 9], True)])
def test_int8_fbgemm_fused_rows_match_eager(M, Kd, N, outliers, bias):
    "kernel_int8_fbgemm's compiled row graph (fused_fbgemm_rows) and its eager ops: the same y and the same Verdict rows on NaN, ±Inf, all-zero rows and outlier channels, guarded or not."
    g = torch.Generator().manual_seed(M * 7 + Kd)
    w, b = torch.randn(N, Kd, generator=g) * 0.05, (torch.randn(N, generator=g) if bias else None)
    x = torch.randn(M, Kd, generator=g)
    x[:, 5] *= 30                                                          # an outlier channel (split off where `outliers` holds 5)
    if M > 2: x[0, 1], x[1, 2], x[2] = float('nan'), float('inf'), 0.
    if M > 3: x[3, 4] = -float('inf')
    if M == 1000: x[500:510] = 0.; x[900, 0] = float('nan')
    k = kernel_int8_fbgemm(w, b, outliers)
    ((ye, ve), fe), ((yf, vf), ff) = _both(k, x, 6.)
    assert K._FUSED[('fbgemm-rows', outliers is not None, True, torch.get_num_threads())] is not None or torch.backends.cpu.get_cpu_capability() != 'AVX512'
    fin = x.isfinite().all(1)
    torch.testing.assert_close(yf, ye, rtol=1e-5, atol=1e-4, equal_nan=True)
    torch.testing.assert_close(ff, fe, rtol=1e-5, atol=1e-4, equal_nan=True)
    assert not yf[~fin].isfinite().any() and yf[fin].isfinite().all()   # a NaN or Inf row comes out NaN, the others finite
    assert vf.rows().tolist() == ve.rows().tolist() and vf.all() == ve.all()
    xi = x.index_fill(1, torch.tensor(outliers or [], dtype=torch.long), 0.)   # what the guard reads: the split channels zeroed
    bad = ~xi.isfinite().all(1)
    assert bad.any() == (M > 2) and not vf.rows()[bad].any() and not vf.rows()[xi.eq(0).all(1)].any()   # refused: non-finite and all-zero rows
    assert not vf.g[bad].isfinite().any()                                 # a non-finite row's guard value is non-finite
    assert k.rows(x, None)[1] is None


@fbgemm
def test_int8_fbgemm_fused_rows_fall_back(monkeypatch):
    "The eager ops for inputs the graph does not take (no rows), a strided view (made contiguous), and after one warning where it cannot compile."
    g = torch.Generator().manual_seed(11)
    w, b = torch.randn(24, 64, generator=g) * 0.05, torch.randn(24, generator=g)
    k, x = kernel_int8_fbgemm(w, b, [3]), torch.randn(64, 6, generator=g).t()
    torch.testing.assert_close(k.fn(x), k.fn(x.contiguous()), rtol=0, atol=0)
    assert k.fn(torch.empty(0, 64)).shape == (0, 24)
    def broken(*a): raise RuntimeError('no C++ compiler')
    monkeypatch.setattr(K, '_compile_fbgemm_rows', broken)
    monkeypatch.setattr(K, '_FUSED', {})
    with pytest.warns(UserWarning, match='kernel_int8_fbgemm: runs as eager ops.*no C\\+\\+ compiler'): y = k.fn(x)
    with warnings.catch_warnings():
        warnings.simplefilter('error'); y2 = k.fn(x)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)


def test_int8_fbgemm_under_autograd():
    "A model called without `torch.no_grad` (as many users call one): the kernel runs on an input that needs a gradient, with and without bias and split."
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32)
    x = torch.randn(5, 64, requires_grad=True)
    for b, out in [(lin.bias, None), (lin.bias, [3]), (None, None), (None, [3])]:
        k = kernel_int8_fbgemm(lin.weight, b, out)
        y, ref = k.rows(x, 100.)[0], torch.nn.functional.linear(x, lin.weight, b)
        assert float((y - ref).detach().norm() / ref.detach().norm()) < 0.02
