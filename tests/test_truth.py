"Truth under bad data: NaN/Inf, constant tensors, tiny magnitudes, files opscope wrote, a schema plain pandas reads, the deep-dump loop."
import json, math, pickle, re, struct, warnings
from pathlib import Path
import numpy as np
import pandas as pd
from opscope.tables import MANIFEST_STAT
import pytest, torch
from hypothesis import given, settings, HealthCheck, strategies as st
from pandas._libs.parsers import STR_NA_VALUES
from opscope import zoo
from opscope.sketch import STATS, ATTN_STATS, GATE_STATS
from opscope.recorder import record, read_sketches, sweep, SCHEMA, RENAMED_STATS, SCHEMA_VERSION
from opscope.miner import mine, tap_features, cross_step, LOWRANK_ERANK_SHARE
from opscope.scale import mine_duckdb, same_findings
from opscope.probe import save_tensors, load_tensors, rank_table, probe_pointers, dump_sites
from opscope.plan import synthesize_guard, parse_guard, guard_holds, live_values, GUARD_STAT, FINITE_GUARD

# claims item 1 of the issue forbids on steps whose statistics were computed over NaN-zeroed data
VETOED = {'sparse-gemm', 'dead-channels', 'stationary', 'int8', 'int4', 'token-sparsity', 'temporal-coherence',
          'spiky', 'channel-outliers', 'deep-dump', 'low-rank'}


def _model():
    torch.manual_seed(11)
    return zoo.mlp(layers=2, d_in=48, hidden=80, d_out=24)


def _batches(seed=100, n=4):
    return [zoo.make_tensor('relu', (24, 48), seed=seed + s) for s in range(n)]


def _taps(f, exploit):
    return set(map(tuple, f.loc[f.exploit == exploit, ['site', 'role']].values))


# ---------------------------------------------------------------- non-finite values (item 1)

@pytest.fixture(scope='module')
def nan_runs():
    m, clean = _model(), _batches()
    half = [x.clone() for x in clean]
    for x in half: x[::2] = float('nan')                  # half of every batch's rows NaN
    alln = [torch.full_like(x, float('nan')) for x in clean]
    return {name: record(m, bs, run_id=name) for name, bs in (('clean', clean), ('half', half), ('all', alln))}


@pytest.mark.parametrize('name', ['half', 'all'])
def test_nan_batches_give_nonfinite_and_no_value_claims(nan_runs, name):
    f = mine(nan_runs[name])
    nonf = _taps(f, 'nonfinite')
    assert {('layers.0', 'lhs'), ('layers.0', 'out'), ('layers.1', 'lhs'), ('layers.1', 'out')} <= nonf
    hit = f[f.apply(lambda r: (r.site, r.role) in nonf, axis=1)]
    assert set(hit.exploit) == {'nonfinite'}, hit[['site', 'role', 'exploit', 'detail']]
    d = f[f.exploit == 'nonfinite'].set_index(['site', 'role']).loc[('layers.0', 'lhs')]
    assert d.value == pytest.approx(0.5 if name == 'half' else 1.0)
    assert 'on 4 of 4 steps, first at step 0' in d.detail and 'no value-structure claim' in d.detail
    # the weights are finite: their findings stay
    assert ('layers.0', 'rhs') in _taps(f, 'stationary') and ('layers.0', 'rhs') not in nonf


def test_clean_batches_keep_their_findings(nan_runs):
    f = mine(nan_runs['clean'])
    assert not (f.exploit == 'nonfinite').any()
    assert ('layers.0', 'lhs') in _taps(f, 'sparse-gemm') and ('layers.0', 'lhs') in _taps(f, 'int8')
    assert ('layers.1', 'lhs') in _taps(f, 'sparse-gemm')


def test_nan_on_some_steps_drops_those_steps_and_says_which():
    m, bs = _model(), _batches(seed=300, n=5)
    bs[1] = torch.full_like(bs[1], float('nan')); bs[3][2, 5] = float('inf')
    f = mine(record(m, bs, run_id='mixed'))
    d = f[(f.exploit == 'nonfinite') & (f.site == 'layers.0') & (f.role == 'lhs')].detail.iloc[0]
    assert 'on 2 of 5 steps, first at step 1' in d and 'steps 1, 3 dropped' in d and 'cross-step claims refused' in d
    lhs = f[(f.site == 'layers.0') & (f.role == 'lhs')]
    sp = lhs[lhs.exploit == 'sparse-gemm'].value.iloc[0]      # read from the 3 clean steps only
    clean_density = np.mean([(x != 0).float().mean().item() for i, x in enumerate(bs) if i not in (1, 3)])
    assert sp == pytest.approx(clean_density, abs=1e-6)
    assert not lhs.exploit.isin(['stationary']).any()


def test_fp16_overflow_output_gets_no_int8():
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 64).half()
    with torch.no_grad(): lin.weight.mul_(8000)
    xs = [torch.randn(4, 64, generator=torch.Generator().manual_seed(s)).half() * 40 for s in range(2)]
    with torch.no_grad(): bad = (~torch.isfinite(lin(xs[0]))).float().mean().item()
    assert bad > 0.1                                     # a real fp16 overflow
    f = mine(record(lin, xs, run_id='fp16'))
    out = f[f.role == 'out']
    assert 'nonfinite' in set(out.exploit) and not out.exploit.isin(['int8', 'int4']).any(), out


def test_every_plan_guard_refuses_nan_and_inf():
    for e in GUARD_STAT:
        g = synthesize_guard(e, pd.Series([0.1, 0.2]))
        assert g.endswith(FINITE_GUARD), g
        cl = parse_guard(g)
        for v in (float('nan'), float('inf'), float('-inf')):
            x = torch.zeros(8, 16); x[3, 4] = v
            assert not guard_holds(cl, live_values(x, cl, 'lhs', torch.tensor([0, 1])))


# ---------------------------------------------------------------- degenerate tensors (item 3)

def test_all_zero_and_constant_tensors_get_one_constant_finding():
    lin = torch.nn.Linear(32, 16, bias=False)
    with torch.no_grad(): lin.weight.fill_(0.25)
    zeros = [torch.zeros(8, 32) for _ in range(3)]
    f = mine(record(lin, zeros, run_id='zero'))
    for role, word in (('lhs', 'all-zero'), ('out', 'all-zero'), ('rhs', 'constant 0.25')):
        g = f[f.role == role]
        assert list(g.exploit) == ['constant'] and word in g.detail.iloc[0], g
    with warnings.catch_warnings():
        warnings.simplefilter('error', RuntimeWarning)     # no rule divides by a zero absmax or energy
        feats = tap_features(record(lin, zeros, run_id='zero'))
    zero = feats[feats.index.get_level_values('role').isin(['lhs', 'out'])]
    assert zero[['rows90', 'crest_nz', 'kurtosis', 'cv2', 'rho']].isna().all().all()


def test_tiny_magnitudes_are_data_not_zero():
    x0 = [zoo.make_tensor('gaussian', (16, 32), seed=400 + s) * 1e-40 for s in range(4)]   # float32 subnormals
    sk = record(torch.nn.Linear(32, 8), x0, run_id='tiny')
    cs = cross_step(sk).reset_index()
    assert not cs[cs.role == 'lhs'].stationary.iloc[0]    # they differ every step
    f = mine(sk)
    lhs = set(f[f.role == 'lhs'].exploit)
    assert 'stationary' not in lhs and 'token-sparsity' not in lhs, f[f.role == 'lhs']


# ---------------------------------------------------------------- files the miner must survive (item 7)

def _frames():
    m = _model()
    clean, zero = _batches(seed=500, n=3), [torch.zeros(24, 48)] * 3
    alln = [torch.full((24, 48), float('nan'))] * 3
    mixed = _batches(seed=600, n=4); mixed[2] = torch.full_like(mixed[2], float('inf'))
    sk = {n: record(m, b, run_id=n) for n, b in (('clean', clean), ('zero', zero), ('all-nan', alln), ('mixed', mixed))}
    c = sk['clean']
    sk['no-density'] = c[c.stat != 'density']
    sk['one-row'] = c.groupby(['site', 'role', 'step'], observed=True).head(1)
    sk['one-row-per-tap'] = c.groupby(['site', 'role'], observed=True).head(1)
    sk['numel-only'] = c[c.stat == 'numel']           # no step-comparable stat at all: nothing is stationary
    return sk


@pytest.mark.parametrize('name', ['clean', 'zero', 'all-nan', 'mixed', 'no-density', 'one-row', 'one-row-per-tap', 'numel-only'])
def test_engines_agree_on_degenerate_files(tmp_path, name):
    df = _frames()[name].reset_index(drop=True)
    path = tmp_path / f'{name}.parquet'
    df.to_parquet(path)
    a, b = mine(df), mine_duckdb(path)
    assert same_findings(a, b), (a, b)
    if name == 'all-nan':
        assert set(a[a.role != 'rhs'].exploit) == {'nonfinite'}
        assert not a.detail.str.contains('of rows hold').any()


# ---------------------------------------------------------------- schema (item 6)

def test_no_stat_or_role_is_a_default_na_token():
    vocab = set(STATS + ATTN_STATS + GATE_STATS) | {'lhs', 'rhs', 'out', 'attn', 'gate'}
    assert not vocab & set(STR_NA_VALUES)
    assert SCHEMA_VERSION >= 2 and set(RENAMED_STATS.values()) <= set(STATS)


def test_plain_read_csv_keeps_every_stat_name(tmp_path):
    m = zoo.transformer(layers=1)
    p = tmp_path / 'sk.csv'
    rec = record(m, [zoo.example_input(m, seed=700 + s) for s in range(2)], run_id='t', sink=p, keep=True)
    plain = pd.read_csv(p)                                  # pandas' defaults, no keep_default_na
    assert plain.stat.notna().all()
    manifest = plain.stat == MANIFEST_STAT                  # each step opens with its manifest row: no site, no role
    assert manifest.sum() == 2 and plain[~manifest].role.notna().all() and plain[manifest].role.isna().all()
    assert set(plain.stat) - {MANIFEST_STAT} == set(rec.stat) and {'nan_count', 'inf_count'} <= set(plain.stat)
    assert len(plain) == len(rec) + 2


def test_schema_1_files_read_with_new_names(tmp_path):
    m = _model()
    new = tmp_path / 'new.csv'
    rec = record(m, _batches(seed=800, n=2), run_id='v', sink=new, keep=True)
    old = tmp_path / 'old.csv'
    old.write_text(new.read_text().replace(',nan_count,', ',nan,').replace(',inf_count,', ',inf,'))
    assert pd.read_csv(old).stat.isna().sum() == (rec.stat == 'nan_count').sum()   # what plain pandas did to them
    back = read_sketches(old)
    assert set(back.stat) == set(rec.stat)
    assert same_findings(mine(back), mine(read_sketches(new)))
    oldp = tmp_path / 'old.parquet'
    read_sketches(new).assign(stat=lambda d: d.stat.replace({v: k for k, v in RENAMED_STATS.items()})).to_parquet(oldp)
    assert set(read_sketches(oldp).stat) == set(rec.stat)
    assert same_findings(mine_duckdb(oldp), mine(read_sketches(new)))


@pytest.mark.parametrize('col, value', [('M', '1e30'), ('numel', '-1e19'), ('step', '9.3e18'), ('idx', 'inf')])
def test_integer_columns_are_range_checked(tmp_path, col, value):
    p = tmp_path / 'ok.csv'
    record(_model(), _batches(n=1), sink=p)
    lines = p.read_text().splitlines()
    row = lines[7].split(','); row[SCHEMA.index(col)] = value
    bad = tmp_path / 'bad.csv'
    bad.write_text('\n'.join(lines[:7] + [','.join(row)] + lines[8:]) + '\n')
    with pytest.raises(ValueError, match=rf"bad.csv: line 8: column '{col}' holds .*(int64 range|not an integer)"):
        read_sketches(bad)


# ---------------------------------------------------------------- safetensors files (item 5)

def test_every_header_length_residue_mod_256_reads(tmp_path):
    data = torch.arange(3, dtype=torch.float32).numpy().tobytes()
    for r in range(256):
        h = json.dumps({'t': {'dtype': 'F32', 'shape': [3], 'data_offsets': [0, 12]}}).encode()
        h += b' ' * ((r - len(h)) % 256)
        p = tmp_path / f'h{r}.safetensors'
        p.write_bytes(struct.pack('<Q', len(h)) + h + data)
        assert torch.equal(load_tensors(p)['t'], torch.arange(3.)), r
    seen = set()
    for L in range(1, 300):                                # save_tensors' own files: every residue it can write
        p = save_tensors(tmp_path / 's.safetensors', {'n' * L: torch.ones(1)})
        seen.add(struct.unpack('<Q', p.read_bytes()[:8])[0] % 256)
        assert list(load_tensors(p)) == ['n' * L]
    assert 0x80 in seen and len(seen) == 32               # safetensors pads headers to 8 bytes


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]


@st.composite
def tensor_dicts(draw):
    names = draw(st.lists(st.text(st.characters(blacklist_categories=('Cs',)), min_size=1, max_size=40), max_size=6, unique=True))
    out = {}
    for i, n in enumerate(names):
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
        dt = draw(st.sampled_from(DTYPES))
        g = torch.Generator().manual_seed(i)
        t = torch.randn(shape, generator=g) * 50
        out[n] = (t > 0) if dt == torch.bool else t.to(dt)
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ts=tensor_dicts())
def test_save_load_round_trips_random_dicts(tmp_path, ts):
    back = load_tensors(save_tensors(tmp_path / 'r.safetensors', ts))
    assert set(back) == set(ts)
    for k, v in ts.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)


@pytest.mark.parametrize('payload, why', [
    (lambda p: p.write_bytes(pickle.dumps({'a': 1}, protocol=2)), 'pickle'),
    (lambda p: torch.save({'w': torch.ones(2)}, p), 'zip archive'),
    (lambda p: p.write_bytes(b'\x10\x00\x00\x00\x00\x00\x00\x00{"a": [1, 2, 3]}'), "tensor 'a': is \\[1, 2, 3\\], not a tensor entry"),
    (lambda p: p.write_bytes(struct.pack('<Q', 1 << 40) + b'{}'), 'bad header'),
    (lambda p: p.write_bytes(b'\x80\x00'), 'pickle'),
    (lambda p: p.write_bytes(b''), 'bad header')])
def test_non_safetensors_are_refused(tmp_path, payload, why):
    p = tmp_path / 'x.safetensors'
    payload(p)
    with pytest.raises(ValueError, match=why): load_tensors(p)


# ---------------------------------------------------------------- the deep-dump loop (item 2)

def _row_heavy(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(0.6 * torch.randn((shape[0], 1), generator=g))


def _row_sparse(shape, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand((shape[0], 1), generator=g) ** 4 / 2
    return torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < keep)


def test_deep_dump_states_no_dimension_and_the_probe_confirms_only_low_rank():
    M, K, N = 160, 192, 224
    sw = sweep(shapes=((M, K, N),), dists=['lowrank', 'heavytail', 'sparse90', 'gaussian'], steps=2, seed=900)
    own = {'row-heavy': _row_heavy, 'row-sparse': _row_sparse}
    sk = pd.concat([sw] + [record(zoo.gemm(K, N), [fn((M, K), 900 + s) for s in range(2)], run_id=n, dist=n)
                           for n, fn in own.items()], ignore_index=True)
    first = {f'{d}-{M}x{K}x{N}': zoo.make_tensor(d, (M, K), seed=900) for d in ['lowrank', 'heavytail', 'sparse90', 'gaussian']}
    first.update({n: fn((M, K), 900) for n, fn in own.items()})
    f0 = mine(sk)
    pointers = f0[f0.exploit == 'deep-dump']
    assert len(pointers) and not pointers.detail.str.contains(r'dims|~\d').any()
    assert 'lhs' in set(pointers[pointers.run_id == f'lowrank-{M}x{K}x{N}'].role)
    truth = pd.concat([rank_table(dump_sites(zoo.gemm(K, N), x), run) for run, x in first.items()], ignore_index=True)
    ranks = pd.concat([probe_pointers(f0, zoo.gemm(K, N), x, run_id=run) for run, x in first.items()], ignore_index=True)
    f1 = mine(sk, probe=ranks)
    assert not (f1.exploit == 'deep-dump').any()
    lr = f1[f1.exploit == 'low-rank'].merge(truth, on=['run_id', 'site', 'role'])
    assert f'lowrank-{M}x{K}x{N}' in set(lr.run_id)
    assert (lr.erank <= LOWRANK_ERANK_SHARE * np.minimum(lr.rows, lr.cols)).all()
    assert (lr.idx >= lr.erank / 3).all() and (lr.value >= lr.erank / 3).all()
    assert not {'row-heavy', 'row-sparse', f'gaussian-{M}x{K}x{N}'} & set(lr.run_id)
    assert len(f1.attrs['retracted']) == len(pointers) - len(lr)


@pytest.mark.parametrize('missing', [('hist',), ('hist', 'row_energy'), ('hist', 'row_energy', 'chan_absmax', 'chan_density')])
def test_taps_missing_stats_keep_their_keys(missing):
    "A table without some statistics (an older writer, a filtered file) mines with every finding keyed by its tap, in both engines."
    sk = record(_model(), _batches(seed=300, n=2), run_id='partial')
    one = sk[(sk.site == sk.site.iloc[0]) & (sk.role == 'lhs')]
    for table in (one, sk):
        part = table[~table.stat.isin(missing)]
        f = mine(part)
        assert len(f) and not f[['run_id', 'dist', 'site', 'role']].isna().any().any(), f
        assert set(f.site) <= set(part.site)
        assert same_findings(f, mine_duckdb(part))
