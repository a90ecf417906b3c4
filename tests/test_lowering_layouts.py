"Issue 51, without transformers: a lowered graph stays runnable where the model `view`s SDPA's output; a router's softmax is known by what it feeds; a flattened (batch·tokens, C) operand is tapped as sequences; a failed export reaches the terminal as one line."
import pytest, torch
import torch.nn as nn
import torch.nn.functional as F
from opscope.sites import trace, infer_sites
from opscope.lower import decompose_attention, _sdpa_layout
from opscope.recorder import record
from opscope.tables import ModelError

g = torch.Generator().manual_seed(0)


class ViewedSDPA(nn.Module):
    "JetMoe's pattern: SDPA's output transposed to (batch, tokens, heads, dim) and `view`ed, which only its kernel's strides allow."
    def forward(self, q, k, v):      # (batch, tokens, heads, dim), as a model's projections give them
        B, T, H, D = q.shape
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).view(B, T, H * D)


def test_decomposed_sdpa_keeps_the_kernels_layout():
    q, k, v = (torch.randn(2, 5, 4, 8, generator=g) for _ in range(3))
    m = ViewedSDPA()
    gm = trace(m, q, k, v, how='export')
    low = decompose_attention(gm)
    assert low is not gm and low.meta['opscope_sdpa'] == 1
    assert any(n.target is _sdpa_layout for n in low.graph.nodes)             # the kernel wrote (batch, tokens, heads, dim): so does the lowering
    torch.testing.assert_close(low(q, k, v), m(q, k, v), rtol=1e-4, atol=1e-4)


class Routers(nn.Module):
    "An attention softmax, and three routers recognized by what their softmax feeds, whatever their names: a max then a gather at the chosen experts (PhiMoE's sparsemixer), a bias then a top-k (Ernie-4.5), a plain top-k (Mixtral)."
    def __init__(self, d=16, e=4):
        super().__init__()
        self.w, self.bias = nn.Linear(d, e, bias=False), nn.Parameter(torch.zeros(e))
    def forward(self, x):
        a = torch.softmax(x @ x.transpose(-2, -1), -1) @ x                  # attention
        s = self.w(a)
        idx = s.max(dim=-1, keepdim=True)[1]
        one = torch.softmax(s, -1).gather(-1, idx)                          # sparsemixer
        two = torch.topk(torch.softmax(s, -1) + self.bias, 2, -1)[0]        # biased choice
        three = torch.topk(torch.softmax(s, -1), 2, -1)[0]
        return a.sum() + one.sum() + two.sum() + three.sum()


@pytest.mark.parametrize('how', ['fx', 'export'])
def test_router_softmax_known_by_what_it_feeds(how):
    x = torch.randn(2, 5, 16, generator=g)
    soft = [s for s in infer_sites(trace(Routers(), x, how=how)) if s.kind == 'softmax']
    assert len(soft) == 1 and soft[0].node.users and all('matmul' in str(u.target) for u in soft[0].node.users)   # the attention's, feeding P·V


class Flattened(nn.Module):
    "OPT's MLP: (batch, tokens, C) flattened to (batch·tokens, C) before its linears."
    def __init__(self, d=16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
    def forward(self, x):
        B, T, C = x.shape
        return self.fc2(torch.relu(self.fc1(x.reshape(-1, C)))).view(B, T, C)


def test_flattened_rows_coherent_only_within_a_sequence():
    x = torch.randn(3, 6, 16, generator=g).cumsum(1)                         # tokens coherent along each sequence, sequences apart
    df = record(Flattened(), [x])
    a = df[(df.stat == 'adj_cos') & (df.site == 'fc1') & (df.role == 'lhs')].value.item()
    want = F.cosine_similarity(x[:, 1:], x[:, :-1], dim=-1).mean().item()
    assert abs(a - want) < 1e-5
    one = record(Flattened(), [x[:, :1].contiguous()])                         # one token per sequence: no adjacent rows at all
    assert one[(one.stat == 'adj_cos') & (one.role != 'rhs')].value.isna().all()


class DataDependent(nn.Module):
    def forward(self, x):
        out = x
        for i in x.nonzero(): out = out + i.sum()                            # a Python loop over data: no graph holds it
        return out


def test_failed_export_is_one_line_on_a_quiet_terminal(capfd):
    capfd.readouterr()
    with pytest.raises(ModelError) as e: trace(DataDependent(), torch.ones(3))
    err = capfd.readouterr().err
    assert '\n' not in str(e.value) and e.value.__cause__ is None and 'def forward' not in err and len(err.splitlines()) < 20, err


def test_a_step_graph_that_fails_to_run_names_the_lowering():
    "Where a lowered step graph cannot run (JetMoe's `view` before the layout fix), the gate says so in one line, naming the rewrite."
    from opscope.runners import _runs
    class Broken(nn.Module):
        def forward(self, x): return x.t().view(-1)        # a view the strides do not allow
    gm = torch.fx.symbolic_trace(Broken())
    gm.meta['opscope_sdpa'] = 2
    with pytest.raises(ModelError) as e: _runs(gm, (torch.randn(3, 4),))
    msg = str(e.value)
    assert '\n' not in msg and 'view size is not compatible' in msg and 'lower.decompose_attention' in msg and e.value.__cause__ is None
