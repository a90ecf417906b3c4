"Architecture: dependencies point one way, the package's own modules are imported at the top, importing has no global side effects."
import ast, importlib, subprocess, sys, warnings
from pathlib import Path
import pytest

PKG = Path(__file__).resolve().parents[1] / 'opscope'
MODULES = sorted(p.stem for p in PKG.glob('*.py') if not p.stem.startswith('_'))
# the pipeline, top to bottom; every other module may import only what is below it in this order or off the spine
SPINE = ['cli', 'plan', 'miner', 'recorder', 'inject', 'lower', 'sites', 'sketch', 'zoo', 'tables']


def _own(node, module):
    "The opscope modules an import node names (relative or absolute), as bare module names."
    if isinstance(node, ast.Import):
        return [a.name.split('.')[1] for a in node.names if a.name.startswith('opscope.')] + \
               [m for a in node.names if a.name == 'opscope' for m in ['__init__']]
    if node.module is None or node.level:   # `from . import x` / `from .x import y`
        base = node.module.split('.')[0] if node.module else None
        return [base] if base else [a.name for a in node.names]
    if node.module == 'opscope': return [a.name for a in node.names]
    if node.module.startswith('opscope.'): return [node.module.split('.')[1]]
    return []


def _imports(module):
    "(top-level edges, in-function imports) of an opscope module, from its AST."
    tree = ast.parse((PKG / f'{module}.py').read_text())
    top, inner = set(), []
    def walk(node, in_fn):
        for ch in ast.iter_child_nodes(node):
            fn = in_fn or isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(ch, (ast.Import, ast.ImportFrom)):
                names = [m for m in _own(ch, module) if m in MODULES]
                if in_fn and names: inner.append((ch.lineno, names))
                top.update(n for n in names if n != module)
            walk(ch, fn)
    walk(tree, False)
    return top, inner


GRAPH = {m: _imports(m)[0] for m in MODULES}


LAZY_OK = {('scale', 'recorder'), ('scale', 'zoo')}   # `scale.record_shard` / `record_spawned` record with torch, but a Dask
# worker imports `scale` to mine: those two functions import the recorder and the zoo when called, so a worker never loads torch


def test_no_import_inside_functions():
    "Only optional third-party packages are imported lazily; opscope's own modules are imported at the top."
    bad = {m: [(l, n) for l, n in _imports(m)[1] if any((m, x) not in LAZY_OK for x in n)] for m in MODULES}
    bad = {m: v for m, v in bad.items() if v}
    assert not bad, bad


def test_no_cycle():
    "The import graph among opscope's modules (functions included) is acyclic."
    state, path = {}, []
    def visit(m):
        state[m] = 'open'; path.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == 'open': pytest.fail(f"import cycle: {' → '.join(path[path.index(n):] + [n])}")
            if n not in state: visit(n)
        state[m] = 'done'; path.pop()
    for m in MODULES:
        if m not in state: visit(m)


def test_spine_points_down():
    "cli → plan → miner → recorder → inject → lower → sites → sketch → zoo → tables: no module imports one above it on the spine."
    for i, m in enumerate(SPINE):
        up = GRAPH[m] & set(SPINE[:i])
        assert not up, f"{m} imports {sorted(up)}, above it in {' → '.join(SPINE)}"


def test_tables_at_the_bottom():
    assert GRAPH['tables'] == set()
    assert all('tables' not in GRAPH[m] or m != 'tables' for m in MODULES)


def test_side_modules_depend_downwards():
    "Nothing imports the CLI, and only the CLI imports the side tools it drives (docs, bench)."
    assert not [m for m in MODULES if 'cli' in GRAPH[m]]
    for side in ('docs', 'bench'):
        assert {m for m in MODULES if side in GRAPH[m]} <= {'cli'}, side


def _third_party(module):
    "The non-opscope modules `module` imports at its top level (imported first, so only opscope's own effects are compared)."
    out = set()
    for node in ast.parse((PKG / f'{module}.py').read_text()).body:
        if isinstance(node, ast.Import): out.update(a.name for a in node.names if not a.name.startswith('opscope'))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module not in ('__future__',) \
                and not node.module.startswith('opscope'): out.add(node.module)
    return out


@pytest.mark.slow
def test_import_has_no_global_side_effects():
    "Importing every opscope module leaves warnings filters, numpy error state, torch defaults and os.environ as the third-party imports left them (a fresh interpreter)."
    deps = sorted(set().union(*map(_third_party, MODULES)))
    code = ("import warnings, importlib\n"
            f"for m in {deps!r}: importlib.import_module(m)\n"
            "import os, numpy as np, torch\n"
            "state = lambda: (list(warnings.filters), np.geterr(), torch.get_default_dtype(), torch.get_num_threads(), dict(os.environ))\n"
            "before = state()\n"
            f"for m in {MODULES!r}: importlib.import_module('opscope.' + m)\n"
            "after = state()\n"
            "assert after[0] == before[0], [f for f in after[0] if f not in before[0]]\n"
            "assert after[1:] == before[1:], 'numpy error state, torch defaults or the environment changed on import'\n")
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_reexports():
    "The table contract and the input error stay importable where DESIGN.md names them."
    from opscope import recorder, tables
    for name in ('SCHEMA', 'INT_COLS', 'STR_COLS', 'SCHEMA_VERSION', 'RENAMED_STATS', 'PARTITION_TYPES', 'InputError'):
        assert getattr(recorder, name) is getattr(tables, name), name


def test_mining_imports_no_torch():
    "The miner, the Dask workers' partials and the `opscope-mine` console script's module run without torch (DESIGN: mining needs only pandas/numpy)."
    code = "import sys, opscope.partials, opscope.miner, opscope.mine_cli; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
