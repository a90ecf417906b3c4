"Issue #18's before/after check: findings, plans and CLI outputs recomputed from the seeds of `golden/make_golden.py` match the files it wrote from the pre-refactor code."
import math, re, sys
from pathlib import Path
import numpy as np, pandas as pd, pytest

sys.path.insert(0, str(Path(__file__).parent / 'golden'))
import make_golden as G

RTOL, ATOL = 1e-4, 1e-6   # numbers may move in their last bits (fp32 reduction order), never more
KEYS = dict(findings=['run_id', 'dist', 'site', 'role', 'exploit', 'stat', 'idx'],
            plans=['run_id', 'site', 'exploit', 'role', 'stat'], mine_out=['run_id', 'dist', 'site', 'role', 'exploit', 'stat', 'idx'],
            plan_out=['run_id', 'site', 'exploit', 'role', 'stat'])
NUM = re.compile(r'\d{1,3}(?:,\d{3})+(?![\d.])|\d+(?:\.\d+)?(?:e[+-]?\d+)?')
ROUNDED_UNIT = re.compile(r'\s*(?:%|dB|×|x\b)')   # an integer printed before these is a rounded float

def _tokens(text:str):
    "(text with numbers replaced by '#', whitespace collapsed; [(number, unit of its last printed digit)])."
    nums = []
    def sub(m):
        t, tail = m.group(), text[m.end():m.end() + 4]
        v = float(t.replace(',', ''))
        if '.' in t and 'e' not in t: unit = 10.0 ** -len(t.split('.')[1].split('e')[0])
        elif 'e' in t: unit = 10.0 ** (int(t.split('e')[1]) - len(t.split('e')[0].split('.')[-1]) * ('.' in t))
        else: unit = 1.0 if ROUNDED_UNIT.match(tail) else 0.0    # other integers (channels, counts) must match exactly
        nums.append((v, unit)); return '#'
    return re.sub(r'\s+', ' ', NUM.sub(sub, text)).strip(), nums

def same_text(a:str, b:str)->bool:
    "Equal text, numbers within RTOL or one unit of their last printed digit (a rounding that flipped)."
    (ta, na), (tb, nb) = _tokens(a), _tokens(b)
    return ta == tb and len(na) == len(nb) and all(
        abs(x - y) <= RTOL * max(abs(x), abs(y)) + ATOL + max(u, w) for (x, u), (y, w) in zip(na, nb))

def test_same_text():
    assert same_text('int8 per-tensor (est. SQNR 42 dB)', 'int8   per-tensor (est. SQNR 41 dB)')
    assert not same_text('dead [ch 0-3,7]', 'dead [ch 0-3,8]') and not same_text('a 1.50', 'a 1.60')
    assert same_text('wrote 227,808 rows', 'wrote 227,808 rows') and not same_text('x 1', 'y 1')

def _clean(v):
    "A cell for comparison: plan notes without the timing-dependent 'not worth it' prefix."
    return v.replace(G.NOT_WORTH_IT, '') if isinstance(v, str) else v

def compare_tables(want:pd.DataFrame, got:pd.DataFrame, keys:list, name:str):
    "Same columns (any order), same rows (any order) by `keys`; numbers within tolerance, strings by `same_text`."
    assert set(want.columns) == set(got.columns), f"{name}: columns {sorted(set(want.columns) ^ set(got.columns))} differ"
    assert len(want) == len(got), f"{name}: {len(got)} rows, golden has {len(want)}"
    keys = [k for k in keys if k in want.columns]
    num = [c for c in want.columns if c not in keys and pd.api.types.is_numeric_dtype(want[c]) and not pd.api.types.is_bool_dtype(want[c])]
    order = lambda d: d[list(want.columns)].astype({k: str for k in keys}).sort_values(keys + num[:1], kind='stable').reset_index(drop=True)
    want, got = order(want), order(got)
    assert want[keys].equals(got[keys]), f"{name}: rows differ:\n" + \
        pd.concat([want[keys].assign(_='golden'), got[keys].assign(_='now')]).drop_duplicates(keys, keep=False).to_string()
    for c in want.columns:
        if c in keys: continue
        a, b = want[c], got[c]
        if c in num:
            ok = np.isclose(a.astype(float), b.astype(float), rtol=RTOL, atol=ATOL, equal_nan=True)
        else:
            ok = np.array([(x is y) or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
                           or (isinstance(x, str) and isinstance(y, str) and same_text(_clean(x), _clean(y))) or x == y
                           for x, y in zip(a, b)])
        bad = np.flatnonzero(~ok)
        assert not len(bad), f"{name}.{c}: {len(bad)} rows differ, e.g. {want.loc[bad[0], keys].tolist()}: golden {a.iloc[bad[0]]!r}, now {b.iloc[bad[0]]!r}"

@pytest.fixture(scope='module')
def recomputed(tmp_path_factory):
    "Every golden output recomputed now, written and read back through the same CSV path as the golden files."
    d = tmp_path_factory.mktemp('golden')
    G.write(G.compute(), d)
    return d

GOLDEN = sorted(p.name for p in G.HERE.glob('*.csv')) + sorted(p.name for p in G.HERE.glob('*.txt'))

def test_golden_files_exist():
    assert {f'{c}_{k}.csv' for c in G.CASES for k in ('findings', 'plans')} <= set(GOLDEN)
    assert {'cli_sweep_stdout.txt', 'cli_mine_stdout.txt', 'cli_mine_out.csv', 'cli_plan_out.csv'} <= set(GOLDEN)

@pytest.mark.slow
@pytest.mark.parametrize('name', GOLDEN)
def test_golden(recomputed, name):
    want, got = G.HERE / name, recomputed / name
    if name.endswith('.txt'):
        a, b = want.read_text().splitlines(), got.read_text().splitlines()
        assert len(a) == len(b), f"{name}: {len(b)} lines, golden has {len(a)}"
        bad = [(x, y) for x, y in zip(sorted(a), sorted(b)) if not same_text(x, y)]
        assert not bad, f"{name}: {len(bad)} lines differ, e.g.\n golden {bad[0][0]}\n now    {bad[0][1]}"
    else:
        kind = name[:-4].split('_', 1)[1]
        compare_tables(pd.read_csv(want), pd.read_csv(got), KEYS[kind], name)
