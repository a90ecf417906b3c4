"""`explore` driven as a user drives it: change a dropdown, the figure changes to the new choice."""
import pandas as pd
import pytest
import torch

pytest.importorskip('ipywidgets')
import matplotlib
matplotlib.use('Agg')

from opscope.explore import explore, Explorer
from opscope.recorder import record
from opscope.zoo import transformer, mnist_mlp, example_input, load_mnist

torch.set_num_threads(1)


def drawn(ax): return [l for l in ax.lines if len(l.get_xdata())]   # legend handles are empty lines


@pytest.fixture(scope='module')
def tdf():
    m = transformer(layers=2)
    return record(m, [example_input(m, seed=s) for s in range(3)], run_id='tfm')


def test_dropdowns_redraw(tdf):
    ex = explore(tdf, interactive=True)
    assert isinstance(ex, Explorer)
    assert list(ex.run.options) == ['(all)', 'tfm']
    assert len(ex.site.options) == tdf.site.nunique()
    f0 = ex.figure
    assert f0.axes[0].get_title() == f"{ex.site.value} · {ex.role.value} · {ex.stat.value}"
    ex.site.value = 'layers.1.ffn.up'
    assert ex.figure is not f0
    assert ex.figure.axes[0].get_title() == f"layers.1.ffn.up · {ex.role.value} · {ex.stat.value}"
    ex.stat.value = 'hist'
    assert len(ex.figure.axes[0].patches) == 64                          # histogram: one bar per bin
    ex.stat.value = 'chan_absmax'
    lines = drawn(ex.figure.axes[0])
    assert len(lines) == 3 and ex.figure.axes[0].get_xlabel() == 'channel'   # a line over channels per step
    ex.stat.value = 'density'
    assert list(drawn(ex.figure.axes[0])[0].get_xdata()) == [0, 1, 2]       # scalar: a line over steps
    ex.role.value = 'out'
    assert ex.stat.value == 'density'                                       # a stat the new role has is kept
    assert ex.figure.axes[0].get_title() == 'layers.1.ffn.up · out · density'
    ex.close()


def test_run_narrows_sites_from_a_file(tdf, tmp_path):
    x, _ = load_mnist(64)
    both = pd.concat([tdf, record(mnist_mlp(), [x[:32], x[32:]], run_id='mnist')], ignore_index=True)
    both.to_csv(tmp_path / 's.csv', index=False)
    ex = explore(tmp_path / 's.csv', interactive=True)
    assert list(ex.run.options) == ['(all)', 'mnist', 'tfm']
    before = ex.figure
    ex.run.value = 'mnist'
    assert list(ex.site.options) == ['fc1', 'fc2', 'fc3']
    assert ex.figure is not before and ex.figure.axes[0].get_title().split(' · ')[0] == 'fc1'
    ex.close()


def test_bad_input():
    with pytest.raises(ValueError, match='missing column'):
        explore(pd.DataFrame({'a': [1]}), interactive=True)
    with pytest.raises(TypeError, match='got int'):
        explore(3, interactive=True)
