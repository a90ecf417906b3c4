"""README.md is generated from nbs/index.ipynb (`jupyter nbconvert --to markdown nbs/index.ipynb --output-dir .
--output README`); it must equal a fresh conversion, figure included, and the figure must be committed."""
import shutil, subprocess
from pathlib import Path

from nbconvert import MarkdownExporter

ROOT = Path(__file__).resolve().parents[1]


def test_readme_is_fresh_nbconvert_of_index():
    body, res = MarkdownExporter().from_filename(str(ROOT / 'nbs/index.ipynb'),
                                                 resources={'unique_key': 'README', 'output_files_dir': 'README_files'})
    assert (ROOT / 'README.md').read_text() == body, \
        'README.md is stale: jupyter nbconvert --to markdown nbs/index.ipynb --output-dir . --output README'
    figs = res['outputs']
    assert any(k.endswith('.png') for k in figs), 'index.ipynb stores no figure'
    for name, data in figs.items():
        assert f']({name})' in body
        assert (ROOT / name).read_bytes() == data, f'{name} differs from the figure stored in nbs/index.ipynb'
    stale = {p.relative_to(ROOT).as_posix() for p in (ROOT / 'README_files').glob('*')} - set(figs)
    assert not stale, f'README_files holds figures the README does not use: {sorted(stale)}'


def test_readme_figures_are_not_ignored():
    if not shutil.which('git') or not (ROOT / '.git').exists(): return
    files = [str(p) for p in (ROOT / 'README_files').glob('*')]
    r = subprocess.run(['git', 'check-ignore', *files], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and not r.stdout, f'git ignores {r.stdout}'
