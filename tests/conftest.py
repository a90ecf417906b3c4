import os, subprocess, sys
import pytest, torch

torch.set_num_threads(1)
os.environ.setdefault('HF_HUB_OFFLINE', '1')


def pytest_configure(config):
    config.addinivalue_line('markers', 'slow: takes more than a few seconds; the fast loop (`pytest -m "not slow" tests`) skips it')


def run_cli(*args, cwd=None):
    "Run a console script; returns the CompletedProcess (text)."
    return subprocess.run(list(args), capture_output=True, text=True, cwd=cwd)


@pytest.fixture
def cli():
    return run_cli
