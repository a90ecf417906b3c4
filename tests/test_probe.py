"Tier 2 probes: safetensors I/O (no pickle), site dumps, probe definitions, and the opscope-probe console script."
import math, os, pickle, subprocess, sys
from pathlib import Path
import pytest, torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st
from opscope import zoo
from opscope.probe import (save_tensors, load_tensors, dump_sites, effective_rank, rank_at_energy, two_four,
                           quant_error, quantize, cardinality, probe, model_tensors)

def _spectrum(s, m, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(m, len(s), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(n, len(s), generator=g, dtype=torch.float64))[0]
    return u @ torch.diag(torch.as_tensor(s, dtype=torch.float64)) @ v.T

class _Payload:
    "Unpickling this runs code: it would create the marker file."
    marker = None
    def __reduce__(self): return (Path.touch, (Path(self.marker),))

def test_roundtrip_keeps_dtypes_and_values(tmp_path):
    ts = {'f': torch.randn(4, 8), 'h': torch.randn(3, dtype=torch.float16), 'i': torch.arange(6, dtype=torch.int64).view(2, 3)}
    back = load_tensors(save_tensors(tmp_path / 't.safetensors', ts))
    assert set(back) == set(ts)
    for k in ts: assert back[k].dtype == ts[k].dtype and torch.equal(back[k], ts[k])

@pytest.mark.parametrize('writer', ['pickle', 'torch.save'])
def test_malicious_pickle_is_refused_without_running_it(tmp_path, writer):
    marker = tmp_path / 'pwned'
    p = _Payload(); p.marker = str(marker)
    f = tmp_path / 'evil.safetensors'  # the extension lies
    if writer == 'pickle': f.write_bytes(pickle.dumps(p))
    else: torch.save({'w': p}, f)
    with pytest.raises(ValueError, match='never unpickles'): load_tensors(f)
    assert not marker.exists()

def test_truncated_file_is_a_clear_error(tmp_path):
    f = save_tensors(tmp_path / 'x.safetensors', {'w': torch.randn(64, 64)})
    f.write_bytes(f.read_bytes()[:200])
    with pytest.raises(ValueError, match=str(f.name)): load_tensors(f)

def test_dump_sites_matches_the_model(tmp_path):
    m = zoo.transformer(layers=1)
    x = zoo.example_input(m, batch=2, tokens=8)
    d = dump_sites(m, x, ['layers.0.ffn.up', 'layers.0.attn.matmul'], tmp_path / 'd.safetensors')
    back = load_tensors(tmp_path / 'd.safetensors')
    assert set(back) == {f'{s}/{r}' for s in ('layers.0.ffn.up', 'layers.0.attn.matmul') for r in ('lhs', 'rhs', 'out')}
    up = m.layers[0].ffn.up
    assert torch.equal(back['layers.0.ffn.up/rhs'], up.weight)
    torch.testing.assert_close(back['layers.0.ffn.up/out'], F.linear(back['layers.0.ffn.up/lhs'], up.weight, up.bias))
    torch.testing.assert_close(back['layers.0.attn.matmul/out'], back['layers.0.attn.matmul/lhs'] @ back['layers.0.attn.matmul/rhs'])
    with pytest.raises(KeyError, match='layers.0.ffn.up'): dump_sites(m, x, ['nope'])

@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(0.01, 10), min_size=1, max_size=12))
def test_effective_rank_is_exp_entropy(s):
    p = torch.tensor(s, dtype=torch.float64); p = p / p.sum()
    expected = math.exp(-(p * p.log()).sum().item())
    assert math.isclose(effective_rank(_spectrum(s, 20, 16)), expected, rel_tol=1e-6)

@settings(max_examples=25, deadline=None)
@given(st.integers(1, 16), st.integers(0, 1000))
def test_rank_at_energy_of_planted_rank(r, seed):
    w = _spectrum([1.] * r, 40, 32, seed)
    f = rank_at_energy(w, 0.999)
    assert f.rank == r and math.isclose(f.saving, 1 - r * 72 / (40 * 32))

@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000))
def test_two_four_bounds_and_exact(seed):
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed))
    kept = two_four(w).kept
    assert 0.5 <= kept <= 1
    pruned = w.abs().reshape(-1, 4).topk(2, 1).values.sum() / w.abs().sum()
    assert math.isclose(kept, pruned.item(), rel_tol=1e-6)
    mask = torch.zeros(8, 4, 4); mask[..., :2] = 1
    assert two_four(w * mask.reshape(8, 16)).kept == 1.0

def test_quant_error_definition():
    w = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    for bits in (8, 4):
        q = quantize(w, bits)
        assert len(torch.unique(q)) <= 2 ** bits - 1
        expected = 10 * math.log10(w.double().pow(2).sum() / (w - q).double().pow(2).sum())
        assert math.isclose(quant_error(w, bits), expected, rel_tol=1e-6)
    assert quant_error(w, 8) > quant_error(w, 4) + 20
    assert quant_error(w, 8, per_channel=True) >= quant_error(w, 8)

def test_cardinality_and_large_tensor_sampling():
    assert cardinality(torch.tensor([1., 1., 2., -3.])).distinct == 3
    big = zoo.make_tensor('lowrank', (30_000, 128), seed=0)
    res = probe({'big': big}).set_index('probe')
    assert res.loc['rank@99%', 'value'] == zoo.LOWRANK_RANK
    assert 'sample of 4,096 of 30,000 rows' in res.loc['effective_rank', 'verdict']

def test_probe_counts_nonfinite():
    w = torch.randn(8, 8); w[0, :3] = float('inf'); w[1, 0] = float('nan')
    res = probe({'w': w}).set_index('probe')
    assert res.loc['nonfinite', 'value'] == 4
    assert math.isfinite(res.loc['effective_rank', 'value'])

def _cli(*args, cwd=None):
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    return subprocess.run(['opscope-probe', *args], capture_output=True, text=True, env=env, cwd=cwd)

def test_cli_transformer_with_dump(tmp_path):
    out = _cli('--model', 'transformer', '--batch', '16', '--dump', str(tmp_path / 'd.safetensors'))
    assert out.returncode == 0, out.stderr
    assert 'w/layers.0.attn.q.weight' in out.stdout and 'a/layers.0.attn.matmul' in out.stdout and 'verdicts:' in out.stdout
    back = load_tensors(tmp_path / 'd.safetensors')
    assert 'w/layers.1.ffn.down.weight' in back and back['a/layers.0.ffn.up'].shape == (2, 32, 64)

def test_cli_bad_model_leaves_no_file(tmp_path):
    out = _cli('--model', 'resnet', '--dump', str(tmp_path / 'd.safetensors'))
    assert out.returncode == 2
    assert out.stderr.splitlines() == ["opscope-probe: error: unknown model 'resnet'; choose one of transformer, mnist, minilm"]
    assert list(tmp_path.iterdir()) == []

@pytest.mark.slow
def test_cli_minilm_reports_effective_ranks():
    out = _cli('--model', 'minilm', '--batch', '4')
    assert out.returncode == 0, out.stderr
    lines = {l.split()[0]: l.split() for l in out.stdout.splitlines() if l.startswith('w/')}
    erank = float(lines['w/encoder.layer.0.attention.self.query.weight'][1])
    assert 100 < erank < 384  # a real trained 384x384 weight: below the full rank, not degenerate
    assert 'svd on a seeded sample of 4,096 of 30,522 rows' in out.stdout
