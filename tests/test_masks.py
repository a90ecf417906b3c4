"Masks reach the row statistics, record warns on untapped GEMM FLOPs, the gate's tolerance follows the dtype, plan skips sites its kernels do not fit."
import warnings
import numpy as np, pandas as pd, pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from opscope.recorder import record, eager_gate, gate_tolerance, masked_sketch, GATE_TOL, SDPA_RTOL, SDPA_ATOL
from opscope.inject import STATS, trace
from opscope.miner import mine, tap_features, TOKEN_ROWS90_MAX
from opscope.partials import row_steps
from opscope.scale import mine_duckdb
from opscope.runners import record_generate, tiny_decoder
from opscope.plan import plan, specialize, format_plan
from opscope.shapes import coverage, tapped_share, shapes_model, COVERAGE_MIN

warnings.filterwarnings('ignore', message='.*requires gradient.*')
MACHINE = dict(peak_flops=1e11, bandwidth=1e10, ridge=10.)   # a fixed machine: plan measures nothing about it


# --- masks -> row statistics ----------------------------------------------------------------------------------------

def test_minilm_padded_tokens_left_out_of_projection_and_attention_rows():
    from opscope.zoo import load_minilm
    model, tok = load_minilm()
    enc = dict(tok(['padding is not data', 'a much longer second sentence than the first one, with commas'],
                   padding=True, return_tensors='pt'))
    real = enc['attention_mask'].bool()
    assert (~real).sum() >= 5
    seen = {}
    def keep(name, which):
        def hook(m, i, o): seen[name] = (i[0] if which == 'in' else o).detach().clone()   # returns None: the output stays
        return hook
    hooks = [model.encoder.layer[1].attention.self.query.register_forward_hook(keep('q', 'in')),
             model.encoder.layer[1].intermediate.dense.register_forward_hook(keep('up', 'out'))]
    with torch.no_grad(): model(**enc)
    for h in hooks: h.remove()
    df = record(model, [enc], run_id='pad')
    def tap(site, role): return df[(df.site == site) & (df.role == role)].set_index(['stat', 'idx']).value
    for site, role, x in (('encoder.layer.1.attention.self.query', 'lhs', seen['q']), ('encoder.layer.1.intermediate.dense', 'out', seen['up'])):
        t = tap(site, role)
        e = t.loc['row_energy'].sort_index().to_numpy()
        assert np.isnan(e).tolist() == (~real).reshape(-1).tolist()        # NaN exactly at the padded tokens
        np.testing.assert_allclose(e[~np.isnan(e)], x[real].norm(dim=-1).numpy(), rtol=1e-4)
        np.testing.assert_allclose(t.loc[('mean', 0)], x[real].mean().item(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(t.loc[('absmax', 0)], x[real].abs().max().item(), rtol=1e-5)
        np.testing.assert_allclose(t.loc['chan_absmax'].sort_index().to_numpy(), x[real].abs().amax(0).numpy(), rtol=1e-5)
        assert t.loc[('numel', 0)] == x.numel()                            # numel stays the tensor's element count
    qk = tap('encoder.layer.1.attention.self.matmul', 'out').loc['row_energy']   # (batch, heads, queries) rows
    H = model.config.num_attention_heads
    assert int(qk.isna().sum()) == H * int((~real).sum())
    f = tap_features(df[(df.site == 'encoder.layer.1.attention.self.query') & (df.role == 'lhs')])
    assert f.rows.item() == real.sum()                                     # the miner counts real tokens only
    assert tap('encoder.layer.1.attention.self.key', 'rhs').loc['row_energy'].notna().all()   # a weight: sketched whole


def test_mask_reaches_a_model_without_mask_input_and_is_device_code():
    torch.manual_seed(31)
    lin = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))
    x = torch.randn(3, 7, 6, generator=torch.Generator().manual_seed(32))
    am = torch.ones(3, 7, dtype=torch.long); am[1, :4] = 0; am[2, 6:] = 0
    df = record(lin, [x, x], attention_mask=am)
    lhs = df[(df.site == '0') & (df.role == 'lhs')]
    for step in (0, 1):
        e = lhs[(lhs.step == step) & (lhs.stat == 'row_energy')].sort_values('idx').value
        assert e.isna().sum() == 5
    dens = df[(df.site == '2') & (df.role == 'lhs') & (df.stat == 'density') & (df.step == 0)].value.item()
    h = torch.relu(lin[0](x))
    assert abs(dens - (h[am.bool()] != 0).float().mean().item()) < 1e-6
    # the graph holds no host sync: the masked sketch is plain torch code and exports
    prog = torch.export.export(_MaskedSketch(), (x, am), strict=False)
    assert all(n.target not in ('item', 'cpu', 'numpy') for n in prog.graph.nodes)
    with pytest.raises(ValueError, match=r'must be \(batch, tokens\)'): record(lin, [x], attention_mask=am[0])


class _MaskedSketch(nn.Module):
    def forward(self, x, mask): return masked_sketch(x, mask)


def test_generate_prefill_padding_masked_decode_rows_all_counted():
    m = tiny_decoder('llama', hidden=40, vocab=112, seed=13)
    ids = torch.randint(2, 112, (2, 5), generator=torch.Generator().manual_seed(33)); am = torch.ones_like(ids); am[1, :3] = 0
    toks, df = record_generate(m, ids, 3, attention_mask=am)
    assert torch.equal(toks, m.generate(ids, attention_mask=am, max_new_tokens=3, min_new_tokens=3, do_sample=False))
    q = df[(df.site == 'model.layers.0.self_attn.q_proj') & (df.role == 'lhs') & (df.stat == 'row_energy')]
    pre = q[q.step == 0].sort_values('idx').value
    assert pre.isna().tolist() == (am == 0).reshape(-1).tolist()         # the prefill's padded prompt tokens
    assert q[q.step > 0].value.notna().all()                              # a decode step's tokens are all real
    km = df[(df.step == 0) & (df.stat == 'key_mass') & (df.site == 'model.layers.0.self_attn.sdpa')].value
    assert abs(km.sum() - m.config.num_attention_heads * int(am.sum())) < 1e-3   # padded query rows carry no mass


def test_nan_rows_are_not_rows_in_every_engine():
    "Ten real tokens among ninety padded ones are ten rows, not token sparsity, in pandas, partials and DuckDB."
    torch.manual_seed(43)
    lin = nn.Linear(4, 3)
    g = torch.Generator().manual_seed(44)
    xs, masks = [], []
    for step in range(3):
        xs.append(torch.randn(2, 50, 4, generator=g))
        am = torch.zeros(2, 50); am[0, step:step + 6] = 1; am[1, :4] = 1; masks.append(am)
    sk = record(lin, xs, attention_mask=masks)
    lhs = sk[sk.role == 'lhs']
    f = tap_features(lhs)
    assert f.rows.item() == 10 and f.rows90.item() > TOKEN_ROWS90_MAX      # counted over the ninety NaN rows it would be ~0.08
    rs = row_steps(lhs)
    assert (rs.rows == 10).all() and np.allclose(rs.rows90.mean(), f.rows90.item())
    for name, engine in (('pandas', mine), ('duckdb', mine_duckdb)):
        assert not (engine(sk).exploit == 'token-sparsity').any(), name


def test_engines_agree_on_a_padded_moe_recording():
    m = tiny_decoder('qwen2_moe', hidden=40, vocab=112, seed=15)
    ids = torch.randint(2, 112, (2, 5), generator=torch.Generator().manual_seed(34)); am = torch.ones_like(ids); am[0, :2] = 0
    _, df = record_generate(m, ids, 4, attention_mask=am)
    assert df[df.stat == 'row_energy'].value.isna().any()
    strip = lambda f: f.drop(columns='detail').sort_values(['site', 'role', 'exploit', 'idx']).reset_index(drop=True)
    a, b = mine(df), mine_duckdb(df)
    pd.testing.assert_frame_equal(strip(a)[['site', 'role', 'exploit', 'idx']], strip(b)[['site', 'role', 'exploit', 'idx']])


# --- record warns on untapped GEMM FLOPs --------------------------------------------------------------------------------

class _ResLikeWithOpaqueAttention(nn.Module):
    "A resnet-like stem and block, then an attention pooling opscope cannot decompose (learned key/value biases)."
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.pool = nn.MultiheadAttention(16, 2, add_bias_kv=True)
        self.fc = nn.Linear(16, 5)
    def forward(self, x):
        h = self.stem(x); h = torch.relu(h + self.block(h))
        t = h.flatten(2).permute(2, 0, 1)                      # (positions, batch, channels)
        return self.fc(self.pool(t, t, t, need_weights=False)[0].mean(0))


def _coverage_warnings(model, batches, **kw):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always'); record(model, batches, **kw)
    return [str(x.message) for x in w if 'GEMM FLOPs' in str(x.message)]


def test_record_warns_once_naming_the_untapped_op():
    torch.manual_seed(35)
    m, x = _ResLikeWithOpaqueAttention().eval(), torch.randn(2, 3, 16, 16)
    share = tapped_share(coverage(m, x))
    assert share < COVERAGE_MIN
    msgs = _coverage_warnings(m, [x, x])
    assert len(msgs) == 1 and '\n' not in msgs[0]                      # one line, once per record (not per step)
    assert 'untapped: pool (' in msgs[0] and f'{share:.1%}' in msgs[0]
    r18 = shapes_model('resnet18', device='cpu')[0]
    assert _coverage_warnings(r18, [torch.randn(1, 3, 32, 32)], taps='matmul') == []   # every convolution tapped


@pytest.mark.parametrize('name', ['mobilenet_v2', 'vit_b_16'])
def test_torchvision_tapped_share(name):
    import torchvision
    m = torchvision.models.vit_b_16(weights=None, image_size=32).eval() if name == 'vit_b_16' else shapes_model(name, device='cpu')[0]
    assert tapped_share(coverage(m, torch.randn(1, 3, 32, 32))) >= COVERAGE_MIN


# --- the gate's tolerance follows the dtype -------------------------------------------------------------------------------

class _Attn(nn.Module):
    def __init__(self): super().__init__(); self.qkv, self.o = nn.Linear(32, 96), nn.Linear(32, 32)
    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 4, 8)).permute(2, 0, 3, 1, 4)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))


def test_bf16_decomposed_sdpa_passes_the_gate():
    torch.manual_seed(36)
    m = _Attn().eval().to(torch.bfloat16)
    xs = [torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (37, 38, 39)]
    gm = trace(m, xs[0])
    from opscope.recorder import inject_taps
    inj = inject_taps(gm, ('matmul', 'softmax', 'topk'), 64)
    with torch.no_grad(): diff = (inj(xs[0])[0].float() - m(xs[0]).float()).abs().max().item()
    assert diff > SDPA_ATOL                                              # the old fixed tolerance would refuse it
    assert record(m, xs, gate_every=True).step.nunique() == 3
    assert gate_tolerance(torch.bfloat16) == GATE_TOL[torch.bfloat16] and gate_tolerance(torch.float32) == (SDPA_RTOL, SDPA_ATOL)
    half = tiny_decoder('llama', hidden=40, vocab=112, seed=16).to(torch.bfloat16)
    ids = torch.randint(2, 112, (2, 4), generator=torch.Generator().manual_seed(40))
    _, df = record_generate(half, ids, 3, gate_every=True)
    assert df.step.nunique() == 3
    y = xs[0]                                                            # unchanged graph: still bit for bit
    with pytest.raises(AssertionError, match='does not reproduce'):
        eager_gate(lambda: y, lambda: ((y.float() * (1 + 2 ** -7)).bfloat16(), {}), decomposed=0)


# --- plan on sites that are not linear layers ---------------------------------------------------------------------------

class _Grouped(nn.Module):
    def __init__(self): super().__init__(); self.w = nn.Parameter(torch.randn(3, 8, 4))
    def forward(self, x, offs): return torch._grouped_mm(x, self.w, offs=offs)


def test_plan_skips_convolutions_and_experts_with_a_reason():
    torch.manual_seed(41)
    g = torch.Generator().manual_seed(42)
    conv = nn.Sequential(nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 3, 1)).eval()
    imgs = [torch.rand(3, 2, 5, 5, generator=g) * (torch.rand(3, 2, 5, 5, generator=g) < 0.3) for _ in range(3)]
    p = plan(record(conv, imgs, run_id='conv'), machine=MACHINE)
    assert [s['site'] for s in p.attrs['skipped']] == ['0'] and 'implicit GEMM' in p.attrs['skipped'][0]['reason']
    assert '0' not in set(p.site) and '2' in set(p.site)                # a 1×1 convolution is its GEMM: planned
    row = p[p.site == '2'].head(1).assign(guard='lhs.density <= 1')
    with pytest.raises(NotImplementedError, match='not a conv site'): specialize(trace(conv, imgs[0]), row)
    xs = [torch.randn(10, 8, generator=g) for _ in range(3)]
    offs = torch.tensor([3, 6, 10], dtype=torch.int32)
    pe = plan(record(_Grouped().eval(), [(x, offs) for x in xs], run_id='experts'), machine=MACHINE)
    assert len(pe) == 0 and {s['site'] for s in pe.attrs['skipped']} == {f'grouped_mm.expert{e}' for e in range(3)}
    assert all('routed' in s['reason'] for s in pe.attrs['skipped'])
    text = format_plan(pe)
    assert text.startswith('nothing to plan') and 'skipped grouped_mm.expert0 (' in text
