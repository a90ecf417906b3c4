"The production recorder's hand-off, the compiled path, and the benchmark functions (correctness only: no wall-clock thresholds)."
import threading
import numpy as np
import pandas as pd
import pytest
import torch
from torch._dynamo.utils import counters
import torch.nn as nn

import opscope.online as online
import opscope.recorder as recorder
from opscope.bench import (bench_model, hist_sample_error, overhead_table, online_table, like_for_like, sketch_profile,
                           miner_throughput, bench_report, goal_table, save_report, load_report, run_label, goals_by_run, GOALS)
from opscope.sketch import STATS, HIST_SAMPLE, sketch as inject_sketch
from opscope.sites import trace
from opscope.inject import inject_matmul_stats, compile_injected
from opscope.online import OnlineRecorder
from opscope.zoo import mlp, transformer, make_tensor


def _stream(n, seed=40):
    m = mlp(layers=2, d_in=32, hidden=48, d_out=16, seed=seed)
    return m, [make_tensor('gaussian', (12, 32), seed=seed + s) for s in range(n)]


# --- OnlineRecorder: background hand-off ----------------------------------------------------------------------

def test_background_sketches_equal_the_synchronous_fold():
    m, xs = _stream(50)
    gm = trace(m, xs[0]); inj = inject_matmul_stats(gm)
    sync = OnlineRecorder(gm, inj, every=3, seed=41, background=False, buffer=100)
    bg = OnlineRecorder(gm, inj, every=3, seed=41, background=True, buffer=100, queue=64)
    with bg:
        for x in xs:
            torch.testing.assert_close(sync(x), gm(x)); bg(x)
    assert bg.dropped == 0 and bg.sampled_steps == sync.sampled_steps and len(sync.sampled_steps) > 5
    a, b = sync.to_arrays(), bg.to_arrays()
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    pd.testing.assert_frame_equal(sync.rows(), bg.rows())
    held = bg.held_bytes()
    assert held['host_buffers'] > 0 and held['sketches'] > 0


def test_flooded_queue_drops_and_counts_without_blocking(monkeypatch):
    m, xs = _stream(20, seed=42)
    gm = trace(m, xs[0])
    release, fold = threading.Event(), online._fold_host
    def stuck(*a, **k):
        release.wait(60); return fold(*a, **k)
    monkeypatch.setattr(online, '_fold_host', stuck)
    rec = OnlineRecorder(gm, every=1, seed=0, queue=2)
    for x in xs: rec(x)                          # returns while the worker is stuck: the model never waits
    assert not release.is_set()
    kept = len(rec.sampled_steps)
    assert kept == 3 and rec.dropped == len(xs) - kept     # one being folded + `queue` waiting; the rest dropped
    release.set(); rec.close()
    assert sorted(rec.rows().step.unique()) == rec.sampled_steps
    assert rec._nbuf == 3                        # bounded: no buffer beyond queue + 1 was ever made


def test_worker_error_is_raised_at_flush(monkeypatch):
    m, xs = _stream(3, seed=43)
    gm = trace(m, xs[0])
    monkeypatch.setattr(online, '_fold_host', lambda *a, **k: 1 / 0)
    rec = OnlineRecorder(gm, every=1)
    rec(xs[0])
    with pytest.raises(RuntimeError, match="worker failed"): rec.flush()


def test_queue_must_be_positive():
    m, xs = _stream(1)
    with pytest.raises(ValueError, match='queue must be >= 1'): OnlineRecorder(trace(m, xs[0]), queue=0)


# --- the compiled path -----------------------------------------------------------------------------------------

@pytest.mark.slow
def test_compiled_injected_equals_eager_and_plain():
    m = transformer(layers=1, d=32, heads=2, seed=44)
    x = make_tensor('heavytail', (2, 8, 32), seed=45)
    x[0, 0, 0] = float('nan')
    gm = trace(m, x); inj = inject_matmul_stats(gm)
    torch._dynamo.reset()
    assert torch._dynamo.explain(inj)(x).graph_break_count == 0
    ci = compile_injected(inj)
    with torch.no_grad():
        yc, sc = ci(x); ye, se = inj(x); yp = gm(x)
    torch.testing.assert_close(yc, yp, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert sc.keys() == se.keys()
    for k in se:
        torch.testing.assert_close(sc[k], se[k], rtol=1e-4, atol=1e-5, equal_nan=True, msg=k)
    assert sc['layers.0.attn.q/lhs/nan_count'].item() > 0 and sc['layers.0.attn.q/lhs/inf_count'].item() == 0
    with torch.no_grad(): m.layers[0].ffn.up.weight.data.mul_(3)     # the weight cache is refreshed outside the compiled graph
    _, sc2 = ci(x)
    torch.testing.assert_close(sc2['layers.0.ffn.up/rhs/absmax'], m.layers[0].ffn.up.weight.abs().max())


@pytest.mark.slow
def test_compiled_with_dynamic_shapes_equals_eager():
    "`compile_injected(inj, dynamic=True)`: one compiled graph for every sequence length (no recompile), whose sketches equal the eager ones, the histograms and near-zero shares included. The sizes make the plain stride n // HIST_SAMPLE share a factor with the channel count (2 with 32 channels, 8 and 18 with 64 and 96 key positions), so the sample needs the coprime search, and change its residues from one length to the next: a search written as a Python loop over the sizes becomes guards that recompile the graph (and a float the sketch region read made Dynamo's nested-region lift fail under dynamic shapes)."
    m = transformer(layers=1, d=32, heads=2, seed=44)
    inj = inject_matmul_stats(trace(m, make_tensor('heavytail', (16, 64, 32), seed=45)))
    torch._dynamo.reset(); counters.clear()
    ci = compile_injected(inj, dynamic=True)
    with torch.no_grad():
        for seq in (64, 96, 80):
            x = make_tensor('heavytail', (16, seq, 32), seed=seq)
            x[0, 0, 0] = float('nan')
            (yc, sc), (ye, se) = ci(x), inj(x)
            torch.testing.assert_close(yc, ye, rtol=1e-5, atol=1e-5, equal_nan=True)
            for k in se:   # a sampled value on a bin edge or on the near-zero threshold may fall on the other side where the compiled producer rounds it
                sampled = se[k.rsplit('/', 1)[0] + '/hist'].sum().item()
                tol = dict(rtol=0, atol=2) if k.endswith('/hist') else dict(rtol=0, atol=2 / sampled) if k.endswith('/nearzero') else dict(rtol=1e-4, atol=1e-5)
                torch.testing.assert_close(sc[k], se[k], equal_nan=True, msg=k, **tol)
                if k.endswith('/hist'): assert sc[k].sum() == se[k].sum(), k   # the same number of values sampled
            assert sc['layers.0.attn.q/lhs/nan_count'].item() > 0     # the NaN reached the taps, and both counted it alike
    assert counters['stats']['unique_graphs'] == 1, dict(counters['stats'])


@pytest.mark.slow
def test_online_recorder_compiled_over_changing_lengths():
    "`OnlineRecorder(compile=True)` serving requests of changing sequence length, under torch.compile's default (automatic dynamic shapes, the path `record(compile=True)` takes too): the injected graph compiles twice, as the plain graph would (once static, once with the sequence dimension symbolic, which every later length reuses), and every sampled step's rows equal the eager recorder's."
    m = transformer(layers=1, d=32, heads=2, seed=47)
    xs = [make_tensor('heavytail', (4, seq, 32), seed=seq) for seq in (64, 96, 80, 72)]
    gm = trace(m, xs[0])
    torch._dynamo.reset(); counters.clear()
    with OnlineRecorder(gm, every=1, compile=True, background=False) as compiled, OnlineRecorder(gm, every=1, background=False) as eager:
        with torch.no_grad():
            for x in xs: torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
        got, ref = compiled.rows(), eager.rows()
    assert counters['stats']['unique_graphs'] == 2, dict(counters['stats'])
    key = ['step', 'site', 'role', 'stat', 'idx']
    both = ref.merge(got, on=key, suffixes=('', '_c'), validate='one_to_one')
    assert len(both) == len(ref) == len(got) and sorted(ref.step.unique()) == [0, 1, 2, 3]
    exact = both.stat.isin(['numel', 'nan_count', 'inf_count'])
    assert (both.value[exact] == both.value_c[exact]).all()
    near = both.stat == 'nearzero'   # a sampled value on the threshold may round to the other side: 2 of the sample (here at least HIST_SAMPLE / 2 values, or all)
    assert ((both.value - both.value_c).abs() <= 4 / np.minimum(both.numel, HIST_SAMPLE) + 1e-9)[near].all()
    rest = ~(exact | near)
    np.testing.assert_allclose(both.value_c[rest], both.value[rest], rtol=1e-4, atol=1e-5)


def test_record_compile_runs_the_compiled_graph(monkeypatch):
    calls = []
    def fake_compile(f, **kw):
        calls.append(f); return f
    monkeypatch.setattr(torch, 'compile', fake_compile)
    m, xs = _stream(3, seed=46)
    df = recorder.record(m, xs, compile=True)
    assert len(calls) == 1 and hasattr(calls[0], 'manifest') and df.step.nunique() == 3   # via compile_injected
    rec = OnlineRecorder(trace(m, xs[0]), every=1, compile=True)
    assert len(calls) == 3 and rec(xs[0]) is not None


# --- the benchmark functions return their tables ---------------------------------------------------------------

def test_benchmark_tables():
    m, x = bench_model(1, 32, 8, 2, seed=47)
    tab = overhead_table(m, x, repeats=2)
    assert {'method', 'taps', 'ms', 'ms_median', 'ratio', 'first_call_s', 'fused'} <= set(tab.columns) and tab.ratio[0] == 1.0
    i = tab.set_index('method').loc['injected (eager, fused kernel)']
    assert i.fused == 0 and i.sketched > 0 and (tab.first_call_s > 0).all()    # these taps are below FUSED_MIN
    assert i.shapes == 6    # 5 shapes, one of them (q/k/v heads) in two memory layouts: 6 nested compile regions
    ll, lt = like_for_like(tab), like_for_like(tab, tuned=True)
    assert ll['hook_taps'] == ll['injected_taps'] and ll['hooks_vs_injected'] > 0     # the same nn.Linear taps
    assert ll['hook_tensors'] == ll['injected_tensors'] == lt['hook_tensors'] > 0     # and the same tensors sketched per forward
    assert ll['hook_weights'] == ll['injected_weights'] == lt['hook_weights'] == 'version'   # and the same weight policy
    assert tab.set_index('method').weights['injected (eager)'] == 'values'     # the default reads the weights' values for its fingerprint
    ot = online_table(m, x, every=(2,), steps=8)
    assert ot.every.tolist() == [2] and ot.dropped[0] == 0 and ot.held_kib[0] > 0
    assert list(sketch_profile(m, x, calls=1, top=5).columns) == ['op', 'ms', 'calls', 'share']
    assert (hist_sample_error((64, 64)).tv_distance >= 0).all()
    mt = miner_throughput(3000)
    assert mt.engine.tolist() == ['pandas', 'duckdb'] and (mt.rows >= 3000).all() and (mt.findings > 0).all()


def test_numpy_hooks_sketch_every_tensor_of_a_forward():
    "The hooks + numpy baseline sketches each tensor of a forward once, even where the allocator reuses a freed tensor's memory for the next one of its shape (keyed on the address alone, those looked sketched already); both numpy sketches agree with the injected sketch."
    from opscope.bench import _numpy_hook, _hooks, _np_sketch, _np_sketch_tuned
    torch.manual_seed(49)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(4)])
    x = torch.randn(16, 32)
    for sk in (_np_sketch, _np_sketch_tuned):
        store = {}
        hs = _hooks(m, _numpy_hook(store, {}, sk))
        with torch.no_grad(): m(x)
        for h in hs: h.remove()
        assert len(store) == 8    # x, three ReLU outputs, four Linear outputs
        for t, got in store.values():
            ref = dict(zip(STATS, (v.double().numpy() for v in inject_sketch(t))))
            for k in ('max', 'mean', 'density', 'adj_cos', 'chan_absmax', 'row_energy', 'hist'):
                np.testing.assert_allclose(np.asarray(got[k], np.float64), ref[k], rtol=1e-4, atol=1e-5)


def test_fused_taps_counted_and_explained(monkeypatch):
    "With every tap above FUSED_MIN the fused-kernel rows count them all as fused (the default rows none), and the goal table's reasons say so."
    import opscope.sketch as sk
    monkeypatch.setattr(sk, 'FUSED_MIN', 0)
    m, x = bench_model(1, 32, 8, 2, seed=48)
    tab = overhead_table(m, x, repeats=1, ao=False).set_index('method')
    i, f = tab.loc['injected (eager)'], tab.loc['injected (eager, fused kernel)']
    assert i.fused == 0 and f.fused == f.sketched == i.sketched > 0 and not sk._FUSED_ERROR
    assert tab.loc['injected (nn.Linear taps, fused kernel)'].taps == tab.loc['injected (nn.Linear taps)'].taps
    rep = dict(eager=tab.reset_index(), online=online_table(m, x, every=(8,), steps=8))
    why = goal_table(rep).set_index('goal').why
    assert f'{int(f.sketched)} of them by the fused kernel' in why['injected eager, fused kernel (opt-in) / plain eager']
    assert 'ten ATen passes' in why['injected eager / plain eager']
    ll, lf = like_for_like(rep['eager']), like_for_like(rep['eager'], fused=True)
    assert ll['hook_taps'] == lf['injected_taps'] and ll['injected_ms_per_tap'] != lf['injected_ms_per_tap']


def test_blocked_taps_counted_as_run(monkeypatch):
    "With small blocks, the taps the bench counts as blocked are the ones a forward sketches block by block (the contiguous ones of three blocks or more), and the reasons say how many; the sketches equal the whole-tensor passes'."
    import opscope.sketch as sk
    m, x = bench_model(1, 128, 16, 2, seed=49)   # two heads: the head-first views are not contiguous
    gm = trace(m, x)
    inj = inject_matmul_stats(gm)
    with torch.no_grad(): _, ref = inj(x)
    monkeypatch.setattr(sk, 'BLOCK', 256 // torch.get_num_threads())
    monkeypatch.setattr(sk, 'DEFER_MAX', 0)   # no tap small enough to be batched: each runs its own passes
    ran, blocked = [], sk._raw_blocked
    monkeypatch.setattr(sk, '_raw_blocked', lambda x, *a: (ran.append(tuple(x.shape)), blocked(x, *a))[1])
    with torch.no_grad(): _, got = inj(x)
    from opscope.bench import _sketched
    s = _sketched(inj)
    assert 0 < s['blocked'] == len(ran) < s['sketched']   # the head-permuted views keep the whole-tensor passes
    assert got.keys() == ref.keys()
    for k in ref:   # '<site>/<role>/<stat>'
        if k.rsplit('/', 1)[1] in ('mean', 'std', 'rms', 'adj_cos'):   # from the total sum and the adjacent-row dots: another summation order
            torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6, msg=k)
        else: assert torch.equal(got[k], ref[k]), k                    # counts, extremes, densities, row energies, histograms: exact
    tab = overhead_table(m, x, repeats=1, ao=False).set_index('method')
    assert tab.blocked['injected (eager)'] == s['blocked']
    rep = dict(eager=tab.reset_index(), online=online_table(m, x, every=(8,), steps=8))
    assert f"({s['blocked']} of them, three cache blocks or bigger, block by block)" in goal_table(rep).set_index('goal').why['injected eager / plain eager']


@pytest.mark.slow
def test_report_goals_and_cli_round_trip(tmp_path, cli):
    rep = bench_report(full=False, miner_rows=2000, repeats=2, compile=False)
    gt = goal_table(rep)
    assert len(gt) == len(GOALS) and gt.met.notna().sum() == 6    # the compiled goals need compile=True
    assert 'branch on the data' in gt.set_index('goal').why['hooks + numpy, tuned / injected eager, same taps']
    save_report(rep, tmp_path / 'r.csv')
    back = load_report(tmp_path / 'r.csv')
    assert set(back) == set(rep)
    assert back['eager'].isa[0] == torch.backends.cpu.get_cpu_capability() and back['eager'].cpu[0]   # the machine is recorded
    old = pd.read_csv(tmp_path / 'r.csv').drop(columns=['cpu', 'isa'])   # a file saved before the machine was recorded
    old.to_csv(tmp_path / 'old.csv', index=False)
    assert 'not recorded, ISA not recorded' in run_label(load_report(tmp_path / 'old.csv'))
    side = goals_by_run([tmp_path / 'r.csv', tmp_path / 'old.csv'])
    assert list(side.index[:len(GOALS)]) == [g for g, _, _ in GOALS] and side.shape == (len(GOALS) + 2, 3)
    np.testing.assert_array_equal(side.iloc[:len(GOALS), 0].astype(float), side.iloc[:len(GOALS), 1].astype(float))   # the same run read twice
    assert side.loc['eager sketch, ns per element'].iloc[0] > 0
    r = cli('opscope-bench', '--miner_rows', '2000', '--out', str(tmp_path / 'b.csv'))
    assert r.returncode == 0, r.stderr[-800:]
    assert 'goal' in r.stdout and (tmp_path / 'b.csv').exists()
    r = cli('opscope-bench', '--out', str(tmp_path / 'b.txt'))
    assert r.returncode == 2 and 'must be a .csv' in r.stderr
