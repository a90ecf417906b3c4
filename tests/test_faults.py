"Fault injection: every recording CLI killed (SIGINT, SIGTERM, SIGKILL) mid-run into CSV, Parquet and a dataset; a full disk; hostile arguments; every numeric argument held to the range its --help states (signals at the edges: test_signals.py)."
import contextlib, errno, inspect, io, os, random, re, signal, subprocess, sys, textwrap, time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import read_with_warnings
import torch

from opscope import cli
from opscope.recorder import read_sketches, record, Recorder, COMMIT_SUFFIX
from opscope.zoo import mlp
from test_signals import Child

# Each run is the real console script (its argument parsing, its signal handling), forked from a server that imported
# opscope once (`test_signals.Child`: a run costs its work, not a torch import), with a recorder that pauses after each
# committed step (a slow disk), so a short run is long enough to be killed mid-run.
LONG = {   # CLI -> (function, arguments after OUT for a run far longer than the test waits)
    'opscope-sweep': ('opscope_sweep', ['--steps', '20', '--quiet']),      # 560 recorded steps: far past the kill, and a disk estimate (`SWEEP_STEP_BYTES`) any machine holds
    'opscope-seq': ('opscope_seq', ['2000']),
    'opscope-mnist': ('opscope_mnist', ['70']),
    'opscope-infer': ('opscope_infer', ['--model', 'moe', '--steps', '256']),
}


def _clean_runs():
    "Rows per (run_id, step) of a short clean run of each CLI's workload, recorded the way the CLI records it."
    from opscope.recorder import SWEEP_SHAPES
    from opscope.zoo import gemm, make_tensor, seq_model, stepped_sequence, mnist_mlp, mnist_batches, infer_workload
    (M, K, N) = SWEEP_SHAPES[0]
    moe, moe_batches = infer_workload('moe', 1)
    runs = {'opscope-sweep': record(gemm(K, N), [make_tensor('gaussian', (M, K), seed=0)], run_id=f'gaussian-{M}x{K}x{N}'),
            'opscope-seq': record(seq_model(), stepped_sequence(3), run_id='seq'),
            'opscope-mnist': record(mnist_mlp(), mnist_batches(1), run_id='mnist'),
            'opscope-infer': record(moe, moe_batches, run_id='moe')}
    return {k: df.groupby(['run_id', 'step'], observed=True).size() for k, df in runs.items()}
FORMATS = ('csv', 'parquet', 'dataset')
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}
MIN_STEPS = 3          # steps committed before the signal is sent


def _out(d, name, fmt):
    return d / (f'{name}.{fmt}' if fmt != 'dataset' else f'{name}_ds/')


def _committed(out, fmt):
    "How many steps the writer has committed so far, counted the way each format commits."
    p = Path(out)
    if fmt == 'csv':
        log = p.with_name(p.name + COMMIT_SUFFIX)
        return log.read_text().count('\n') if log.exists() else 0
    if fmt == 'parquet': return len(list(p.with_name(p.name + '.parts').glob('part-*.parquet')))
    return len(list(p.rglob('part-*.parquet'))) if p.exists() else 0


def _rows_per_step(df):
    return df.groupby(['run_id', 'step']).size()


def _expected(ref, run_id, step):
    "Rows of `step` of `run_id` in a clean run: that step's, or (for steps past the short run) its last step's."
    r = ref.loc[run_id]
    return int(r.loc[min(step, r.index.max())])


KILLS = ([(n, f, sig) for n in LONG for f in FORMATS for sig in (signal.SIGINT, signal.SIGKILL)]   # every CLI × format, both
         + [(n, FORMATS[i % len(FORMATS)], signal.SIGTERM) for i, n in enumerate(LONG)])        # and each CLI (and format) SIGTERMed
WAVE = 10              # kills run concurrently, at most this many at once (each child is a fork holding its own model and steps)


def _kill_wave(d, wave, rng):
    jobs = []
    for name, fmt, sig in wave:
        fn, long_args = LONG[name]
        out = _out(d, f'{name}-{signal.Signals(sig).name}', fmt)
        log = d / f'{name}-{signal.Signals(sig).name}-{fmt}'
        jobs.append(dict(name=name, fmt=fmt, sig=sig, out=out, proc=Child(fn, [out, *long_args], log, [('slow_steps', 0.05)]), sent=None))
    deadline = time.monotonic() + 240
    while any(j['sent'] is None for j in jobs) and time.monotonic() < deadline:
        for j in jobs:
            if j['sent'] is None and (_committed(j['out'], j['fmt']) >= MIN_STEPS or not j['proc'].running()):
                time.sleep(rng.uniform(0, 0.1))                     # a random point of the step in flight
                j['proc'].send(j['sig']); j['sent'] = time.monotonic()
        time.sleep(0.02)
    for j in jobs:
        if j['sent'] is None: j['proc'].kill()
        c = j['proc'].wait(120)
        j['stdout'], j['stderr'], j['rc'] = c.out, c.err, c.rc
    return jobs


@pytest.fixture(scope='module')
def killed_runs(tmp_path_factory):
    "Every recording CLI × format killed by SIGINT and by SIGKILL, and each CLI by SIGTERM, in concurrent waves."
    d = tmp_path_factory.mktemp('faults')
    rng = random.Random(15)
    jobs = [j for w in range(0, len(KILLS), WAVE) for j in _kill_wave(d, KILLS[w:w + WAVE], rng)]
    return jobs, _clean_runs()


@pytest.mark.slow
@pytest.mark.parametrize('k', range(len(KILLS)))
def test_killed_cli_keeps_every_finished_step(killed_runs, k):
    jobs, ref = killed_runs
    j = jobs[k]
    what = f"{j['name']} → {j['fmt']} killed by {signal.Signals(j['sig']).name}"
    assert j['sent'] is not None, f"{what}: never committed {MIN_STEPS} steps: {j['stderr'][-1000:]}"
    assert j['rc'] == EXIT[j['sig']], f"{what}: exit {j['rc']}: {j['stderr'][-1000:]}"
    assert 'Traceback' not in j['stderr'], f"{what}: {j['stderr'][-2000:]}"
    df, warned = read_with_warnings(j['out'])
    steps = _rows_per_step(df)
    assert len(steps) >= MIN_STEPS, what
    print(f"{what}: {len(steps)} whole steps kept ({steps.sum():,} rows)")
    for (run, step), n in steps.items():          # every step whole: the rows of the same step in a clean run
        assert n == _expected(ref[j['name']], run, step), f"{what}: {run} step {step} has {n} rows"
    assert len(warned) <= 1 and all('torn' in w or 'interrupted run' in w for w in warned), warned
    p = Path(j['out'])
    if j['sig'] != signal.SIGKILL:                # Ctrl-C and SIGTERM close the output: nothing left beside it
        last = j['stderr'].strip().splitlines()[-1]
        m = re.search(r'interrupted: kept (\d+) finished steps? in', last)
        assert m and int(m.group(1)) == len(steps), f"{what}: {last!r} but {len(steps)} steps read"
        assert not warned, warned
        assert not p.with_name(p.name + '.parts').exists() and not p.with_name(p.name + COMMIT_SUFFIX).exists()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
        cli.opscope_mine(str(j['out']))           # opscope-mine reads it too
    assert buf.getvalue().strip(), what


@pytest.mark.slow
def test_killed_output_mined_by_the_console_script(killed_runs):
    "The real `opscope-mine` on a SIGKILLed CSV: exit 0, and at most the torn-step warning on stderr."
    jobs, _ = killed_runs
    chosen = [j for j in jobs if j['sig'] == signal.SIGKILL and j['fmt'] == 'csv'][:1]
    procs = [subprocess.Popen(['opscope-mine', str(j['out'])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for j in chosen]
    for j, p in zip(chosen, procs):
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and 'Traceback' not in err, err[-2000:]
        assert all(l.startswith('opscope-mine: warning:') for l in err.splitlines()), err


def test_rerun_refuses_or_replaces(tmp_path, capsys):
    "An existing OUT is refused without --force; with it, a re-run replaces every old step."
    for fmt in FORMATS:
        out = _out(tmp_path, 'again', fmt)
        cli.opscope_seq(str(out), steps=4, seed=1)
        with pytest.raises(SystemExit) as e: cli.opscope_seq(str(out), steps=2)
        assert e.value.code == 2 and 'pass --force to replace it' in capsys.readouterr().err
        cli.opscope_seq(str(out), steps=2, force=True)
        assert sorted(read_sketches(out).step.unique()) == [0, 1]


def test_stale_parts_never_mix(tmp_path):
    "A re-run killed early shows only its own steps, never the earlier run's (library sinks, all formats)."
    m = mlp(layers=2)
    xs = [torch.randn(4, 256, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    for fmt in FORMATS:
        out = _out(tmp_path, 'stale', fmt)
        record(m, xs, run_id='old', sink=out)
        rec = Recorder(out)
        record(m, xs[:1], run_id='new', sink=rec)        # one step written, then "killed": never closed
        df, _ = read_with_warnings(out)
        assert df.run_id.unique().tolist() == ['new'] and df.step.unique().tolist() == [0], fmt
        rec.close()


# --- a full disk --------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    "A 3 MiB tmpfs where mounting is allowed (root); else None."
    mnt = tmp_path / 'small'; mnt.mkdir()
    r = subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=3m', 'tmpfs', str(mnt)], capture_output=True)
    if r.returncode != 0: yield None; return
    try: yield mnt
    finally: subprocess.run(['umount', '-l', str(mnt)], capture_output=True)


def _fill_after(monkeypatch, n):
    "Make the recorder's `fsync` fail with ENOSPC after `n` calls (a disk that fills up)."
    import opscope.recorder as r
    calls = [0]
    def fsync(fd):
        calls[0] += 1
        if calls[0] > n: raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(fd)
    monkeypatch.setattr(r.os, 'fsync', fsync)


@pytest.mark.parametrize('fmt', FORMATS)
def test_full_disk(tmp_path, small_disk, monkeypatch, capsys, fmt):
    "A disk that fills mid-run: one line naming the problem, exit 2, every step before it readable and whole."
    where = small_disk or tmp_path
    if small_disk is None: _fill_after(monkeypatch, 9)
    out = _out(where, 'full', fmt)
    with pytest.raises(SystemExit) as e: cli.opscope_seq(str(out), steps=400)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count('\n') == 1 and 'No space left on device' in err and 'Traceback' not in err, err
    df, _ = read_with_warnings(out)
    sizes = _rows_per_step(df)
    assert len(sizes) >= 1 and sizes.iloc[1:].nunique() <= 1          # prefill, then decode steps, all whole
    if len(sizes) > 1: assert sizes.loc[('seq', 1)] == sizes.iloc[-1]


# --- hostile arguments ----------------------------------------------------------------------------------------

def _hostile(d):
    afile = d / 'afile'; afile.write_text('x')
    good = d / 'good.csv'
    record(mlp(layers=2), [torch.randn(4, 256)], sink=good)
    (d / 'alien').mkdir(); (d / 'alien' / 'notes.txt').write_text('mine')
    huge = d / 'huge.csv'                # M = 10^30: once read as int64's minimum, then a SymInt error in plan
    t = pd.read_csv(good, dtype=str, keep_default_na=False); t.loc[t.index[:3], 'M'] = '1e30'; t.to_csv(huge, index=False)
    vast = d / 'vast.csv'                # shapes that claim M = K = N = 200,000: about 1.2 TiB of float32 operands to plan
    t = pd.read_csv(good, dtype=str, keep_default_na=False); t[['M', 'K', 'N']] = '200000'; t.to_csv(vast, index=False)
    (d / 'folder.csv').mkdir()           # a directory named like a file
    (d / 'f.py').write_text("import torch\ndef make(): return torch.nn.Linear(4, 4), [torch.randn(2, 4)]\n")
    return [   # (function, kwargs, what the one line must say)
        ('opscope_seq', dict(out=str(d / 's.csv'), steps=10**12), 'STEPS must be 2 to 20,000'),
        ('opscope_seq', dict(out=str(d / 's.csv'), steps=1), 'STEPS must be 2 to'),
        ('opscope_seq', dict(out=str(d / 's.csv'), steps=4, seed=-1), '--seed must be 0 to'),
        ('opscope_seq', dict(out=str(d / 's.txt')), 'output must be a .csv or .parquet file, or a dataset directory'),
        ('opscope_seq', dict(out=str(afile / 'x.csv')), 'does not exist'),
        ('opscope_seq', dict(out='/proc/opscope.csv'), 'cannot write there'),
        ('opscope_seq', dict(out=str(good)), 'already exists'),
        ('opscope_seq', dict(out=str(d / 'alien'), force=True), 'not an opscope dataset'),
        ('opscope_sweep', dict(out=str(d / 'w.csv'), steps=0), '--steps must be 1 to'),
        ('opscope_sweep', dict(out=str(d / 'w.csv'), steps=-4), '--steps must be 1 to'),
        ('opscope_mnist', dict(out=str(d / 'm.csv'), batches=0), 'BATCHES must be 1 to 937'),
        ('opscope_mnist', dict(out=str(d / 'm.csv'), batches=10**9), 'BATCHES must be 1 to 937'),
        ('opscope_infer', dict(out=str(d / 'i.csv'), steps=0), '--steps must be 1 to'),
        ('opscope_infer', dict(out=str(d / 'i.csv'), steps=10**6), '--steps must be 1 to'),
        ('opscope_infer', dict(out=str(d / 'i.csv'), model='gpt2'), "unknown model 'gpt2'"),
        ('opscope_motifs', dict(layers=100_000_000), 'LAYERS must be 1 to 256'),
        ('opscope_motifs', dict(layers=4, max_len=0), '--max_len must be 1 to 64'),
        ('opscope_flow', dict(layers=100_000_000, model='mlp'), 'LAYERS must be 1 to 256'),
        ('opscope_flow', dict(layers=0), 'LAYERS must be 1 to'),
        ('opscope_flow', dict(layers=2, depth=-1), '--depth must be at least 1'),
        ('opscope_graph', dict(file=str(d / 'none.txt')), 'no such file'),
        ('opscope_graph', dict(file=str(d / 'none.txt'), top=-1), '--top must be at least 1'),
        ('opscope_graph', dict(file=str(d / 'none.txt'), max_len=0), '--max_len must be 1 to'),
        ('opscope_probe', dict(batch=0), '--batch must be 1 to'),
        ('opscope_probe', dict(batch=-3, model='transformer'), '--batch must be 1 to'),
        ('opscope_probe', dict(batch=100, model='minilm'), '--batch must be 1 to 8'),
        ('opscope_probe', dict(dump=str(d / 'x.pt')), 'must be a .safetensors file'),
        ('opscope_shapes', dict(model='mlp', batch=-1), '--batch must be 1 to'),
        ('opscope_shapes', dict(model='mlp', top=-1), '--top must be at least 1'),
        ('opscope_shapes', dict(model='mlp', peak_flops=-1.0), '--peak_flops must be a positive finite number'),
        ('opscope_shapes', dict(model='mlp', bandwidth=0.0), '--bandwidth must be a positive finite number'),
        ('opscope_shapes', dict(model='mlp', peak_flops=float('inf')), '--peak_flops must be a positive finite number'),
        ('opscope_mine', dict(inp=str(good), out=str(good / 'x.csv')), 'does not exist'),
        ('opscope_mine', dict(inp=str(good), out=str(d / 'f.txt')), '--out must be a .csv file'),
        ('opscope_mine', dict(inp=str(good), engine='spark'), '--engine must be'),
        ('opscope_mine', dict(inp=str(d / 'missing.csv')), 'no such file'),
        ('opscope_mine', dict(inp=str(afile)), 'unknown format'),
        ('opscope_plan', dict(inp=str(good), out=str(afile / 'p.csv')), 'does not exist'),
        ('opscope_plan', dict(inp=str(good), seed=-2), '--seed must be 0 to'),
        ('opscope_plan', dict(inp=str(huge)), "column 'M' holds 1e+30, outside the int64 range"),
        ('opscope_mine', dict(inp=str(huge)), "column 'M' holds 1e+30, outside the int64 range"),
        ('opscope_docs_preview', dict(out_dir=str(afile / 'sub')), 'is a file, so the folder cannot be made'),
        ('opscope_bench', dict(miner_rows=-5), '--miner_rows must be 1 to 100,000,000'),
        ('opscope_bench', dict(miner_rows=0), '--miner_rows must be 1 to 100,000,000'),
        ('opscope_bench', dict(miner_rows=10**12), '--miner_rows must be 1 to 100,000,000'),
        ('opscope_record', dict(out=str(d / 'r.csv'), model=f'{d}/f.py:make', max_new_tokens=-7), '--max-new-tokens must be 1 to 4,096'),
        ('opscope_record', dict(out=str(d / 'r.csv'), hf=str(d), prompts=str(afile), max_new_tokens=0), '--max-new-tokens must be 1 to 4,096'),
        ('opscope_record', dict(out=str(d / 'r.csv'), hf=str(d), prompts=str(afile), max_new_tokens=10**9), '--max-new-tokens must be 1 to 4,096'),
        ('opscope_infer', dict(out=str(d / 'i.csv'), model=f'{d}/f.py:make', max_new_tokens=-7), '--max-new-tokens must be 1 to 4,096'),
        ('opscope_specialize', dict(model=f'{d}/f.py:make', max_new_tokens=10**9), '--max-new-tokens must be 1 to 4,096'),
        ('opscope_specialize', dict(model=f'{d}/f.py:make', tolerance=2.0), '--tolerance must be 0 to 1'),
        ('opscope_specialize', dict(model=f'{d}/f.py:make', tolerance=float('nan')), '--tolerance must be 0 to 1'),
        ('opscope_probe', dict(sweep=str(good), seed=-1), '--seed must be 0 to'),
        ('opscope_plan', dict(inp=str(vast)), "vast.csv: planning site 'layers.0' of run 'run' (M=200,000, K=200,000, N=200,000) needs about"),
        ('opscope_sweep', dict(out=str(d / 'folder.csv')), 'folder.csv: a .csv OUT is a file, but a folder has that name'),
        ('opscope_seq', dict(out=str(d / 'x.parquet') + '/'), 'x.parquet/: a .parquet OUT is a file, but the path ends in /'),
        ('opscope_probe', dict(dump=str(d / 'x.safetensors') + '/'), "x.safetensors/: a .safetensors file's path cannot end in /"),
        ('opscope_mine', dict(inp=str(good), out=str(d / 'f.csv') + '/'), "f.csv/: a .csv file's path cannot end in /"),
    ]


def test_hostile_arguments(tmp_path, capsys):
    "Every CLI, bad arguments: one line `prog: error: ...` saying what and why, exit 2, no traceback, nothing written."
    before = None
    for fn, kwargs, says in _hostile(tmp_path):
        before = sorted(p.name for p in tmp_path.rglob('*'))
        with pytest.raises(SystemExit) as e: getattr(cli, fn)(**kwargs)
        err = capsys.readouterr().err
        prog = fn.replace('_', '-')
        assert e.value.code == 2, (fn, kwargs, err)
        assert err.startswith(f'{prog}: error: ') and err.count('\n') == 1 and says in err, (fn, kwargs, err)
        assert sorted(p.name for p in tmp_path.rglob('*')) == before, (fn, kwargs, 'wrote something')


NUM = r"-?\d{1,3}(?:,\d{3})*(?!\d)"
RANGE = re.compile(rf"({NUM}) to ({NUM}|this machine's CPU count)|at least ({NUM})|a positive number")
REQUIRED = dict(out='r.csv', inp='missing.csv', file='none.txt')   # the positional arguments of each command, harmless here


def _numeric_options():
    "(command, argparse action) for every int or float argument of every console script."
    from fastcore.script import anno_parser
    for fn in [getattr(cli, n) for n in cli.__all__ if n.startswith('opscope_')]:
        for a in anno_parser(fn.__wrapped__)._actions:
            if a.type in (int, float): yield fn, a


@pytest.mark.parametrize('fn,a', list(_numeric_options()), ids=lambda x: getattr(x, '__name__', None) or getattr(x, 'dest', ''))
def test_every_numeric_argument_has_its_documented_range(fn, a, tmp_path, capsys):
    "Each int/float argument states its range in its --help text, and that range is the one enforced: one step outside it is refused, naming it."
    m = RANGE.search(a.help or '')
    assert m, f"{fn.__name__} --{a.dest}: no range in its help: {a.help!r}"
    num = lambda t: a.type(t.replace(',', ''))
    if m.group(3): outside, says = [num(m.group(3)) - 1], f'at least {m.group(3)}'
    elif m.group(1):
        hi = os.cpu_count() if 'CPU' in m.group(2) else num(m.group(2))
        outside, says = [num(m.group(1)) - 1, hi + 1], f"{m.group(1)} to {hi:,}" if 'CPU' in m.group(2) else m.group(0)
    else: outside, says = [0, -1], 'a positive finite number'
    params = inspect.signature(fn.__wrapped__).parameters
    args = {k: str(tmp_path / REQUIRED[k]) for k, p in params.items() if p.default is p.empty}
    for v in outside:
        with pytest.raises(SystemExit) as e: fn(**args, **{a.dest: v})
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.count('\n') == 1, (fn.__name__, a.dest, v, err)
    assert not list(tmp_path.iterdir())


def test_issue_34_arguments_through_the_parser(tmp_path, capsys):
    "The issue's unbounded arguments and mistaken paths, parsed as the console scripts parse them (`cli.console`): one line, exit 2, nothing run."
    (tmp_path / 'd.csv').mkdir()
    (tmp_path / 'f.py').write_text("import torch\ndef make(): return torch.nn.Linear(4, 4), [torch.randn(2, 4)]\n")
    cases = [(cli.opscope_bench, ['--miner_rows', '-5'], '--miner_rows must be 1 to 100,000,000'),
             (cli.opscope_bench, ['--miner-rows', '0'], '--miner_rows must be 1 to 100,000,000'),
             (cli.opscope_record, [tmp_path / 'r.csv', '--model', f'{tmp_path}/f.py:make', '--max-new-tokens', '-7'], '--max-new-tokens must be 1 to 4,096'),
             (cli.opscope_infer, [tmp_path / 'i.csv', '--hf', tmp_path, '--prompts', tmp_path / 'f.py', '--max_new_tokens', '1000000000'],
              '--max-new-tokens must be 1 to 4,096'),
             (cli.opscope_sweep, [tmp_path / 'd.csv'], 'd.csv: a .csv OUT is a file, but a folder has that name'),
             (cli.opscope_probe, ['--dump', f'{tmp_path}/x.safetensors/'], "x.safetensors/: a .safetensors file's path cannot end in /")]
    for fn, argv, says in cases:
        with pytest.raises(SystemExit) as e: cli.console(fn, [str(a) for a in argv])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count('\n') == 1 and says in err, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['d.csv', 'f.py'] and not any((tmp_path / 'd.csv').iterdir())


@pytest.mark.slow
def test_hostile_arguments_console_scripts(tmp_path):
    "The review's cases through the real entry points: one line and exit 2."
    (tmp_path / 'afile').write_text('x')
    cases = [(['opscope-seq', str(tmp_path / 'o.csv'), '1000000000000'], 'STEPS must be 2 to 20,000'),
             (['opscope-probe', '--batch', '0'], '--batch must be 1 to'),
             (['opscope-flow', '100000000', 'mlp'], 'LAYERS must be 1 to 256'),
             (['opscope-docs-preview', str(tmp_path / 'afile' / 'sub')], 'is a file')]
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a, _ in cases]
    for (a, says), p in zip(cases, procs):
        _, err = p.communicate(timeout=240)
        assert p.returncode == 2 and err.count('\n') == 1 and says in err and 'Traceback' not in err, (a, err)


def test_library_bug_keeps_traceback(capsys):
    "A ValueError that opscope did not raise on purpose is a bug: it is not turned into a usage line."
    with pytest.raises(ValueError, match='cannot reshape'):
        with cli.cli_errors('prog'): np.zeros(3).reshape(2)
    with pytest.raises(KeyError):
        with cli.cli_errors('prog'): {}['nope']


# --- bounded memory -------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_rss_flat_over_1000_steps(tmp_path):
    if Path('/dev/shm').is_dir(): tmp_path = Path(__import__('tempfile').mkdtemp(dir='/dev/shm'))   # memory, not fsync, is measured
    "1,000 steps of a small model into a CSV sink: resident memory grows by less than 64 MiB (steady state after warm-up)."
    psutil = pytest.importorskip('psutil')
    m = mlp(layers=2, d_in=64, hidden=64, d_out=32)
    g = torch.Generator().manual_seed(1515)
    xs = [torch.randn(8, 64, generator=g) for _ in range(16)]
    proc = psutil.Process()
    record(m, xs[:4], sink=tmp_path / 'warm.csv')                    # warm-up: allocator pools, first trace, imports
    rss = []
    def batches():
        for s in range(1000):
            if s % 100 == 0: rss.append(proc.memory_info().rss)
            yield xs[s % len(xs)]
    r = record(m, batches(), sink=tmp_path / 'long.csv')
    rss.append(proc.memory_info().rss)
    assert r.steps == 1000 and len(read_sketches(tmp_path / 'long.csv')) == r.rows
    growth = (rss[-1] - rss[0]) / 2**20
    print(f"RSS over 1,000 steps: {rss[0] / 2**20:.0f} → {rss[-1] / 2**20:.0f} MiB ({growth:+.1f} MiB)")
    assert growth < 64, f"RSS grew {growth:.1f} MiB over 1,000 steps: {[round(x / 2**20) for x in rss]}"


def test_only_input_errors_are_one_line(capsys):
    "An opscope ValueError that is not an InputError is a bug too (no stopgap turns it into a line); an InputError is one line, exit 2."
    from opscope.tables import InputError, MissingError
    with pytest.raises(ValueError, match='a bug'):
        with cli.cli_errors('prog'): raise ValueError('a bug')
    for e in (InputError('bad input'), MissingError('no site x')):
        with pytest.raises(SystemExit) as x:
            with cli.cli_errors('prog'): raise e
        assert x.value.code == 2
        assert capsys.readouterr().err.strip() in ('prog: error: bad input', 'prog: error: no site x')


@pytest.mark.slow
def test_library_bug_in_a_cli_shows_its_traceback(tmp_path):
    "A CLI whose library call raises ValueError (a bug, monkeypatched in) prints the traceback; bad input stays one line."
    sk = tmp_path / 'sk.csv'
    code = textwrap.dedent(f"""
        from opscope.recorder import sweep
        sweep({str(sk)!r}, shapes=((8, 16, 16),), dists=['gaussian'], steps=1)
        import opscope.mine_cli as c
        def bug(*a, **k): raise ValueError('mine broke')
        c.mine = bug
        c.opscope_mine(inp={str(sk)!r})
    """)
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=240)
    assert r.returncode == 1 and 'Traceback' in r.stderr and 'ValueError: mine broke' in r.stderr, r.stderr[-2000:]
    bad = tmp_path / 'bad.csv'; bad.write_text('run_id,step\nx,1\n')
    r = subprocess.run(['opscope-mine', str(bad)], capture_output=True, text=True, timeout=240)
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'missing columns' in r.stderr and 'Traceback' not in r.stderr, r.stderr
