"Fuzzing every reader opscope owns (issue 34): seeded mutations of a good file — bit flips, cuts, insertions, garbled headers, huge lengths, deep nesting — give a clean, validated read or one `InputError` line naming the file, each within 5 s."
import io, json, random, resource, shutil, struct, time, zipfile
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from opscope.tables import InputError
from opscope.probe import save_tensors, load_tensors
from opscope.flow import load_graph, write_edgelist, zoo_graph, dataflow_motifs, op_motifs, OpGraph
from opscope.bench import load_report
from opscope.plan import read_findings, read_plan, PLAN_COLUMNS
from opscope.runners import read_prompts, load_hf

LIMIT_S = 5.0          # the slowest any one read may be
FAST, SLOW = 50, 1000  # mutated files per reader: the unmarked test, and the @slow one
NB = Path(__file__).resolve().parents[1] / 'nbs'


# --- the mutator ----------------------------------------------------------------------------------------------

NEST = [b'[' * 5000 + b']' * 5000, b'{"a":' * 3000 + b'1' + b'}' * 3000, b'[' * 200_000]
HUGE = [b'9' * 5000, b'1e999999', b'-1', b'18446744073709551615', b'"' + b'x' * 200_000 + b'"', b',' * 200_000]

def _bytes_op(rng, b:bytes)->bytes:
    "One byte-level mutation of `b`."
    n, k = len(b), rng.randrange(9)
    at = rng.randrange(n + 1) if n else 0
    if k == 0 and n:                                                    # flip bits
        a = bytearray(b)
        for _ in range(rng.randint(1, 8)): i = rng.randrange(n); a[i] ^= 1 << rng.randrange(8)
        return bytes(a)
    if k == 1: return b[:at]                                            # cut
    if k == 2: return b[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) + b[at:]   # insert noise
    if k == 3 and n: j = rng.randrange(at, n + 1) if at < n else n; return b[:at] + b[j:]               # delete a span
    if k == 4: return bytes(rng.randrange(256) for _ in range(rng.randint(1, 16))) + b[rng.randint(0, 16):]   # garble the header
    if k == 5: return b[:at] + rng.choice(NEST) + b[at:]                # nesting
    if k == 6: return b[:at] + rng.choice(HUGE) + b[at:]                # huge numbers, long fields
    if k == 7 and n:                                                    # duplicate a span (a repeated line, a doubled block)
        j = min(n, at + rng.randint(1, 200)); return b[:j] + b[at:j] + b[j:]
    return b[:at] + b'\n' * rng.randint(1, 3) + b[at:]                  # stray newlines

def _json_op(rng, v):
    "`v` (parsed JSON) with one value somewhere replaced by something hostile."
    choices = [None, True, -1, 0, 2**64, 1.5, float('nan'), '', 'x' * 1000, '8', [], {}, [1, 2, 3], ['0', '8'], {'a': 1},
               json.loads('[' * 500 + ']' * 500)]
    def walk(x, depth):
        if isinstance(x, dict) and x and rng.random() < 0.8:
            k = rng.choice(list(x))
            if rng.random() < 0.15: return {**{kk: vv for kk, vv in x.items() if kk != k}}                     # drop a key
            return {**x, k: walk(x[k], depth + 1)}
        if isinstance(x, list) and x and rng.random() < 0.8:
            i = rng.randrange(len(x)); y = list(x); y[i] = walk(x[i], depth + 1)
            if rng.random() < 0.15: y.append(rng.choice(choices))
            return y
        return rng.choice(choices)
    return walk(v, 0)

def mutate(rng, b:bytes, json_part=None)->bytes:
    "1 to 3 mutations of `b`; with `json_part` = (get, put), sometimes a structural one of the JSON inside it."
    if json_part is not None and rng.random() < 0.5:
        get, put = json_part
        try: return put(json.dumps(_json_op(rng, json.loads(get(b))), allow_nan=True).encode())
        except (ValueError, RecursionError): pass
    for _ in range(rng.randint(1, 3)): b = _bytes_op(rng, b)
    return b


# --- the seeds: one good file per reader, and what a clean read must look like -----------------------------------

def _st_parts(b):
    n = struct.unpack('<Q', b[:8])[0]
    return b[8:8 + n], b[8 + n:]

def _pt2_json(b):
    with zipfile.ZipFile(io.BytesIO(b)) as z: return z.read(next(n for n in z.namelist() if n.endswith('models/model.json')))

def _pt2_put(b, j):
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(b)) as zin, zipfile.ZipFile(out, 'w') as z:
        for n in zin.namelist(): z.writestr(n, j if n.endswith('models/model.json') else zin.read(n))
    return out.getvalue()

def _graph_read(p):
    "load_graph, then what opscope-graph does with the graph next."
    g = load_graph(p)
    dataflow_motifs(g); op_motifs(g, 4)
    return g

_graph_ok = lambda g: isinstance(g, OpGraph) and len(g) >= 1

def _plan_rows():
    base = dict(site='fc1', exploit='dead-channels', guard='lhs.chan_absmax[channels] <= 0 and lhs.nan_count <= 0', guard_holds=1.0,
                guard_sigma=0.0, est_speedup=1.2, measured_speedup=1.1, dense_ms=0.5, special_ms=0.45, M=64, K=784, N=256, note='ok',
                run_id='mnist', role='lhs', stat='chan_density', value=0.1, channels='0-3,7', steps_held=2, steps=2, exact=True, packed_bytes=0)
    return pd.DataFrame([base, {**base, 'site': '0', 'exploit': 'sparse-gemm', 'guard': 'lhs.density <= 0.25', 'channels': ''}])[PLAN_COLUMNS]


@pytest.fixture(scope='module')
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp('seeds')
    g = torch.Generator().manual_seed(0)
    st = save_tensors(d / 's.safetensors', {'w': torch.randn(3, 4, generator=g), 'i': torch.arange(5), 'h': torch.ones(2, dtype=torch.bfloat16)}).read_bytes()
    write_edgelist(zoo_graph('transformer', 1), d / 'g.txt')
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    torch.export.save(torch.export.export(m, (torch.randn(2, 8),)), d / 'g.pt2')
    onnx = pytest.importorskip('onnx')
    from onnx import helper, TensorProto
    nodes = [helper.make_node('Gemm', ['x', 'w'], ['h']), helper.make_node('Relu', ['h'], ['r']), helper.make_node('Softmax', ['r'], ['y'])]
    onnx.save(helper.make_model(helper.make_graph(nodes, 'tiny', [helper.make_tensor_value_info('x', TensorProto.FLOAT, [2, 8])],
                                                  [helper.make_tensor_value_info('y', TensorProto.FLOAT, [2, 8])],
                                                  [helper.make_tensor('w', TensorProto.FLOAT, [8, 8], [0.0] * 64)])), d / 'g.onnx')
    from opscope.recorder import record
    from opscope.miner import mine
    from opscope.zoo import mlp
    xs = [torch.relu(torch.randn(16, 32, generator=g)) for _ in range(2)]
    found = mine(record(mlp(layers=2, d_in=32, hidden=32, d_out=8), xs, run_id='fz'))
    found.to_csv(d / 'f.csv', index=False)
    _plan_rows().to_csv(d / 'p.csv', index=False)
    hf = d / 'hf'
    import sys; sys.path.insert(0, str(Path(__file__).parent))
    from test_runners import _decoder_folder
    _decoder_folder(hf)
    return {
        'safetensors': dict(name='x.safetensors', data=st, read=load_tensors, json=(lambda b: _st_parts(b)[0], lambda j, b=st: struct.pack('<Q', len(j)) + j + _st_parts(b)[1]),
                            ok=lambda r: all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in r.items())),
        'edgelist': dict(name='x.txt', data=(d / 'g.txt').read_bytes(), read=_graph_read, ok=_graph_ok),
        'onnx': dict(name='x.onnx', data=(d / 'g.onnx').read_bytes(), read=_graph_read, ok=_graph_ok),
        'pt2': dict(name='x.pt2', data=(d / 'g.pt2').read_bytes(), read=_graph_read, ok=_graph_ok,
                    json=(_pt2_json, lambda j, b=(d / 'g.pt2').read_bytes(): _pt2_put(b, j))),
        'report': dict(name='x.csv', data=(NB / 'bench_full.csv').read_bytes(), read=load_report, ok=lambda r: 'eager' in r and 'online' in r),
        'findings': dict(name='x.csv', data=(d / 'f.csv').read_bytes(), read=read_findings, ok=lambda r: r.idx.dtype == np.int64),
        'plan': dict(name='x.csv', data=(d / 'p.csv').read_bytes(), read=read_plan, ok=lambda r: r.exact.dtype == bool and r.M.dtype == np.int64),
        'prompts': dict(name='x.txt', data='w3 w5 w7\nw4 w8\n\nünïcode prompt\n'.encode(), read=read_prompts,
                        ok=lambda r: r and all(isinstance(s, str) and s.strip() == s and s for s in r)),
        'hf-config': dict(folder=hf, file='config.json', read=load_hf, json=(lambda b: b, lambda j: j), ok=lambda r: len(r) == 3),
        'hf-weights': dict(folder=hf, file='model.safetensors', read=load_hf, ok=lambda r: len(r) == 3,
                           json=(lambda b: _st_parts(b)[0], lambda j, b=(hf / 'model.safetensors').read_bytes(): struct.pack('<Q', len(j)) + j + _st_parts(b)[1])),
    }


READERS = ['safetensors', 'edgelist', 'onnx', 'pt2', 'report', 'findings', 'plan', 'prompts', 'hf-config', 'hf-weights']
RESULTS = {}   # reader -> (mutated files, clean reads, InputErrors, worst seconds): the numbers the test prints


def fuzz(spec, n, tmp, seed):
    "Read `n` mutations of the reader's seed file; return (clean reads, InputErrors, worst seconds). Anything else fails, naming the case to replay."
    rng, out, worst = random.Random(seed), Counter(), 0.
    if 'folder' in spec:
        folder = tmp / 'model'; shutil.copytree(spec['folder'], folder); p = folder / spec['file']; good = p.read_bytes(); where = str(folder)
    else: p = tmp / spec['name']; good = spec['data']; where = str(p)
    for i in range(n):
        p.write_bytes(mutate(rng, good, spec.get('json')))
        t = time.perf_counter()
        try: res = spec['read'](p.parent if 'folder' in spec else p)
        except InputError as e:
            msg = str(e)
            assert '\n' not in msg.strip() and where in msg, f"case {i} (seed {seed}): not one line naming {where}: {msg[:300]!r}"
            out['error'] += 1
        except Exception as e:
            raise AssertionError(f"case {i} (seed {seed!r}): {type(e).__name__}: {str(e)[:300]}") from e
        else:
            assert spec['ok'](res), f"case {i} (seed {seed!r}): a read that does not validate"
            out['clean'] += 1
        dt = time.perf_counter() - t
        worst = max(worst, dt)
        assert dt < LIMIT_S, f"case {i} (seed {seed!r}) took {dt:.1f} s"
    return out['clean'], out['error'], worst


def _run(seeds, reader, n, tmp_path):
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    clean, err, worst = fuzz(seeds[reader], n, tmp_path, f'{reader}-{n}')
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    RESULTS[reader] = (n, clean, err, worst)
    print(f"\nfuzz {reader:12s} {n:5d} files: {clean:4d} clean reads, {err:4d} InputError, worst {worst * 1e3:7.1f} ms, peak RSS +{grew:.0f} MiB")
    assert clean + err == n and grew < 1024


@pytest.mark.parametrize('reader', READERS)
def test_fuzz_reader(seeds, reader, tmp_path):
    f"{FAST} mutated files per reader: only a clean read or one InputError line, each under {LIMIT_S:.0f} s."
    _run(seeds, reader, FAST, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize('reader', READERS)
def test_fuzz_reader_1000(seeds, reader, tmp_path):
    "The issue's goal: 1,000 mutated files per reader, only InputError or a clean read, none slower than 5 s."
    _run(seeds, reader, SLOW, tmp_path)


def test_the_issue_cases_are_one_line(tmp_path):
    "The reports of issue 34 that ended in a traceback: non-integer offsets, a deeply nested header, a binary prompts file."
    raw = json.dumps({'w': {'dtype': 'F32', 'shape': [2], 'data_offsets': ['0', '8']}}).encode()
    (tmp_path / 'a.safetensors').write_bytes(struct.pack('<Q', len(raw)) + raw + bytes(8))
    raw = b'{"a":' + b'[' * 100_000 + b']' * 100_000 + b'}'
    (tmp_path / 'b.safetensors').write_bytes(struct.pack('<Q', len(raw)) + raw)
    (tmp_path / 'p.txt').write_bytes(bytes(range(256)))
    for read, name, says in [(load_tensors, 'a.safetensors', 'are not two byte offsets'), (load_tensors, 'b.safetensors', 'nests deeper'),
                             (read_prompts, 'p.txt', 'a NUL byte')]:
        with pytest.raises(InputError, match=says): read(tmp_path / name)
