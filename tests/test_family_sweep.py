"The decoder-family sweep of issue 51: every transformers decoder family that builds from a small config (random weights) records `generate`'s tokens or is refused in one short line, with no router tapped as attention and no coherence across the sequences of a batch. Minutes of work: run with OPSCOPE_FAMILY_SWEEP=1 (without it, tests/conftest.py does not collect this file)."
import re, warnings
import pytest, torch
tf = pytest.importorskip('transformers')
from opscope.runners import record_generate
from opscope.tables import InputError, ModelError

pytestmark = pytest.mark.slow   # collected only with OPSCOPE_FAMILY_SWEEP=1 (tests/conftest.py)

H = 32
BASE = dict(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            vocab_size=96, max_position_embeddings=128, bos_token_id=0, eos_token_id=1, pad_token_id=0)
FAMILIES = {
 'llama': {}, 'mistral': {}, 'mixtral': dict(num_local_experts=4, num_experts_per_tok=2), 'qwen2': {}, 'qwen3': {},
 'qwen2_moe': dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=H, shared_expert_intermediate_size=H),
 'qwen3_moe': dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=H),
 'gemma': {}, 'gemma2': {}, 'gemma3_text': {}, 'phi': dict(partial_rotary_factor=0.5), 'phi3': {},
 'phimoe': dict(num_local_experts=4, num_experts_per_tok=2), 'starcoder2': {}, 'stablelm': {}, 'olmo': {}, 'olmo2': {},
 'olmoe': dict(num_experts=4, num_experts_per_tok=2), 'granite': {}, 'granitemoe': dict(num_local_experts=4, num_experts_per_tok=2),
 'cohere': {}, 'glm': {}, 'glm4': {}, 'helium': {}, 'smollm3': {}, 'ernie4_5': {},
 'ernie4_5_moe': dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=H, moe_layer_start_index=0),
 'gpt_neox': dict(rotary_pct=0.5), 'gpt2': dict(n_embd=H, n_layer=2, n_head=4, n_positions=128),
 'gptj': dict(n_embd=H, n_layer=2, n_head=4, n_positions=128, rotary_dim=4),
 'opt': dict(ffn_dim=2 * H, word_embed_proj_dim=H), 'bloom': dict(n_layer=2, n_head=4),
 'falcon': dict(new_decoder_architecture=True, num_kv_heads=2, head_dim=None),
 'jetmoe': dict(kv_channels=8, ffn_hidden_size=2 * H, num_local_experts=4, num_experts_per_tok=2),
 'dbrx': None, 'deepseek_v2': dict(num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=H, first_k_dense_replace=1, n_shared_experts=1, q_lora_rank=None),
 'gpt_oss': dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=64),
 'lfm2': {}, 'falcon_h1': {}, 'bamba': dict(mamba_n_heads=8, mamba_d_head=8, mamba_expand=2, attn_layer_indices=[1]), 'minimax': dict(num_local_experts=4, num_experts_per_tok=2),
}
def config(f):
    if f == 'dbrx':
        c = tf.DbrxConfig(d_model=H, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=96, attn_config=dict(kv_n_heads=2, clip_qkv=8.0),
                          ffn_config=dict(ffn_hidden_size=2 * H, moe_num_experts=4, moe_top_k=2), pad_token_id=0, bos_token_id=0, eos_token_id=1)
        c.attn_config.rope_theta = 10000.0
        return c
    cls = tf.CONFIG_MAPPING[f]
    import inspect
    kw = {k: v for k, v in {**BASE, **FAMILIES[f]}.items() if v is not None or k == 'q_lora_rank'}
    return cls(**kw)
def build(f):
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        return tf.AutoModelForCausalLM.from_config(config(f)).eval()

def prompt(B=2, T=6):
    ids = torch.randint(2, 96, (B, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids); mask[0, :2] = 0     # left padding in the first row
    return ids, mask

ROUTER = re.compile(r'(^|\.)(mlp|moe|router|gate|experts|block_sparse_moe|feed_forward)(\.|$)')
NEW = 4

@pytest.mark.parametrize('family', list(FAMILIES))
def test_family_records_generate_or_refuses_in_one_line(family, capfd):
    try: m = build(family)
    except Exception as e: pytest.skip(f"{family} does not build from a small config here ({type(e).__name__})")
    ids, mask = prompt()
    capfd.readouterr()
    try: toks, df = record_generate(m, ids, NEW, mask, check=False)
    except (InputError, ModelError) as e:
        err = capfd.readouterr().err
        assert '\n' not in str(e) and len(err.splitlines()) < 20, (str(e), err[-2000:])
        return
    with torch.no_grad(): ref = m.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    assert torch.equal(toks, ref)
    attn = set(df[df.role == 'attn'].site)
    assert not [s for s in attn if ROUTER.search(s)], attn                       # a router's softmax is the gate's, never attention
    a = df[(df.stat == 'adj_cos') & (df.step > 0) & df.role.isin(['lhs', 'out']) & ~(df.M > ids.shape[0])]   # more rows than sequences: a cache's slots (MLA), a sequence each
    assert a.value.isna().all(), a[a.value.notna()][['site', 'role', 'step', 'M', 'value']].head()   # a decode step: one token per sequence, no adjacent rows
