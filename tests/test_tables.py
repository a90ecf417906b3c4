"One table contract: the same columns and dtypes from every source (record, every file format, the engines), one column check."
import pandas as pd, pytest
from opscope.tables import SCHEMA, STR_COLS, InputError, MissingError, require_columns, as_strings
from opscope.zoo import mlp, make_tensor
from opscope.recorder import record, read_sketches, Recorder
from opscope.miner import mine, KEYS
from opscope.scale import mine_duckdb


def _dtypes(t, cols): return {c: str(t[c].dtype) for c in cols}


@pytest.fixture(scope='module')
def rows():
    return record(mlp(3, 24), [make_tensor('relu', (16, 24), seed=90 + s) for s in range(3)], run_id='t', dist='relu')


def test_every_source_same_dtypes(rows, tmp_path):
    assert all(str(rows[c].dtype) == 'str' for c in STR_COLS), rows.dtypes
    want = _dtypes(rows, SCHEMA)
    for name in ('s.csv', 's.parquet', 'ds'):
        with Recorder(tmp_path / name) as rec:
            for _, g in rows.groupby('step', sort=True): rec.write(g)
        back = read_sketches(tmp_path / name)
        assert _dtypes(back, SCHEMA) == want, name
        order = lambda t: t[SCHEMA].sort_values(['step', 'site', 'role', 'stat', 'idx']).reset_index(drop=True)
        pd.testing.assert_frame_equal(order(back), order(rows), check_exact=False, rtol=1e-7)   # CSV keeps 9 digits


def test_findings_keys_are_strings_in_both_engines(rows):
    a, b = mine(rows), mine_duckdb(rows)
    assert _dtypes(a, KEYS) == _dtypes(b, KEYS) == {k: 'str' for k in KEYS}
    cat = rows.astype({c: 'category' for c in STR_COLS})      # a user's categorical table is read under the same policy
    assert mine(cat).equals(a)


def test_one_column_check():
    with pytest.raises(MissingError, match=r'x: missing columns stat, idx, value'): require_columns(['run_id', 'dist', 'site', 'role', 'step'], what='x')
    assert issubclass(MissingError, InputError) and issubclass(MissingError, KeyError)
    t = as_strings(pd.DataFrame({'site': pd.Categorical(['a', None])}))
    assert t.site.tolist() == ['a', '']
