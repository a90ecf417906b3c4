"End-to-end tests of opscope.flow and its console scripts: counts that follow the architecture, round trips, bad files."
import random, re, subprocess
from pathlib import Path

import onnx
import pandas as pd
import pytest
import torch

from opscope import zoo
from opscope.flow import (GraphError, dataflow_motifs, from_export, load_graph, op_motifs, read_edgelist,
                          write_edgelist, zoo_graph)

ONNX_LIGHT = Path(onnx.__file__).parent / 'backend/test/data/light'


def run(*args):
    return subprocess.run(list(args), capture_output=True, text=True, timeout=120)


def rows(stdout):
    "The data rows of a printed table: lines after the header that start with a 16-hex-digit hash."
    return [l.split() for l in stdout.splitlines() if re.match(r'^\s*[0-9a-f]{16}\s', l)]


@pytest.mark.parametrize('layers', [1, 2, 5])
def test_transformer_blocks_follow_layers(layers):
    df = dataflow_motifs(zoo_graph('transformer', layers), min_count=1)
    got = dict(zip(df.label, df['count']))
    assert got['FusedAttentionBlock'] == layers and got['FusedMatMulBiasAct'] == layers


@pytest.mark.parametrize('layers', [1, 3, 7])
def test_moe_and_mlp_blocks_follow_layers(layers):
    df = dataflow_motifs(zoo_graph('moe', layers), min_count=1)
    assert df[df.label == 'FusedGroupedMatMulGating']['count'].tolist() == [layers]
    mo = op_motifs(zoo_graph('mlp', layers), 2, min_count=1).set_index('motif')['count']
    assert mo['linear → relu'] == layers


@pytest.mark.slow
def test_cli_flow_transformer_and_moe():
    r = run('opscope-flow', '6', 'transformer')
    assert r.returncode == 0, r.stderr
    got = {row[-2]: int(row[1]) for row in rows(r.stdout)}
    assert got == {'FusedAttentionBlock': 6, 'FusedMatMulBiasAct': 6}
    r = run('opscope-flow', '4', 'moe')
    assert r.returncode == 0, r.stderr
    assert [(row[-2], int(row[1])) for row in rows(r.stdout)] == [('FusedGroupedMatMulGating', 4)]
    assert 'topk' in r.stdout and 'bmm×2' in r.stdout


def test_cli_motifs():
    r = run('opscope-motifs', '3')
    assert r.returncode == 0, r.stderr
    table = {l.rsplit(None, 2)[0].strip(): int(l.split()[-1]) for l in r.stdout.splitlines()[2:]}
    assert table['linear → relu'] == 3 and table['relu → linear'] == 3


def test_edgelist_round_trip_same_motifs(tmp_path):
    g = zoo_graph('transformer', 3)
    back = load_graph(write_edgelist(g, tmp_path / 'g.txt'))
    pd.testing.assert_frame_equal(dataflow_motifs(back), dataflow_motifs(g))
    pd.testing.assert_frame_equal(op_motifs(back), op_motifs(g))


def test_edgelist_order_and_names_do_not_matter(tmp_path):
    "Shuffled lines and renamed ids give the same motifs: the hash sees op types and wiring only."
    g = zoo_graph('moe', 3)
    lines = write_edgelist(g, tmp_path / 'g.txt').read_text().splitlines()
    body = [l for l in lines if not l.startswith('#')]
    rename = {l.split()[0]: f'n{k}' for k, l in enumerate(body)}
    body = [' '.join(rename.get(t, t) if k != 1 else t for k, t in enumerate(l.split())) for l in body]
    random.Random(0).shuffle(body)
    (tmp_path / 's.txt').write_text('\n'.join(body))
    a, b = dataflow_motifs(g), dataflow_motifs(read_edgelist(tmp_path / 's.txt'))
    assert a[['hash', 'count', 'size', 'ops', 'label']].equals(b[['hash', 'count', 'size', 'ops', 'label']])
    assert op_motifs(read_edgelist(tmp_path / 's.txt')).equals(op_motifs(g))


def test_cli_graph_real_onnx_resnet50():
    r = run('opscope-graph', str(ONNX_LIGHT / 'light_resnet50.onnx'))
    assert r.returncode == 0, r.stderr
    assert sorted(int(row[1]) for row in rows(r.stdout)) == [4, 12]      # 12 identity + 4 projection bottlenecks
    assert 'conv → batch_norm → relu' in r.stdout


def test_pt2_file(tmp_path):
    m = zoo.transformer(2)
    ep = torch.export.export(m, (zoo.example_input(m, 1, 8),))
    torch.export.save(ep, tmp_path / 't.pt2')
    df = dataflow_motifs(load_graph(tmp_path / 't.pt2'))
    assert df.equals(dataflow_motifs(from_export(ep)))
    assert dict(zip(df.label, df['count'])) == {'FusedAttentionBlock': 2, 'FusedMatMulBiasAct': 2}


BAD = {
    'garbled_op.txt': ("x input\ny re$lu x\n", ":2: cannot read op 're$lu'"),
    'no_op.txt': ("x input\n\n# c\nlonely\n", ":4: expected 'ID OP [INPUT_ID ...]'"),
    'dangling.txt': ("x input\ny relu x\nz add y ghost\n", ":3: node 'z' takes input 'ghost', which is not defined"),
    'cycle.txt': ("x input\na relu x b\nb relu a\n", ":2: cycle through nodes a -> b -> a"),
    'dup.txt': ("x input\nx relu x\n", ":2: node id 'x' is defined twice"),
    'graph.json': ("{}", "unknown graph format '.json'"),
    'broken.onnx': (b"\x08\x07\x12garbage\xff\xff\x00", "not a readable ONNX model"),
    'broken.pt2': (b"PK\x03\x04 not really a zip", "not a readable torch.export program"),
}


@pytest.mark.parametrize('name', sorted(BAD))
def test_cli_bad_files_exit_2_one_line(tmp_path, name):
    body, msg = BAD[name]
    p = tmp_path / name
    p.write_bytes(body) if isinstance(body, bytes) else p.write_text(body)
    with pytest.raises((GraphError, ValueError)): load_graph(p)
    r = run('opscope-graph', str(p))
    assert r.returncode == 2
    assert r.stdout == ''
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and 'Traceback' not in r.stderr, r.stderr
    assert lines[0].startswith(f'opscope-graph: error: {p}') and msg in lines[0], lines[0]


@pytest.mark.slow
def test_cli_missing_file_and_bad_layers(tmp_path):
    r = run('opscope-graph', str(tmp_path / 'nope.onnx'))
    assert (r.returncode, r.stderr.strip()) == (2, f'opscope-graph: error: {tmp_path}/nope.onnx: no such file')
    r = run('opscope-flow', '0', 'moe')
    assert r.returncode == 2 and r.stderr.strip() == 'opscope-flow: error: LAYERS must be 1 to 256 (the model is built and traced in memory), not 0'
