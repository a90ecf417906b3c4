"specialize_model on Hugging Face architectures (small configs, random weights): the copy keeps its class and generate, the input is untouched, every report row is accounted for."
import copy
import pytest
import torch
import torch.nn as nn
from opscope.tables import InputError
from opscope.specialize import specialize_model, SpecializedLinear, linear_sites, is_decoder, format_report, REPORT_COLUMNS

transformers = pytest.importorskip('transformers')


def _state(m): return {k: v.clone() for k, v in m.state_dict().items()}


def _untouched(m, before):
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())
    assert not any(isinstance(c, SpecializedLinear) for c in m.modules())


@pytest.fixture(scope='module')
def llama():
    from opscope.zoo import tiny_decoder
    torch.manual_seed(0)
    return tiny_decoder('llama').eval()


def _prompts(m, n, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, m.config.vocab_size, (2, n), generator=g)
    mask = torch.ones_like(ids); mask[0, :2] = 0          # left padding on the first prompt
    return dict(input_ids=ids, attention_mask=mask)


def test_decoder_keeps_class_and_generate(llama):
    before = _state(llama)
    assert is_decoder(llama)
    res = specialize_model(llama, [_prompts(llama, 12, 0)], holdout=[_prompts(llama, 10, 1)], max_new_tokens=4, rounds=1)
    assert type(res.model) is type(llama)
    _untouched(llama, before)
    out = res.model.generate(**_prompts(llama, 10, 1), max_new_tokens=4, do_sample=False)   # HF generate, unchanged
    assert out.shape == (2, 14)
    assert set(REPORT_COLUMNS) <= set(res.report.columns)
    assert (res.report.applied | (res.report.reason.fillna('') != '')).all()              # nothing dropped silently
    assert set(res.report.site) == set(linear_sites(llama))
    assert {'greedy_equal', 'prompts', 'first_divergence', 'logit_rel_err', 'bf16_greedy_equal'} <= set(res.error)
    assert res.error['greedy_equal'] >= res.tolerance * res.error['prompts'] - 1e-9
    assert {'prefill_tok_s', 'decode_tok_s', 'tok_s'} <= set(res.e2e.columns)
    assert 'end to end' in format_report(res)
    timed = res.report[res.report.exploit != '']
    dec = timed[timed.speedup_decode.notna() & timed.guard_cost.notna()]     # NaN guard cost: a trap, reported from one call alone
    assert len(dec) and dec.groupby('site').dense_ms_decode.nunique().eq(1).all()   # decode timed in one pass: one dense time per site


def test_decoder_bad_input(llama):
    before = _state(llama)
    p = _prompts(llama, 8, 2)
    with pytest.raises(InputError, match=r'holdout\[0\]: a decoder'):
        specialize_model(llama, [p], holdout=[p['input_ids']])
    with pytest.raises(InputError, match='max_new_tokens'):
        specialize_model(llama, [p], holdout=[p], max_new_tokens=0)
    with pytest.raises(InputError, match='tolerance'):
        specialize_model(llama, [p], holdout=[p], tolerance=-0.1)
    with pytest.raises(InputError, match=r'calib\[0\]: the model rejects'):
        specialize_model(llama, [dict(input_ids=p['input_ids'].float())], holdout=[p])
    _untouched(llama, before)


def test_tied_lm_head_shares_its_weight():
    "A specialized lm_head tied to the embedding keeps sharing the one Parameter (no copy of the weight)."
    from opscope.specialize import Choice
    from opscope.plan import make_kernel
    emb = nn.Embedding(50, 16); head = nn.Linear(16, 50, bias=False); head.weight = emb.weight
    sl = SpecializedLinear(head, {'prefill': Choice('bf16', make_kernel('bf16', head.weight.detach(), None))})
    assert sl.weight is emb.weight


def test_gemm_layers_left_out_are_named():
    "GPT-2's attention and MLP are transformers' Conv1D, nn.MultiheadAttention's out_proj a Linear subclass read by its caller: named in one warning."
    from opscope.specialize import left_out
    from opscope.zoo import tiny_decoder
    assert left_out(tiny_decoder('gpt2')) == 'specialize_model replaces nn.Linear layers only; left as they are: 8 Conv1D'
    assert 'NonDynamicallyQuantizableLinear' in left_out(nn.TransformerEncoderLayer(16, 2))
    assert left_out(nn.Sequential(nn.Linear(2, 2))) == ''


def test_int4_candidate_needs_a_4bit_grid():
    "int4-weight is measured only where the weight lies on a 4-bit grid per group (as dequantized GGUF Q4 weights do)."
    import pandas as pd
    from opscope.specialize import candidates
    from opscope.kernels import int4_grid
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    none = pd.DataFrame(columns=['site', 'exploit', 'role', 'idx', 'value'])
    assert 'int4-weight' not in [c[0] for c in candidates('s', lin, none)]          # float-trained: no evidence
    q, step, low, _ = int4_grid(lin.weight.detach())
    with torch.no_grad(): lin.weight.copy_((q.reshape(48, 2, 32) * step[..., None] + low[..., None]).reshape(48, 64))
    c = {c[0]: c for c in candidates('s', lin, none)}
    assert 'int4-weight' in c and 'fit error' in c['int4-weight'][4]


_CAPPED = r"""
import json, torch
from opscope.zoo import tiny_decoder, mlp, make_tensor
from opscope.specialize import specialize_model, SpecializedLinear, format_report
torch.manual_seed(0)
out = {}
net = mlp(layers=2, d_in=64, hidden=256, d_out=32).eval()
b = [make_tensor('gaussian', (64, 64), seed=s) for s in range(4)]
models = {'mlp': (net, dict(calib=b[:2], holdout=b[2:], rounds=3))}
m = tiny_decoder('llama').eval()
g = torch.Generator().manual_seed(0)
p = [dict(input_ids=torch.randint(3, m.config.vocab_size, (2, 10), generator=g), attention_mask=torch.ones(2, 10, dtype=torch.long)) for _ in range(2)]
models['llama'] = (m, dict(calib=p[:1], holdout=p[1:], max_new_tokens=4, rounds=1))
for name, (model, kw) in models.items():
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = specialize_model(model, kw.pop('calib'), **kw)
    out[name] = dict(untouched=all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()) and not any(isinstance(c, SpecializedLinear) for c in model.modules()),
                     error=res.error, tolerance=res.tolerance, isa=res.machine['isa'], bf16_native=res.machine['bf16_native'],
                     seconds=res.seconds, report='AVX2' in format_report(res), rows=len(res.report), exploits=sorted(set(res.report.exploit) - {''}))
print(json.dumps(out))
"""


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ('AVX2', 'AVX512'), reason='an x86 CPU with AVX2 at least')
def test_specialize_under_the_avx2_cap():
    "specialize_model runs to the end in a process capped to AVX2 (`kernels.ISA_CAPS`): the model untouched, the accuracy within tolerance, the report naming the capped ISA (no timing is asserted)."
    import json, os, subprocess, sys
    from opscope.kernels import capped_env
    r = subprocess.run([sys.executable, '-c', _CAPPED], env=capped_env('avx2', {**os.environ, 'OMP_NUM_THREADS': '1'}),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    mlp, llama = out['mlp'], out['llama']
    assert mlp['untouched'] and llama['untouched']
    assert mlp['error']['min_cosine'] >= mlp['tolerance']
    assert llama['error']['greedy_equal'] >= llama['tolerance'] * llama['error']['prompts'] - 1e-9
    for o in (mlp, llama):
        assert o['isa'] == 'AVX2' and o['bf16_native'] is False and o['report'] and o['seconds'] > 0
        assert {'int8-fbgemm', 'fp16-weight', 'bf16', 'int8'} <= set(o['exploits'])
