"Issue #18: one site-naming function. `inject` (the injected graph), `shapes` (its FLOPs table and coverage) and the runners (what `record` writes) name every GEMM site of a 3-layer zoo transformer, the zoo MoE and resnet18 identically."
import pytest, torch, torchvision
from opscope import zoo
from opscope.sites import trace, matmul_sites
from opscope.inject import inject_matmul_stats
from opscope.shapes import op_costs, coverage
from opscope.recorder import record

def _resnet18():
    torch.manual_seed(61)
    return torchvision.models.resnet18(weights=None).eval(), torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(62))

def _zoo(build, **kw):
    m = build()
    return m, zoo.example_input(m, batch=2, tokens=8, seed=63, **kw)

CASES = {'transformer3': lambda: _zoo(lambda: zoo.transformer(layers=3, d=32, heads=4, seed=64)),
         'moe': lambda: _zoo(lambda: zoo.moe(layers=2, d=32, experts=4, seed=65)),
         'resnet18': _resnet18}

@pytest.fixture(scope='module', params=list(CASES))
def names(request):
    "Each tool's set of GEMM site names for one model."
    model, x = CASES[request.param]()
    gm = trace(model, x)
    inj = inject_matmul_stats(gm)
    with torch.no_grad(): _, stats = inj(x)
    costs = op_costs(model, x)
    rec = record(model, [x], run_id='sites', taps=('matmul',))
    return request.param, dict(
        matmul_sites={s.name for s in matmul_sites(gm)},
        injected={k.rsplit('/', 2)[0] for k in stats},
        shapes_costs=set(costs[costs.kind.isin(['matmul', 'conv'])].site),
        shapes_coverage=set(coverage(model, x).site),
        record=set(rec.site.astype(str)))

def test_one_naming(names):
    case, n = names
    want = n['matmul_sites']
    assert len(want) >= {'transformer3': 3 * 8, 'moe': 2 * 4, 'resnet18': 21}[case]   # every GEMM of the model has a site
    for tool, got in n.items():
        assert got == want, f"{case}: {tool} names {sorted(got ^ want)[:6]} differently from sites.matmul_sites"

def test_no_module_path_names():
    "The old mismatch: shapes named the zoo attention's `@` after its module (`layers.0.attn`), inject `layers.0.attn.matmul`."
    model, x = CASES['transformer3']()
    c = op_costs(model, x)
    assert {'layers.0.attn.matmul', 'layers.0.attn.matmul_1'} <= set(c.site) and 'layers.0.attn' not in set(c[c.kind == 'matmul'].site)

def test_record_generate_names_as_record():
    "A decoder's generate loop runs it inside `StaticDecoder` (as `.model`); its sites are still the decoder's own names."
    from opscope.runners import tiny_decoder, record_generate
    m = tiny_decoder('llama', layers=1, seed=67)
    ids = torch.randint(2, 128, (1, 6), generator=torch.Generator().manual_seed(68))
    _, gen = record_generate(m, ids, 2, taps=('matmul',))
    rec = record(m, [dict(input_ids=ids, use_cache=False)], taps=('matmul',))
    cov = coverage(m, input_ids=ids, use_cache=False)
    assert set(gen.site) == set(rec.site.astype(str)) == set(cov.site) and 'lm_head' in set(gen.site)
