"""The docs preview, opened in a real browser: every page the sidebar lists is built by
`opscope-docs-preview` (nbdev's processing + nbconvert, from the stored outputs) and loaded in headless
Debian chromium; each page must show its title, its API section, its figures, and no error output.
Screenshots of two pages are kept in test-artifacts/ (git-ignored)."""
import ast, base64, json, os, re, shutil, subprocess, tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from bs4 import BeautifulSoup

from opscope.docs import quarto_id, sidebar_entries, sidebar_pages, _page_name

ROOT = Path(__file__).resolve().parents[1]
NBS = ROOT / 'nbs'
ARTIFACTS = ROOT / 'test-artifacts'
CHROMIUM = shutil.which('chromium') or '/usr/bin/chromium'
FLAGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
         '--disable-background-networking', '--disable-component-update', '--disable-sync']
PAGES = sidebar_pages(NBS)
SCREENSHOTS = ('index.ipynb', '02a_explore.ipynb')

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                reason='needs Debian chromium (.ci/run installs it: apt-get install chromium)')
slow = pytest.mark.slow   # the tests of the built site: every page built, then opened in chromium


def chromium(profile, *args, timeout=60):
    r = subprocess.run([CHROMIUM, *FLAGS, f'--user-data-dir={profile}', *args], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope='module')
def site():
    "Build the whole preview with the console script, then dump every page's DOM from chromium."
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / 'site'
        r = subprocess.run(['opscope-docs-preview', str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600)   # every page through nbdev's processors
        assert r.returncode == 0, r.stderr[-3000:]
        assert f'{len(PAGES)} page(s)' in r.stdout, r.stdout
        assert 'Found cells containing imports' not in r.stderr, r.stderr[-3000:]   # nbdev_docs would execute such cells (and warn): imports live in cells of their own

        def dom(i_page):
            i, page = i_page
            return page, chromium(Path(d) / f'profile{i}', '--dump-dom', (out / _page_name(page)).as_uri())
        with ThreadPoolExecutor(2) as ex: doms = dict(ex.map(dom, enumerate(PAGES)))

        ARTIFACTS.mkdir(exist_ok=True)
        for page in SCREENSHOTS:
            png = ARTIFACTS / f'docs-{_page_name(page).removesuffix(".html")}.png'
            png.unlink(missing_ok=True)
            chromium(Path(d) / 'profile-shot', '--window-size=1280,1600', '--hide-scrollbars', f'--screenshot={png}',
                     (out / _page_name(page)).as_uri())
        yield {p: BeautifulSoup(h, 'html.parser') for p, h in doms.items()}


def notebook(page):
    return json.loads((NBS / page).read_text())


def title_of(nb):
    "The notebook's `# title` markdown heading: what nbdev's frontmatter makes the page title."
    for c in nb['cells']:
        if c['cell_type'] == 'markdown':
            m = re.match(r'#\s+(.+)', ''.join(c['source']).strip())
            if m: return m[1].strip()


def _directives(src):
    return {m[1] for m in re.finditer(r'^\s*#\|\s*([\w-]+)', src, re.M)}


def documented_names(nb):
    "Public top-level functions and classes of the `#| export` cells: nbdev writes a show_doc for each."
    names = []
    for c in nb['cells']:
        src = ''.join(c['source'])
        if c['cell_type'] != 'code' or not ({'export', 'exports'} & _directives(src)) or 'hide' in _directives(src): continue
        for node in ast.parse(src).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith('_'): names.append(node.name)
    return names


def shown_images(nb):
    "How many PNG outputs the notebook stores in cells that the docs show."
    n = 0
    for c in nb['cells']:
        d = _directives(''.join(c['source'])) if c['cell_type'] == 'code' else set()
        if c['cell_type'] != 'code' or d & {'hide', 'export', 'exporti'}: continue
        n += sum('image/png' in o.get('data', {}) for o in c.get('outputs', []))
    return n


@slow
@pytest.mark.parametrize('page', PAGES)
def test_page(site, page):
    soup, nb = site[page], notebook(page)
    title = title_of(nb)
    assert soup.title.string == f'{title} – opscope'
    assert soup.select_one('h1.title').get_text(strip=True) == title

    # the sidebar: every page, in sidebar order, and this one marked
    nav = soup.select_one('#opscope-nav')
    hrefs = [a['href'] for a in nav.select('a') if '#' not in a['href']]
    assert list(dict.fromkeys(hrefs[1:])) == [_page_name(p) for p in PAGES]
    assert nav.select_one('.current a')['href'] == _page_name(page)

    # the API section: show_doc output for every exported public name
    names = documented_names(nb)
    if names:
        api = soup.select('.celltag_api')
        assert api, 'no API section'
        heads = {h.get_text(strip=True).rstrip('¶') for cell in api for h in cell.select('h3, h4')}
        missing = [n for n in names if not any(h == n or h.endswith('.' + n) for h in heads)]   # `@patch`ed: Class.name
        assert not missing, f'no show_doc for {missing}'
        assert all(c.select_one('pre, code') for c in api)                 # the signature is rendered

    # figures: each stored image of a shown cell is an <img> with real PNG bytes
    want = shown_images(nb)
    imgs = [i for i in soup.select('.jp-OutputArea-output img') if i.get('src', '').startswith('data:image/png;base64,')]
    assert len(imgs) == want, (len(imgs), want)
    for img in imgs:
        png = base64.b64decode(img['src'].split(',', 1)[1])
        assert png[:8] == b'\x89PNG\r\n\x1a\n' and len(png) > 2000

    # no error output, no traceback, no unprocessed directive
    shown = '\n'.join(o.get_text() for o in soup.select('.jp-OutputArea-output'))
    assert 'Traceback' not in shown and not re.search(r'^\w+Error: ', shown, re.M)
    assert not any(o.get_text().lstrip().startswith("['") and "\\n'," in o.get_text()   # lines joined, not a list repr
                   for o in soup.select('.jp-OutputArea-output'))
    assert not soup.select('[data-mime-type="application/vnd.jupyter.error"], .jp-OutputArea-executeResult .ansi-red-fg')
    for err in soup.select('[data-mime-type="application/vnd.jupyter.stderr"]'):
        assert not re.search(r'\w+Error\b', err.get_text()), err.get_text()[:500]
    assert not re.search(r'^\s*#\|', '\n'.join(c.get_text() for c in soup.select('.jp-InputArea pre')), re.M)


@slow
def test_results_anchors(site):
    "Every anchored sidebar entry (the Results section) lands on a heading of its page."
    res = [e for e in sidebar_entries(NBS) if e['anchor']]
    assert {e['text'].split(':')[0] for e in res} >= {'MNIST', 'Transformer', 'MoE', 'Real models'}
    for e in res:
        assert site[e['nb']].find(id=e['anchor']) is not None, f"{e['nb']} has no #{e['anchor']}"


@slow
def test_screenshots(site):
    for page in SCREENSHOTS:
        png = ARTIFACTS / f'docs-{_page_name(page).removesuffix(".html")}.png'
        assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n' and png.stat().st_size > 20_000


def test_every_notebook_is_a_page():
    "The sidebar (the site's table of contents) lists every notebook, and every listed one exists."
    assert sorted(PAGES) == sorted(p.name for p in NBS.glob('*.ipynb'))


def test_bad_input(tmp_path):
    r = subprocess.run(['opscope-docs-preview', str(tmp_path / 'x'), '--pages', 'nope.ipynb'], capture_output=True,
                       text=True, cwd=ROOT)
    assert (r.returncode, r.stderr.count('\n')) == (2, 1) and 'not in' in r.stderr and 'nope.ipynb' in r.stderr
    assert not (tmp_path / 'x').exists()
