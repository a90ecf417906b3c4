"Decoder families a user brings, from small configs (random weights): `record_generate` gives `generate`'s tokens, or refuses in one line before any row is written."
import warnings
import pytest, torch
tf = pytest.importorskip('transformers')
from opscope.runners import record_generate, _CHECKED
from opscope.recorder import record
from opscope.tables import InputError

H = 32
COMMON = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=96, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=0)
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=H, first_k_dense_replace=1, n_shared_experts=1)

def config(family, window=None):
    c = dict(COMMON)
    return {'mistral': lambda: tf.MistralConfig(**c, sliding_window=window),
            'gemma2': lambda: tf.Gemma2Config(**c, sliding_window=window, head_dim=8),
            'gemma3': lambda: tf.Gemma3TextConfig(**c, sliding_window=window, head_dim=8),
            'gpt_oss': lambda: tf.GptOssConfig(**c, sliding_window=window, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
            'deepseek_v2': lambda: tf.DeepseekV2Config(**{**c, **MLA}, q_lora_rank=None),
            'deepseek_v3': lambda: tf.DeepseekV3Config(**{**c, **MLA}, q_lora_rank=16, n_group=1, topk_group=1),
            'granitemoe': lambda: tf.GraniteMoeConfig(**c, num_local_experts=4, num_experts_per_tok=2),
            'jamba': lambda: tf.JambaConfig(**c, num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                                            expert_layer_period=2, expert_layer_offset=1),
            'mamba': lambda: tf.MambaConfig(hidden_size=H, num_hidden_layers=2, vocab_size=96, bos_token_id=0, eos_token_id=1,
                                            pad_token_id=0),
            'jetmoe': lambda: tf.JetMoeConfig(**{k: v for k, v in c.items() if k not in ('intermediate_size', 'num_attention_heads')},
                                              kv_channels=8, ffn_hidden_size=2 * H, num_local_experts=4, num_experts_per_tok=2),
            'dbrx': lambda: _dbrx(),
            'phimoe': lambda: tf.PhimoeConfig(**c, num_local_experts=4, num_experts_per_tok=2),
            'ernie4_5_moe': lambda: tf.Ernie4_5_MoeConfig(**c, moe_num_experts=4, moe_k=2, moe_intermediate_size=H, moe_layer_start_index=0),
            'opt': lambda: tf.OPTConfig(hidden_size=H, ffn_dim=2 * H, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
                                        max_position_embeddings=128, word_embed_proj_dim=H, bos_token_id=0, eos_token_id=1, pad_token_id=0),
            'bloom': lambda: tf.BloomConfig(hidden_size=H, n_layer=2, n_head=4, vocab_size=96, bos_token_id=0, eos_token_id=1,
                                            pad_token_id=0)}[family]()

def _dbrx():
    c = tf.DbrxConfig(d_model=H, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=96, attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
                      ffn_config=dict(ffn_hidden_size=2 * H, moe_num_experts=4, moe_top_k=2), pad_token_id=0, bos_token_id=0, eos_token_id=1)
    c.attn_config.rope_theta = 10000.0   # transformers 5.25's DbrxAttention reads it, and its attention config no longer sets it
    return c

def build(family, window=None):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return tf.AutoModelForCausalLM.from_config(config(family, window)).eval()

def prompt(B=2, T=6):
    ids = torch.randint(2, 96, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids); mask[0, :2] = 0     # left padding in the first row
    return ids, mask

def greedy(m, ids, mask, n):
    return m.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

NEW = 5   # prompt 6 + 5 new tokens: the cache holds 10 slots

@pytest.mark.parametrize('family,window', [('mistral', 64), ('gemma2', 64), ('gemma3', 10), ('gpt_oss', 64),
                                           ('deepseek_v2', None), ('deepseek_v3', None), ('granitemoe', None),
                                           ('jetmoe', None), ('phimoe', None), ('ernie4_5_moe', None), ('opt', None)])
@pytest.mark.slow
def test_tokens_equal_generate(family, window):
    "Sliding windows that hold every token (10 slots: exactly, in gemma3's case), MLA caches (keys wider than values), GraniteMoE; JetMoe `view`s its SDPA output, which the decomposed attention lays out as the fused kernel does."
    m = build(family, window)
    ids, mask = prompt()
    toks, df = record_generate(m, ids, NEW, mask, check=False)   # our own comparison, not the built-in oracle's
    assert torch.equal(toks, greedy(m, ids, mask, NEW))
    assert sorted(df.step.unique()) == list(range(NEW))

@pytest.mark.parametrize('family', ['mistral', 'gemma2', 'gpt_oss'])
def test_short_window_refused_before_any_row(family, tmp_path):
    m = build(family, 4)
    ids, mask = prompt()
    sink = tmp_path / 'x.csv'
    with pytest.raises(InputError, match=r'sliding window holds 4 tokens and this run needs 10.*shorten the prompt|within 4'):
        record_generate(m, ids, NEW, mask, sink=sink)
    assert not sink.exists() or sink.read_text().count('\n') <= 1

@pytest.mark.parametrize('family', ['jamba', 'mamba'])
def test_state_space_refused_in_one_line(family):
    m = build(family)
    ids, mask = prompt()
    with pytest.raises(InputError) as e: record_generate(m, ids, 3, mask)
    msg = str(e.value)
    assert '\n' not in msg and 'key/value cache in every layer' in msg and 'use_cache=False' in msg
    df = record(m, [dict(input_ids=ids, attention_mask=mask, use_cache=False)])   # what the message says to do instead
    assert (df.role == 'lhs').any()

def test_oracle_stops_at_the_first_differing_step(tmp_path):
    "The tokens are checked against `model.generate`'s: a mismatch stops the run at that step, its rows unwritten."
    m = build('mistral', 64)
    ids, mask = prompt()
    good = greedy(m, ids, mask, NEW)
    bad = good.clone(); bad[1, ids.shape[1] + 2] = (bad[1, ids.shape[1] + 2] + 1) % 96   # generate 'disagrees' at step 2
    m.generate = lambda *a, **k: bad
    sink = tmp_path / 'run.csv'
    with pytest.raises(RuntimeError, match=r'at step 2 gives token .* where model.generate gives .* \(row 1\)'):
        record_generate(m, ids, NEW, mask, sink=sink, check=True)
    from opscope.tables import read_sketches
    assert sorted(read_sketches(sink).step.unique()) == [0, 1]     # the steps before it, whole; nothing of step 2 on
    assert m not in _CHECKED

def test_oracle_runs_once_per_model():
    m = build('granitemoe')
    ids, mask = prompt()
    calls, gen = [], m.generate
    m.generate = lambda *a, **k: calls.append(1) or gen(*a, **k)
    t1, _ = record_generate(m, ids, 3, mask)
    t2, _ = record_generate(m, ids, 3, mask)
    assert calls == [1] and torch.equal(t1, t2) and m in _CHECKED

def test_every_nth_step_and_chosen_vectors():
    m = build('granitemoe')
    ids, mask = prompt()
    toks, df = record_generate(m, ids, 7, mask, every=3, vectors=('hist',), check=False)
    assert torch.equal(toks, greedy(m, ids, mask, 7))
    assert sorted(df.step.unique()) == [0, 3, 6]              # the prefill and every third decode step
    assert not df.stat.isin(['chan_density', 'key_uniform', 'head_mass', 'expert_mass']).any()
    assert (df[df.stat == 'hist'].shape[0] > 0) and (df.M > 0).any() and (df.K > 0).any()   # the tap dims survive
    with pytest.raises(InputError, match='every must be at least 1'): record_generate(m, ids, 3, mask, every=0)
    with pytest.raises(InputError, match='unknown vector'): record_generate(m, ids, 3, mask, vectors=('nope',))

@pytest.mark.slow
@pytest.mark.parametrize('family,window', [('granitemoe', None), ('gpt_oss', 64), ('phimoe', None), ('ernie4_5_moe', None)])
def test_router_softmax_is_not_attention(family, window):
    "A router's softmax over its top-k values is covered by the gate tap, never an `attn` site; no padding warning names it."
    m = build(family, window)
    ids, mask = prompt()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter('always')
        _, df = record_generate(m, ids, 3, mask, check=False)
    attn = set(df[df.role == 'attn'].site)
    assert {a.rsplit('.', 1)[0] for a in attn} == {f'model.layers.{i}.self_attn' for i in range(2)} and len(attn) == 2   # PhiMoE's sparsemixer (max, gather), Ernie's biased top-k: routers
    gate = {'granitemoe': 'block_sparse_moe.router.topk', 'gpt_oss': 'mlp.router.topk', 'ernie4_5_moe': 'mlp.gate.topk', 'phimoe': None}[family]
    assert set(df[df.role == 'gate'].site) == ({f'model.layers.{i}.{gate}' for i in range(2)} if gate else set())   # PhiMoE chooses by max: no top-k
    assert not [w for w in said if 'padded tokens still count' in str(w.message)]

def test_dbrx_refused_in_one_line_on_a_quiet_terminal(capfd):
    "DBRX's experts only run eagerly (transformers refuses it grouped_mm): one line saying so, and torch.export's graph dump held back."
    from opscope.tables import ModelError
    m = build('dbrx')
    ids, mask = prompt()
    capfd.readouterr()
    with pytest.raises(ModelError) as e: record_generate(m, ids, 3, mask)
    msg, err = str(e.value), capfd.readouterr().err
    assert '\n' not in msg and msg.startswith('cannot trace DbrxForCausalLM') and 'no other experts_implementation' in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert 'def forward' not in err and len(err.splitlines()) < 20, err[:2000]

@pytest.mark.slow
def test_no_padding_no_padding_warning():
    "BLOOM (scores by baddbmm over batch·heads) and the MoE routers on prompts without padding: nothing for a mask to leave out, so no warning."
    for family in ('bloom', 'phimoe', 'ernie4_5_moe'):
        m = build(family)
        ids, _ = prompt()
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter('always')
            toks, _ = record_generate(m, ids, 3)
        assert not [w for w in said if 'padded tokens still count' in str(w.message)], family

def test_opt_coherence_stays_within_a_sequence():
    "OPT flattens its MLP input to (batch·tokens, C): adjacent rows are adjacent tokens of one sequence on the prefill, and a decode step (one token per sequence) has no adjacent rows."
    m = build('opt')
    ids, _ = prompt(B=2, T=6)
    seen = {}
    h = m.model.decoder.layers[0].fc1.register_forward_hook(lambda mod, i, o: seen.__setitem__('x', i[0].detach().clone()))
    with torch.no_grad(): m(ids)                          # the prefill's forward, hooked
    h.remove()
    toks, df = record_generate(m, ids, 3, check=False)
    x = seen['x'].reshape(2, 6, -1)                        # the prefill's rows, as the two sequences
    want = float(torch.nn.functional.cosine_similarity(x[:, 1:], x[:, :-1], dim=-1).mean())
    a = df[(df.stat == 'adj_cos') & (df.site == 'model.decoder.layers.0.fc1') & (df.role == 'lhs')].set_index('step').value
    assert abs(a[0] - want) < 1e-4 and a[1:].isna().all(), (a.to_dict(), want)
    flat = df[(df.stat == 'adj_cos') & df.site.str.contains(r'\.fc[12]$') & (df.step > 0) & (df.role != 'rhs')]
    assert len(flat) and flat.value.isna().all()

def test_coverage_with_use_cache_says_leave_it_unset():
    from opscope.runners import coverage
    from opscope.tables import ModelError
    from opscope.zoo import tiny_decoder
    m = tiny_decoder('llama')
    ids, _ = prompt()
    with pytest.raises(ModelError) as e: coverage(m, ids, use_cache=True)
    msg = str(e.value)
    assert '\n' not in msg and 'leave use_cache unset' in msg and 'pytree' not in msg

def test_sizing_the_cache_reaches_no_hook():
    "`static_cache` runs one token through the model to size each layer's tensors (MLA writes a latent, not per-head keys); the user's hooks never see that call."
    from opscope.runners import static_cache
    m = build('deepseek_v2')
    seen = []
    h = m.model.layers[0].register_forward_hook(lambda *a: seen.append(1))
    keys, values = static_cache(m, 2, 10)
    h.remove()
    assert seen == [] and m.model.layers[0]._forward_hooks == {}
    assert all(k.shape[2] == 10 and not k.any() for k in keys + values)

def test_record_a_causal_lm_forward_as_users_call_it():
    "`record` on a Hugging Face causal LM with its default `use_cache=True`: the cache object is left out, every GEMM recorded."
    from opscope.zoo import tiny_decoder
    m = tiny_decoder('llama')
    ids, mask = prompt()
    df = record(m, [dict(input_ids=ids, attention_mask=mask)] * 2)
    assert len(record(m, [ids])) > 0
    assert sorted(df.step.unique()) == [0, 1] and 'lm_head' in set(df.site)


# --- what the miner says about these models is true (issue 33: 0 false findings) ----------------------------------

def _truth(m, found, seen, lin, df):
    "Per finding that a linear layer's tensors can check: (exploit, claimed, the tensors' value, holds)."
    from opscope import miner
    wins = {k: d.groupby('w').step.apply(list).tolist() for k, d in miner.evidence_windows(df).query('ok').groupby(['site', 'role'], observed=True)}
    kurt = lambda x: float((x ** 4).mean() / (x ** 2).mean() ** 2)          # raw, about 0, as the claims
    out = []
    for r in found.itertuples():
        if r.site not in lin or (r.site == 'lm_head' and r.role != 'rhs'): continue   # generate computes lm_head on the last prompt row only
        w = lin[r.site].weight.detach().double()
        xs = [w] if r.role == 'rhs' else [a if r.role == 'lhs' else b for a, b in seen[r.site]]
        x = torch.cat(xs)
        if r.exploit == 'spiky': v = kurt(x[x != 0]); ok = v >= miner.SPIKY_KURTOSIS
        elif r.exploit == 'deep-dump':
            e = (x ** 2).sum(1); v = float(e.var(unbiased=False) / e.mean() ** 2 * x.shape[1] / (kurt(x) - 1)); ok = v >= miner.DEEP_DUMP_RHO
        elif r.exploit in ('int8', 'int4'):
            L, bar = (127, miner.INT8_MIN_SQNR_DB) if r.exploit == 'int8' else (7, miner.INT4_MIN_SQNR_DB)
            q = lambda t: (t / (t.abs().max() / L)).round() * (t.abs().max() / L)
            v = float(10 * torch.log10(sum((t ** 2).sum() for t in xs) / sum(((t - q(t)) ** 2).sum() for t in xs))); ok = v >= bar
        elif r.exploit == 'stationary': v, ok = float(r.role == 'rhs'), r.role == 'rhs'
        elif r.exploit == 'channel-outliers':     # the ratio averaged over the evidence windows the miner reads (prefill, decode steps pooled)
            ws = [w] if r.role == 'rhs' else [torch.cat([xs[s] for s in steps]) for steps in wins[(r.site, r.role)]]
            v = float(sum(float(a[r.idx] / a.median()) for a in (x.abs().amax(0) for x in ws)) / len(ws))
            ok = v >= miner.OUTLIER_TOP_RATIO and abs(v - r.value) <= 1e-3 * v
        elif r.exploit == 'temporal-coherence':
            p = w if r.role == 'rhs' else xs[0]
            v = float(torch.nn.functional.cosine_similarity(p[1:], p[:-1], dim=1).mean()); ok = v >= miner.COHERENCE_MIN
        else: continue
        if v != v: continue     # a hooked call the tensors cannot check it on (DeepSeek-V3's generate shows one all-zero q_a_proj input): unchecked, not held
        out.append((r.exploit, r.site, r.role, float(r.value), v, bool(ok)))
    return out

@pytest.mark.parametrize('family,window', [('mistral', 64), ('gemma2', 64), ('gemma3', 10), ('gpt_oss', 64),
                                           ('deepseek_v2', None), ('deepseek_v3', None), ('granitemoe', None),
                                           ('llama', None), ('mixtral', None), ('qwen2_moe', None)])
@pytest.mark.slow
def test_no_finding_the_tensors_contradict(family, window):
    "Every finding on a family's recording that its linear layers' own tensors (hooked in the model's own `generate`) can check holds: estimator claims (int8/int4 SQNR, spiky kurtosis, deep-dump ρ), channel outliers, coherence, stationarity."
    from opscope.miner import mine
    from opscope.zoo import tiny_decoder
    m = tiny_decoder(family) if family in ('llama', 'mixtral', 'qwen2_moe') else build(family, window)
    ids = torch.randint(2, m.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))   # one unpadded sequence: the hooks see what the taps see
    toks, df = record_generate(m, ids, NEW, check=False)
    lin = {n: mod for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)}
    seen = {}
    hooks = [mod.register_forward_hook(lambda mod, i, o, n=n: seen.setdefault(n, []).append(
        (i[0].detach().double().reshape(-1, i[0].shape[-1]), o.detach().double().reshape(-1, o.shape[-1])))) for n, mod in lin.items()]
    with torch.no_grad(): ref = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    for h in hooks: h.remove()
    assert torch.equal(toks, ref)
    checked = _truth(m, mine(df), seen, lin, df)
    false = [c for c in checked if not c[-1]]
    assert checked and not false, false
