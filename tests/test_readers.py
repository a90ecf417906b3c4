"Readers that refuse what they cannot trust (issue 34): one key per row, a manifest per step, a schema version, bounded work per line, engines that agree on non-finite values — and a seeded fuzzer over every sketches reader."
import random, resource, shutil, time, warnings
from pathlib import Path
import numpy as np, pandas as pd, pytest, torch
from conftest import engine_outcomes

from opscope.tables import (SCHEMA, SCHEMA_VERSION, MANIFEST_STAT, COMMIT_SUFFIX, COUNT_STATS, SHARE_STATS, MAGNITUDE_STATS, InputError, read_sketches,
                            first_duplicate, dataset_files)
from opscope.recorder import record, Recorder
from opscope.zoo import mlp, make_tensor
from opscope.miner import mine
from opscope.scale import mine_duckdb, same_findings

FUZZ_SLOW, FUZZ_FAST = 1000, 50      # mutated files per reader
DUCKDB_EVERY = 10                    # mine_duckdb runs on every 10th mutated Parquet file / dataset
MAX_SECONDS = 5.0
MAX_RSS_GROWTH_MIB = 1024


def _batches(n=3):
    return [make_tensor('relu', (8, 24), seed=70 + s) for s in range(n)]


@pytest.fixture(scope='module')
def rows():
    return record(mlp(2, 24), _batches(), run_id='r', dist='relu')


@pytest.fixture(scope='module')
def files(rows, tmp_path_factory):
    "The recording in every format: a finished CSV, an unfinished one (its commit log beside it), a .parquet file, a dataset."
    d = tmp_path_factory.mktemp('readers')
    for name in ('s.csv', 's.parquet', 'ds'):
        with Recorder(d / name) as rec:
            for _, g in rows.groupby('step', sort=True): rec.write(g)
    rec = Recorder(d / 'live.csv')            # never closed: the log stays, as a killed writer leaves it
    for _, g in rows.groupby('step', sort=True): rec.write(g)
    rec._f.close(); rec._log.close()
    return d


def _read(p):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        df = read_sketches(p)
    return df, [str(x.message) for x in w]


def _mine_both(p):
    "(outcome, warnings) of mine and mine_duckdb on `p`: ('ok', findings) or ('err', message)."
    return engine_outcomes(p, mine, mine_duckdb)


def _agree(p):
    (a, wa), (b, wb) = _mine_both(p)
    assert a[0] == b[0], (a, b)
    assert wa == wb, (wa, wb)
    if a[0] == 'ok': assert same_findings(a[1], b[1])
    else: assert a[1] == b[1]
    return a, wa


# --- the cases, every engine ----------------------------------------------------------------------

def test_written_with_a_manifest_read_without(files, rows):
    for name in ('s.csv', 's.parquet', 'ds', 'live.csv'):
        df, w = _read(files / name)
        assert not w and len(df) == len(rows) and MANIFEST_STAT not in set(df.stat), name
        assert list(df.columns[:len(SCHEMA)]) == SCHEMA
    head = (files / 's.csv').read_text().splitlines()[1].split(',')
    assert head[SCHEMA.index('stat')] == MANIFEST_STAT and head[SCHEMA.index('idx')] == str(SCHEMA_VERSION)
    assert int(head[-1]) == (rows.step == 0).sum()


def test_duplicated_rows_refused_by_every_engine(files, tmp_path):
    text = (files / 's.csv').read_bytes()
    d = tmp_path / 'd.csv'; d.write_bytes(text + text.split(b'\n', 1)[1])   # (cat s.csv; tail -n +2 s.csv)
    a, _ = _agree(d)
    assert a[0] == 'err' and "d.csv: two rows have the key run_id='r', step=0" in a[1] and '\n' not in a[1]
    ds = tmp_path / 'ds'; shutil.copytree(files / 'ds', ds)
    part = dataset_files(ds)[1]
    t = pd.read_parquet(part); t = pd.concat([t, t.iloc[5:6]]); t.to_parquet(part, index=False)    # one row twice
    a, _ = _agree(ds)
    assert a[0] == 'err' and 'two rows have the key' in a[1] and 'step=1' in a[1]


def test_cut_file_drops_its_partial_step_with_a_warning(files, tmp_path):
    text = (files / 's.csv').read_bytes()
    t = tmp_path / 't.csv'; t.write_bytes(text[:len(text) * 5 // 6])     # head -c, no commit log
    a, w = _agree(t)
    assert a[0] == 'ok' and len(w) == 1 and 'dropped 1 incomplete step' in w[0] and 'step 2 of run r' in w[0]
    df, _ = _read(t)
    assert sorted(df.step.unique()) == [0, 1]
    ds = tmp_path / 'ds'; shutil.copytree(files / 'ds', ds)
    part = dataset_files(ds)[1]
    p = pd.read_parquet(part); p.iloc[:-10].to_parquet(part, index=False)   # a part that lost rows
    a, w = _agree(ds)
    assert a[0] == 'ok' and len(w) == 1 and 'step 1 of run r (rank 0)' in w[0]


def test_schema_versions(files, rows, tmp_path):
    text = (files / 's.csv').read_text()
    man = f',{MANIFEST_STAT},{SCHEMA_VERSION},'
    for v, msg in ((SCHEMA_VERSION + 1, f'written with sketch schema version {SCHEMA_VERSION + 1}, newer than version {SCHEMA_VERSION}'),
                   (2, 'states schema version 2, which no opscope writes'), (0, 'states schema version 0')):
        p = tmp_path / f'v{v}.csv'; p.write_text(text.replace(man, f',{MANIFEST_STAT},{v},'))
        a, _ = _agree(p)
        assert a[0] == 'err' and msg in a[1], a[1]
    old = tmp_path / 'v1.csv'      # written before manifests, with version 1's stat names: read
    old.write_text(''.join(l for l in text.splitlines(keepends=True) if man not in l).replace(',nan_count,', ',nan,'))
    df, w = _read(old)
    assert not w and len(df) == len(rows) and 'nan_count' in set(df.stat)
    col = tmp_path / 'c.csv'
    rows.assign(schema_version=3).to_csv(col, index=False)
    a, _ = _agree(col)
    assert a[0] == 'err' and "column 'schema_version' is not part of opscope's schema" in a[1]
    ds = tmp_path / 'ds'; shutil.copytree(files / 'ds', ds)                 # a dataset part from a newer opscope
    part = dataset_files(ds)[0]
    p = pd.read_parquet(part); p.loc[p.stat == MANIFEST_STAT, 'idx'] = SCHEMA_VERSION + 1; p.to_parquet(part, index=False)
    a, _ = _agree(ds)
    assert a[0] == 'err' and f'newer than version {SCHEMA_VERSION}' in a[1]


@pytest.mark.parametrize('case', ['all-inf', 'all-nan', 'all-neginf', 'counts-inf', 'mixed-values', 'mixed-all'])
def test_engines_agree_on_nonfinite_values(rows, case, tmp_path):
    rng = np.random.default_rng(5)
    counts = rows.stat.isin(COUNT_STATS).to_numpy()
    bounded = rows.stat.isin(list(COUNT_STATS + SHARE_STATS + MAGNITUDE_STATS)).to_numpy()   # stats with a domain: ±Inf there is refused
    d = rows.copy()
    if case.startswith('all'): d['value'] = {'all-inf': np.inf, 'all-nan': np.nan, 'all-neginf': -np.inf}[case]
    elif case == 'counts-inf': d.loc[counts, 'value'] = np.inf
    else:
        m = (rng.random(len(d)) < 0.2) & (~bounded if case == 'mixed-values' else True)
        d.loc[m, 'value'] = rng.choice([np.inf, -np.inf, np.nan], m.sum())
    for src in (d, _to_parquet(d, tmp_path / 'x.parquet')):
        a, _ = _agree(src)
        if case in ('all-inf', 'all-nan', 'all-neginf', 'counts-inf', 'mixed-all'):
            assert a[0] == 'err' and any(w in a[1] for w in ('not a count (a finite number >= 0)', 'outside 0 to 1', 'negative (a magnitude')), a
        else: assert a[0] == 'ok' and len(a[1])


def _to_parquet(df, p):
    with Recorder(p) as rec:
        for _, g in df.groupby('step', sort=True): rec.write(g)
    return p


def test_recorder_edges(tmp_path):
    r = Recorder(tmp_path / 'x.parquet'); r._open(); r.close()        # opened, no step written
    assert not (tmp_path / 'x.parquet').exists() and not (tmp_path / 'x.parquet.parts').exists()
    for name in ('dir.csv', 'dir.parquet'):
        (tmp_path / name).mkdir()
        with pytest.raises(InputError, match=rf'{name}: a \.\w+ sink is a file, but a directory has that name'): Recorder(tmp_path / name)
    assert Recorder(tmp_path / 'dir.csv', dataset=True).fmt == 'dataset'


def test_bounded_work_per_line(files, tmp_path):
    lines = (files / 's.csv').read_text().splitlines(keepends=True)
    for bad, msg in ((','.join(['x'] * 200_000) + '\n', 'line 2 has 200,000 fields, the header 13'),
                     (lines[5].replace('layers.0', 'x' * 100_000, 1), r'line 2 is 100,\d{3} bytes long \(at most 65,536\)'),
                     ('"' + ','.join(['x'] * 200_000) + '"\n', 'line 2 has 1 fields, the header 13')):
        for at in (1, 40):
            p = tmp_path / 'f.csv'; p.write_text(''.join(lines[:at] + [bad] + lines[at:]))
            t0 = time.perf_counter()
            with pytest.raises(InputError, match=msg.replace('line 2', f'line {at + 1}')): read_sketches(p)
            assert time.perf_counter() - t0 < 1.0
    for n, msg in ((1000, r'line 1 \(the header\) has 1,000 fields'), (200_000, r'no line end \(\\n\) in its first 65,536 bytes')):
        p = tmp_path / 'h.csv'; p.write_text(','.join(SCHEMA + [f'c{i}' for i in range(n - len(SCHEMA))]) + '\n' + ''.join(lines[1:]))
        with pytest.raises(InputError, match=msg): read_sketches(p)


def test_garbled_commit_log(files, tmp_path):
    for garble, msg in ((b'12\t3\n', 'line 1 is not a commit'), (b'\xff\xfe\x00\n', 'line 1 is not a commit'),
                        (b'9' * 5000 + b'\t1\t00000000\tx\n', 'line 1 is not a commit')):
        shutil.copy(files / 'live.csv', tmp_path / 'g.csv')
        (tmp_path / ('g.csv' + COMMIT_SUFFIX)).write_bytes(garble + (files / ('live.csv' + COMMIT_SUFFIX)).read_bytes())
        with pytest.raises(InputError, match=msg): read_sketches(tmp_path / 'g.csv')


# --- the fuzzer ---------------------------------------------------------------------------------------------

def _lines(b): return b.split(b'\n')


def _mutate(data:bytes, rng:random.Random, parquet=False)->tuple:
    "One seeded mutation of a file's bytes: (name, new bytes)."
    ops = ['flip', 'flips', 'truncate', 'empty'] + (['footer', 'meta', 'tail_trunc'] if parquet else
          ['dup_line', 'dup_block', 'delete_line', 'delete_block', 'swap', 'header', 'cr_only', 'header_only', 'huge_fields', 'huge_field', 'concat'])
    op = rng.choice(ops)
    b = bytearray(data)
    if op == 'flip': i = rng.randrange(len(b)); b[i] ^= 1 << rng.randrange(8)
    elif op == 'flips':
        for _ in range(rng.randint(2, 64)): b[rng.randrange(len(b))] = rng.randrange(256)
    elif op == 'truncate': b = b[:rng.randrange(len(b))]
    elif op == 'empty': b = bytearray()
    elif op == 'footer':                       # the Parquet footer: metadata length, magic, thrift metadata
        for _ in range(rng.randint(1, 8)): b[len(b) - 1 - rng.randrange(min(len(b), 64))] ^= 1 << rng.randrange(8)
    elif op == 'meta':
        for _ in range(rng.randint(1, 8)): b[len(b) - 1 - rng.randrange(min(len(b), 4096))] = rng.randrange(256)
    elif op == 'tail_trunc': b = b[:len(b) - rng.randint(1, 200)]
    else:
        ls = _lines(bytes(b))
        k = rng.randrange(1, max(2, len(ls) - 1))
        if op == 'dup_line': ls.insert(rng.randrange(1, len(ls)), ls[k])
        elif op == 'dup_block': j = min(len(ls), k + rng.randint(2, 400)); ls[j:j] = ls[k:j]
        elif op == 'delete_line': del ls[k]
        elif op == 'delete_block': del ls[k:k + rng.randint(2, 400)]
        elif op == 'swap': j = rng.randrange(1, len(ls)); ls[k], ls[j] = ls[j], ls[k]
        elif op == 'header': h = ls[0].split(b','); rng.shuffle(h); ls[0] = rng.choice([b','.join(h), bytes(rng.randrange(256) for _ in range(40))])
        elif op == 'cr_only': return op, bytes(b).replace(b'\n', b'\r')
        elif op == 'header_only': ls = ls[:1] + [b'']
        elif op == 'huge_fields': ls.insert(k, b','.join([b'7'] * rng.choice([14, 1000, 200_000])))
        elif op == 'huge_field': ls[k] = ls[k] + b'9' * rng.choice([100, 100_000, 1_000_000])
        elif op == 'concat': ls = ls + ls[1:]
        return op, b'\n'.join(ls)
    return op, bytes(b)


def _validated(df, ref_counts):
    "A clean read: the schema's columns, no manifest row, no duplicated key, every step whole (the rows its clean recording has)."
    assert list(df.columns[:len(SCHEMA)]) == SCHEMA
    assert MANIFEST_STAT not in set(df.stat)
    assert first_duplicate(df) is None
    got = df.groupby(['run_id', 'step']).size()
    for key, n in got.items(): assert ref_counts.get(key) == n, (key, n, ref_counts.get(key))


def _fuzz(files, tmp_path, reader, n, seed=0):
    "Mutate `reader`'s file `n` times; every case ends in an InputError or a validated read, within MAX_SECONDS; returns the tallies."
    ref = read_sketches(files / 's.csv').groupby(['run_id', 'step']).size().to_dict()
    rng = random.Random(seed)
    src = {'csv': 's.csv', 'csv_log': 'live.csv', 'parquet': 's.parquet', 'dataset': 'ds'}[reader]
    tally = dict(error=0, clean=0, worst=0.0, worst_op='', duckdb=0)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for i in range(n):
        case = tmp_path / f'{i}'
        if reader == 'dataset':
            shutil.copytree(files / src, case / 'ds'); target = case / 'ds'
            part = rng.choice(dataset_files(target)); op, data = _mutate(part.read_bytes(), rng, parquet=True); part.write_bytes(data)
        else:
            case.mkdir(); target = case / src
            if reader == 'csv_log':       # the CSV and its commit log: mutate one or the other
                shutil.copy(files / src, target)
                log = files / (src + COMMIT_SUFFIX)
                which = rng.choice(['csv', 'log'])
                op, data = _mutate((files / src if which == 'csv' else log).read_bytes(), rng)
                (target if which == 'csv' else case / (src + COMMIT_SUFFIX)).write_bytes(data)
                if which == 'log': op = 'log:' + op
                else: shutil.copy(log, case / (src + COMMIT_SUFFIX))
            else:
                op, data = _mutate((files / src).read_bytes(), rng, parquet=reader == 'parquet'); target.write_bytes(data)
        runs = [read_sketches] + ([mine_duckdb] if reader in ('parquet', 'dataset') and i % DUCKDB_EVERY == 0 else [])
        for f in runs:
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter('ignore')
                try:
                    out = f(target)
                    if f is read_sketches: _validated(out, ref); tally['clean'] += 1
                    else: tally['duckdb'] += 1
                except InputError as e:
                    assert '\n' not in str(e), (op, str(e))
                    if f is read_sketches: tally['error'] += 1
                    else: tally['duckdb'] += 1
                except FileNotFoundError:        # a mutation cannot remove the file; never expected
                    raise
            dt = time.perf_counter() - t0
            assert dt < MAX_SECONDS, f"{reader} case {i} ({op}) took {dt:.1f} s"
            if dt > tally['worst']: tally['worst'], tally['worst_op'] = dt, f"{op}{' (duckdb)' if f is not read_sketches else ''}"
        shutil.rmtree(case)
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert growth < MAX_RSS_GROWTH_MIB, f"{reader}: peak memory grew {growth:.0f} MiB"
    tally['rss_growth_mib'] = growth
    print(f"fuzz {reader}: {n} files, {tally['error']} InputError, {tally['clean']} clean reads, {tally['duckdb']} mine_duckdb runs, "
          f"worst {tally['worst']:.2f} s ({tally['worst_op']}), peak memory +{growth:.0f} MiB")
    assert tally['error'] + tally['clean'] == n
    return tally


READERS = ['csv', 'csv_log', 'parquet', 'dataset']


@pytest.mark.parametrize('reader', READERS)
def test_fuzz_fast(files, tmp_path, reader):
    _fuzz(files, tmp_path, reader, FUZZ_FAST, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize('reader', READERS)
def test_fuzz_1000(files, tmp_path, reader):
    _fuzz(files, tmp_path, reader, FUZZ_SLOW, seed=1000)
