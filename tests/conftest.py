import os, subprocess, sys, warnings
import pytest, torch

torch.set_num_threads(1)
os.environ.setdefault('HF_HUB_OFFLINE', '1')
# the 41-family decoder sweep takes ~22 minutes on 2 cores: collected only when asked for (OPSCOPE_FAMILY_SWEEP=1), not skipped
collect_ignore = [] if os.environ.get('OPSCOPE_FAMILY_SWEEP') else ['test_family_sweep.py']


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: takes more than a few seconds; the fast loop (`pytest -m "not slow" tests`) skips it')


def read_with_warnings(out):
    "(the sketches at `out`, the messages of the warnings reading them raised): what a reader of a killed run's output sees."
    from opscope.tables import read_sketches
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        df = read_sketches(out)
    return df, [str(x.message) for x in w]


def engine_outcomes(src, *engines):
    "Per engine (a function of `src`): (('ok', findings) or ('err', its ValueError's message), the incomplete-step warnings it raised)."
    out = []
    for f in engines:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            try: r = ('ok', f(src))
            except ValueError as e: r = ('err', str(e))
        out.append((r, sorted(str(x.message) for x in w if 'incomplete step' in str(x.message))))
    return out


def run_cli(*args, cwd=None):
    "Run a console script; returns the CompletedProcess (text)."
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def cli():
    return run_cli
