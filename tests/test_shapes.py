"Tier 3 costs: agreement with FlopCounterMode and torchvision's published figures, roofline, and opscope-shapes."
import os, subprocess, time
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from opscope import zoo
from opscope.sites import trace
from opscope.shapes import (op_costs, roofline, roofline_totals, gemm_histogram, measure_machine, shapes_model,
                            published_gmacs, GEMM_KINDS, COST_COLUMNS)

def _counter(m, *x, **kw):
    with torch.no_grad(), FlopCounterMode(display=False) as fc: m(*x, **kw)
    return fc.get_total_flops()

def _gemm_flops(c): return int(c[c.kind.isin(GEMM_KINDS)].flops.sum())

@pytest.mark.parametrize('name', ['mlp', 'transformer', 'moe', 'mnist'])
def test_zoo_totals_match_flop_counter(name):
    m, ins = shapes_model(name, batch=4)
    c = op_costs(m, *ins)
    assert list(c.columns) == COST_COLUMNS
    assert (c.flops == 2 * c.macs)[c.kind.isin(GEMM_KINDS)].all()
    assert _gemm_flops(c) == _counter(m, *ins)

def test_graph_module_matches_module():
    m = zoo.moe(layers=1)
    x = zoo.example_input(m, batch=2, tokens=8)
    assert op_costs(trace(m, x), x).flops.sum() == op_costs(m, x).flops.sum()

def test_conv_net_matches_flop_counter():
    m = shapes_model('resnet18', device='cpu')[0]
    x = torch.randn(1, 3, 32, 32)
    assert _gemm_flops(op_costs(m, x)) == _counter(m, x)

@pytest.mark.parametrize('name', ['resnet18', 'mobilenet_v2', 'vit_b_16'])
def test_torchvision_macs_match_published(name):
    m, ins = shapes_model(name)
    assert abs(op_costs(m, *ins).macs.sum() / 1e9 / published_gmacs(name) - 1) < 0.01

def test_fused_attention_counted_where_the_counter_misses_it():
    mha = nn.MultiheadAttention(64, 8, batch_first=True).eval()
    x = torch.randn(2, 16, 64)
    c = op_costs(mha, x, x, x, need_weights=False)
    B, L, E = 2, 16, 64
    assert c.macs.sum() == B * L * E * 3 * E + 2 * B * L * L * E + B * L * E * E
    assert _counter(mha, x, x, x, need_weights=False) == 0
    q = torch.randn(2, 4, 16, 8)
    class S(nn.Module):
        def forward(self, q): return F.scaled_dot_product_attention(q, q, q, is_causal=True)
    c = op_costs(S(), q)
    assert c.flops.sum() == 4 * 8 * 16 * 16 * 8 and _counter(S(), q) == 0

def test_bytes_follow_dtype():
    lin = nn.Linear(32, 16)
    x = torch.randn(4, 32)
    b32 = op_costs(lin, x).bytes.sum()
    assert op_costs(lin.half(), x.half()).bytes.sum() * 2 == b32 == 4 * (4 * 32 + 16 * 32 + 16 + 4 * 16)

def test_roofline_classifies_and_shares():
    m, ins = shapes_model('transformer', batch=2)
    r = roofline(op_costs(m, *ins), peak_flops=1e11, bandwidth=1e10)
    assert r.attrs['ridge'] == 10
    assert ((r.intensity >= 10) == (r.bound == 'compute')).all()
    assert abs(r.share.sum() - 1) < 1e-9 and abs(roofline_totals(r).share.sum() - 1) < 1e-9
    h = gemm_histogram(r)
    assert h.flops.is_monotonic_decreasing and h.calls.sum() == (r.kind.isin(GEMM_KINDS)).sum()

def test_measure_machine_is_consistent():
    mm = measure_machine()     # how long it takes is not asserted: a loaded CI machine is slower
    assert mm['peak_flops'] > 0 and mm['bandwidth'] > 0 and mm['ridge'] == mm['peak_flops'] / mm['bandwidth']

def _cli(*args):
    return subprocess.run(['opscope-shapes', *args], capture_output=True, text=True, env={**os.environ, 'OMP_NUM_THREADS': '1'})

@pytest.mark.slow
def test_cli_zoo_and_torchvision():
    out = _cli('mnist', '--top', '3', '--peak_flops', '1e11', '--bandwidth', '1e10')
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith('machine: peak 100.00 GFLOP/s, bandwidth 10.00 GB/s, ridge 10.0 FLOP/byte')
    assert ' fc1 ' in out.stdout and 'top 3 GEMM shapes' in out.stdout
    out = _cli('resnet18', '--top', '2')
    assert out.returncode == 0, out.stderr
    assert '(1.81 GMAC)' in out.stdout

@pytest.mark.slow
def test_cli_unknown_model_is_one_line():
    out = _cli('resnet19')
    assert out.returncode == 2 and out.stdout == ''
    assert len(out.stderr.splitlines()) == 1 and "unknown model 'resnet19'" in out.stderr
