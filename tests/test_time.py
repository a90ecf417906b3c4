"Sequence and time: the decode-like run, real MNIST, and the cross-step miner (issue 3)."
import re
import pandas as pd, pytest, torch
from opscope.zoo import mnist_mlp, mnist_batches, seq_model, stepped_sequence, mlp
from opscope.recorder import record, read_sketches
from opscope.miner import mine, cross_step


@pytest.mark.slow
def test_mnist_cli_finds_border_and_relu_sparsity(tmp_path, cli):
    r = cli('opscope-mnist', str(tmp_path / 'm.csv'), '12')
    assert r.returncode == 0, r.stderr
    r = cli('opscope-mine', str(tmp_path / 'm.csv'), '--out', str(tmp_path / 'f.csv'))
    assert r.returncode == 0, r.stderr
    lines = {tuple(l.split()[2:4]): l for l in r.stdout.splitlines()}
    fc1 = lines[('fc1', 'lhs')]
    dens = float(re.search(r'density (\S+)', fc1).group(1))
    assert 0.1 < dens < 0.3                              # real MNIST: well under 0.3 of pixels are ink
    assert 'sparse-GEMM (skip' in fc1 and 'channels zero in every step' in fc1
    assert 'sparse-GEMM (skip' in lines[('fc2', 'lhs')]   # post-ReLU
    for site in ('fc1', 'fc2', 'fc3'):
        assert 'stationary' in lines[(site, 'rhs')]
        for role in ('lhs', 'out'): assert 'drift' in lines[(site, role)] and 'stationary' not in lines[(site, role)]
    f = pd.read_csv(tmp_path / 'f.csv')
    dead = sorted(f.query("site == 'fc1' and role == 'lhs' and exploit == 'dead-channels'").idx)
    imgs = torch.cat(mnist_batches(12))                 # the same images, computed independently
    assert dead == torch.nonzero((imgs == 0).all(0)).flatten().tolist()
    skip = 1 - f.query("site == 'fc1' and role == 'lhs' and exploit == 'sparse-gemm'").value.item()
    assert abs(skip - (imgs == 0).float().mean().item()) < 1e-6


@pytest.mark.slow
def test_seq_cli_stationary_weights_drifting_coherent_activations(tmp_path, cli):
    r = cli('opscope-seq', str(tmp_path / 's.parquet'), '16')
    assert r.returncode == 0, r.stderr
    df = read_sketches(tmp_path / 's.parquet')
    assert df.step.nunique() == 16
    found = mine(df)
    cs = found.attrs['cross_step'].reset_index()
    weight = (cs.role == 'rhs') & ~cs.site.str.contains('matmul')
    assert cs[weight].stationary.all() and len(cs[weight]) == 12
    assert not cs[~weight].stationary.any()
    st = found[found.exploit == 'stationary']
    assert set(zip(st.site, st.role)) == set(zip(cs[weight].site, cs[weight].role))   # once per site and role
    coh = found[(found.exploit == 'temporal-coherence') & found.detail.str.contains('across calls')]
    assert len(coh) >= 0.8 * (~weight).sum()
    r = cli('opscope-mine', str(tmp_path / 's.parquet'))
    assert 'consecutive steps coherent' in r.stdout and 'stationary' in r.stdout


def test_changed_weight_is_not_stationary():
    m = mlp(layers=2, d_in=32, hidden=16, d_out=8)
    def batches():
        for i in range(6):
            if i == 4:
                with torch.no_grad(): m.layers[1].weight.mul_(1.5)
            yield torch.randn(8, 32, generator=torch.Generator().manual_seed(i))
    found = mine(record(m, batches()))
    st = set(found[found.exploit == 'stationary'].site)
    assert 'layers.0' in st and 'layers.1' not in st


def test_independent_batches_not_called_coherent():
    df = record(mnist_mlp(), mnist_batches(12, seed=5))
    found = mine(df)
    assert not found.detail.str.contains('across calls').any()


@pytest.mark.slow
def test_bad_counts(tmp_path, cli):
    for cmd, arg in (('opscope-seq', '1'), ('opscope-mnist', '0')):
        r = cli(cmd, str(tmp_path / 'x.csv'), arg)
        assert r.returncode == 2 and r.stderr.count('\n') == 1 and ' must be ' in r.stderr
        assert not (tmp_path / 'x.csv').exists()
