"""The search on a real PostgreSQL server, started by the tests: initdb in a temporary folder,
listening on 127.0.0.1 on a free port only, stopped at teardown. PostgreSQL refuses to run as
root, so as root the server runs as the `postgres` user the Debian package creates.

Missing server binaries fail the tests (they are not skipped): `make test` installs them
through scripts/ensure-test-services.sh.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from optuna.trial import TrialState

from tests.search_support import FINISHED, TINY, kill_scenario, start_worker, trials_of, write_study

# A PostgreSQL server and worker processes: about a minute a test on 2 cores.
pytestmark = [pytest.mark.services, pytest.mark.slow]
INSTALL = "run scripts/ensure-test-services.sh (as root; `make test` runs it) to install them"


def _server_binaries() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=_version)
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(initdb).parent
    pytest.fail(f"PostgreSQL server binaries (initdb, pg_ctl) not found; {INSTALL}")


def _version(path: str) -> tuple[int, ...]:
    number = Path(path).parts[4]  # /usr/lib/postgresql/<version>/bin/initdb
    return tuple(int(p) for p in number.split(".") if p.isdigit())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres():
    """A fresh server; yields its URL (user miras, trust auth on loopback)."""
    bin_dir = _server_binaries()
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="miras-pg-"))
    if os.geteuid() == 0:
        try:
            account = pwd.getpwnam("postgres")
        except KeyError:
            pytest.fail(f"running as root needs the 'postgres' user to own the server; {INSTALL}")
        os.chown(folder, account.pw_uid, account.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    data, port = folder / "data", _free_port()

    def run(*command: str) -> None:
        subprocess.run([*as_user, *command], check=True, capture_output=True, text=True)

    run(
        str(bin_dir / "initdb"),
        "-D",
        str(data),
        "-U",
        "miras",
        "--auth=trust",
        "-E",
        "UTF8",
        "--no-sync",
    )
    options = f"-h 127.0.0.1 -p {port} -k {folder} -c fsync=off -c max_connections=100"
    run(
        str(bin_dir / "pg_ctl"),
        "-D",
        str(data),
        "-o",
        options,
        "-l",
        str(folder / "log"),
        "-w",
        "start",
    )
    try:
        yield f"postgresql://miras@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [*as_user, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"],
            capture_output=True,
        )
        shutil.rmtree(folder, ignore_errors=True)


def test_two_workers_complete_exactly_the_budget(postgres, tmp_path):
    """Two processes (as on two machines) run one study: exactly `trials` finished trials, each
    once, none left running, and both processes took part."""
    study = write_study(tmp_path, name="pair")
    url, trials = postgres, 6
    workers = [start_worker(study, url, trials) for _ in range(2)]
    for w in workers:
        _, stderr = w.communicate(timeout=300)
        assert w.returncode == 0, stderr
    found = trials_of(url, "pair")
    finished = [t for t in found if t.state in FINISHED]
    assert len(finished) == trials
    assert len({t.number for t in found}) == len(found)  # no trial stored twice
    assert not [t for t in found if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # A failed trial can only be the loser of a race for the last slot.
    for t in found:
        if t.state == TrialState.FAIL:
            assert t.user_attrs["reason"].startswith("over budget"), t.user_attrs
    by_worker = Counter(t.user_attrs["worker"] for t in finished)
    assert len(by_worker) == 2, by_worker
    assert all("spec" in t.user_attrs for t in finished)


def test_killed_worker_on_postgres(postgres, tmp_path):
    study = write_study(tmp_path, train={**TINY["train"], "steps": 60})
    kill_scenario(study, postgres, trials=3)
