"The core loop end to end: planted structure on fresh seeds, the CLI as a user runs it, and bad input."
import math, os, zipfile
from pathlib import Path
import numpy as np, pandas as pd, pytest, torch, torch.nn as nn
from hypothesis import given, settings, strategies as st, HealthCheck

from opscope.zoo import DISTS, make_tensor, mlp, transformer, moe, mnist_mlp, example_input, outlier_channels
from opscope.sketch import sketch, STATS
from opscope.sites import trace
from opscope.inject import inject_matmul_stats, gate
from opscope.recorder import record, read_sketches, sweep, SCHEMA, SWEEP_SHAPES
from opscope.miner import mine
from opscope.bench import planted_check


@pytest.mark.parametrize('seed,structure_seed', [(1000, 0), (2024, 7)])
def test_planted_structure_every_shape_fresh_seeds(seed, structure_seed):
    "Seeds the notebooks never use; every shape of the grid; every distribution."
    sw = sweep(seed=seed, structure_seed=structure_seed, steps=3)
    found = mine(sw)
    check = planted_check(found, sw, structure_seed=structure_seed)
    assert len(check) == len(SWEEP_SHAPES) * len(DISTS)
    assert check.ok.all(), check[~check.ok].to_string()
    lhs = found[found.role == 'lhs']
    for d in ('gaussian', 'uniform'):
        assert set(lhs[lhs.dist == d].exploit) <= {'int8', 'int4'}


def test_outlier_channels_named_for_other_structure_seed():
    sw = sweep(shapes=((128, 512, 64),), dists=['outlier'], seed=5, structure_seed=3, steps=3)
    f = mine(sw)
    got = sorted(f[(f.exploit == 'channel-outliers') & (f.role == 'lhs')].idx)
    assert got == outlier_channels(512, 3)


@pytest.mark.slow
def test_main_job_cli(tmp_path, cli):
    r = cli('opscope-sweep', str(tmp_path / 'sweep.csv'), '--steps', '2', '--quiet')
    assert r.returncode == 0, r.stderr
    r = cli('opscope-mine', str(tmp_path / 'sweep.csv'), '--out', str(tmp_path / 'f.csv'))
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith('sparse90-64x256x256') and ' lhs ' in l)
    import re
    assert 0.07 < float(re.search(r'density (\S+)', line).group(1)) < 0.13 and 'sparse-GEMM (skip 90% zeros)' in line
    line = next(l for l in r.stdout.splitlines() if l.startswith('gaussian-64x256x256') and ' lhs ' in l)
    assert 'density 1.000' in line and 'sparse' not in line
    f = pd.read_csv(tmp_path / 'f.csv')
    assert list(f.columns) == ['run_id', 'dist', 'site', 'role', 'stat', 'idx', 'value', 'exploit', 'detail']


@pytest.mark.slow
def test_sweep_parquet(tmp_path, cli):
    r = cli('opscope-sweep', str(tmp_path / 's.parquet'), '--steps', '1', '--quiet')
    assert r.returncode == 0, r.stderr
    df = read_sketches(tmp_path / 's.parquet')
    assert list(df.columns) == SCHEMA and df.run_id.nunique() == 28
    assert not (tmp_path / 's.parquet.parts').exists()


def _one_clear_line(r):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and 'error' in lines[0] and 'Traceback' not in r.stderr, r.stderr
    return lines[0]


@pytest.mark.slow
def test_cli_bad_input(tmp_path, cli):
    good = tmp_path / 'good.csv'
    record(mlp(layers=2), [torch.randn(4, 256)], sink=good)
    text = good.read_text().splitlines()
    cases = {
        'missing.csv': None,
        'cols.csv': '\n'.join(l.rsplit(',', 1)[0] for l in text) + '\n',
        'types.csv': '\n'.join(text[:3] + [text[3].replace(',0,', ',x,', 1)] + text[4:]) + '\n',
        'garbage.csv': '\n'.join(text[:2] + ['1,2,3,4,5,6,7,8,9,10,11,12,13,14,15'] + text[2:]) + '\n',
        'bad.parquet': b'not parquet at all',
        'empty.csv': '',
        'file.txt': 'hello',
    }
    for name, content in cases.items():
        p = tmp_path / name
        if isinstance(content, bytes): p.write_bytes(content)
        elif content is not None: p.write_text(content)
        out = tmp_path / f'{name}.findings.csv'
        msg = _one_clear_line(cli('opscope-mine', str(p), '--out', str(out)))
        assert name in msg
        assert not out.exists()
    # sweep: bad output path → nothing written
    msg = _one_clear_line(cli('opscope-sweep', str(tmp_path / 'out.json')))
    assert 'out.json' in msg and not (tmp_path / 'out.json').exists()
    msg = _one_clear_line(cli('opscope-sweep', str(tmp_path / 'nodir' / 'x.csv')))
    assert 'does not exist' in msg


def test_gate_every_zoo_model():
    for m in (mlp(), transformer(), moe(), mnist_mlp(), transformer(causal=True, layers=1)):
        x = example_input(m, seed=11)
        gm = trace(m, x)
        y, stats = gate(gm, inject_matmul_stats(gm), x)
        assert torch.equal(y, m(x))
        assert stats and all(k.count('/') == 2 for k in stats)


def test_user_module_untouched():
    m = transformer(layers=1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = example_input(m)
    gm = trace(m, x)
    n_nodes = len(gm.graph.nodes)
    inject_matmul_stats(gm)
    assert len(gm.graph.nodes) == n_nodes
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    assert isinstance(m(x), torch.Tensor)


def test_export_fallback_records():
    class Branchy(nn.Module):
        def __init__(self): super().__init__(); self.l = nn.Linear(16, 8)
        def forward(self, x):
            if x.shape[0] > 1: x = torch.relu(x)
            return self.l(x)
    df = record(Branchy(), [torch.randn(4, 16) for _ in range(2)])
    assert set(df.site) == {'l'}
    d = df[(df.stat == 'density') & (df.role == 'lhs')].value
    assert (d < 0.8).all()     # the ReLU inside the branch was traced by torch.export


def test_no_matmul_model_clear_message():
    with pytest.raises(ValueError, match='no matmul sites'):
        record(nn.Sequential(nn.ReLU(), nn.Tanh()), [torch.randn(3, 4)])


def test_empty_nan_inf_int_half_inputs():
    m = nn.Linear(8, 4)
    df = record(m, [torch.empty(0, 8)])
    lhs = df[(df.role == 'lhs')].set_index('stat').value
    assert lhs['numel'] == 0 and math.isnan(lhs['mean'])
    x = torch.randn(6, 8); x[0, 1] = float('nan'); x[2, 3] = float('inf'); x[4, 0] = float('-inf')
    df = record(m, [x])
    s = df[(df.role == 'lhs') & (df.stat.isin(['nan_count', 'inf_count', 'mean', 'absmax', 'std', 'density']))].set_index('stat').value
    assert (s['nan_count'], s['inf_count']) == (1, 2)
    assert np.isfinite(s[['mean', 'absmax', 'std', 'density']]).all()
    # out has NaN rows: counted there too, other stats stay finite
    o = df[(df.role == 'out')].set_index('stat').value
    assert o['nan_count'] >= 4 and np.isfinite(o['absmax'])
    s = dict(zip(STATS, sketch(torch.randint(-5, 5, (7, 3)))))
    assert s['max'] <= 4 and s['min'] >= -5
    h = nn.Linear(8, 4).half()
    if True:  # half matmul on CPU is supported by torch 2.x
        df = record(h, [torch.randn(5, 8).half()])
        assert np.isfinite(df[df.stat == 'mean'].value).all()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.integers(1, 40), cols=st.integers(1, 40), nans=st.integers(0, 5), seed=st.integers(0, 10_000))
def test_sketch_matches_numpy(rows, cols, nans, seed):
    g = np.random.default_rng(seed)
    a = g.standard_normal((rows, cols)).astype(np.float32) * (g.random((rows, cols)) < 0.7)
    idx = g.integers(0, a.size, nans)
    a.reshape(-1)[idx] = np.nan
    s = {k: v.numpy() for k, v in zip(STATS, sketch(torch.from_numpy(a)))}
    clean = np.nan_to_num(a, nan=0.0)
    assert s['nan_count'] == np.isnan(a).sum()
    assert s['numel'] == a.size
    np.testing.assert_allclose(s['chan_absmax'], np.abs(clean).max(0), rtol=1e-6)
    np.testing.assert_allclose(s['chan_density'], (clean != 0).mean(0), rtol=1e-6)
    np.testing.assert_allclose(s['row_energy'], np.linalg.norm(clean, axis=1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s['mean'], clean.mean(), atol=1e-5)
    np.testing.assert_allclose(s['std'], clean.std(), rtol=1e-3, atol=1e-4)
    assert s['hist'].sum() == a.size


def test_read_sketches_roundtrip_and_partial_line(tmp_path):
    p = tmp_path / 'r.csv'
    df = record(mlp(layers=2), [torch.randn(4, 256) for _ in range(3)], sink=p, keep=True)
    raw = p.read_bytes()
    p.write_bytes(raw[:-40])            # a kill mid-line, without the commit log: the step's manifest says it is short
    with pytest.warns(UserWarning, match='step 2 of run run'):
        back = read_sketches(p)
    assert len(back) == (df.step < 2).sum() and sorted(back.step.unique()) == [0, 1]   # the cut step dropped whole


def test_package_builds_with_entry_points(tmp_path):
    "Install-from-clean check without the network: the wheel holds every module and the console scripts."
    import subprocess, sys
    root = Path(__file__).parents[1]
    r = subprocess.run([sys.executable, '-m', 'pip', 'wheel', '--no-deps', '--no-build-isolation', '-q', '-w', str(tmp_path), str(root)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    whl = next(tmp_path.glob('opscope-*.whl'))
    names = zipfile.ZipFile(whl).namelist()
    for mod in ('zoo', 'sketch', 'sites', 'lower', 'inject', 'recorder', 'miner', 'cli', 'mine_cli', 'harness'):
        assert f'opscope/{mod}.py' in names
    ep = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith('entry_points.txt'))).decode()
    assert 'opscope-sweep = opscope.cli:opscope_sweep' in ep and 'opscope-mine = opscope.mine_cli:opscope_mine' in ep


def test_nan_values_roundtrip_through_csv_and_parquet(tmp_path):
    "An undefined statistic (the mean of an empty tensor) is NaN in the file and NaN again when read."
    for ext in ('csv', 'parquet'):
        p = tmp_path / f'e.{ext}'
        df = record(nn.Linear(8, 4), [torch.empty(0, 8)], sink=p, keep=True)
        back = read_sketches(p)
        assert back.value.isna().sum() == df.value.isna().sum() > 0


def _traced_form(x, bins):
    "The sketch in its traceable form (what torch.compile / torch.export trace), run on real tensors."
    from unittest import mock
    import opscope.sketch as sk
    with mock.patch.object(torch.compiler, 'is_compiling', return_value=True): return sk._packed(x, bins)


@pytest.mark.parametrize('bins', [64, 10])
def test_eager_sketch_matches_traced_form(bins):
    "The eager kernels (one preallocated output, in-place parts) and the traced form give the same packed sketch."
    import opscope.sketch as sk
    g = torch.Generator().manual_seed(2027)
    x = torch.randn(4, 12, 20, generator=g); x.view(-1)[::6] = 0
    x[0, 1, 2], x[1, 2, 3], x[2, 3, 4] = float('nan'), float('inf'), -float('inf')
    t = torch.randn(9, 7, generator=g).t(); t[1, 1] = float('nan')
    cases = [x, t, torch.randn(2, 3, 10, 8, generator=g).transpose(-1, -2), torch.randn(5, 3, 2, generator=g)[:, 1:],
             torch.randn(7, generator=g), torch.tensor(3.0), torch.full((5, 6), float('nan')), torch.full((5, 6), float('inf')),
             torch.zeros(4, 4), torch.randn(6, 8, generator=g).half(), torch.randn(6, 8, generator=g).double(),
             torch.randint(-3, 3, (6, 8), generator=g)]
    for c in cases:
        before = c.clone()
        a, b = sk._packed(c, bins), _traced_form(c, bins)
        assert a.shape == b.shape and a.dtype == b.dtype, c.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)
        torch.testing.assert_close(c, before, equal_nan=True)     # the tapped tensor is never written


def test_injected_graph_reads_nothing_back_to_the_host():
    "No `.item()` / `bool(tensor)` / `.tolist()` in an eager injected forward (one would be a device sync on an accelerator): no ATen `_local_scalar_dense` runs, on a transformer with NaN input, an MoE and a model with weights re-sketched in the graph."
    from torch.utils._python_dispatch import TorchDispatchMode
    from opscope.zoo import transformer, moe, example_input
    class Reads(TorchDispatchMode):
        def __init__(self): super().__init__(); self.n = 0
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))
    for m, cache in ((transformer(layers=1), True), (moe(layers=1), True), (transformer(layers=1), False)):
        x = example_input(m)
        if x.is_floating_point(): x = x.clone(); x.view(-1)[0] = float('nan')
        inj = inject_matmul_stats(trace(m, x), cache_weights=cache)
        with torch.no_grad():
            inj(x)                                    # first call: weight sketches and finalize layouts are built
            with Reads() as r: y, stats = inj.forward(x)   # the graph alone: the weight-cache refresh before it reads fingerprints by design
        assert r.n == 0, f"{r.n} host reads in {type(m).__name__}'s injected forward"
        assert stats and all(isinstance(v, torch.Tensor) for v in stats.values())


def _with_kernel(monkeypatch, kernel, fn):
    import opscope.sketch as sk
    with monkeypatch.context() as m:
        m.setattr(sk, 'EAGER_KERNEL', kernel)
        return fn()


def test_fused_eager_kernel_equals_aten_passes(monkeypatch):
    "The fused eager kernel (opt-in: what 'auto' runs for big CPU float32 taps) gives the ATen passes' sketch: NaN, ±inf, zeros, short sequences, and a whole injected transformer; it runs only where asked and compiles to one graph with no host read."
    import opscope.sketch as sk
    calls = []
    kernel = sk._fused_kernel
    monkeypatch.setattr(sk, '_fused_kernel', lambda *a: calls.append(a[1:4]) or kernel(*a))
    g = torch.Generator().manual_seed(11)
    for shape in ((8, 96, 384), (10, 7, 1000)):
        x = torch.randn(shape, generator=g)
        x.view(-1)[::97], x.view(-1)[5::199], x.view(-1)[7::299], x.view(-1)[1::3] = float('nan'), float('inf'), -float('inf'), 0.
        n = len(calls)
        fused, aten = (_with_kernel(monkeypatch, k, lambda: sketch(x)) for k in ('fused', 'aten'))
        assert len(calls) == n + 1
        for name, a, b in zip(STATS, fused, aten): torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True, msg=f'{shape} {name}')
    n = len(calls)
    sketch(torch.randn(8, 96, 384)); assert len(calls) == n            # the default: the ATen passes
    _with_kernel(monkeypatch, 'auto', lambda: (sketch(torch.randn(8, 96, 384)), sketch(torch.randn(4, 8, 16))))
    assert len(calls) == n + 1 and not sk._FUSED_ERROR            # 'auto': the big tap fused, the small one not
    m, x = transformer(layers=1, d=128, heads=2), make_tensor('gaussian', (8, 64, 128), seed=3)   # taps of 65,536 elements and more
    x[0, 3, :5] = float('nan')
    gm = trace(m, x)
    with torch.no_grad():
        n = len(calls); _, fused = _with_kernel(monkeypatch, 'auto', lambda: inject_matmul_stats(gm)(x)); assert len(calls) > n
        _, aten = inject_matmul_stats(gm)(x)
    assert fused.keys() == aten.keys()
    for k in fused: torch.testing.assert_close(fused[k], aten[k], rtol=1e-4, atol=1e-4, equal_nan=True, msg=k)
    R, C, T = 768, 384, 96
    ex = torch._dynamo.explain(sk._fused_passes)(torch.randn(R * C), R, C, T, sk.sample_stride(R * C, C), 64)
    assert ex.graph_break_count == 0 and ex.graph_count == 1
    reads = [n for gr in ex.graphs for n in gr.graph.nodes if n.op == 'call_method' and n.target in ('item', 'tolist', 'cpu', 'numpy', '__bool__')]
    assert not reads, reads


def test_fused_eager_kernel_failure_falls_back_once(monkeypatch):
    "A fused kernel that cannot compile (no C++ compiler, say) warns once and every tap then runs the ATen passes, with the same sketch."
    import opscope.sketch as sk
    def broken(*a): raise RuntimeError('no compiler here\nmore detail')
    monkeypatch.setattr(sk, '_fused_kernel', broken)
    monkeypatch.setattr(sk, '_FUSED_ERROR', [])
    x = torch.randn(8, 96, 384)
    with pytest.warns(UserWarning, match='fused eager sketch kernel failed .RuntimeError: no compiler here.'):
        got = _with_kernel(monkeypatch, 'fused', lambda: sketch(x))
    assert len(sk._FUSED_ERROR) == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        again = _with_kernel(monkeypatch, 'fused', lambda: sketch(x))    # no second warning, no second try
    want = _with_kernel(monkeypatch, 'aten', lambda: sketch(x))
    for name, a, b, c in zip(STATS, got, again, want):
        torch.testing.assert_close(a, c, equal_nan=True, msg=name); torch.testing.assert_close(b, c, equal_nan=True, msg=name)


def test_fused_eager_kernel_off_under_dispatch_modes(monkeypatch):
    "A tap sketched under a TorchDispatchMode (a profiler or counter that wants the ATen ops) runs the ATen passes."
    from torch.utils._python_dispatch import TorchDispatchMode
    import opscope.sketch as sk
    calls = []
    monkeypatch.setattr(sk, '_fused_kernel', lambda *a: calls.append(1))
    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None): return func(*args, **(kwargs or {}))
    with Count(): s = _with_kernel(monkeypatch, 'fused', lambda: sketch(torch.randn(8, 96, 384)))
    assert not calls and len(s) == len(STATS)


def test_fused_eager_kernel_past_the_recompile_limit(monkeypatch):
    "A size class past Dynamo's recompile limit runs the ATen passes for that tap, with no warning, and the kernel stays on; a batch of one is no new size class, and its sketch is the ATen passes'."
    import opscope.sketch as sk
    from torch._dynamo.utils import counters
    import warnings
    x = torch.randn(8, 96, 384)
    want = sketch(x)
    one = x[:1].clone()
    _with_kernel(monkeypatch, 'fused', lambda: sketch(torch.randn(4, 96, 384)))
    graphs = counters['stats']['unique_graphs']
    for name, a, b in zip(STATS, _with_kernel(monkeypatch, 'fused', lambda: sketch(one)), sketch(one)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, equal_nan=True, msg=name)
    assert counters['stats']['unique_graphs'] == graphs            # a batch of one shares batch 4's compiled kernel
    def limit(*a): raise torch._dynamo.exc.FailOnRecompileLimitHit('recompile_limit reached')
    monkeypatch.setattr(sk, '_fused_kernel', limit)
    monkeypatch.setattr(sk, '_FUSED_ERROR', [])
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        got = _with_kernel(monkeypatch, 'fused', lambda: sketch(x))
    assert not sk._FUSED_ERROR
    for name, a, b in zip(STATS, got, want): torch.testing.assert_close(a, b, equal_nan=True, msg=name)
