"""Session-wide test setup.

Triton chooses its interpreter when it is first imported, and test modules import it at
collection (fla, in test_known_models.py, imports triton). So on a machine without CUDA the
choice is made here, before any test module: TRITON_INTERPRET=1 runs the Triton backend's
kernels on the CPU (tests/kernels/test_triton.py). Nothing else in the suite launches a kernel.

Emitted sources go to a fresh temporary MIRAS_CACHE_DIR for the session (removed at the end),
so the tests neither write to the user's ~/.cache/miras nor read stale modules from it.

The tests in tests/runtime, tests/ops, tests/models and tests/kernels run with every
`torch.empty` / `empty_like` / `empty_strided` / `Tensor.new_empty` result filled with NaN (the
largest value for integers; tests/poison.py), through setup, call and teardown: a buffer read
before it is written shows up as NaN rather than as the allocator's leftovers.

Markers (registered in pyproject.toml): `services` for tests that start PostgreSQL or headless
Chromium, `slow` for the longest ones. `pytest -m "not slow and not services"` is the fast
suite; a plain `pytest` (and `make test`) runs everything.

The suite's folders follow the source (tests/compiler/, tests/runtime/, ...) and are packages
(tests/__init__.py): test modules import shared oracles by package path (`from
tests.runtime.test_known_models import fla_naive`, `from tests.helpers import random_inputs`).
pytest imports every test module by its package name, the repository root first on sys.path, so
nothing here adds to sys.path.
"""

import contextlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.poison import POISONED_FOLDERS, poisoned_empty

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_CACHE = tempfile.mkdtemp(prefix="miras-test-cache-")
_USER_CACHE = os.environ.get("MIRAS_CACHE_DIR")
os.environ["MIRAS_CACHE_DIR"] = _CACHE

_TESTS = Path(__file__).resolve().parent
# The compile-only check's support module, once its test module has imported it.
_GPU_COMPILE_SUPPORT = "tests.kernels.gpu_compile_support"


def pytest_collection_modifyitems(session, config, items):
    """The compile-only check of every covered spec runs last, so its ptxas work, started when
    collection ends (below), has the whole run to finish on the core the tests leave idle."""
    support = sys.modules.get(_GPU_COMPILE_SUPPORT)
    if support is not None:
        items.sort(key=support.is_early)


def pytest_collection_finish(session):
    """When the run includes the compile-only check of every covered spec, start its ptxas
    work now, in a child process (tests/kernels/gpu_compile_support.py, which the check's
    module imports: a run that did not collect it pays nothing here)."""
    support = sys.modules.get(_GPU_COMPILE_SUPPORT)
    if support is not None and any(map(support.is_early, session.items)):
        support.start_early(session.config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The poison is on for the item's whole protocol, so the fixtures it sets up (of any scope)
    are poisoned too, not only the test's body."""
    path = Path(item.path)
    folder = path.relative_to(_TESTS).parts[0] if path.is_relative_to(_TESTS) else ""
    with poisoned_empty() if folder in POISONED_FOLDERS else contextlib.nullcontext():
        yield


def pytest_unconfigure(config):
    if _USER_CACHE is None:
        os.environ.pop("MIRAS_CACHE_DIR", None)
    else:
        os.environ["MIRAS_CACHE_DIR"] = _USER_CACHE
    shutil.rmtree(_CACHE, ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models and tensors run fastest on one thread: more only contend, the more so on a
    shared 2-core machine. A module opts in with `pytestmark = pytest.mark.usefixtures(...)`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
