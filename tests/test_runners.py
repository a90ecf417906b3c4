"Real runners: Hugging Face decoders through their greedy generate loop (static KV cache), the eager gate, and opscope-record."
import warnings
from pathlib import Path
import pandas as pd, pytest, torch
from torch._subclasses.fake_tensor import is_fake
from opscope.runners import record_generate, tiny_decoder, DECODERS, load_factory, load_hf
from opscope.recorder import record, read_sketches
from opscope.miner import cross_step
from opscope.cli import opscope_record

warnings.filterwarnings('ignore', message='.*requires gradient.*')
N = 4   # new tokens


def _prompts(vocab, seed=11, B=3, T=4):
    "Left-padded prompts: row 0 has two padding slots."
    ids = torch.randint(2, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
    am = torch.ones_like(ids); am[0, :2] = 0
    return ids, am


_runs = {}
def _run(arch):
    "One recorded generate per architecture (hidden 48, vocab 160, seed 7: not the notebook's), shared by the tests."
    if arch not in _runs:
        m = tiny_decoder(arch, hidden=48, vocab=160, seed=7)
        ids, am = _prompts(160)
        calls = []
        h = m.register_forward_pre_hook(lambda mod, a: calls.append(1))
        ref = m.generate(ids, attention_mask=am, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        h.remove()
        routed = {}
        def hook(name):
            def f(mod, inp, out):   # the eager model's own choices (the gate runs it every step); not export's fake ones
                if not is_fake(out[2]): routed.setdefault(name, []).append(torch.bincount(out[2].reshape(-1), minlength=4))
            return f
        hs = [mod.register_forward_hook(hook(n)) for n, mod in m.named_modules() if n.endswith('mlp.gate')]
        toks, df = record_generate(m, ids, N, attention_mask=am, gate_every=True, check=False)   # `ref` above is the check; the hooks see only the gate
        for h in hs: h.remove()
        _runs[arch] = (m, ref, len(calls), toks, df, routed)
    return _runs[arch]


@pytest.mark.slow
@pytest.mark.parametrize('arch', DECODERS)
def test_tokens_equal_generate_and_one_step_per_forward(arch):
    m, ref, calls, toks, df, _ = _run(arch)
    assert torch.equal(toks, ref)
    assert calls == N and sorted(df.step.unique()) == list(range(N))


@pytest.mark.parametrize('arch', DECODERS)
def test_weights_stationary_activations_not(arch):
    df = _run(arch)[4]
    cs = cross_step(df[~df.role.isin(['attn', 'gate'])]).reset_index()
    attn_products = cs.site.str.contains(r'\.matmul')    # Q·Kᵀ and P·V: both operands are activations
    weights, acts = cs[(cs.role == 'rhs') & ~attn_products], cs[cs.role.isin(['lhs', 'out']) | attn_products]
    assert len(weights) and weights.stationary.all() and (weights.steps == N).all()   # a weight's shape: every step
    dense = acts[(acts.role == 'lhs') & ~acts.site.str.contains('expert')]   # an expert's rows vary with its routed tokens
    assert (dense.steps == N - 1).all()                  # decode steps share one shape; the prefill is apart
    experts = cs[(cs.role == 'rhs') & cs.site.str.contains('expert')]
    assert experts.stationary.all() and (len(experts) > 0) == (arch in ('mixtral', 'qwen2_moe'))
    assert not acts.stationary.any()


@pytest.mark.parametrize('arch', ['mixtral', 'qwen2_moe'])
def test_expert_load_is_the_routers_bincount(arch):
    m, _, _, _, df, routed = _run(arch)
    load = df[(df.role == 'gate') & (df.stat == 'expert_load')]
    assert len(routed) == 2
    for name, counts in routed.items():
        site = load[load.site.str.contains(name.replace('model.', '', 1) + '.', regex=False)]
        assert len(counts) == N
        for step, c in enumerate(counts):
            got = site[site.step == step].sort_values('idx').value.to_numpy()
            assert got.tolist() == c.tolist(), (name, step)


def test_python_state_branch_is_refused():
    m = tiny_decoder('llama', hidden=48, vocab=160, seed=8)
    mlp, calls = m.model.layers[1].mlp, [0]
    orig = mlp.forward
    def counted(x):
        calls[0] += 1
        return orig(x) * (0.0 if calls[0] % 2 == 0 else 1.0)
    mlp.forward = counted
    ids, am = _prompts(160, seed=12)
    with pytest.raises(AssertionError, match='does not reproduce the eager model'):
        record_generate(m, ids, 3, attention_mask=am, gate_every=True)

    class Flag(torch.nn.Module):
        def __init__(self): super().__init__(); self.lin, self.n = torch.nn.Linear(6, 3), 0
        def forward(self, x):
            self.n += 1
            return self.lin(x) if self.n < 3 else -self.lin(x)
    xs = [torch.randn(2, 6, generator=torch.Generator().manual_seed(s)) for s in range(40, 44)]
    with pytest.raises(AssertionError, match='Python state'): record(Flag(), xs, gate_every=True)
    assert record(torch.nn.Linear(6, 3), xs, gate_every=True).step.nunique() == 4


def _call(capsys, *argv):
    "Run opscope_record in process; (exit code, stderr)."
    try: opscope_record(*argv)
    except SystemExit as e: return e.code, capsys.readouterr().err
    return 0, capsys.readouterr().err


@pytest.mark.slow
def test_cli_bad_specs_one_line_exit_2_nothing_written(tmp_path, capsys, cli):
    (tmp_path / 'fac.py').write_text("import torch\ndef good():\n    return torch.nn.Linear(4, 2), [torch.randn(3, 4)]\n"
                                     "def wrong():\n    return torch.nn.Linear(4, 2)\nnot_callable = 3\n")
    (tmp_path / 'p.txt').write_text('hello world\n')
    (tmp_path / 'empty').mkdir()
    out, p = str(tmp_path / 'o.csv'), str(tmp_path / 'p.txt')
    cases = [((f'{tmp_path}/missing.py:good',), 'no such file'),
             ((f'{tmp_path}/fac.py:absent',), "has no function 'absent'"),
             ((f'{tmp_path}/fac.py:not_callable',), "has no function 'not_callable'"),
             ((f'{tmp_path}/fac.py:wrong',), 'must return (model, batches)'),
             ((None, f'{tmp_path}/empty', p), 'no config.json'),
             ((None, f'{tmp_path}/nowhere', p), 'no such folder'),
             ((None, f'{tmp_path}/empty'), '--hf needs --prompts'),
             ((), 'give one of --model')]
    for args, msg in cases:
        code, err = _call(capsys, out, *args)
        assert code == 2, (args, err)
        assert msg in err and err.count('\n') == 1 and err.startswith('opscope-record: error: '), (args, err)
    assert sorted(x.name for x in tmp_path.iterdir()) == ['empty', 'fac.py', 'p.txt']
    r = cli('opscope-record', out, '--model', f'{tmp_path}/missing.py:good')    # the console script, once
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and 'no such file' in r.stderr, r.stderr
    r = cli('opscope-record', str(tmp_path / 'ds'), '--model', f'{tmp_path}/fac.py:good')   # a dataset directory
    assert r.returncode == 0, r.stderr
    assert read_sketches(tmp_path / 'ds').step.nunique() == 1


def _decoder_folder(d):
    "A tiny Llama saved with save_pretrained, and a word-level tokenizer built offline beside it."
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ['<pad>', '</s>', '<unk>'] + [f'w{i}' for i in range(157)]
    t = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token='<unk>'))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=t, pad_token='<pad>', eos_token='</s>', unk_token='<unk>').save_pretrained(d)
    m = tiny_decoder('llama', hidden=48, vocab=160, seed=9)
    m.save_pretrained(d)
    return m


def test_cli_hf_decoder_records_generate(tmp_path, capsys):
    d = tmp_path / 'tiny-llama'
    _decoder_folder(d)
    (tmp_path / 'p.txt').write_text('w3 w5 w7 w9\nw4 w8\n')
    code, err = _call(capsys, str(tmp_path / 'g.parquet'), None, str(d), str(tmp_path / 'p.txt'), 3)
    assert code == 0, err
    df = read_sketches(tmp_path / 'g.parquet')
    assert sorted(df.step.unique()) == [0, 1, 2] and (df.run_id == 'tiny-llama').all()
    m, tok, dec = load_hf(d)
    assert dec


def test_cli_hf_encoder_minilm(tmp_path, capsys):
    from opscope.zoo import minilm_path
    (tmp_path / 'p.txt').write_text('a short one\nthe second prompt is a little longer\n')
    code, err = _call(capsys, str(tmp_path / 'e.csv'), None, str(minilm_path()), str(tmp_path / 'p.txt'))
    assert code == 0, err
    df = read_sketches(tmp_path / 'e.csv')
    assert df.step.nunique() == 1 and (df.role == 'attn').any()


class _KeyPadAttention(torch.nn.Module):
    "One-head attention with a key-padding mask only (BERT-style): padded query rows still see the real keys."
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(8, 8) for _ in range(3))
    def forward(self, x, attention_mask):
        keep = attention_mask[:, None, None, :].bool()
        return torch.nn.functional.scaled_dot_product_attention(self.q(x)[:, None], self.k(x)[:, None], self.v(x)[:, None],
                                                                attn_mask=keep)[:, 0]


def test_padded_query_rows_not_counted():
    torch.manual_seed(21)
    x = torch.randn(2, 5, 8); am = torch.ones(2, 5, dtype=torch.long); am[0, 3:] = 0
    df = record(_KeyPadAttention().eval(), [dict(x=x, attention_mask=am)], taps='softmax')
    km = df[df.stat == 'key_mass'].sort_values('idx').value.to_numpy()
    assert abs(km.sum() - 8) < 1e-4          # 3 + 5 real query rows carry mass 1 each; the 2 padded rows carry none
    peak = df[df.stat == 'peak'].value.item()
    assert 0 < peak <= 1


def test_masked_probabilities_not_reported_as_sparse():
    from opscope.zoo import transformer, example_input
    from opscope.miner import mine
    m = transformer(layers=1, causal=True, seed=5)
    df = record(m, [example_input(m, seed=s) for s in (30, 31)])
    f = mine(df)
    pv = [s for s in df.site.unique() if s.endswith('matmul_1')]
    assert pv
    dens = df[(df.site == pv[0]) & (df.role == 'lhs') & (df.stat == 'density')].value
    assert (dens < 0.7).all()                # the causal mask's zeros are there ...
    hit = f[f.site.isin(pv) & (f.role == 'lhs') & f.exploit.isin(['sparse-gemm', 'dead-channels', 'channel-outliers'])]
    assert hit.empty, hit                    # ... and are not read as structure
