"""Signals at the edges (issue 34): SIGINT or SIGTERM while a command starts, a second signal while the first is handled,
one during the final Parquet combine, SIGKILL there and `--force` after it, an inherited SIGINT ignore, a command that
records nothing. Every one ends with the "kept N steps" line (or "interrupted") and exit 130 / 143, the output readable.

Most runs are forked from a server that imported opscope once (`Child`), so that a run costs its work, not a torch
import; the start-up cases run a console script in a fresh interpreter, since the import is what they test."""
import multiprocessing as mp, os, re, signal, subprocess, sys, time
from pathlib import Path

import pytest
from conftest import read_with_warnings
import torch

from opscope import cli
from opscope.recorder import record, COMMIT_SUFFIX

_CTX = mp.get_context('forkserver')
_CTX.set_forkserver_preload(['opscope.cli', 'test_signals'])   # the server imports these once; each run is a fork of it


# --- what a forked run may have changed before the command starts --------------------------------------------------

def _slow_steps(pause):
    "A recorder that pauses after each committed step (a slow disk), so a short run is long enough to be signalled mid-run."
    import opscope.recorder as r
    write = r.Recorder.write
    def slow(self, df): write(self, df); time.sleep(pause)
    r.Recorder.write = slow


def _signal_at_close(sig):
    "`sig` to itself as the recorder starts closing (a second signal while the first is handled, or a first one at the end)."
    import opscope.recorder as r
    close = r.Recorder.close
    def closing(self):
        if not getattr(self, '_signalled', False): self._signalled = True; os.kill(os.getpid(), sig)
        close(self)
    r.Recorder.close = closing


def _signal_in_combine(sig):
    "`sig` to itself in the middle of the final Parquet combine: as it writes the second step into OUT's temporary file."
    import pyarrow.parquet as pq, opscope.recorder as r
    combine, write, n = r._combine_parts, pq.ParquetWriter.write_table, [0]
    def counted(self, *a, **k):
        n[0] += 1
        if n[0] == 2: os.kill(os.getpid(), sig)
        return write(self, *a, **k)
    def combining(parts, dest):
        pq.ParquetWriter.write_table = counted
        try: return combine(parts, dest)
        finally: pq.ParquetWriter.write_table = write
    r._combine_parts = combining


def _slow_mine(marker):
    "`mine` that says it started (a file) and takes a minute: a command that records nothing, signalled mid-work."
    import opscope.mine_cli as mc
    def mine(*a, **k): Path(marker).touch(); time.sleep(60)
    mc.mine = mine


PATCHES = dict(slow_steps=_slow_steps, signal_at_close=_signal_at_close, signal_in_combine=_signal_in_combine, slow_mine=_slow_mine)


def _child(fn, argv, log, patches):
    "The body of a forked run: stdout and stderr to `log`.out / .err, SIGINT as a foreground job has it, `patches` applied, then the console script."
    for fd, s in ((1, 'out'), (2, 'err')): os.dup2(os.open(f'{log}.{s}', os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    torch.set_num_threads(1)
    for name, arg in patches: PATCHES[name](arg)
    cli.console(getattr(cli, fn), argv)


class Child:
    "Console script `fn` (e.g. 'opscope_seq') run with `argv` in a forked process: `.send(sig)`, `.wait()`, then `.rc`, `.out`, `.err`."
    def __init__(self, fn, argv, log, patches=()):
        self.log, self.proc = str(log), _CTX.Process(target=_child, args=(fn, [str(a) for a in argv], str(log), list(patches)))
        self.proc.start()
    def running(self): return self.proc.exitcode is None
    def send(self, sig):
        if self.running(): os.kill(self.proc.pid, sig)
    def kill(self): self.proc.kill()
    def wait(self, timeout=240):
        self.proc.join(timeout)
        if self.proc.exitcode is None: self.proc.kill(); self.proc.join()
        self.rc = self.proc.exitcode
        self.out, self.err = (Path(f'{self.log}.{s}').read_text() if Path(f'{self.log}.{s}').exists() else '' for s in ('out', 'err'))
        return self


def _parts_steps(out):
    return len(list(Path(f'{out}.parts').glob('part-*.parquet')))


def _committed(out):
    "Steps committed so far, counted the way each format commits them."
    p = Path(out)
    if p.suffix == '.csv':
        log = p.with_name(p.name + COMMIT_SUFFIX)
        return log.read_text().count('\n') if log.exists() else 0
    if p.suffix == '.parquet': return _parts_steps(p)
    return len(list(p.rglob('part-*.parquet'))) if p.exists() else 0


def _signal_after(child, out, sig, steps=3, timeout=120):
    "Send `sig` once `steps` steps are committed; wait for the end."
    t = time.monotonic()
    while _committed(out) < steps and child.running() and time.monotonic() - t < timeout: time.sleep(0.02)
    child.send(sig)
    return child.wait()


def _last(err): return err.strip().splitlines()[-1] if err.strip() else ''


def _kept(err):
    m = re.search(r'interrupted: kept (\d+) finished steps? in (\S+)', _last(err))
    assert m, err[-2000:]
    return int(m.group(1)), m.group(2)


def _no_temp(out):
    p = Path(out)
    return not [q.name for q in p.parent.iterdir() if q.name.startswith(f'.{p.name}.')]


# --- while it starts: a real console script, the import included ---------------------------------------------------

SCRIPT = """import re
import sys
from opscope.cli import opscope_record
if __name__ == '__main__':
    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])
    sys.exit(opscope_record())
"""
FACTORY = """import time, torch
from pathlib import Path
def make():
    Path(__file__).with_name('started').touch()
    time.sleep(30)                                   # a model that takes long to load: start-up
    return torch.nn.Linear(4, 4), [torch.randn(2, 4)]
"""


def _start(d, out, sigint):
    "The console script `opscope-record` (as pip writes it) in a fresh interpreter, SIGINT as given; returns once torch is loading."
    (d / 'opscope-record').write_text(SCRIPT)
    (d / 'f.py').write_text(FACTORY)
    p = subprocess.Popen([sys.executable, str(d / 'opscope-record'), str(out), '--model', f'{d}/f.py:make'], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, sigint))
    t = time.monotonic()
    while p.poll() is None and time.monotonic() - t < 60:      # opscope's handler is in before torch: the import is under way
        if 'libtorch' in Path(f'/proc/{p.pid}/maps').read_text(): break
        time.sleep(0.005)
    return p


@pytest.mark.skipif(not Path('/proc/self/maps').exists(), reason='needs /proc to see the import under way')
@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_signal_while_it_starts(tmp_path, sig):
    "A signal while the modules load (or the model does): kept 0 steps, exit 130 / 143, nothing written."
    out = tmp_path / 'o.csv'
    p = _start(tmp_path, out, signal.SIG_DFL)
    p.send_signal(sig)
    _, err = p.communicate(timeout=120)
    where = 'the model loading' if (tmp_path / 'started').exists() else 'the import'
    print(f"{sig.name} during {where}: {_last(err)!r}")
    assert p.returncode == 128 + sig and 'Traceback' not in err, err[-2000:]
    assert _last(err) == f'opscope-record: interrupted: kept 0 finished steps in {out}'
    assert not out.exists() and not list(tmp_path.glob('o.csv*'))


@pytest.mark.skipif(not Path('/proc/self/maps').exists(), reason='needs /proc to see the import under way')
def test_inherited_sigint_ignore_is_honoured(tmp_path):
    "Started with SIGINT ignored (`cmd &` in a script): SIGINT does nothing, on purpose; SIGTERM still stops it with the line."
    out = tmp_path / 'o.csv'
    p = _start(tmp_path, out, signal.SIG_IGN)
    p.send_signal(signal.SIGINT)                                 # during the import: ignored
    t = time.monotonic()
    while not (tmp_path / 'started').exists() and p.poll() is None and time.monotonic() - t < 60: time.sleep(0.02)
    p.send_signal(signal.SIGINT)                                 # during the model's loading: ignored too
    time.sleep(0.3)
    assert p.poll() is None, p.communicate()[1][-2000:]
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143 and 'Traceback' not in err, err[-2000:]
    assert _last(err) == f'opscope-record: interrupted: kept 0 finished steps in {out}'


# --- a second signal, and the final combine: forked runs ------------------------------------------------------------

FORMATS = ('o.csv', 'o.parquet', 'o_ds/')
TINY = """import torch
def short():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)), [torch.randn(2, 8) for _ in range(4)]
def long(): return short()[0], [torch.randn(2, 8) for _ in range(2000)]
"""


def _tiny(d, which):
    "`opscope-record`'s arguments after OUT for a tiny model: 4 steps (`short`) or 2,000 (`long`)."
    (d / 'tiny.py').write_text(TINY)
    return ['--model', f'{d}/tiny.py:{which}']


@pytest.fixture(scope='module')
def second_signal(tmp_path_factory):
    "Each format: SIGTERM mid-run, then SIGINT while the recorder closes (all three runs at once)."
    d = tmp_path_factory.mktemp('second')
    kids = {f: Child('opscope_record', [d / f, *_tiny(d, 'long')], d / f.strip('/'), [('slow_steps', 0.05), ('signal_at_close', signal.SIGINT)])
            for f in FORMATS}
    return {f: (d / f, _signal_after(k, d / f, signal.SIGTERM)) for f, k in kids.items()}


@pytest.mark.parametrize('fmt', FORMATS)
def test_second_signal_while_closing_waits(second_signal, fmt):
    "The second signal does not cut the close short: the first one's exit code, the line, every kept step readable, nothing left beside OUT."
    out, c = second_signal[fmt]
    assert c.rc == 143 and 'Traceback' not in c.err, c.err[-2000:]
    kept, where = _kept(c.err)
    assert where == str(out) and kept >= 3
    df, warned = read_with_warnings(out)
    assert df.step.nunique() == kept and not warned, warned
    p = Path(out)
    assert not p.with_name(p.name + '.parts').exists() and not p.with_name(p.name + COMMIT_SUFFIX).exists() and _no_temp(out)


def test_signal_in_the_final_combine(tmp_path, capsys):
    "A finished run signalled during the combine: exit 130, the parts kept whole and named in the line, read like OUT."
    out = tmp_path / 'o.parquet'
    c = Child('opscope_record', [out, *_tiny(tmp_path, 'short')], tmp_path / 'log', [('signal_in_combine', signal.SIGINT)]).wait()
    assert c.rc == 130 and 'Traceback' not in c.err, c.err[-2000:]
    kept, where = _kept(c.err)
    assert kept == 4 and where == f'{out}.parts' and f'combining them into {out}' in _last(c.err), _last(c.err)
    assert not out.exists() and _parts_steps(out) == 4 and _no_temp(out)
    df, warned = read_with_warnings(out)
    assert df.step.nunique() == 4 and 'reading the parts of an interrupted run' in warned[0]
    cli.opscope_mine(str(out))                                   # opscope-mine reads them too
    assert 'reading the parts' in capsys.readouterr().err


def test_second_signal_in_the_combine_of_an_interrupted_run(tmp_path):
    "SIGTERM mid-run, then SIGINT during the combine it starts: exit 143 (the first), the parts kept and named."
    out = tmp_path / 'o.parquet'
    c = _signal_after(Child('opscope_record', [out, *_tiny(tmp_path, 'long')], tmp_path / 'log', [('slow_steps', 0.05), ('signal_in_combine', signal.SIGINT)]),
                      out, signal.SIGTERM)
    assert c.rc == 143 and 'Traceback' not in c.err, c.err[-2000:]
    kept, where = _kept(c.err)
    assert where == f'{out}.parts' and kept == _parts_steps(out) >= 3
    assert read_with_warnings(out)[0].step.nunique() == kept


def test_signal_at_the_end_still_stops(tmp_path):
    "A signal that comes while a finished run closes its CSV waits for the close; the run ends with the line and 143, every step kept."
    out = tmp_path / 'o.csv'
    c = Child('opscope_record', [out, *_tiny(tmp_path, 'short')], tmp_path / 'log', [('signal_at_close', signal.SIGTERM)]).wait()
    assert c.rc == 143 and 'Traceback' not in c.err, c.err[-2000:]
    assert _kept(c.err) == (4, str(out))
    df, warned = read_with_warnings(out)
    assert df.step.nunique() == 4 and not warned


def test_sigkill_in_the_combine_then_force(tmp_path, capsys):
    "SIGKILL during the final combine leaves the parts (read back) and the combine's hidden temporary file; a re-run is refused naming it, and `--force` removes it."
    out = tmp_path / 'o.parquet'
    c = Child('opscope_record', [out, *_tiny(tmp_path, 'short')], tmp_path / 'log', [('signal_in_combine', signal.SIGKILL)]).wait()
    assert c.rc == -signal.SIGKILL
    temps = [q.name for q in tmp_path.iterdir() if re.fullmatch(r'\.o\.parquet\.[a-z0-9_]{8}\.parquet', q.name)]
    assert len(temps) == 1 and _parts_steps(out) == 4 and not out.exists(), sorted(q.name for q in tmp_path.iterdir())
    assert read_with_warnings(out)[0].step.nunique() == 4
    with pytest.raises(SystemExit) as e: cli.opscope_record(str(out), model=f'{tmp_path}/tiny.py:short')
    err = capsys.readouterr().err
    assert e.value.code == 2 and temps[0] in err and 'pass --force' in err, err
    cli.opscope_record(str(out), model=f'{tmp_path}/tiny.py:short', force=True)
    assert _no_temp(out) and not Path(f'{out}.parts').exists()
    df, warned = read_with_warnings(out)
    assert sorted(df.step.unique()) == [0, 1, 2, 3] and not warned


def test_signal_to_a_command_that_records_nothing(tmp_path):
    "`opscope-mine` signalled mid-work: one line, `interrupted`, exit 143, no traceback."
    sk = tmp_path / 's.csv'
    record(torch.nn.Linear(8, 4), [torch.randn(2, 8)], sink=sk)
    c = Child('opscope_mine', [sk], tmp_path / 'log', [('slow_mine', tmp_path / 'mining')])
    t = time.monotonic()
    while not (tmp_path / 'mining').exists() and c.running() and time.monotonic() - t < 60: time.sleep(0.02)
    c.send(signal.SIGTERM)
    c.wait()
    assert (c.rc, c.err) == (143, 'opscope-mine: interrupted\n')
