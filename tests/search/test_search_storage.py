"""The search's storage (miras.search.storage): several workers opening one fresh SQLite file at
the same moment all get a working storage."""

from __future__ import annotations

import threading

import optuna
import pytest

from miras.search.storage import open_storage

# warnings.catch_warnings (storage.quiet) is process-wide, so threads let some through.
pytestmark = pytest.mark.filterwarnings("ignore::optuna.exceptions.ExperimentalWarning")

WORKERS = 3
ROUNDS = 8  # without the schema lock nearly every round failed (20 of 20 with two workers)


@pytest.mark.parametrize("round_", range(ROUNDS))
def test_workers_started_together_on_a_fresh_sqlite_file_all_open_it(tmp_path, round_):
    """Each thread builds its own engine, as separate `miras search` processes do, and they
    are released together so that they create Optuna's tables at the same moment."""
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    start = threading.Barrier(WORKERS)
    opened: list[optuna.storages.RDBStorage] = []
    errors: list[str] = []

    def worker() -> None:
        start.wait()
        try:
            opened.append(open_storage(url, interval=10, grace=30))
        except Exception as err:  # a thread cannot raise into the test: the assertion reports it
            errors.append(f"{type(err).__name__}: {err}")

    threads = [threading.Thread(target=worker) for _ in range(WORKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert errors == []
    assert len(opened) == WORKERS
    # One schema: a study made through one storage is seen through every other.
    optuna.create_study(study_name="shared", storage=opened[0])
    for storage in opened:
        assert [s.study_name for s in storage.get_all_studies()] == ["shared"]
