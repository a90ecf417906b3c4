"Scale: Parquet datasets written by two ranks, out-of-core mining with DuckDB, and the CLI on a dataset directory."
import subprocess, sys
import numpy as np, pandas as pd, pytest, torch

from opscope.zoo import seq_model, stepped_sequence, mnist_mlp, mnist_batches
from opscope.recorder import record, read_sketches, sweep, Recorder, SCHEMA
from opscope.miner import mine
from opscope.scale import record_spawned, record_shard, mine_duckdb, same_findings, WORKLOADS


@pytest.fixture(scope='module')
def two_ranks(tmp_path_factory):
    "The decode-like sequence recorded by 2 spawned ranks (gloo, loopback) and by one process."
    d = tmp_path_factory.mktemp('scale')
    ds = record_spawned(d / 'seq', world=2, workload='seq', steps=12)
    one = record(seq_model(), stepped_sequence(12), run_id='seq', dist='seq', sink=d / 'seq.parquet', keep=True)
    return d, ds, one


def test_two_ranks_partitions_and_rows(two_ranks):
    d, ds, one = two_ranks
    files = sorted(p.relative_to(ds).as_posix() for p in ds.rglob('*.parquet'))
    assert files == sorted(f'run_id=seq/rank={s % 2}/part-{s:09d}.parquet' for s in range(12))
    back = read_sketches(ds)
    assert list(back.columns) == SCHEMA + ['rank']
    assert back.groupby('step')['rank'].unique().map(list).tolist() == [[s % 2] for s in range(12)]
    assert np.array_equal(back[SCHEMA].value.fillna(-1).values, one.value.fillna(-1).values)


def test_same_findings_pandas_duckdb_file_and_dataset(two_ranks):
    d, ds, one = two_ranks
    ref = mine(one)
    assert len(ref) > 10 and {'stationary', 'temporal-coherence'} <= set(ref.exploit)
    for got in (mine(ds), mine_duckdb(ds), mine_duckdb(d / 'seq.parquet', memory_limit='200MB', threads=1)):
        assert same_findings(ref, got)


def test_same_findings_sweep_and_mnist(tmp_path):
    df = pd.concat([sweep(shapes=((128, 512, 64), (64, 256, 256)), steps=3, seed=11, structure_seed=4),
                    record(mnist_mlp(), mnist_batches(5), run_id='mnist', dist='mnist')], ignore_index=True)
    p = tmp_path / 'ds'
    with Recorder(p) as rec:
        for _, g in df.groupby(['run_id', 'step'], observed=True, sort=False): rec.write(g)
    a, b = mine(df), mine_duckdb(p)
    assert {'sparse-gemm', 'channel-outliers', 'spiky', 'deep-dump', 'dead-channels'} <= set(a.exploit)
    assert same_findings(a, b)
    b2 = b.copy(); b2.loc[0, 'value'] *= 1 + 1e-6
    assert not same_findings(a, b2)          # the comparison can fail


def test_shard_without_process_group_and_collisions(tmp_path):
    m = seq_model(); bs = stepped_sequence(4)
    with pytest.raises(RuntimeError, match='not initialized'):
        record_shard(m, bs, tmp_path / 'x')
    a = record_shard(m, bs, tmp_path / 'x', rank=1, world=2, run_id='s')
    assert sorted(a.step.unique()) == [1, 3] and (a['rank'] == 1).all()
    assert record_shard(m, bs[:1], tmp_path / 'x', rank=1, world=2).empty     # an empty shard is not an error
    clash = pd.concat([a.assign(step=0), a.assign(step=0, rank=0)])
    for f in (mine, mine_duckdb):
        with pytest.raises(ValueError, match='more than one rank'): f(clash)


@pytest.mark.slow
def test_cli_mine_dataset_dir_equals_file(two_ranks, cli):
    d, ds, one = two_ranks
    a = cli('opscope-mine', str(ds) + '/')
    b = cli('opscope-mine', str(d / 'seq.parquet'))
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert a.stdout == b.stdout and 'stationary' in a.stdout and 'coherent' in a.stdout
    c = cli('opscope-mine', str(ds), '--engine', 'duckdb', '--out', str(d / 'f.csv'))
    assert c.returncode == 0, c.stderr
    assert c.stdout.split('\n\n')[0] == a.stdout.strip('\n')       # the same report, out of core
    assert len(pd.read_csv(d / 'f.csv')) == len(mine(ds))
    r = cli('opscope-mine', str(ds), '--engine', 'spark')
    assert r.returncode == 2 and 'engine must be pandas, duckdb or dask' in r.stderr
    broken = d / 'broken'; (broken / 'run_id=x' / 'rank=0').mkdir(parents=True)
    (broken / 'run_id=x' / 'rank=0' / 'part-000000000.parquet').write_bytes(b'PAR1 not parquet')
    for engine in ('pandas', 'duckdb'):
        r = cli('opscope-mine', str(broken), '--engine', engine)
        assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'Traceback' not in r.stderr, r.stderr
    empty = d / 'empty'; empty.mkdir()
    r = cli('opscope-mine', str(empty))
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'no sketches in it' in r.stderr


def test_scale_imports_no_torch():
    "Mining needs no torch: `import opscope.scale` (what a Dask worker and a mining script import) leaves it out; recording imports it when called."
    code = ("import sys, opscope.scale as s; assert 'torch' not in sys.modules, 'torch imported'; "
            "assert 'seq' in s.WORKLOADS and 'torch' in sys.modules")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert set(WORKLOADS) >= {'seq', 'mnist'}
