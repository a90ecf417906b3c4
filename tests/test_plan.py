"Tier 4: the plan on real MNIST, guarded specialization with fallback under drift, the guard language, and opscope-plan."
import math
from pathlib import Path
import pandas as pd
import pytest, torch
import torch.nn.functional as F
from opscope.zoo import load_mnist, mnist_mlp, make_tensor
from opscope.sites import trace
from opscope.recorder import record
from opscope.miner import mine
from opscope.exploits import REGISTRY, Exploit, Rule, register, planned, guard_density, cost_sparse, evidence_sparse
from opscope.kernels import kernel_sparse
from opscope.tables import InputError
from opscope.plan import (plan, specialize, choose, check_specialized, parse_guard, format_guard, guard_holds,
                          sketch_values, live_values, parse_channels, make_kernel, format_plan, PLAN_COLUMNS,
                          NOT_WORTH_IT, LOSSY_REL_TOL, stationary_taps, FINITE_GUARD)

MACHINE = dict(peak_flops=2e10, bandwidth=1.6e10)   # fixed, so estimates do not depend on this run's load


@pytest.fixture(scope='module')
def mnist():
    torch.manual_seed(0)
    images, _ = load_mnist(8 * 64, seed=0)
    batches = [images[i * 64:(i + 1) * 64] for i in range(8)]
    model = mnist_mlp()
    gm = trace(model, batches[0])
    sk = record(gm, batches, run_id='mnist', dist='mnist')
    found = mine(sk)
    return dict(batches=batches, gm=gm, sk=sk, found=found, plan=plan(sk, found, machine=MACHINE))


def test_plan_columns_and_dead_columns_row(mnist):
    p, found = mnist['plan'], mnist['found']
    assert list(p.columns) == PLAN_COLUMNS
    assert not p.duplicated(['run_id', 'site', 'exploit']).any()
    dead = p[(p.site == 'fc1') & (p.exploit == 'dead-channels')].iloc[0]
    want = sorted(found.query("site == 'fc1' and role == 'lhs' and exploit == 'dead-channels'").idx)
    assert parse_channels(dead.channels) == want and len(want) > 100
    assert dead.guard == 'lhs.chan_absmax[channels] <= 0 and ' + FINITE_GUARD and dead.guard_holds == 1 and dead.guard_sigma == 0
    assert (dead.M, dead.K, dead.N) == (64, 784, 256) and bool(dead.exact)
    assert dead.measured_speedup > 0 and dead.dense_ms > 0 and dead.special_ms > 0


def test_every_row_is_measured_and_losers_say_so(mnist):
    p = mnist['plan']
    assert {'dead-channels', 'sparse-gemm', 'int8', 'prepack'} <= set(p[p.site == 'fc1'].exploit)
    assert (p.measured_speedup > 0).all() and p.est_speedup.notna().all()
    assert ((p.measured_speedup < 1) == p.note.str.startswith(NOT_WORTH_IT)).all()
    sp = p[(p.site == 'fc1') & (p.exploit == 'sparse-gemm')].iloc[0]
    assert sp.guard == 'lhs.density <= 0.25 and ' + FINITE_GUARD and sp.guard_holds == 1   # fc1 density ~0.19 + margin
    assert set(p[p.exploit == 'prepack'].site) == {'fc1', 'fc2', 'fc3'}
    assert 'fc1  dead-channels' in format_plan(p)


def test_dead_columns_specialized_exactly(mnist):
    gm, p, batches = mnist['gm'], mnist['plan'], mnist['batches']
    sgm = specialize(gm, p[(p.site == 'fc1') & (p.exploit == 'dead-channels')])
    chk = check_specialized(gm, sgm, batches)
    assert sgm.guarded['fc1'].counts == {'special': 8, 'dense': 0}
    assert chk.within_tol.all() and chk.rel_err.max() < 1e-6
    x = batches[0]
    assert torch.allclose(sgm(x), gm(x), rtol=0, atol=1e-5)


def test_fallback_on_exactly_the_drifting_steps(mnist):
    gm, p, batches = mnist['gm'], mnist['plan'], mnist['batches']
    g = torch.Generator().manual_seed(1)
    drift = []
    for s, xb in enumerate(batches):                       # faint background noise on more images from step 5
        xb, n = xb.clone(), max(0, s - 4) * 8
        xb[:n] = (xb[:n] + 0.02 * torch.rand(n, 784, generator=g)).clamp(max=1)
        drift.append(xb)
    skd = record(gm, drift, run_id='drift')
    for ex in ('dead-channels', 'sparse-gemm'):
        row = p[(p.site == 'fc1') & (p.exploit == ex)]
        cl = parse_guard(row.guard.iloc[0])
        want = sketch_values(skd, 'fc1', cl, parse_channels(row.channels.iloc[0])).apply(lambda v: guard_holds(cl, dict(v)), axis=1)
        assert not want.all() and want.iloc[:5].all()
        sgm = specialize(gm, row)
        chk = check_specialized(gm, sgm, drift)
        assert list(chk.path == 'special') == list(want)
        assert chk.within_tol.all() and chk.rel_err.max() < 1e-5


def test_int8_is_lossy_within_tolerance(mnist):
    gm, p, batches = mnist['gm'], mnist['plan'], mnist['batches']
    chk = check_specialized(gm, specialize(gm, p[p.exploit == 'int8']), batches[:3])
    assert chk.within_tol.all() and 0 < chk.rel_err.max() <= LOSSY_REL_TOL


def test_choose_picks_one_exact_row_per_site(mnist):
    c = choose(mnist['plan'])
    assert not c.site.duplicated().any() and c.exact.all() and (c.measured_speedup >= 1).all()
    bare = c[c.guard.fillna('') == '']
    assert all(REGISTRY[e].guard is None for e in bare.exploit)           # no guard: a weight-only exploit, never a dropped one


def test_weight_only_rows_are_applied_not_dropped(mnist):
    "A plan row without a guard (prepack: weight-only, exact) is applied by specialize and verified like any other (issue 32: they were dropped silently)."
    gm, p, batches = mnist['gm'], mnist['plan'], mnist['batches']
    pre = p[p.exploit == 'prepack']
    assert len(pre) and (pre.guard.fillna('') == '').all()
    sgm = specialize(gm, pre)
    assert set(sgm.guarded) == set(pre.site)
    chk = check_specialized(gm, sgm, batches[:2])
    assert chk.within_tol.all() and (chk.path == 'special').all() and len(chk) == 2 * len(pre)
    i8 = p[p.exploit == 'int8'].head(1).assign(guard='')
    with pytest.raises(InputError, match="int8 needs a guard"): specialize(gm, i8)


def test_guard_language_round_trip_and_no_eval():
    for text in ['lhs.density <= 0.25', 'lhs.crest < 14 and lhs.nan_count == 0', 'out.absmax >= 1e-3',
                 'lhs.chan_absmax[channels] <= 0 and rhs.rms > 0.5']:
        assert format_guard(parse_guard(text)) == format_guard(parse_guard(format_guard(parse_guard(text))))
    for bad, msg in [('lhs.density <= 0.25 and __import__("os").system("x")', 'clause 2'),
                     ('print(1)', 'clause 1'), ('lhs.foo < 1', "unknown stat 'foo'"),
                     ('lhs.density[channels] < 1', 'takes no [channels]'), ('lhs.density <= ', 'clause 1')]:
        with pytest.raises(ValueError, match=msg.replace('[', r'\[').replace(']', r'\]').replace('(', r'\(')): parse_guard(bad)


def test_live_values_match_sketch_values():
    x = make_tensor('sparse90', (48, 32), seed=3)
    x[:, [1, 4]] = 0
    cl = parse_guard('lhs.density <= 1 and lhs.crest <= 100 and lhs.chan_absmax[channels] <= 0 and lhs.rms > 0')
    from opscope.zoo import gemm
    sk = record(gemm(32, 8), [x], run_id='t')
    sv = sketch_values(sk, 'mm0', cl, [1, 4]).iloc[0]
    lv = live_values(x, cl, channels=torch.tensor([1, 4]))
    for k in sv.index: assert math.isclose(sv[k], lv[k], rel_tol=1e-4, abs_tol=1e-7), k


def test_stationary_taps_are_the_weights(mnist):
    st = stationary_taps(mnist['sk'])
    assert set(zip(st.site, st.role)) == {('fc1', 'rhs'), ('fc2', 'rhs'), ('fc3', 'rhs')}
    found = mnist['found']                                      # one definition: the miner's finding names the same taps
    assert set(zip(st.site, st.role)) == set(zip(found[found.exploit == 'stationary'].site, found[found.exploit == 'stationary'].role))


@pytest.fixture
def very_sparse():
    "A toy exploit for one test, one record: the sparse kernel behind a tighter rule and guard cap."
    def rule(f):
        s = f[f.density <= 0.3]
        return s.index.to_frame(index=False).assign(stat='density', idx=-1, value=s.density.to_numpy(), exploit='very-sparse',
                                                    detail='very sparse')
    ev = lambda g, e: evidence_sparse(g.assign(exploit=g.exploit.replace({'very-sparse': 'sparse-gemm', 'sparse-gemm': ''})), e)
    register(Exploit('very-sparse', (Rule('features', rule),), 'CSR lhs', evidence=ev, guard=lambda per: guard_density(per, cap=0.3),
                     guard_stat='density', kernel=kernel_sparse, cost=cost_sparse, plan_order=9))
    yield 'very-sparse'
    del REGISTRY['very-sparse']


def test_a_new_record_is_a_new_exploit(mnist, very_sparse):
    found = mine(mnist['sk'])
    vs = found[found.exploit == very_sparse]
    assert set(zip(vs.site, vs.role)) == {('fc1', 'lhs')}       # fc1 reads raw pixels (density ~0.19); fc2, fc3 are ReLU outputs
    p = plan(mnist['sk'], found, machine=MACHINE, exploits=[very_sparse, 'prepack'])
    assert set(p.exploit) == {very_sparse, 'prepack'} and list(p[p.site == 'fc1'].exploit) == ['prepack', very_sparse]   # in plan_order
    row = p[p.exploit == very_sparse].iloc[0]
    assert row.guard == 'lhs.density <= 0.25 and ' + FINITE_GUARD and row.guard_holds == 1 and row.est_speedup > 0
    assert very_sparse in planned()


def test_without_the_record_the_exploit_is_gone(mnist):
    assert 'very-sparse' not in REGISTRY and not (mnist['found'].exploit == 'very-sparse').any()
    with pytest.raises(ValueError, match="no kernel for exploit 'very-sparse'"): make_kernel('very-sparse', torch.zeros(2, 2))


def test_kernels_match_dense():
    w, b = torch.randn(24, 40), torch.randn(24)
    x = torch.rand(16, 40); x[x < 0.7] = 0
    ref = F.linear(x, w, b)
    for ex, arg, tol in [('sparse-gemm', None, 1e-5), ('int8', None, 3e-2), ('prepack', None, 1e-6), ('low-rank', 24, 1e-4)]:
        y = make_kernel(ex, w, b, arg).fn(x)
        assert ((y - ref).norm() / ref.norm()) < tol, ex


@pytest.mark.slow
def test_check_specialized_keyword_inputs():
    "A Hugging Face encoder traced from keyword inputs: specialize and check_specialized take the same dict batches (issue 32: they raised 'kwarg keyword mismatch')."
    from transformers import BertConfig, BertModel
    from opscope.probe import dump_sites
    torch.manual_seed(0)
    m = BertModel(BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100)).eval()
    bs = [dict(input_ids=torch.randint(0, 100, (2, 16)), attention_mask=torch.ones(2, 16, dtype=torch.long)) for _ in range(2)]
    gm = trace(m, **bs[0])
    sk = record(m, bs)
    picked = choose(plan(sk, mine(sk), machine=MACHINE), lossy=True, min_speedup=0)
    assert len(picked) >= 6
    sgm = specialize(gm, picked)
    chk = check_specialized(gm, sgm, bs)
    assert len(chk) == 2 * len(picked) and chk.within_tol.all() and (chk.path == 'special').any()
    site = picked.site.iloc[0]
    d = dump_sites(gm, bs[0], sites=[site], roles=('lhs', 'out'))
    with torch.no_grad(): test = m.get_submodule(site)(d[f'{site}/lhs'])
    assert torch.allclose(test, d[f'{site}/out'], atol=1e-5)          # the dump is that layer's real input and output


def test_specialize_bad_input(mnist):
    gm, p = mnist['gm'], mnist['plan']
    with pytest.raises(KeyError, match="plan site 'fc9' is not a matmul site"): specialize(gm, p.iloc[:1].assign(site='fc9'))
    two = p[(p.site == 'fc1') & p.exploit.isin(['dead-channels', 'sparse-gemm'])]
    with pytest.raises(ValueError, match="several plan rows"): specialize(gm, two)
    with pytest.raises(ValueError, match='lack columns stat'): plan(mnist['sk'].drop(columns=['stat']))


@pytest.fixture(scope='module')
def sketch_file(tmp_path_factory, mnist):
    d = tmp_path_factory.mktemp('plan')
    record(mnist['gm'], mnist['batches'][:2], run_id='mnist', sink=d / 'mnist.csv')   # empty dist on purpose
    return d


@pytest.mark.slow
def test_cli_plan_prints_and_writes(cli, sketch_file):
    out = sketch_file / 'plan.csv'
    r = cli('opscope-plan', str(sketch_file / 'mnist.csv'), '--out', str(out))
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith('fc1  dead-channels'))
    assert f'guard lhs.chan_absmax[channels] <= 0 and {FINITE_GUARD} (holds 2/2, σ 0)' in line and 'est ' in line and 'measured ' in line
    back = pd.read_csv(out)
    assert list(back.columns) == PLAN_COLUMNS and len(back) == len(r.stdout.split('\n\n')[0].splitlines())
    # the written plan drives specialize
    sgm = specialize(trace(mnist_mlp(), torch.zeros(2, 784)), back[(back.site == 'fc1') & (back.exploit == 'dead-channels')])
    assert 'fc1' in sgm.guarded


@pytest.mark.slow
def test_cli_plan_only_the_chosen_exploits(cli, sketch_file):
    r = cli('opscope-plan', str(sketch_file / 'mnist.csv'), '--exploits', 'dead-channels')
    assert r.returncode == 0, r.stderr
    assert {l.split()[1] for l in r.stdout.splitlines() if l.strip()} == {'dead-channels'}


@pytest.mark.slow
def test_cli_plan_bad_input(cli, sketch_file):
    r = cli('opscope-plan', str(sketch_file / 'missing.csv'), '--out', str(sketch_file / 'never.csv'))
    assert r.returncode == 2 and r.stderr.strip() == f'opscope-plan: error: {sketch_file}/missing.csv: no such file'
    bad = sketch_file / 'bad.csv'
    bad.write_text('run_id,step\nx,1\n')
    r = cli('opscope-plan', str(bad), '--out', str(sketch_file / 'never.csv'))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and 'missing columns' in r.stderr
    r = cli('opscope-plan', str(sketch_file / 'mnist.csv'), '--out', str(sketch_file / 'plan.txt'))
    assert r.returncode == 2 and '--out must be a .csv file' in r.stderr
    r = cli('opscope-plan', str(sketch_file / 'mnist.csv'), '--exploits', 'int8,fp4', '--out', str(sketch_file / 'never.csv'))
    assert r.returncode == 2 and r.stderr.strip() == ("opscope-plan: error: --exploits: 'fp4' is not an exploit with a kernel; "
                                                      f"choose from {', '.join(planned())}")
    assert not (sketch_file / 'never.csv').exists() and not (sketch_file / 'plan.txt').exists()
    assert not [p for p in sketch_file.iterdir() if p.name.startswith('.')]   # no temporary left behind
