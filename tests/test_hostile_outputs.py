"""Hostile outputs (issue 50): an OUT that is a symbolic link (dangling or not, with or without --force), two writers into
one OUT, an --out that is an input, a full disk, a sweep too large for its disk, a later batch of another width, a memory
limit below physical memory, and the final Parquet combine. Every refusal: exit 2, one line naming the file, nothing
written, nothing lost."""
import errno, os, resource, subprocess, sys, textwrap, time
from pathlib import Path

import pytest
import torch

from opscope import cli, mine_cli
from opscope.recorder import Recorder, record, read_sketches, writer_of, sweep, _combine_parts
from opscope.zoo import mlp
from test_signals import Child, _committed

FORMATS = ('csv', 'parquet', 'dataset')
RECORDERS = ('opscope_sweep', 'opscope_seq', 'opscope_mnist', 'opscope_infer', 'opscope_record')


def _out(d, name, fmt): return d / (f'{name}.{fmt}' if fmt != 'dataset' else name)


def _args(fn, d):
    "What `fn` needs beyond OUT and --force for a short run (its refusals come before any of it is used)."
    if fn == 'opscope_record':
        (d / 'f.py').write_text("import torch\ndef make(): return torch.nn.Linear(4, 4), [torch.randn(2, 4)]\n")
        return dict(model=f"{d / 'f.py'}:make")
    return dict(opscope_sweep=dict(steps=1, quiet=True), opscope_seq=dict(steps=2), opscope_mnist=dict(batches=1),
                opscope_infer=dict(model='moe', steps=1))[fn]


def _refused(capsys, fn, says, *args, **kwargs):
    "Run the command in-process: exit 2 and exactly one line `prog: error: ...` holding `says`; that line."
    with pytest.raises(SystemExit) as e: fn(*args, **kwargs)
    err = capsys.readouterr().err.rpartition('\r')[2]          # after a progress bar's last redraw
    prog = fn.__name__.replace('_', '-')
    assert 'Traceback' not in err and e.value.code == 2 and err.startswith(f'{prog}: error: ') and err.count('\n') == 1 and says in err, err
    return err


def _tree(d): return sorted((str(p.relative_to(d)), p.is_symlink(), p.read_bytes() if p.is_file() and not p.is_symlink() else None)
                            for p in d.rglob('*'))


# --- 50.3: OUT is never followed through a link ---------------------------------------------------------------------

@pytest.mark.parametrize('force', [False, True], ids=['plain', 'force'])
@pytest.mark.parametrize('target', ['dangling', 'file', 'folder'])
@pytest.mark.parametrize('fmt', FORMATS)
@pytest.mark.parametrize('fn', RECORDERS)
def test_symlinked_recording_out(tmp_path, capsys, fn, fmt, target, force):
    "`ln -s target OUT`: refused in one line naming OUT, whatever it points at; the target neither created nor changed."
    out = _out(tmp_path, 'o', fmt)
    aim = tmp_path / ('t' + ('' if fmt == 'dataset' else f'.{fmt}'))
    if target == 'file': aim.write_bytes(b'precious')
    if target == 'folder': aim.mkdir(); (aim / 'keep.txt').write_text('mine')
    os.symlink(aim, out)
    kwargs = _args(fn, tmp_path)
    before = _tree(tmp_path)
    _refused(capsys, getattr(cli, fn), f'{out} is a symbolic link (to {aim})', str(out), force=force, **kwargs)
    assert _tree(tmp_path) == before


def test_symlinked_whole_outs(tmp_path, capsys):
    "Findings, a plan, a bench report, a probe dump: a link as --out is refused, even with --force."
    good = tmp_path / 'good.csv'
    record(mlp(layers=2), [torch.randn(4, 256)], sink=good)
    for name in ('dangling.csv', 'dangling.safetensors'): os.symlink(tmp_path / 'nowhere', tmp_path / name)
    (tmp_path / 'keep.csv').write_text('keep'); os.symlink(tmp_path / 'keep.csv', tmp_path / 'tokeep.csv')
    before = _tree(tmp_path)
    for link in ('dangling.csv', 'tokeep.csv'):
        q = str(tmp_path / link)
        _refused(capsys, mine_cli.opscope_mine, 'is a symbolic link', str(good), out=q)
        _refused(capsys, mine_cli.opscope_mine, 'is a symbolic link', str(good), out=q, force=True)
        _refused(capsys, cli.opscope_plan, 'is a symbolic link', str(good), out=q, force=True)
        _refused(capsys, cli.opscope_bench, 'is a symbolic link', out=q)
    _refused(capsys, cli.opscope_probe, 'is a symbolic link', dump=str(tmp_path / 'dangling.safetensors'))
    assert _tree(tmp_path) == before


def test_library_recorder_refuses_a_link(tmp_path):
    os.symlink(tmp_path / 'target.csv', tmp_path / 'link.csv')
    with pytest.raises(ValueError, match='is a symbolic link'): record(mlp(layers=2), [torch.randn(4, 256)], sink=tmp_path / 'link.csv')
    assert not (tmp_path / 'target.csv').exists()


# --- 50.5: one writer per OUT ---------------------------------------------------------------------------------------

@pytest.mark.parametrize('fmt', FORMATS)
def test_library_recorder_second_writer_refused(tmp_path, fmt):
    "Two `Recorder`s on one OUT: the second is refused before it clears anything; the first's steps all stay; once closed, OUT is free."
    out, m = _out(tmp_path, 'o', fmt), mlp(layers=2)
    xs = [torch.randn(4, 256) for _ in range(3)]
    first = Recorder(out)
    record(m, xs[:2], sink=first, step_ids=[0, 1])
    with pytest.raises(ValueError, match='another writer'): record(m, xs[2:], sink=out, run_id='other')
    record(m, xs[2:], sink=first, step_ids=[2]); first.close()
    df = read_sketches(out)
    assert sorted(df.step.unique()) == [0, 1, 2] and set(df.run_id) == {'run'}
    assert not [p.name for p in tmp_path.iterdir() if 'lock' in p.name]       # the lock file goes with the writer
    record(m, xs[:1], sink=out, run_id='after')                                # and OUT is free again
    assert set(read_sketches(out).run_id) == {'after'}


def test_ranks_each_hold_their_own_partition(tmp_path):
    m, ds = mlp(layers=2), tmp_path / 'ds'
    a, b = Recorder(ds, rank=0, dataset=True), Recorder(ds, rank=1, dataset=True)
    record(m, [torch.randn(4, 256)], sink=a, step_ids=[0]); record(m, [torch.randn(4, 256)], sink=b, step_ids=[1])
    with pytest.raises(ValueError, match='another writer'): record(m, [torch.randn(4, 256)], sink=Recorder(ds, rank=1, dataset=True))
    a.close(); b.close()
    assert sorted(read_sketches(ds)['rank'].unique()) == [0, 1]


HOLD = textwrap.dedent('''
    import sys, time
    from opscope.recorder import Recorder
    held = Recorder(sys.argv[1], dataset=sys.argv[2] == 'dataset').lock()
    print('held', flush=True); time.sleep(120)
''')


@pytest.mark.parametrize('fmt', FORMATS)
def test_every_recording_cli_refuses_a_held_out(tmp_path, capsys, fmt):
    "Another process records into OUT: each recording CLI, with or without --force, is refused in one line naming OUT and the pid; OUT untouched."
    out = _out(tmp_path, 'o', fmt)
    holder = subprocess.Popen([sys.executable, '-c', HOLD, str(out), fmt], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == 'held'
        assert writer_of(out) == str(holder.pid)
        for fn in RECORDERS:
            kwargs = _args(fn, tmp_path)
            before = _tree(tmp_path)
            for force in (False, True):
                _refused(capsys, getattr(cli, fn), f'{out}: another writer (pid {holder.pid}) is recording into it', str(out), force=force, **kwargs)
            assert _tree(tmp_path) == before, fn
    finally: holder.kill(); holder.wait()
    assert writer_of(out) is None                       # the kernel let go of a killed writer's lock


@pytest.mark.slow
@pytest.mark.parametrize('fmt', FORMATS)
def test_two_concurrent_writers(tmp_path, fmt):
    "Two real `opscope-mnist` runs into one OUT, the second started (with --force) while the first records: refused in one line, exit 2; the first ends exit 0 with every step, the same rows as a run alone."
    out, steps = _out(tmp_path, 'o', fmt), 8
    alone = tmp_path / f'alone.{fmt if fmt != "dataset" else "csv"}'
    assert Child('opscope_mnist', [alone, steps], tmp_path / 'alone').wait().rc == 0
    first = Child('opscope_mnist', [out, steps], tmp_path / 'first', patches=[('slow_steps', 0.4)])
    t = time.monotonic()
    while _committed(out) < 2 and first.running() and time.monotonic() - t < 120: time.sleep(0.02)
    assert first.running(), 'the first writer ended before the second started'
    second = Child('opscope_mnist', [out, steps, '--force'], tmp_path / 'second').wait()
    assert second.rc == 2 and second.err.count('\n') == 1 and 'another writer' in second.err and str(out) in second.err, second.err
    assert first.wait().rc == 0, first.err
    got, want = read_sketches(out), read_sketches(alone)
    assert got.step.nunique() == steps and len(got) == len(want)
    assert (got.groupby('step').size() == want.groupby('step').size()).all()


def _locks(d): return sorted(p.name for p in d.iterdir() if p.name.startswith('.opscope-lock.'))


def _held(rec, says):
    "`rec.lock()` refused in one line naming OUT and `says` (the holder's pid)."
    with pytest.raises(ValueError) as e: rec.lock()
    msg = str(e.value)
    assert msg.count('\n') == 0 and f'{rec.path}: another writer (pid {says}) is recording into it' in msg, msg


def test_rankless_and_ranked_writers_refuse_each_other(tmp_path):
    "A dataset writer without a rank (it clears the whole dataset) and any ranked writer refuse each other; ranks coexist, one rank twice is refused; the lock files go with the last writer."
    m, ds, me = mlp(layers=2), tmp_path / 'ds', os.getpid()
    r0 = Recorder(ds, rank=0, dataset=True)
    record(m, [torch.randn(4, 256)], sink=r0, step_ids=[0])
    _held(Recorder(ds, dataset=True), me)                                      # rank-less refused while rank 0 writes
    with pytest.raises(ValueError, match='another writer'): record(m, [torch.randn(4, 256)], sink=ds, run_id='other')
    r1 = Recorder(ds, rank=1, dataset=True).lock()                             # rank 1 beside rank 0: fine
    _held(Recorder(ds, rank=1, dataset=True), me)                              # rank 1 twice: refused
    assert _locks(tmp_path) == ['.opscope-lock.ds', '.opscope-lock.ds.rank0', '.opscope-lock.ds.rank1']
    record(m, [torch.randn(4, 256)], sink=r1, step_ids=[1])
    r0.close()
    assert _locks(tmp_path) == ['.opscope-lock.ds', '.opscope-lock.ds.rank1']  # rank 1 still shares the main lock
    _held(Recorder(ds, dataset=True), 'unknown')                               # still refused; rank 0 named itself there and has gone
    r1.close()
    assert _locks(tmp_path) == []                                              # the last writer removed the main lock
    df = read_sketches(ds)
    assert sorted(df['rank'].unique()) == [0, 1] and set(df.run_id) == {'run'}  # nothing cleared by the refused writers
    solo = Recorder(ds, dataset=True)                                          # all released: a rank-less writer succeeds
    record(m, [torch.randn(4, 256)], sink=solo, run_id='solo', step_ids=[0])
    _held(Recorder(ds, rank=0, dataset=True), me)                              # rank 0 refused while a rank-less writer writes
    assert _locks(tmp_path) == ['.opscope-lock.ds']                            # the refused rank left no lock of its own
    solo.close()
    assert _locks(tmp_path) == [] and set(read_sketches(ds).run_id) == {'solo'}


HOLD_RANK = textwrap.dedent('''
    import sys, time
    from opscope.recorder import Recorder
    held = Recorder(sys.argv[1], rank=None if sys.argv[2] == '-' else int(sys.argv[2]), dataset=True).lock()
    print('held', flush=True); time.sleep(120)
''')


def _holder(out, rank):
    p = subprocess.Popen([sys.executable, '-c', HOLD_RANK, str(out), '-' if rank is None else str(rank)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == 'held'
    return p


def test_ranked_and_rankless_writers_in_other_processes(tmp_path, capsys):
    "Across processes: the refusal names the other writer's pid; `writer_of` answers for the whole OUT and for each rank; a killed writer's locks go with it."
    ds = tmp_path / 'ds'
    r0 = _holder(ds, 0)
    try:
        assert writer_of(ds) == writer_of(ds, 0) == str(r0.pid) and writer_of(ds, 1) is None
        _held(Recorder(ds, dataset=True), r0.pid)
        _refused(capsys, cli.opscope_record, f'{ds}: another writer (pid {r0.pid}) is recording into it', str(ds), force=True, **_args('opscope_record', tmp_path))
        r1 = Recorder(ds, rank=1, dataset=True).lock()                         # another rank, this process: fine
        _held(Recorder(ds, rank=0, dataset=True), r0.pid)
        r1.close()
        assert writer_of(ds) == str(r0.pid)                                    # rank 0 still holds the main lock, and is named
    finally: r0.kill(); r0.wait()
    assert writer_of(ds) is None and writer_of(ds, 0) is None
    solo = _holder(ds, None)
    try:
        assert writer_of(ds) == str(solo.pid)
        _held(Recorder(ds, rank=0, dataset=True), solo.pid)
    finally: solo.kill(); solo.wait()
    last = Recorder(ds, rank=0, dataset=True).lock(); last.close()             # a killed writer's lock files are reused, then removed
    assert _locks(tmp_path) == []


# --- 50.6: --out is never an input; an existing --out needs --force -------------------------------------------------

@pytest.mark.parametrize('fmt', ['csv', 'dataset'])
def test_out_is_the_input(tmp_path, capsys, fmt):
    "`opscope-mine IN --out IN` (or a path inside a dataset IN, or a hard link to IN) and `opscope-plan` alike: refused, IN untouched."
    src = _out(tmp_path, 's', fmt)
    record(mlp(layers=2), [torch.randn(4, 256)], sink=src)
    outs = [src / 'f.csv', tmp_path / 'x' / '..' / 's' / 'f.csv'] if fmt == 'dataset' else [src, tmp_path / '.' / 's.csv']
    if fmt == 'csv': os.link(src, tmp_path / 'hard.csv'); outs.append(tmp_path / 'hard.csv')
    (tmp_path / 'x').mkdir()
    before = _tree(tmp_path)
    for out in outs:
        for force in (False, True):
            _refused(capsys, mine_cli.opscope_mine, '--out is the input', str(src), out=str(out), force=force)
            _refused(capsys, cli.opscope_plan, '--out is the input', str(src), out=str(out), force=force)
    assert _tree(tmp_path) == before


def test_existing_out_needs_force(tmp_path, capsys):
    src, out = tmp_path / 's.csv', tmp_path / 'f.csv'
    record(mlp(layers=2), [torch.randn(4, 256)], sink=src)
    out.write_text('old findings')
    _refused(capsys, mine_cli.opscope_mine, 'f.csv already exists; pass --force to replace it', str(src), out=str(out))
    _refused(capsys, cli.opscope_plan, 'f.csv already exists; pass --force to replace it', str(src), out=str(out))
    assert out.read_text() == 'old findings'
    mine_cli.opscope_mine(str(src), out=str(out), force=True)
    assert out.read_text().startswith('run_id,')


# --- 50.11: a full disk, a file where a dataset goes, a newline in a path, a sweep too large for its disk ------------

def _fill_after(monkeypatch, n):
    "`os.fsync` fails with ENOSPC after `n` calls: a disk that fills up (every writer's fsync, the final combine's too)."
    calls, real = [0], os.fsync
    def fsync(fd):
        calls[0] += 1
        if calls[0] > n: raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)
    monkeypatch.setattr(os, 'fsync', fsync)


@pytest.mark.parametrize('fmt', FORMATS)
def test_full_disk_names_the_file(tmp_path, monkeypatch, capsys, fmt):
    "ENOSPC mid-run: one line naming OUT (a Parquet file's finished steps: in OUT.parts, which the reader reads), exit 2, every finished step readable."
    out = _out(tmp_path, 'full', fmt)
    _fill_after(monkeypatch, 9)
    err = _refused(capsys, cli.opscope_mnist, 'No space left on device', str(out), batches=60)
    assert 'full' in err
    if fmt == 'parquet': assert f'finished steps are in {out}.parts' in err, err
    monkeypatch.undo()
    df = read_sketches(out)
    assert df.step.nunique() >= 1


def test_force_over_a_plain_file_where_a_dataset_goes(tmp_path, capsys):
    "OUT without extension is a dataset directory: a plain file there is refused up front (not 'File exists' after the work), and kept."
    (tmp_path / 'plain').write_text('keep')
    _refused(capsys, cli.opscope_seq, 'plain is a file, but an OUT without extension is a dataset directory', str(tmp_path / 'plain'), steps=2, force=True)
    assert (tmp_path / 'plain').read_text() == 'keep'


def test_newline_in_a_path_stays_one_line(tmp_path, capsys):
    out = tmp_path / 'no\nsuch' / 'x.csv'
    err = _refused(capsys, cli.opscope_seq, repr(str(out.parent)), str(out), steps=2)
    assert err.count('\n') == 1


def test_sweep_refuses_what_will_not_fit(tmp_path, monkeypatch, capsys):
    "`opscope-sweep --steps 100000`: the disk it needs, stated up front, refused where the filesystem has less free; nothing written."
    free = 50e9
    monkeypatch.setattr(cli.shutil, 'disk_usage', lambda d: type('U', (), dict(free=free))())
    for fmt in FORMATS:
        out = _out(tmp_path, 'big', fmt)
        need = 100_000 * cli.SWEEP_STEP_BYTES[fmt] / 1e9
        if need > free / 1e9:
            _refused(capsys, cli.opscope_sweep, f'needs about {need:,.1f} GB on disk, more than the 50.0 GB free', str(out), steps=100_000)
    assert not list(tmp_path.iterdir())
    monkeypatch.setattr(cli, 'DISK_NOTE_BYTES', 1)                     # past the threshold, the estimate is said before the work
    cli.opscope_sweep(str(tmp_path / 'one.parquet'), steps=1, quiet=True)
    assert f"opscope-sweep: about {cli.SWEEP_STEP_BYTES['parquet'] / 1e9:,.1f} GB to write to {tmp_path / 'one.parquet'}" in capsys.readouterr().err


def test_mine_help_says_the_cluster_is_trusted():
    from fastcore.script import anno_parser
    text = ' '.join(anno_parser(mine_cli.opscope_mine.__wrapped__).format_help().split())
    assert 'trusted like this machine' in text and 'pickles' in text and 'TLS' in text and '--force' in text


def test_mine_tls_options(tmp_path, capsys):
    "--tls-* go with a tls:// scheduler, and name regular files; refused in one line before any connection."
    src = tmp_path / 's.csv'
    record(mlp(layers=2), [torch.randn(4, 256)], sink=src)
    _refused(capsys, mine_cli.opscope_mine, 'go with --scheduler tls://HOST:PORT', str(src), engine='dask', tls_ca_file=str(src))
    _refused(capsys, mine_cli.opscope_mine, 'go with --scheduler tls://HOST:PORT', str(src), engine='dask', scheduler='tcp://127.0.0.1:1', tls_ca_file=str(src))
    _refused(capsys, mine_cli.opscope_mine, f"--tls-cert {tmp_path / 'none.pem'}: not a file", str(src), engine='dask', scheduler='tls://127.0.0.1:1', tls_cert=str(tmp_path / 'none.pem'))
    assert mine_cli._security('tls://h:1', str(src), None, None).require_encryption


@pytest.mark.slow
def test_sweep_step_bytes_bound_a_real_step(tmp_path):
    "`SWEEP_STEP_BYTES` is at least what a real sweep step takes in each format (Parquet: its part and the combined file)."
    for fmt in FORMATS:
        out = _out(tmp_path, 'one', fmt)
        with Recorder(out) as rec:
            sweep(rec, steps=1)
            parts = sum(f.stat().st_size for f in rec.parts.rglob('*')) if rec.parts.exists() else 0
        size = sum(f.stat().st_size for f in out.rglob('*')) if out.is_dir() else out.stat().st_size
        assert parts + size <= cli.SWEEP_STEP_BYTES[fmt], (fmt, parts, size)


# --- 50.9: a later batch of another width; the effective memory limit ----------------------------------------------

def test_a_later_batch_of_another_width(tmp_path, capsys):
    "Batch 50 of 61 another width: one line naming the batch (as batch 0 gets), exit 2, the 50 finished steps kept."
    (tmp_path / 'f.py').write_text(textwrap.dedent('''
        import torch
        def make():
            xs = [torch.randn(2, 8) for _ in range(61)]; xs[50] = torch.randn(2, 9)
            return torch.nn.Linear(8, 4), xs
    '''))
    out = tmp_path / 'o.csv'
    _refused(capsys, cli.opscope_record, 'the model cannot run batch 50 (step 50), though it ran batch 0: mat1 and mat2 shapes', str(out), model=f"{tmp_path / 'f.py'}:make")
    assert read_sketches(out).step.nunique() == 50


def test_memory_check_reads_the_effective_limit(monkeypatch, capsys):
    "A ulimit below physical memory is the limit the check holds work to (and says so); the least limit wins."
    have = cli.machine_memory()
    if not have: pytest.skip('the OS does not say how much memory this machine has')
    real = resource.getrlimit
    monkeypatch.setattr(resource, 'getrlimit', lambda r: (have // 4, resource.RLIM_INFINITY) if r == resource.RLIMIT_AS else real(r))
    assert cli.memory_limit()[0] <= have // 4
    rows = int(have / 2 / cli.BENCH_ROW_BYTES)              # half of physical memory: passed before, over the ulimit now
    if cli.memory_limit()[1].startswith('the RLIMIT_AS'):
        _refused(capsys, cli.opscope_bench, 'more than the RLIMIT_AS limit (ulimit) of', miner_rows=rows)


def test_cgroup_limits_read(tmp_path, monkeypatch):
    "cgroup v2 `memory.max` (a number, or `max`) and v1 `memory.limit_in_bytes` (its 'no limit' too) of the process's cgroup and its ancestors."
    root = tmp_path / 'cg'
    (root / 'a' / 'b').mkdir(parents=True); (root / 'memory' / 'x').mkdir(parents=True)
    (root / 'memory.max').write_text('max\n'); (root / 'a' / 'memory.max').write_text('3000000000\n'); (root / 'a' / 'b' / 'memory.max').write_text('max\n')
    (root / 'memory' / 'x' / 'memory.limit_in_bytes').write_text('9223372036854771712\n')
    real = Path.read_text
    monkeypatch.setattr(Path, 'read_text', lambda self, *a, **k: '4:memory:/x\n0::/a/b\n' if str(self) == '/proc/self/cgroup' else real(self, *a, **k))
    assert cli._cgroup_limits(root) == [3_000_000_000]


# --- 50.12: the final Parquet combine ------------------------------------------------------------------------------

def test_combine_reads_each_part_once_and_says_so(tmp_path, monkeypatch, capsys):
    "The final combine is one pass over the parts (each row group read once: linear in steps), and a long one says 'combining N steps' on stderr."
    import pyarrow.parquet as pq
    monkeypatch.setattr(cli, 'COMBINE_NOTE_STEPS', 3)
    reads, real = [0], pq.ParquetFile.read_row_group
    def counted(self, *a, **k): reads[0] += 1; return real(self, *a, **k)
    monkeypatch.setattr(pq.ParquetFile, 'read_row_group', counted)
    out = tmp_path / 'o.parquet'
    cli.opscope_mnist(str(out), batches=6)
    err = capsys.readouterr().err
    assert f'opscope-mnist: combining 6 steps into {out}' in err, err
    assert reads[0] == pq.ParquetFile(out).num_row_groups and read_sketches(out).step.nunique() == 6
