"A saved plan (`Specialized.save` / `load_specialized`): applied again bit for bit, refusing another model and bad folders in one line, re-timed on another machine (an ISA-capped process), written by `opscope-specialize --save`."
import copy, json, os, subprocess, sys, types, warnings
from pathlib import Path
import pandas as pd
import pytest, torch
import torch.nn as nn
import opscope
from opscope.tables import InputError
from opscope.zoo import mlp, make_tensor
from opscope.specialize import specialize_model, SpecializedLinear, Choice
from opscope.plan import make_kernel
from opscope.kernels import int4_grid
from opscope.saved import (load_specialized, read_plan, fingerprint, plan_entries, write_plan, machine, PLAN_JSON, PLAN_TENSORS,
                           PLAN_FORMAT, MAX_PLAN_BYTES, MIN_GAIN)

AVX2 = dict(ATEN_CPU_CAPABILITY='avx2', ONEDNN_MAX_CPU_ISA='AVX2', DNNL_MAX_CPU_ISA='AVX2', MKL_ENABLE_INSTRUCTIONS='AVX2',
            FBGEMM_ENABLE_INSTRUCTIONS='AVX2')   # an AVX2-only CPU, per process


def _forced(net):
    "`net` specialized by hand, every choice forced (what a machine makes fastest does not matter here): int8 with an outlier channel, prepack, dead channels, fp16 and weight-only int8, both regimes; a report as `specialize_model` writes it."
    spec = copy.deepcopy(net)
    l0, l1 = spec.layers[0], spec.layers[1]
    w0, b0, w1, b1 = l0.weight.detach(), l0.bias.detach(), l1.weight.detach(), l1.bias.detach()
    i8 = Choice('int8', make_kernel('int8', w0, b0, [3]), 40.0, '', [3], [3])
    fp = make_kernel('fp16', w0, b0)
    spec.layers[0] = SpecializedLinear(l0, {'prefill': i8, 'decode': Choice('fp16', fp, fp.limit)}, 'layers.0')
    dead = Choice('dead-channels', make_kernel('dead-channels', w1, b1, list(range(2, 256))), None, 'lhs.chan_absmax[channels] <= 0', [0, 1], list(range(2, 256)))
    spec.layers[1] = SpecializedLinear(l1, {'prefill': Choice('prepack', make_kernel('prepack', w1, b1, 96), arg=96), 'decode': dead}, 'layers.1')
    rep = pd.DataFrame([dict(site='layers.0', exploit='int8', M_prefill=96, speedup_prefill=2.0), dict(site='layers.0', exploit='fp16', M_decode=4, speedup_decode=1.5),
                        dict(site='layers.1', exploit='prepack', M_prefill=96, speedup_prefill=1.1), dict(site='layers.1', exploit='dead-channels', M_decode=4, speedup_decode=1.2)])
    return types.SimpleNamespace(model=spec, report=rep)


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
    "(model, batches, its hand-made specialization, the folder it was saved to)."
    torch.manual_seed(0)
    net = mlp(layers=2, d_in=128, hidden=256, d_out=64)
    batches = [make_tensor('gaussian', (96, 128), seed=s) for s in range(2)] + [make_tensor('gaussian', (4, 128), seed=9)]
    res = _forced(net)
    d = write_plan(tmp_path_factory.mktemp('plan') / 'mlp', plan_entries(res), res.model, False)
    return net, batches, res, d


def _one_line(e): assert '\n' not in str(e.value), str(e.value)


def _copy(d, to, change=None):
    "A copy of plan folder `d` at `to`, its JSON changed by `change`."
    to.mkdir()
    j = json.loads((d / PLAN_JSON).read_text())
    if change: change(j)
    (to / PLAN_JSON).write_text(json.dumps(j)); (to / PLAN_TENSORS).write_bytes((d / PLAN_TENSORS).read_bytes())
    return to


def test_load_is_bit_identical_and_leaves_the_model(saved):
    net, batches, res, d = saved
    before = {k: v.clone() for k, v in net.state_dict().items()}
    lo = opscope.load_specialized(net, d)                    # the lazy top-level name
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in before.items())
    assert not any(isinstance(m, SpecializedLinear) for m in net.modules())
    assert lo.other_machine == '' and lo.report.kept.all() and len(lo.report) == len(read_plan(d)['choices']) == 4
    with torch.no_grad():
        for x in batches: assert torch.equal(lo.model(x), res.model(x))
    assert {(m.site, r, c.exploit) for m in lo.model.modules() if isinstance(m, SpecializedLinear) for r, c in m.choices.items()} == \
        {('layers.0', 'prefill', 'int8'), ('layers.0', 'decode', 'fp16'), ('layers.1', 'prefill', 'prepack'), ('layers.1', 'decode', 'dead-channels')}
    assert lo.model.layers[0].choices['prefill'].limit == 40.0 and lo.model.layers[1].choices['decode'].guard == 'lhs.chan_absmax[channels] <= 0'


def test_a_specialize_model_result_round_trips(tmp_path):
    "`Specialized.save` on what `specialize_model` returns (whatever it chose here), loaded back: the same outputs bit for bit."
    torch.manual_seed(0)
    net = mlp(layers=2, d_in=128, hidden=256, d_out=64)
    batches = [make_tensor('gaussian', (96, 128), seed=s) for s in range(4)]
    res = specialize_model(net, batches[:2], holdout=batches[2:], rounds=1)
    res.save(tmp_path / 'p')
    lo = load_specialized(net, tmp_path / 'p')
    assert fingerprint(res.model) == fingerprint(net)      # a specialized copy shares the original's parameters
    with torch.no_grad():
        for x in batches: assert torch.equal(lo.model(x), res.model(x))


def test_top_level_names():
    "`opscope.load_specialized` is the lazy top-level name; `opscope.specialize_model` also attaches `Specialized.save`."
    assert opscope.load_specialized is load_specialized
    code = "import opscope; opscope.specialize_model; from opscope.specialize import Specialized; print(hasattr(Specialized, 'save'))"
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == 'True', out.stderr[-2000:]


def test_refuses_another_model(saved, tmp_path):
    net, _, _, d = saved
    other = copy.deepcopy(net)
    with torch.no_grad(): next(other.parameters())[0, 0] += 1e-6
    with pytest.raises(InputError, match=f"{d}: saved for another model \\(its weights differ") as e: load_specialized(other, d)
    _one_line(e)
    with pytest.raises(InputError, match="saved for another model") as e: load_specialized(mlp(layers=2, d_in=128, hidden=64, d_out=64), d)
    _one_line(e)
    with pytest.raises(InputError, match="'nope' is not a linear layer"):
        load_specialized(net, _copy(d, tmp_path / 'x', lambda j: j['choices'][0].update(site='nope')))


@pytest.mark.parametrize('change, says', [
    (lambda j: j.update(format=PLAN_FORMAT + 1), 'is newer than this opscope'),
    (lambda j: j.pop('format'), 'no format number'),
    (lambda j: j['choices'][0].update(regime='train'), "regime 'train' is not one of"),
    (lambda j: j['choices'][0].update(channels=[10 ** 6]), 'a channel lies outside'),
    (lambda j: j['choices'][0].update(exploit='no-such'), "exploit 'no-such'"),
    (lambda j: j['choices'][0].update(arg=dict(tensor='a', dtype='float32', shape=[2])), 'holds 0 tensors, the plan names 1'),
    (lambda j: j['choices'][0].update(arg=dict(tensor='a', dtype='object', shape=[2])), 'a bad tensor reference'),
    (lambda j: j['choices'].append(j['choices'][0]), 'chosen twice'),
])
def test_refuses_a_bad_plan(saved, tmp_path, change, says):
    net, _, _, d = saved
    with pytest.raises(InputError, match=says) as e: load_specialized(net, _copy(d, tmp_path / 'p', change))
    _one_line(e)


def test_refuses_bad_files(saved, tmp_path):
    net, _, _, d = saved
    cases = []
    p = _copy(d, tmp_path / 'text'); (p / PLAN_JSON).write_text('{"format": 1,'); cases.append((p, 'not JSON'))
    p = _copy(d, tmp_path / 'deep'); (p / PLAN_JSON).write_text('[' * 200_000 + ']' * 200_000); cases.append((p, 'nested too deeply'))
    p = _copy(d, tmp_path / 'big'); (p / PLAN_JSON).write_bytes(b' ' * (MAX_PLAN_BYTES + 1)); cases.append((p, 'larger than'))
    p = _copy(d, tmp_path / 'link'); (p / PLAN_JSON).unlink(); (p / PLAN_JSON).symlink_to(d / PLAN_JSON); cases.append((p, 'a symlink'))
    p = _copy(d, tmp_path / 'tlink'); (p / PLAN_TENSORS).unlink(); (p / PLAN_TENSORS).symlink_to(d / PLAN_TENSORS); cases.append((p, 'a symlink'))
    p = _copy(d, tmp_path / 'pickle'); torch.save({'x': torch.ones(1)}, p / PLAN_TENSORS); cases.append((p, 'kernels.safetensors'))
    p = _copy(d, tmp_path / 'none'); (p / PLAN_TENSORS).unlink(); cases.append((p, 'kernels.safetensors: missing'))
    cases.append((tmp_path / 'nowhere', 'no such folder'))
    for p, says in cases:
        with pytest.raises(InputError, match=says) as e: load_specialized(net, p)
        _one_line(e)


def _int4_model():
    "A linear layer whose weight lies on a 4-bit grid, specialized by hand with int4-weight (an arg of tensors), and a report row for it."
    torch.manual_seed(1)
    lin = nn.Linear(64, 32)
    with torch.no_grad(): lin.weight.copy_(torch.randint(0, 16, (32, 64)).float() * 0.01 - 0.08)
    net = nn.Sequential(lin)
    spec = copy.deepcopy(net)
    fit = int4_grid(spec[0].weight.detach())          # the arg `specialize_model` builds int4-weight from
    k = make_kernel('int4-weight', spec[0].weight.detach(), spec[0].bias.detach(), fit)
    spec[0] = SpecializedLinear(spec[0], {'decode': Choice('int4-weight', k, arg=fit)}, '0')
    rep = pd.DataFrame([dict(site='0', exploit='int4-weight', M_decode=4, note='', speedup_decode=1.5)])
    return net, types.SimpleNamespace(model=spec, report=rep)


def test_tensor_args_in_safetensors(tmp_path):
    net, res = _int4_model()
    d = write_plan(tmp_path / 'int4', plan_entries(res), res.model, False)
    j = json.loads((d / PLAN_JSON).read_text())
    assert j['choices'][0]['arg'][0] == dict(tensor='0/decode/arg.0', dtype='int32', shape=[32, 64])
    lo = load_specialized(net, d)
    x = torch.randn(4, 64)
    with torch.no_grad(): assert torch.equal(lo.model(x), res.model(x))
    def wrong_shape(j): j['choices'][0]['arg'][0]['shape'] = [64, 32]
    with pytest.raises(InputError, match=r"0/decode/arg.0 is \[32, 64\], the plan says \[64, 32\]"): load_specialized(net, _copy(d, tmp_path / 'w', wrong_shape))


def test_another_machine_retimes(saved, tmp_path):
    "The saved machine altered: every choice is timed here, and kept exactly where it is `MIN_GAIN` faster; load says so in one warning."
    net, _, _, d = saved
    p = _copy(d, tmp_path / 'moved', lambda j: j['machine'].update(torch='0.0'))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter('always')
        lo = load_specialized(net, p)
    assert lo.other_machine.startswith("torch '0.0' here")
    assert any('another machine' in str(x.message) and 're-timed' in str(x.message) for x in w)
    r = lo.report
    assert r.speedup_here.notna().all() and (r.kept == (r.speedup_here >= MIN_GAIN)).all()
    assert r[~r.kept].reason.str.startswith('dropped').all()
    lo.save(tmp_path / 'here')
    assert len(read_plan(tmp_path / 'here')['choices']) == int(r.kept.sum())


def test_isa_capped_process_is_another_machine(saved):
    "Capped to AVX2 (a process on this machine as an AVX2-only CPU), or uncapped when the suite runs capped: the machine differs and every kernel is re-timed."
    _, _, _, d = saved
    code = ("import json, warnings, torch\nfrom opscope.zoo import mlp\nfrom opscope.saved import load_specialized\n"
            "warnings.simplefilter('ignore'); torch.manual_seed(0)\n"
            f"lo = load_specialized(mlp(layers=2, d_in=128, hidden=256, d_out=64), {str(d)!r})\n"
            "print(json.dumps(dict(cap=torch.backends.cpu.get_cpu_capability(), other=lo.other_machine, timed=bool(lo.report.speedup_here.notna().all()))))")
    capped = all(os.environ.get(k) == v for k, v in AVX2.items())    # this suite itself runs capped: the other machine is the native one
    env = {k: v for k, v in os.environ.items() if k not in AVX2} if capped else {**os.environ, **AVX2}
    out = subprocess.run([sys.executable, '-c', code], env={**env, 'OMP_NUM_THREADS': '1'}, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got['other'] and got['timed']                     # the caps are in the machine description: always another machine
    if not capped: assert got['cap'] == 'AVX2' or machine()['isa'] not in ('AVX512', 'AVX512_BF16'), got   # ATen takes the cap on a larger CPU


FACTORY = '''import torch
from opscope.zoo import mlp, make_tensor
def make():
    torch.manual_seed(0)
    return mlp(layers=2, d_in=128, hidden=256, d_out=64), [make_tensor('gaussian', (128, 128), seed=s) for s in range(3)]
'''


def test_cli_save(tmp_path, capsys):
    "`opscope-specialize --model FILE.py:FACTORY --save DIR` writes a plan that loads on the factory's model."
    from opscope.cli import opscope_specialize, console
    (tmp_path / 'fac.py').write_text(FACTORY)
    console(opscope_specialize, ['--model', f'{tmp_path}/fac.py:make', '--save', str(tmp_path / 'plan')])
    assert str(tmp_path / 'plan') in capsys.readouterr().out
    torch.manual_seed(0)
    lo = load_specialized(mlp(layers=2, d_in=128, hidden=256, d_out=64), tmp_path / 'plan')
    assert lo.other_machine == '' and lo.report.kept.all()
    (tmp_path / 'afile').write_text('x')
    with pytest.raises(SystemExit): console(opscope_specialize, ['--model', f'{tmp_path}/fac.py:make', '--save', str(tmp_path / 'afile')])
    assert 'not a folder' in capsys.readouterr().err


def test_console_script_lists_save(cli):
    "The installed `opscope-specialize` takes `--save DIR`."
    r = cli('opscope-specialize', '--help')
    assert r.returncode == 0 and '--save' in r.stdout, r.stderr[-2000:]
