"Masks reach the row statistics, record warns on untapped GEMM FLOPs, the gate's tolerance follows the dtype, plan skips sites its kernels do not fit."
import warnings
import numpy as np, pandas as pd, pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from opscope.recorder import record, eager_gate, gate_tolerance, masked_sketch, GATE_TOL, SDPA_RTOL, SDPA_ATOL
from opscope.sketch import STATS
from opscope.sites import trace
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# --- masks -> the experts' routed rows and the attention products' key operands ---------------------------------------

class _Named(nn.Module):
    "A decoder whose mask input is not named `attention_mask`: recorded plain, or masked through `record(..., attention_mask=)`."
    def __init__(self, m): super().__init__(); self.m = m
    def forward(self, ids, am): return self.m(input_ids=ids, attention_mask=am, use_cache=False).logits


def _left_padded(vocab, seed, B=2, T=6, pad=3):
    ids = torch.randint(2, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids); am[0, :pad] = 0
    return ids, am


def _capture(m, names):
    "Forward hooks keeping the real (not fake) inputs/outputs of the named modules at every eager call."
    from torch._subclasses.fake_tensor import is_fake
    got, hs = {n: [] for n in names}, []
    for n in names:
        def f(mod, i, o, n=n):
            t = o if isinstance(o, torch.Tensor) else o[2] if n.endswith('gate') else o[0]
            if not is_fake(t): got[n].append((tuple(x.detach().clone() for x in i if isinstance(x, torch.Tensor)),
                                             tuple(x.detach().clone() for x in (o if isinstance(o, tuple) else (o,)))))
        hs.append(m.get_submodule(n).register_forward_hook(f))
    return got, hs


def _tap(df, site, role, step=0):
    return df[(df.site == site) & (df.role == role) & (df.step == step)].set_index(['stat', 'idx']).value


@pytest.mark.slow
@pytest.mark.parametrize('arch,impl', [('mixtral', 'grouped_mm'), ('qwen2_moe', 'grouped_mm'), ('mixtral', 'batched_mm')])
def test_expert_rows_are_the_real_tokens_routed_to_them(arch, impl):
    m = tiny_decoder(arch, hidden=24, vocab=96, seed=71)
    if impl != 'grouped_mm': m.set_experts_implementation(impl)
    ids, am = _left_padded(96, 72)
    real = am.reshape(-1).bool()
    got, hs = _capture(m, ['model.layers.0.mlp.gate', 'model.layers.1.mlp.gate'])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        masked = record(_Named(m), [(ids, am)], attention_mask=am)
        plain = record(_Named(m), [(ids, am)])
        ones = record(_Named(m), [(ids, am)], attention_mask=torch.ones_like(am))
    for h in hs: h.remove()
    E = 4
    for layer in (0, 1):
        (x,), (_, _, choice) = got[f'model.layers.{layer}.mlp.gate'][0]    # the router's input (the tokens) and its top-k ids
        op = 'grouped_mm' if impl == 'grouped_mm' else 'bmm'
        base = f'm.model.layers.{layer}.mlp.experts.{op}'
        for e in range(E):
            lhs, raw = _tap(masked, f'{base}.expert{e}', 'lhs'), _tap(plain, f'{base}.expert{e}', 'lhs')
            rows = x[(choice == e).any(-1) & real]                         # the real tokens routed to expert e
            n_all = int((choice == e).sum())
            assert int(lhs.loc['row_energy'].notna().sum()) == len(rows) == int(((choice == e) & real[:, None]).sum())
            assert int(raw.loc['row_energy'].notna().sum()) == n_all        # unmasked: every routed row, padding too
            if len(rows):
                np.testing.assert_allclose(lhs.loc[('mean', 0)], rows.mean().item(), rtol=1e-4, atol=1e-6)
                np.testing.assert_allclose(lhs.loc[('absmax', 0)], rows.abs().max().item(), rtol=1e-5)
                np.testing.assert_allclose(lhs.loc['chan_absmax'].sort_index().to_numpy(), rows.abs().amax(0).numpy(), rtol=1e-5)
                np.testing.assert_allclose(np.sort(lhs.loc['row_energy'].dropna().to_numpy()), np.sort(rows.norm(dim=-1).numpy()), rtol=1e-4)
            out = _tap(masked, f'{base}.expert{e}', 'out').loc['row_energy']
            assert int(out.notna().sum()) == len(rows)
        # the router's own load counts every token it routed (padding too): the top-k tap is the router's choice
        load = masked[(masked.stat == 'expert_load') & masked.site.str.contains(f'layers.{layer}.mlp')].sort_values('idx').value
        assert load.tolist() == torch.bincount(choice.reshape(-1), minlength=E).tolist()
    # an all-ones mask is no mask: the same statistics as the plain recording
    a, b = (d.set_index(['site', 'role', 'stat', 'idx']).value.sort_index() for d in (ones, plain))
    assert a.index.equals(b.index)
    np.testing.assert_allclose(a.to_numpy(), b.to_numpy(), rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.slow
def test_masked_expert_graph_exports_without_host_reads():
    "transformers' own grouped_mm experts module, traced alone: its masked expert taps export and match the eager graph."
    from opscope.recorder import _apply_mask
    from opscope.inject import inject_matmul_stats
    m = tiny_decoder('qwen2_moe', hidden=16, layers=1, vocab=64, seed=73)
    experts = m.model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(74)
    x, am = torch.randn(8, 16, generator=g), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(8)])
    w = torch.rand(8, 2, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        inj = _apply_mask(inject_matmul_stats(trace(experts, x, idx, w), cache_weights=False), am)
        assert sum(getattr(n.target, '__name__', '') == 'routed_groups' for n in inj.graph.nodes) == 2   # one per grouped matmul
        with torch.no_grad():
            prog = torch.export.export(inj, (x, idx, w), strict=False)
            got, ref = prog.module()(x, idx, w)[1], inj(x, idx, w)[1]
    assert all(n.target not in ('item', 'cpu', 'numpy') for n in prog.graph.nodes)
    assert all(torch.allclose(got[k], ref[k], equal_nan=True) for k in ref)
    base = next(k for k in ref if k.endswith('expert0/lhs/row_energy')).rsplit('.expert0', 1)[0]
    real = am.reshape(-1).bool()
    for e in range(4):                                                 # each expert: the real tokens routed to it
        assert int(ref[f'{base}.expert{e}/lhs/row_energy'].isfinite().sum()) == int(((idx == e) & real[:, None]).sum())


def test_value_and_key_operands_leave_padded_keys_out():
    "GPT-2 (no rotary embedding: K and V are c_attn's output) through record: V's rows and Kᵀ's columns are the keys."
    m = tiny_decoder('gpt2', hidden=32, vocab=96, seed=75)
    ids, am = _left_padded(96, 76)
    got, hs = _capture(m, ['transformer.h.0.attn.c_attn'])
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        df = record(_Named(m), [(ids, am)], attention_mask=am)
        plain = record(_Named(m), [(ids, am)])
    for h in hs: h.remove()
    qkv = got['transformer.h.0.attn.c_attn'][0][1][0]                  # (B, T, 3·hidden)
    B, T, H = 2, 6, m.config.n_head
    k, v = (t.unflatten(-1, (H, -1)).transpose(1, 2) for t in qkv.split(32, -1)[1:])   # (B, H, T, D)
    real = am.bool()
    base = 'm.transformer.h.0.attn'
    names = sorted({s for s in df.site.unique() if s.startswith(base + '.matmul')})
    qk, pv = names                                                     # Q·Kᵀ, then P·V
    V, Vraw = _tap(df, pv, 'rhs'), _tap(plain, pv, 'rhs')
    assert int(V.loc['row_energy'].isna().sum()) == H * int((~real).sum())    # a padded key is no row of V
    assert Vraw.loc['row_energy'].notna().all()
    vr = v.transpose(1, 2)[real]                                        # (real keys, H, D)
    np.testing.assert_allclose(V.loc[('mean', 0)], vr.mean().item(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(V.loc['chan_absmax'].sort_index().to_numpy(), vr.abs().amax((0, 1)).numpy(), rtol=1e-5)
    Kt = _tap(df, qk, 'rhs')                                            # Kᵀ: (B, H, D, keys), keys are its channels
    kr = k.transpose(1, 2)[real]
    np.testing.assert_allclose(Kt.loc[('mean', 0)], kr.mean().item(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(Kt.loc[('absmax', 0)], kr.abs().max().item(), rtol=1e-5)
    per_key = torch.where(real[:, None, :, None], k, 0).abs().amax((0, 1, 3))   # a key padded in one sequence counts in the other
    np.testing.assert_allclose(Kt.loc['chan_absmax'].sort_index().to_numpy(), per_key.numpy(), rtol=1e-5)
    np.testing.assert_allclose(Kt.loc['row_energy'].sort_index().to_numpy(),
                               torch.where(real[:, None, :, None], k, 0).norm(dim=2).reshape(-1).numpy(), rtol=1e-4)
    P = _tap(df, pv, 'lhs')                                             # probabilities: real queries × real keys
    assert int(P.loc['row_energy'].isna().sum()) == H * int((~real).sum())
    Praw = _tap(plain, pv, 'lhs')
    assert P.loc[('density', 0)] > Praw.loc[('density', 0)]             # the padded keys' zero probabilities are not sparsity


def test_decode_key_value_operands_leave_unfilled_cache_slots_out():
    m = tiny_decoder('llama', hidden=40, vocab=112, seed=77)
    ids, am = _left_padded(112, 78, T=5, pad=2)
    N, (B, T) = 3, ids.shape
    L, H = T + N - 1, m.config.num_attention_heads
    got, hs = _capture(m, ['model.layers.0.self_attn.v_proj'])
    toks, df = record_generate(m, ids, N, attention_mask=am, gate_every=True)
    for h in hs: h.remove()
    assert torch.equal(toks, m.generate(ids, attention_mask=am, max_new_tokens=N, min_new_tokens=N, do_sample=False))
    vs = [o[0] for _, o in got['model.layers.0.self_attn.v_proj']]      # v_proj's output at each eager call (B, n, kv·D)
    mask = torch.cat([am, am.new_ones(B, N - 1)], 1).bool()
    base = 'model.layers.0.self_attn'
    qk, pv = sorted({s for s in df.site.unique() if s.startswith(base + '.matmul')})
    for step in range(N):
        filled = T + step                                              # slots written after this step's call
        real = mask[:, :filled]
        V, Kt = _tap(df, pv, 'rhs', step), _tap(df, qk, 'rhs', step)
        assert len(V.loc['row_energy']) == B * H * L                   # the whole cache is the operand ...
        assert int(V.loc['row_energy'].notna().sum()) == H * int(real.sum())   # ... its real, written slots the rows
        assert V.loc[('density', 0)] == 1 and Kt.loc[('density', 0)] == 1      # unfilled zeros are not sparsity
        assert Kt.loc['chan_absmax'].sort_index().isna().tolist() == [not real[:, s].any().item() if s < filled else True for s in range(L)]
        vr = torch.cat(vs[:step + 1], 1)[real]                         # every real token's value so far
        np.testing.assert_allclose(V.loc[('mean', 0)], vr.mean().item(), rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(V.loc[('absmax', 0)], vr.abs().max().item(), rtol=1e-5)
        S = _tap(df, qk, 'out', step).loc['chan_absmax'].sort_index()     # scores: a column per cache slot
        assert S.isna().sum() == L - filled                          # unwritten slots: no column


class _BmmAttention(nn.Module):
    "Attention over (batch·heads, tokens, head_dim) with torch.bmm, as older code writes it: a key layout the masks cannot reach."
    def __init__(self, d=16, h=2):
        super().__init__(); self.h, self.qkv, self.o = h, nn.Linear(d, 3 * d), nn.Linear(d, d)
    def forward(self, x, attention_mask):
        B, T, D = x.shape
        q, k, v = (t.reshape(B, T, self.h, -1).transpose(1, 2).reshape(B * self.h, T, -1) for t in self.qkv(x).chunk(3, -1))
        s = torch.bmm(q, k.transpose(1, 2)) / (D // self.h) ** 0.5
        s = s.masked_fill(attention_mask.repeat_interleave(self.h, 0)[:, None, :] == 0, float('-inf'))
        return self.o(torch.bmm(torch.softmax(s, -1), v).reshape(B, self.h, T, -1).transpose(1, 2).reshape(B, T, D))


def _mask_warnings(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        fn()
    return [str(x.message) for x in w if str(x.message).startswith('attention_mask:')]


@pytest.mark.slow
def test_taps_a_mask_cannot_reach_are_named_in_one_warning():
    "Padding the key masks cannot remove (an unknown attention layout) is said, not silently counted; known layouts say nothing."
    torch.manual_seed(81)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(82))
    am = torch.ones(2, 6, dtype=torch.long); am[0, :2] = 0
    said = _mask_warnings(lambda: record(_BmmAttention().eval(), [dict(x=x, attention_mask=am)]))
    assert len(said) == 1 and 'the keys of' in said[0] and 'sketched whole' in said[0], said
    for arch in ('gpt2', 'mixtral'):
        m = tiny_decoder(arch, seed=83)
        ids, am2 = _left_padded(m.config.vocab_size, 84)
        assert _mask_warnings(lambda: record(_Named(m), [(ids, am2)], attention_mask=am2)) == [], arch
