"What a new user hits first (issue 33, item 9): option spellings, `opscope-record --hf` loading once and failing in one line, no export log noise, and `mine` on what `record` returns."
import logging
import pytest, torch
from fastcore.script import anno_parser
from opscope import cli
from opscope.cli import opscope_record, kebab_options, console
from opscope.recorder import record, read_sketches
from opscope.miner import mine
from opscope.runners import record_generate, tiny_decoder

COMMANDS = [getattr(cli, n) for n in cli.__all__ if n.startswith('opscope_')]


def _call(capsys, *argv, **kw):
    "Run opscope_record in process; (exit code, stderr)."
    try: opscope_record(*argv, **kw)
    except SystemExit as e: return e.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


def _decoder_folder(d, seed=9):
    "A tiny Llama saved with save_pretrained, and a word-level tokenizer built offline beside it."
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ['<pad>', '</s>', '<unk>'] + [f'w{i}' for i in range(125)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token='<unk>'))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token='<pad>', eos_token='</s>', unk_token='<unk>').save_pretrained(d)
    tiny_decoder('llama', seed=seed).save_pretrained(d)
    return d


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp('hf')
    (d / 'p.txt').write_text('w3 w5 w7 w9\nw4 w8\n')
    return _decoder_folder(d / 'tiny-llama')


# --- option spellings ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize('fn', COMMANDS, ids=lambda f: f.__name__)
def test_every_option_takes_both_spellings(fn):
    p = kebab_options(anno_parser(fn.__wrapped__))
    for a in p._actions:
        for s in a.option_strings:
            if s.startswith('--') and '_' in s: assert s.replace('_', '-') in a.option_strings, (fn.__name__, s)


@pytest.mark.slow
def test_console_script_takes_the_documented_spelling(hf_dir, cli, tmp_path, capsys):
    "`--max-new-tokens`, as the docs and the error message spell it, through the installed entry point; its refusals through the same parser (`cli.console`)."
    r = cli('opscope-record', str(tmp_path / 'g.csv'), '--hf', str(hf_dir), '--prompts', str(hf_dir.parent / 'p.txt'),
            '--max-new-tokens', '2')
    assert r.returncode == 0 and 'rows: 2 steps' in r.stdout, r.stderr                  # opscope-record keeps no rows, and says so from counts
    assert read_sketches(tmp_path / 'g.csv').step.nunique() == 2
    for value, says in [('0', '--max-new-tokens must be 1 to 4,096 ('), ('many', "argument --max_new_tokens/--max-new-tokens: invalid int value: 'many'")]:
        with pytest.raises(SystemExit) as e:
            console(opscope_record, [str(tmp_path / 'h.csv'), '--hf', str(hf_dir), '--prompts', str(hf_dir.parent / 'p.txt'), '--max-new-tokens', value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err, err                                       # the range's line, or argparse's own error
    assert not (tmp_path / 'h.csv').exists()


# --- opscope-record --hf --------------------------------------------------------------------------------------------

def test_hf_model_loaded_once(hf_dir, tmp_path, capsys, monkeypatch):
    import transformers as tf
    loads, load = [], tf.AutoModelForCausalLM.from_pretrained.__func__
    def counted(cls, *a, **k):
        loads.append(a[0] if a else k.get('pretrained_model_name_or_path'))
        return load(cls, *a, **k)
    monkeypatch.setattr(tf.AutoModelForCausalLM, 'from_pretrained', classmethod(counted))
    code, err = _call(capsys, str(tmp_path / 'g.parquet'), hf=str(hf_dir), prompts=str(hf_dir.parent / 'p.txt'), max_new_tokens=2)
    assert code == 0, err
    assert len(loads) == 1, loads


def test_hf_folder_transformers_cannot_load_is_one_line(hf_dir, tmp_path, capsys):
    import shutil
    unknown, torn = tmp_path / 'unknown', tmp_path / 'torn'
    shutil.copytree(hf_dir, unknown); shutil.copytree(hf_dir, torn)
    cfg = unknown / 'config.json'
    cfg.write_text(cfg.read_text().replace('"model_type": "llama"', '"model_type": "nosuchmodel"'))
    w = next(torn.glob('*.safetensors')); w.write_bytes(w.read_bytes()[:1000])
    for d, msg in [(unknown, 'nosuchmodel'), (torn, 'model.safetensors: ')]:   # the torn weights file named, checked before transformers reads it
        code, err = _call(capsys, str(tmp_path / 'o.csv'), hf=str(d), prompts=str(hf_dir.parent / 'p.txt'))
        lines = err.strip().splitlines()
        assert code == 2 and 'Traceback' not in err, err
        assert lines[-1].startswith(f'opscope-record: error: {d}') and msg in lines[-1], err
    assert not (tmp_path / 'o.csv').exists()


def test_untraceable_model_is_one_line(tmp_path, capsys):
    (tmp_path / 'f.py').write_text(
        "import torch\n"
        "class Branchy(torch.nn.Module):\n"
        "    def __init__(self): super().__init__(); self.l = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        y = self.l(x)\n"
        "        return y if y.sum().item() > 0 else -y     # data-dependent control flow: no graph holds it\n"
        "def make(): return Branchy(), [torch.randn(3, 4)]\n")
    code, err = _call(capsys, str(tmp_path / 'o.csv'), model=f'{tmp_path}/f.py:make')
    assert code == 2 and 'Traceback' not in err, err
    assert err.strip().splitlines()[-1].startswith('opscope-record: error: cannot trace Branchy: '), err
    assert not (tmp_path / 'o.csv').exists()


# --- library -------------------------------------------------------------------------------------------------------

def test_record_generate_logs_nothing_from_export(capfd):
    m = tiny_decoder('llama')
    ids = torch.randint(2, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    log = logging.getLogger('torch._export.non_strict_utils')
    level = log.level
    record_generate(m, ids, 3)
    err = capfd.readouterr().err
    assert 'Dim.AUTO' not in err and 'specialized' not in err, err
    assert log.level == level                      # the logger's level is restored


@pytest.mark.parametrize('out', ['x.csv', 'x.parquet', 'x_dataset'])
def test_mine_takes_what_record_returns(tmp_path, out):
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    bs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    r = record(m, bs, sink=tmp_path / out)          # a `Recorded` summary, not the rows
    assert len(r) == len(read_sketches(tmp_path / out))
    f = mine(r)
    assert len(f) and f.equals(mine(read_sketches(tmp_path / out)))


@pytest.mark.slow
def test_infer_hf_decoder_mines_the_rows_it_wrote(hf_dir, cli, tmp_path):
    "`opscope-infer --hf` on a decoder keeps its rows to mine (a sink alone would return counts; `opscope-record` keeps none: above)."
    r = cli('opscope-infer', str(tmp_path / 'i.csv'), '--hf', str(hf_dir), '--prompts', str(hf_dir.parent / 'p.txt'),
            '--max-new-tokens', '2')
    assert r.returncode == 0, r.stderr
    assert '2 steps, gate passed' in r.stdout and read_sketches(tmp_path / 'i.csv').step.nunique() == 2


# --- sampling a decoder's recording from the command line (issue 33, item 8) -----------------------------------------

def test_every_and_vectors(hf_dir, tmp_path, capsys):
    "`--every 2 --vectors chan_absmax`: the prefill and every second decode step, only the chosen vector stat (plus the shape stats)."
    from opscope.runners import VECTOR_STATS, DIM_STATS
    out = tmp_path / 'e.parquet'
    code, err = _call(capsys, str(out), hf=str(hf_dir), prompts=str(hf_dir.parent / 'p.txt'), max_new_tokens=5, every=2,
                      vectors='chan_absmax')
    assert code == 0, err
    df = read_sketches(out)
    assert sorted(df.step.unique()) == [0, 2, 4]
    kept = set(df.stat) & set(VECTOR_STATS)
    assert 'chan_absmax' in kept and kept <= {'chan_absmax', *DIM_STATS}, kept
    assert 'hist' not in set(df.stat)
    full = tmp_path / 'f.parquet'
    assert _call(capsys, str(full), hf=str(hf_dir), prompts=str(hf_dir.parent / 'p.txt'), max_new_tokens=5)[0] == 0
    whole = read_sketches(full)
    assert 'hist' in set(whole.stat) and sorted(whole.step.unique()) == [0, 1, 2, 3, 4]
    s = whole[whole.step.isin([0, 2, 4]) & (whole.stat == 'chan_absmax')].sort_values(['step', 'site', 'role', 'idx']).value.to_numpy()
    e = df[df.stat == 'chan_absmax'].sort_values(['step', 'site', 'role', 'idx']).value.to_numpy()
    import numpy as np
    assert np.allclose(s, e, rtol=1e-4, atol=1e-6, equal_nan=True)               # the sampled steps are the same steps (the plain steps between round alike)


@pytest.mark.parametrize('kw,says', [
    (dict(every=0), '--every must be 1 to 4,096'),
    (dict(every=4097), '--every must be 1 to 4,096'),
    (dict(vectors='hist,bogus'), "--vectors 'hist,bogus': unknown stat(s) bogus; choose from chan_absmax"),
    (dict(vectors=','), 'unknown stat(s) (none given)'),
])
def test_every_and_vectors_refused(hf_dir, tmp_path, capsys, kw, says):
    code, err = _call(capsys, str(tmp_path / 'r.csv'), hf=str(hf_dir), prompts=str(hf_dir.parent / 'p.txt'), max_new_tokens=5, **kw)
    assert code == 2 and says in err and err.count('\n') == 1, err
    assert not (tmp_path / 'r.csv').exists()


def test_every_with_a_factory_refused(tmp_path, capsys):
    (tmp_path / 'f.py').write_text("import torch\ndef make(): return torch.nn.Linear(4, 2), [torch.randn(3, 4)]\n")
    code, err = _call(capsys, str(tmp_path / 'r.csv'), model=f'{tmp_path}/f.py:make', every=2)
    assert code == 2 and '--every and --vectors go with --hf and a decoder' in err, err


def test_vectors_none_keeps_the_shapes(hf_dir, tmp_path, capsys):
    from opscope.runners import VECTOR_STATS, DIM_STATS
    out = tmp_path / 'n.csv'
    code, err = _call(capsys, str(out), hf=str(hf_dir), prompts=str(hf_dir.parent / 'p.txt'), max_new_tokens=2, vectors='none')
    assert code == 0, err
    assert set(read_sketches(out).stat) & set(VECTOR_STATS) <= set(DIM_STATS)
    mine(out)                                                       # minable as it is


# --- a real decoder's recording streamed into a dataset, killed (issue 35, item 5) ---------------------------------

@pytest.mark.slow
def test_killed_hf_recording_into_a_dataset(hf_dir, tmp_path):
    "`opscope-record --hf DIR ds/` SIGKILLed mid-generate: every finished step is a whole part, minable; memory per step flat."
    import os, signal, subprocess, sys, time
    from conftest import read_with_warnings
    out = tmp_path / 'ds'
    code = ("import sys, opscope.recorder as r, time\n"
            "w = r.Recorder.write\n"
            "def slow(self, df): w(self, df); time.sleep(0.2)\n"          # a slow disk: the run is long enough to be killed mid-way
            "r.Recorder.write = slow\n"
            "from opscope.cli import opscope_record, console\n"
            "console(opscope_record, sys.argv[1:])\n")
    p = subprocess.Popen([sys.executable, '-c', code, f'{out}/', '--hf', str(hf_dir), '--prompts', str(hf_dir.parent / 'p.txt'),
                          '--max-new-tokens', '120'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    t, rss = time.monotonic(), []                   # (4 prompt tokens + 120 new: within the model's 128 positions, checked up front)
    while (k := len(list(out.rglob('part-*.parquet')))) < 30 and p.poll() is None and time.monotonic() - t < 240:
        if k >= 5: rss.append(int(open(f'/proc/{p.pid}/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE') / 2**20)   # once the decode graph is traced and gated
        time.sleep(0.1)
    p.send_signal(signal.SIGKILL); p.wait()
    parts = list(out.rglob('part-*.parquet'))
    assert len(parts) >= 30, p.stderr.read()[-2000:]
    df, warned = read_with_warnings(out)
    per_step = df.groupby('step').size()
    assert len(per_step) == len(parts) and (per_step.iloc[1:] == per_step.iloc[1]).all(), per_step   # whole steps only
    assert not mine(out).empty
    n = len(rss)                                    # from the fifth step on, memory stays flat while parts accumulate
    assert n >= 10 and max(rss[n // 2:]) - max(rss[:n // 2]) < 50, (n, rss[0], rss[-1])
