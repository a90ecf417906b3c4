"The Dask engine: findings identical to pandas and DuckDB on a 2-worker LocalCluster, out of one worker's memory, the CLI."
import builtins, shutil, subprocess, sys, time
import numpy as np, pandas as pd, pytest
import pyarrow as pa, pyarrow.parquet as pq

from opscope.zoo import mnist_mlp, mnist_batches, moe, planted_attention, example_input, transformer
from opscope.recorder import record, sweep, Recorder
from opscope.tables import read_sketches, COUNT_STATS, SHARE_STATS
from conftest import engine_outcomes
from opscope.miner import mine, INFER_EXPLOITS
from opscope.scale import mine_duckdb, mine_dask, same_findings, ClusterError

distributed = pytest.importorskip('distributed')


@pytest.fixture(scope='module')
def cluster():
    "Two worker processes, one thread and 700 MB each (a bare worker with pandas and pyarrow loaded is ~200 MB, and at 80% of its limit a worker pauses)."
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, memory_limit='700MB',
                                  dashboard_address=None) as lc, distributed.Client(lc) as c:
        yield c


def _workers(c):
    "The workers as the scheduler sees them now (`Client.scheduler_info`'s cached copy can come back empty: a periodic refresh asks for no workers)."
    return c.sync(c.scheduler.identity, n_workers=-1)['workers']


def _to_dataset(df, path):
    with Recorder(path) as rec:
        for _, g in df.groupby(['run_id', 'step'], observed=True, sort=False): rec.write(g)
    return path


@pytest.fixture(scope='module')
def sketches(tmp_path_factory):
    "Sweep + MNIST + planted attention (key counts changing across steps) + a biased MoE router, as a dataset."
    a = planted_attention(sink=7, band=2, sink_logit=4.4, band_logit=4.4)
    e = moe(router_bias=[-30, 0, 0, 5, 0, 0, -30, 0], seed=2)
    df = pd.concat([sweep(shapes=((96, 256, 64),), steps=3, seed=21, structure_seed=3),
                    record(mnist_mlp(), mnist_batches(4), run_id='mnist', dist='mnist'),
                    record(a, [example_input(a, tokens=T, seed=s) for s, T in enumerate([32, 48, 24])],
                           taps=('matmul', 'softmax'), run_id='attn', dist='attn'),
                    record(e, [example_input(e, seed=s + 3) for s in range(3)], taps=('matmul', 'topk'), run_id='moe', dist='moe')],
                   ignore_index=True)
    d = tmp_path_factory.mktemp('dask')
    return df, _to_dataset(df, d / 'ds')


@pytest.mark.slow
def test_three_engines_same_findings_on_two_workers(sketches, cluster):
    df, ds = sketches
    ref = mine(df)
    assert {'sparse-gemm', 'channel-outliers', 'dead-channels', 'attention-sink', 'windowed-attention',
            'cold-experts', 'hot-experts', 'stationary'} <= set(ref.exploit)
    got = mine_dask(ds, cluster)
    assert same_findings(ref, got) and same_findings(ref, mine_duckdb(ds))
    assert same_findings(ref, mine_dask(df.sample(frac=1, random_state=3), cluster))   # steps split over partitions: shuffled
    bad = got.copy(); bad.loc[bad.exploit == 'attention-sink', 'value'] *= 1 + 1e-6
    assert not same_findings(ref, bad)
    assert not any(cluster.run(lambda: 'torch' in sys.modules).values())   # the worker processes mined without torch


def test_dask_agrees_on_steps_without_rows_and_outlier_evidence(cluster):
    "Issue #33: steps where an expert saw no rows, steps with too few rows, and the persistence path of channel-outliers, as pandas reads them."
    from test_steps_outliers import _tap, _chan, _spread, _rows
    nan = np.nan
    df = pd.concat([_tap('expert3', [3.67, 2.44] + [nan] * 4, [[3.67, 1.2], [2.44, 0.9]] + [[nan, nan]] * 4),
                    _tap('expert1', [1.5, 1.5] + [nan] * 4, [[1.5, 0.7]] * 2 + [[nan, nan]] * 4),
                    _tap('weight', [0.5] * 6, [[0.5, 0.25]] * 6, role='rhs'),
                    _chan([[5] + _spread(t, 383) for t in range(3)], rows=8, site='top'),
                    _chan([[20] + _spread(t, 383) for t in range(3)], rows=1, site='thin'),       # 3 rows in all: no evidence window
                    _rows(_chan([[20] + _spread(t, 383) for t in range(3)], rows=16, site='decode'), [37, 1, 1]),   # prefill + 2 decode steps pooled
                    _rows(_chan([[20] + _spread(t, 383) for t in range(6)], rows=16, site='odd'), [2, 1, 3, 1, 2, 1])], ignore_index=True)
    ref = mine(df)
    assert set(ref[ref.exploit == 'stationary'].site) == {'expert1', 'weight'}
    assert set(ref[ref.exploit == 'channel-outliers'].site) == {'top', 'decode', 'odd'}
    assert same_findings(ref, mine_dask(df, cluster)) and same_findings(ref, mine_duckdb(df))


def test_dask_refuses_rank_clash_and_bad_input(sketches, cluster, tmp_path):
    df, _ = sketches
    one = df[df.run_id == 'mnist']
    with pytest.raises(ValueError, match='more than one rank'):
        mine_dask(pd.concat([one.assign(rank=0), one.assign(rank=1)]), cluster)
    with pytest.raises(FileNotFoundError, match='no such file'): mine_dask(tmp_path / 'nothing', cluster)
    with pytest.raises(ValueError, match="missing columns stat"): mine_dask(one.drop(columns='stat'), cluster)
    (tmp_path / 'empty').mkdir()
    with pytest.raises(ValueError, match='no sketches in it'): mine_dask(tmp_path / 'empty', cluster)
    assert mine_dask(one.iloc[:0], cluster).empty



def _three(src, cluster):
    "((outcome, message or findings), incomplete-step warnings) of the three engines on `src`."
    return engine_outcomes(src, mine, mine_duckdb, lambda x: mine_dask(x, cluster))


def test_dask_vets_as_the_other_engines(sketches, cluster, tmp_path):
    "Issue #34: a part that lost rows (dropped, the same warning), a row twice, a newer schema, non-finite values: the three engines agree."
    from opscope.tables import dataset_files, MANIFEST_STAT, COUNT_STATS, SHARE_STATS, MAGNITUDE_STATS
    df, ds = sketches
    cut, dup, new = (tmp_path / n for n in ('cut', 'dup', 'new'))
    for d in (cut, dup, new): shutil.copytree(ds, d)
    part = dataset_files(cut)[2]; t = pd.read_parquet(part); t.iloc[:-5].to_parquet(part, index=False)
    part = dataset_files(dup)[1]; t = pd.read_parquet(part); pd.concat([t, t.iloc[7:8]]).to_parquet(part, index=False)
    part = dataset_files(new)[0]; t = pd.read_parquet(part); t.loc[t.stat == MANIFEST_STAT, 'idx'] += 1; t.to_parquet(part, index=False)
    one = df[df.run_id == 'mnist']
    rng = np.random.default_rng(3)
    mixed = one.copy(); m = (rng.random(len(one)) < 0.2) & ~one.stat.isin(list(COUNT_STATS + SHARE_STATS + MAGNITUDE_STATS)).to_numpy()   # ±Inf only where a stat has no domain
    mixed.loc[m, 'value'] = rng.choice([np.inf, -np.inf, np.nan], m.sum())
    for src, want in ((cut, 'ok'), (dup, 'two rows have the key'), (new, 'newer than version'), (one.assign(value=np.inf), 'outside 0 to 1'),
                      (one.assign(value=np.nan), 'not a count'), (mixed, 'ok')):
        (a, wa), (b, wb), (c, wc) = _three(src, cluster)
        assert a[0] == b[0] == c[0] and wa == wb == wc, (a, b, c, wa, wb, wc)
        if a[0] == 'ok': assert same_findings(a[1], b[1]) and same_findings(a[1], c[1])
        else: assert a[1] == b[1] == c[1] and want in a[1], (a, b, c)
        assert (want == 'ok') == (a[0] == 'ok')
        if src is cut: assert len(wa) == 1 and 'dropped 1 incomplete step' in wa[0]

def test_missing_dask_names_the_extra(monkeypatch):
    real = builtins.__import__
    def no_dask(name, *a, **k):
        if name.split('.')[0] in ('dask', 'distributed'): raise ImportError(f"No module named {name!r}")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, '__import__', no_dask)
    with pytest.raises(ImportError, match=r"pip install 'opscope\[dask\]'"): mine_dask(pd.DataFrame())


def _replicate(src, dst, times):
    "A dataset `times` as long as `src`: each part copied with its steps shifted (a long run of the same workload)."
    files = sorted(src.rglob('part-*.parquet'))
    n = len(files)
    for k in range(times):
        for f in files:
            t = pq.read_table(f)
            s = t['step'].to_numpy() + k * n
            t = t.set_column(t.schema.get_field_index('step'), 'step', pa.array(s, pa.int64()))
            keep = np.isin(t['stat'].to_numpy(zero_copy_only=False), list(COUNT_STATS + SHARE_STATS))   # counts, shares (at most 1) and the step's manifest stay as they are
            t = t.set_column(t.schema.get_field_index('value'), 'value', pa.array(np.where(keep, t['value'].to_numpy(), t['value'].to_numpy() * (1 + 1e-3 * k))))
            out = dst / f.relative_to(src).parent / f'part-{int(s[0]):09d}.parquet'
            out.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(t, out)
    return dst


@pytest.mark.slow
def test_larger_than_a_worker_two_workers_no_restarts(cluster, tmp_path):
    m = transformer(layers=2)
    record(m, (example_input(m, batch=8, seed=s) for s in range(10)), sink=tmp_path / 'one', run_id='big')
    ds = _replicate(tmp_path / 'one', tmp_path / 'big', 17)   # 17 × 40 MiB decoded: just over a worker's 667 MiB
    decoded = sum(pq.read_table(f).nbytes for f in ds.rglob('*.parquet'))
    limit = _workers(cluster)
    per_worker = min(w['memory_limit'] for w in limit.values())
    assert decoded > per_worker, (decoded, per_worker)         # the table does not fit one worker
    before = set(limit)
    got = mine_dask(ds, cluster)
    assert set(_workers(cluster)) == before                     # no worker killed for memory and restarted
    assert same_findings(mine_duckdb(ds, memory_limit='300MB', threads=1), got) and len(got) > 10


@pytest.mark.slow
def test_cli_three_engines_on_dataset(sketches, cli, tmp_path):
    "opscope-mine prints the same report and writes the same findings through pandas, DuckDB and Dask; opscope-sweep writes a dataset directory."
    _, ds = sketches
    out = {e: cli('opscope-mine', str(ds), '--engine', e, '--out', str(tmp_path / f'{e}.csv')) for e in ('pandas', 'duckdb', 'dask')}
    assert all(o.returncode == 0 for o in out.values()), {e: o.stderr[-500:] for e, o in out.items()}
    report = {e: o.stdout.rsplit('\n\n', 1)[0] for e, o in out.items()}   # all but the closing '... findings → FILE' line
    assert report['pandas'] == report['duckdb'] == report['dask']
    f = {e: pd.read_csv(tmp_path / f'{e}.csv', keep_default_na=False, na_values=['']) for e in out}
    assert same_findings(f['pandas'], f['dask']) and same_findings(f['pandas'], f['duckdb'])
    r = cli('opscope-mine', str(ds), '--scheduler', 'tcp://127.0.0.1:1')
    assert r.returncode == 2 and '--scheduler needs --engine dask' in r.stderr
    r = cli('opscope-sweep', str(tmp_path / 'sw') + '/', '--steps', '1', '--quiet')
    assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / 'sw').rglob('*.parquet'))) > 1 and not read_sketches(tmp_path / 'sw').empty


@pytest.fixture
def no_kill():
    "Workers that pause at 80% of their memory limit but are never killed at 95%: the case that used to hang."
    import dask
    with dask.config.set({'distributed.worker.memory.terminate': False}): yield


def test_paused_worker_ends_the_call_in_one_line(sketches, no_kill):
    "A worker whose 150 MB limit is below what its imports take pauses for good; mine_dask says so within `patience`, naming it."
    df, _ = sketches
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e: mine_dask(df[df.run_id == 'mnist'], n_workers=1, memory_limit='150MB', patience=1)
    took, msg = time.monotonic() - t0, str(e.value)
    assert '\n' not in msg and 'worker 0 (tcp://' in msg and 'stayed paused for 1 s' in msg, msg
    assert 'of its 143 MiB memory limit' in msg and 'memory_limit=' in msg, msg
    assert took < 30, took                  # cluster start + imports + patience, not forever


def test_killed_worker_and_no_worker_end_the_call(sketches):
    "A worker the nanny kills at 95% of its limit, and a cluster without workers: one ClusterError line each, at once or after `patience`."
    df, _ = sketches
    with pytest.raises(ClusterError, match=r'worker 0 \(tcp://[^)]+\) was killed by its nanny at \d+ MiB, \d+% of its 114 MiB'):
        mine_dask(df[df.run_id == 'mnist'], n_workers=1, memory_limit='120MB')     # below what the worker's imports take
    with distributed.LocalCluster(n_workers=0, processes=True, dashboard_address=None) as lc, distributed.Client(lc) as c:
        with pytest.raises(ClusterError, match='the cluster has had no worker for 1 s'): mine_dask(df[df.run_id == 'mnist'], c, patience=1)


def _taps_per_row_group(f):
    "Each row group's (run, step, site, role) keys, as sets."
    p = pq.ParquetFile(f)
    return [set(map(tuple, p.read_row_group(i, columns=['step', 'site', 'role']).to_pandas().drop_duplicates().to_numpy().tolist()))
            for i in range(p.num_row_groups)]


def test_recorder_cuts_row_groups_between_taps(sketches, tmp_path, monkeypatch):
    "A dataset's part file is row groups of whole taps (issue 35: a reader can take a step apart tap by tap); a tap never spans two."
    import opscope.recorder as R
    df, _ = sketches
    monkeypatch.setattr(R, 'ROW_GROUP_ROWS', 500)
    ds = _to_dataset(df, tmp_path / 'ds')
    files = sorted(ds.rglob('part-*.parquet'))
    groups = [_taps_per_row_group(f) for f in files]
    assert max(len(g) for g in groups) > 5                                 # several row groups a step
    for g in groups:
        seen = [t for s in g for t in s]
        assert len(seen) == len(set(seen))                                 # no tap in two row groups
    assert read_sketches(ds).sort_values(['run_id', 'step', 'site', 'role', 'stat', 'idx']).reset_index(drop=True).equals(
        read_sketches(_to_dataset(df, tmp_path / 'whole')).sort_values(['run_id', 'step', 'site', 'role', 'stat', 'idx']).reset_index(drop=True))
    shuffled = df.sample(frac=1, random_state=0)                            # a tap's rows not contiguous: one row group, as before
    assert R._tap_groups(shuffled[shuffled.step == 0], 100) == [int((shuffled.step == 0).sum())]


def test_dask_batches_of_whole_taps_same_findings(sketches, cluster, tmp_path, monkeypatch):
    "A local dataset is mined a batch of whole taps per task, by DuckDB on the worker: small batches, and row groups that split taps (read by each batch with a tap in them), mine as pandas does; a batch missing some of the run's step columns makes its cross-step table again with them."
    import opscope.recorder as R, opscope.scale as S
    df, _ = sketches
    ref = mine(df)
    monkeypatch.setattr(R, 'ROW_GROUP_ROWS', 2000)
    ds = _to_dataset(df, tmp_path / 'ds')
    monkeypatch.setattr(S, 'TASK_ROWS', 3000)
    tasks, runs = [], []
    real_tasks, real_run = S._tap_tasks, S._run
    monkeypatch.setattr(S, '_tap_tasks', lambda loc: tasks.append(real_tasks(loc)) or tasks[-1])
    monkeypatch.setattr(S, '_run', lambda c, xs, w, d: runs.append(len(xs)) or real_run(c, xs, w, d))
    assert same_findings(ref, mine_dask(ds, cluster))
    taps = pd.concat([t for t, _ in tasks[0]], ignore_index=True)
    assert len(tasks[0]) > 10 and not taps.duplicated().any() and len(taps) == len(df.drop_duplicates(['run_id', 'dist', 'site', 'role']))   # each tap in one batch
    for t, groups in tasks[0]:       # a batch reads only row groups that hold one of its taps
        mine_ = set(zip(t.site, t.role))
        for f, rgs in groups: assert all(mine_ & {(s, r) for _, s, r in g} for g in [_taps_per_row_group(f)[i] for i in rgs])
    assert len(runs) == 3 and runs[2] > 0         # vetting, batches, and cross-step tables made again for some batches
    cut = tmp_path / 'cut'                                                  # row groups of 700 rows whatever the taps: a tap split over row groups
    for f in ds.rglob('part-*.parquet'):
        (cut / f.parent.relative_to(ds)).mkdir(parents=True, exist_ok=True)
        pq.write_table(pq.read_table(f), cut / f.relative_to(ds), row_group_size=700)
    assert same_findings(ref, mine_dask(cut, cluster))


def test_step_columns_from_counts_or_none():
    "The run's step columns from per-(tap, step) channel counts; None where a tap's channels differ between steps (then the matrices tell)."
    from opscope.scale import _step_columns
    s = pd.DataFrame({'tap': [0, 0, 0, 1, 1], 'step': [4, 1, 2, 1, 3], 'n': 3, 'v': [3, 0, 3, 3, 3], 'lo': 0, 'hi': 2})
    assert _step_columns(s) == [0, 1, 2]        # tap 0's t=0 (step 1) has no value, but tap 1's has
    assert _step_columns(s.assign(v=[3, 3, 0, 0, 0])) == [0, 2]    # t=1 (tap 0's step 2, tap 1's step 3) valued nowhere: not a column
    assert _step_columns(s.assign(hi=[2, 2, 3, 2, 2])) is None
    assert _step_columns(s.iloc[:0]) == []


def test_duckdb_in_batches_of_taps(sketches, monkeypatch):
    "DuckDB reduces the per-step medians, ranks and histogram tails, and hands the chan_absmax series to pandas, a batch of whole taps at a time: the same findings with batches of one tap."
    import opscope.scale as S
    df, ds = sketches
    ref = mine(df)
    monkeypatch.setattr(S, 'CROSS_ROWS', 1)
    monkeypatch.setattr(S, 'BATCH_ROWS', 1)
    assert same_findings(ref, mine_duckdb(ds))
    assert S._batches([0, 1, 2, 3], [5, 5, 0, 9], 10) == [(0, 1), (2, 3)] and S._batches([], [], 10) == []


def test_task_out_of_memory_ends_in_one_line(sketches, tmp_path, monkeypatch):
    "A batch task whose DuckDB runs out of its share of the worker's memory: one ClusterError line saying what to set; its database files removed."
    import dask, opscope.scale as S
    _, ds = sketches
    db = tmp_path / 'task.duckdb'
    monkeypatch.setattr(S, '_task_con', lambda: (S._connect('2MB', 1, tmp_path / 'spill', db), db, 2**21, 2**24))
    with pytest.raises(ClusterError) as e:
        S._mine_batched(sorted(ds.rglob('part-*.parquet')), ds, 'ds', lambda *xs: dask.compute(*xs, scheduler='sync'), dask.delayed, 1)
    msg = str(e.value)
    assert '\n' not in msg and msg.startswith('ds: DuckDB ran out of the 2 MiB a task gets on a worker (1/8 of its memory limit, over its threads)'), msg
    assert 'give each worker more than 16 MiB memory' in msg and not db.exists(), msg


WARN_ON_WORKER = '''
import warnings, opscope.scale as s
warnings.simplefilter('always')          # this test's worker: every warning shown, not once per place
def warned(f):
    def task(*a, **k):
        warnings.warn("opscope test: a task's warning\\nits second line", RuntimeWarning)
        return f(*a, **k)
    return task
s._vet_part, s._tap_facts = warned(s._vet_part), warned(s._tap_facts)    # the first tasks of either path
'''


def test_worker_warnings_come_back_as_lines(tmp_path, capsys):
    "A warning a task raises on a worker is warned again in the client (its category and text kept, once however many tasks raised it), and `opscope-mine --engine dask` prints it as the one `warning:` line the other engines print; the plugin leaves with the call."
    import warnings
    from opscope.mine_cli import opscope_mine
    df = sweep(shapes=((32, 64, 16),), dists=['gaussian', 'relu'], steps=2, seed=5)
    ds, ref = _to_dataset(df, tmp_path / 'ds'), mine(df)
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, memory_limit='700MB', dashboard_address=None) as lc, \
         distributed.Client(lc) as c:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            assert same_findings(ref, mine_dask(ds, c))
        assert not [x for x in w if 'a task' in str(x.message)]
        c.run(exec, WARN_ON_WORKER, {})
        for src in (ds, df):          # DuckDB tasks on a dataset; dask.dataframe tasks on a DataFrame
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter('always')
                assert same_findings(ref, mine_dask(src, c))
            said = [x for x in w if 'a task' in str(x.message)]
            assert len(said) == 1 and said[0].category is RuntimeWarning, [str(x.message) for x in w]
            assert str(said[0].message) == "opscope test: a task's warning\nits second line"
        capsys.readouterr()
        opscope_mine(str(ds), engine='dask', scheduler=lc.scheduler_address)
        err = capsys.readouterr().err.strip().splitlines()
        assert err == ["opscope-mine: warning: opscope test: a task's warning"], err
        assert not [p for ps in c.run(lambda dask_worker: list(dask_worker.plugins)).values() for p in ps if p.startswith('opscope-warning')]
