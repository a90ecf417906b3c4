"Coverage: convolutions, nn.MultiheadAttention, SDPA and MoE experts as tapped GEMM sites; one site name everywhere."
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from opscope import zoo
from opscope.sketch import STATS
from opscope.sites import trace, matmul_sites, infer_sites, site_names
from opscope.lower import decompose_attention, SDPA_RTOL, SDPA_ATOL
from opscope.inject import inject_matmul_stats, inject_infer_stats, gate
from opscope.shapes import op_costs, coverage, tapped_share, coverage_warning, shapes_model, GEMM_KINDS, COVERAGE_MIN

def _stats(inj, *x, **kw):
    with torch.no_grad(): return inj(*x, **kw)[1]

def _primary(y): return y.logits if hasattr(y, 'logits') else y

# --- convolutions -------------------------------------------------------------------------------------------------

class Convs(nn.Module):
    "Every conv form: modules (1d/2d/3d, transposed, grouped) and functional calls."
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv1d(3, 6, 3, padding=1), nn.Conv2d(3, 8, 3, stride=2, groups=1)
        self.c3, self.t2 = nn.Conv3d(3, 4, 2), nn.ConvTranspose2d(8, 5, 2, stride=2)
        self.g2 = nn.Conv2d(8, 8, 3, padding=1, groups=4)
        self.w = nn.Parameter(torch.randn(7, 3, 3, 3))
    def forward(self, x):
        a = self.c1(x.flatten(2))
        b = self.t2(self.g2(self.c2(x)))
        c = self.c3(x.unsqueeze(2).expand(-1, -1, 2, -1, -1))
        d = F.conv2d(x, self.w, padding=1)
        return a.sum() + b.sum() + c.sum() + d.sum()

@pytest.mark.parametrize('how', ['fx', 'export'])
def test_conv_forms_are_sites_and_gate_bit_identical(how):
    torch.manual_seed(21)
    m, x = Convs().eval(), torch.randn(2, 3, 10, 10)
    gm = trace(m, x, how=how)
    sites = [s for s in matmul_sites(gm) if s.kind == 'conv']
    assert len(sites) == 6
    y, stats = gate(gm, inject_matmul_stats(gm), x)
    assert torch.equal(y, m(x))
    cov = coverage(gm, x)
    assert cov.tapped.all() and len(cov) == 6

def test_conv_lhs_density_is_the_images_nonzero_share():
    g = torch.Generator().manual_seed(22)
    img = torch.rand(2, 3, 20, 20, generator=g)
    img = img * (torch.rand(2, 3, 20, 20, generator=g) < 0.17)     # a sparse image
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 4, 1)).eval()
    inj = inject_matmul_stats(trace(m, img))
    st = _stats(inj, img)
    share = (img != 0).float().mean()
    torch.testing.assert_close(st['0/lhs/density'], share)
    # per input channel: chan_density is each channel's own non-zero share
    torch.testing.assert_close(st['0/lhs/chan_density'], (img != 0).float().mean((0, 2, 3)))
    torch.testing.assert_close(st['0/lhs/numel'], torch.tensor(float(img.numel())))
    man = inj.manifest.set_index(['site', 'role'])
    M, K, N = man.loc[('0', 'lhs'), ['M', 'K', 'N']]
    assert (M, K, N) == (2 * 20 * 20, 3 * 9, 16)
    c = op_costs(trace(m, img), img)
    assert c[c.site == '0'].flops.sum() == 2 * M * K * N
    w = m[0].weight
    torch.testing.assert_close(st['0/rhs/chan_absmax'], w.detach().reshape(16, -1).abs().amax(0))

# --- attention ----------------------------------------------------------------------------------------------------

class SeqFirstMHA(nn.Module):
    "Sequence-first MHA with a float attention mask and the attention weights returned per head."
    def __init__(self):
        super().__init__(); self.mha = nn.MultiheadAttention(24, 3); self.ff = nn.Linear(24, 24)
    def forward(self, x, mask):
        o, w = self.mha(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
        return self.ff(o), w

def test_mha_decomposed_gated_and_softmax_is_a_site():
    torch.manual_seed(23)
    m, x = SeqFirstMHA().eval(), torch.randn(9, 2, 24)
    mask = torch.triu(torch.full((9, 9), float('-inf')), 1)
    gm = trace(m, x, mask)
    assert [s.name for s in infer_sites(decompose_attention(gm))] == ['mha.softmax']
    inj = inject_matmul_stats(inject_infer_stats(gm))
    y, stats = gate(gm, inj, x, mask)
    ref = m(x, mask)
    torch.testing.assert_close(y[0], ref[0], rtol=SDPA_RTOL, atol=SDPA_ATOL)
    torch.testing.assert_close(y[1], ref[1], rtol=SDPA_RTOL, atol=SDPA_ATOL)
    assert {'mha.in_proj', 'mha.matmul', 'mha.matmul_1', 'mha.out_proj', 'ff'} <= {k.split('/')[0] for k in stats}
    assert 'mha.softmax/attn/key_mass' in stats
    assert tapped_share(coverage(m, x, mask)) == 1.0

def test_sdpa_products_tapped_by_the_matmul_pass():
    class S(nn.Module):
        def __init__(self): super().__init__(); self.qkv = nn.Linear(16, 48)
        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).permute(2, 0, 3, 1, 4)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.manual_seed(24)
    m, x = S().eval(), torch.randn(3, 5, 16)
    cov = coverage(m, x)
    assert cov.tapped.all() and set(cov.site) == {'qkv', 'matmul', 'matmul_1'}
    gm = trace(m, x)
    y, st = gate(gm, inject_matmul_stats(gm), x)
    torch.testing.assert_close(y, m(x), rtol=SDPA_RTOL, atol=SDPA_ATOL)

# --- experts --------------------------------------------------------------------------------------------------------

class Grouped(nn.Module):
    "torch._grouped_mm over a stacked (E, K, N) weight, rows grouped by the offsets."
    def __init__(self):
        super().__init__(); self.w = nn.Parameter(torch.randn(3, 8, 4))
    def forward(self, x, offs): return torch._grouped_mm(x, self.w, offs=offs)

def test_grouped_mm_expert_sites():
    torch.manual_seed(25)
    m, x = Grouped().eval(), torch.randn(11, 8)
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)
    gm = trace(m, x, offs)
    inj = inject_matmul_stats(gm)
    y, st = gate(gm, inj, x, offs)
    assert torch.equal(y, m(x, offs))
    for e, rows in enumerate((slice(0, 4), slice(4, 4), slice(4, 11))):
        n = rows.stop - rows.start
        assert st[f'grouped_mm.expert{e}/lhs/numel'] == n * 8
        if n: torch.testing.assert_close(st[f'grouped_mm.expert{e}/lhs/mean'], x[rows].mean())
        torch.testing.assert_close(st[f'grouped_mm.expert{e}/rhs/absmax'], m.w[e].detach().abs().max())
    assert st['grouped_mm.expert1/lhs/mean'].isnan()               # an expert no row went to: undefined, not zero
    cov = coverage(m, x, offs)
    assert cov.tapped.all() and cov.flops.tolist() == [2 * 4 * 8 * 4, 0, 2 * 7 * 8 * 4]

def test_expert_taps_have_no_data_dependent_shape():
    "The injected graph exports (torch.export refuses data-dependent shapes) and the program serves any routing."
    class G16(nn.Module):
        def __init__(self): super().__init__(); self.w = nn.Parameter(torch.randn(3, 16, 8, dtype=torch.bfloat16))
        def forward(self, x, offs): return torch._grouped_mm(x, self.w, offs=offs)
    torch.manual_seed(29)
    m, x = G16().eval(), torch.randn(13, 16, dtype=torch.bfloat16)
    offs = torch.tensor([5, 5, 13], dtype=torch.int32)
    inj = inject_matmul_stats(trace(m, x, offs), cache_weights=False)   # the weight cache refreshes outside the graph (a pre-hook): export the uncached form
    with torch.no_grad():
        prog = torch.export.export(inj, (x, offs), strict=False).module()
        for o in (offs, torch.tensor([0, 12, 13], dtype=torch.int32)):
            got, ref = prog(x, o)[1], inj(x, o)[1]
            assert all(torch.allclose(got[k], ref[k], equal_nan=True) for k in ref)
    assert got['grouped_mm.expert1/lhs/numel'] == 12 * 16

def _tiny_moe(kind, impl='grouped_mm', seed=26):
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig
    common = dict(vocab_size=96, hidden_size=24, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
                  max_position_embeddings=32, num_experts_per_tok=2)
    cfg = (MixtralConfig(intermediate_size=40, num_local_experts=5, **common) if kind == 'mixtral' else
           Qwen2MoeConfig(intermediate_size=40, moe_intermediate_size=20, shared_expert_intermediate_size=32,
                          num_experts=6, decoder_sparse_step=1, **common))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, experts_implementation=impl).eval()

@pytest.mark.parametrize('kind,impl', [('mixtral', 'grouped_mm'), ('qwen2_moe', 'grouped_mm'), ('mixtral', 'batched_mm')])
def test_hf_moe_experts_tapped_stationary_and_routed(kind, impl):
    m = _tiny_moe(kind, impl)
    g = torch.Generator().manual_seed(27)
    ids, ids2 = (torch.randint(0, 96, (2, 7), generator=g) for _ in range(2))
    cov = coverage(m, ids, use_cache=False)
    assert tapped_share(cov) >= COVERAGE_MIN and coverage_warning(cov) is None
    gm = trace(m, ids, use_cache=False)
    inj = inject_matmul_stats(inject_infer_stats(gm))
    y, st = gate(gm, inj, ids, use_cache=False)
    with torch.no_grad(): ref = m(ids, use_cache=False).logits
    torch.testing.assert_close(_primary(y), ref, rtol=1e-5, atol=1e-5)
    st2 = _stats(inj, ids2, use_cache=False)
    experts = sorted({k.split('/')[0] for k in st if '.expert' in k})
    assert experts and all(torch.equal(st[f'{e}/rhs/{s}'], st2[f'{e}/rhs/{s}']) for e in experts for s in STATS)
    # per-expert token counts (the first grouped matmul of layer 0) equal the router's own choices
    gate_key = next(k for k in st if k.endswith('/gate/expert_load') and 'layers.0.' in k)
    base = min({e.rsplit('.expert', 1)[0] for e in experts if 'layers.0.' in e})
    K = inj.manifest.set_index(['site', 'role']).loc[(f'{base}.expert0', 'lhs'), 'K']
    rows = torch.stack([st[f'{base}.expert{e}/lhs/numel'] / K for e in range(len(st[gate_key]))])
    torch.testing.assert_close(rows, st[gate_key])

def test_eager_experts_refused_in_one_line():
    m = _tiny_moe('mixtral', impl='eager')
    with pytest.raises(RuntimeError, match="experts_implementation='grouped_mm'") as e:
        trace(m, torch.randint(0, 96, (1, 5)), use_cache=False)
    assert '\n' not in str(e.value)

@pytest.mark.slow
@pytest.mark.parametrize('arch', ['llama', 'mixtral'])
def test_hf_causal_lm_covered_as_users_call_it(arch):
    "A causal LM's default use_cache=True returns a cache object no graph can return: coverage runs it without the cache."
    m = zoo.tiny_decoder(arch)
    ids = torch.randint(2, m.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(30))
    am = torch.ones_like(ids); am[1, :3] = 0                  # the second prompt left-padded
    cov = coverage(m, ids)                                    # use_cache left at its default (True)
    assert tapped_share(cov) == 1.0 and coverage_warning(cov) is None
    assert cov.site.str.contains(r'\.expert\d', regex=True).any() == (arch == 'mixtral')
    batch = dict(input_ids=ids, attention_mask=am)            # a tokenizer's batch, as `record` takes it
    cov_b = coverage(m, **batch)
    assert tapped_share(cov_b) == 1.0 and cov_b.flops.sum() == cov.flops.sum()
    assert coverage(m, ids, use_cache=False).equals(cov)
    c = op_costs(m, ids)                                      # traced too: GEMM sites carry inject's names
    assert set(c[c.kind == 'matmul'].site) <= set(cov.site) and c[c.kind.isin(GEMM_KINDS)].flops.sum() == cov.flops.sum()

# --- one name everywhere ------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', ['transformer', 'moe', 'resnet18'])
def test_inject_and_shapes_name_every_gemm_site_identically(name):
    if name == 'resnet18': m, x = shapes_model('resnet18', device='cpu')[0], torch.randn(1, 3, 48, 48)
    else:
        m = zoo.transformer(layers=3) if name == 'transformer' else zoo.moe(layers=2)
        x = zoo.example_input(m, batch=2)
    gm = trace(m, x)
    c = op_costs(gm, x)
    shapes_names = set(c[c.kind.isin(GEMM_KINDS)].site)
    inject_names = set(inject_matmul_stats(gm).manifest.site)
    assert shapes_names == inject_names == {s.name for s in matmul_sites(gm)} == set(site_names(gm).values())
    assert coverage(m, x).tapped.all()

def test_coverage_warning_names_the_untapped_op():
    class KV(nn.Module):
        "An MHA with learned key/value biases (not decomposed) and a linear layer."
        def __init__(self):
            super().__init__(); self.a = nn.Linear(8, 8); self.attn = nn.MultiheadAttention(8, 2, add_bias_kv=True)
        def forward(self, x): return self.attn(self.a(x), x, x, need_weights=False)[0]
    torch.manual_seed(28)
    cov = coverage(KV().eval(), torch.randn(5, 3, 8))
    assert list(cov.columns) == ['site', 'op', 'flops', 'tapped']
    assert cov.loc[cov.site == 'a', 'tapped'].all() and not cov.loc[cov.site == 'attn', 'tapped'].any()
    w = coverage_warning(cov)
    assert 'untapped: attn (' in w and '\n' not in w and f'{tapped_share(cov):.1%}' in w
    assert coverage_warning(cov, min_share=0.0) is None
