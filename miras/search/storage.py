"""Where studies live: Optuna's RDB storage (SQLite by default, PostgreSQL to scale out), with
heartbeats and retry of stale trials, and the study opened in it with its sampler and pruner.

    storage = open_storage("sqlite:///runs/quickstart.db", interval=10, grace=30)
    handle = open_study(study, storage, "quickstart")      # created, or loaded to resume
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import random
import sqlite3
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial

from miras.search.grid_sampler import grid_sampler
from miras.search.study import StudyDef, load_study, resolve_directions

MAX_RETRY = 3  # a trial that kills its worker three times is not tried again


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Heartbeats, stale-trial retries and TPE's group mode are marked experimental in Optuna;
    they are what the search is built on, so their warnings say nothing to the user."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


class SearchError(ValueError):
    """A search cannot go on: the storage is unreachable, the stored study was made from another
    definition, or trials keep failing. The message says what to do."""


def default_storage(study_name: str, root: str | Path = "runs") -> str:
    """runs/<study>.db, relative to the working directory."""
    return f"sqlite:///{Path(root) / study_name}.db"


def masked(url: str) -> str:
    """The URL with its password hidden, for messages."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):  # unparsable: show the host part only
        return url.split("@")[-1] if "@" in url else url


def open_storage(url: str, interval: int, grace: int) -> RDBStorage:
    """Optuna's RDB storage with heartbeats and retry of stale trials.

    SQLite: the file's folder is created, the journal is switched to WAL (readers do not block
    the writer) and a connection waits up to a minute for a lock, so a few workers on one
    machine can share it; the tables are created under a lock on `<db>.lock`. PostgreSQL: a
    connection attempt gives up after 10 s."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, IntegrityError, ProgrammingError, SQLAlchemyError

    try:
        parsed = make_url(url)
    except ArgumentError:
        raise SearchError(
            f"storage: cannot parse {url!r}; expected a URL such as sqlite:///runs/x.db or "
            "postgresql://user:password@host:5432/db"
        ) from None
    given = url  # messages name the URL as the user gave it
    engine_kwargs: dict[str, Any] = {}
    lock: Path | None = None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        lock = Path(f"{parsed.database}.lock")
        try:
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
            with _schema_lock(lock):  # two first switches to WAL at once: 'database is locked'
                _sqlite_wal(parsed.database)
        except (OSError, sqlite3.Error) as err:
            raise SearchError(f"storage: cannot open {parsed.database}: {err}") from None
        engine_kwargs["connect_args"] = {"timeout": 60}
    elif parsed.get_backend_name() == "postgresql":
        engine_kwargs["connect_args"] = {"connect_timeout": 10}
        if parsed.drivername == "postgresql" and not _importable("psycopg"):
            # SQLAlchemy 2.1 reads postgresql:// as psycopg 3; the dev extra installs psycopg2,
            # Optuna's documented driver. Either works when named.
            url = parsed.set(drivername="postgresql+psycopg2").render_as_string(False)
    for attempt in range(5):
        try:
            with quiet(), _schema_lock(lock):
                return RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=interval,
                    grace_period=grace,
                    **_retry_callback(),
                )
        except (IntegrityError, ProgrammingError):
            # PostgreSQL (SQLite holds the lock instead): workers that start together on an
            # empty database race to create Optuna's tables; the losers find them on a second
            # look.
            if attempt == 4:
                raise
            time.sleep(0.5 + random.random())
        except (SQLAlchemyError, ImportError, OSError, ValueError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SearchError(f"storage: cannot open {masked(given)}: {first}") from None
    raise AssertionError("unreachable")


@contextlib.contextmanager
def _schema_lock(path: Path | None) -> Iterator[None]:
    """Held while Optuna's RDBStorage creates its tables, for SQLite (`path` is `<db>.lock`).

    The constructor checks for each table and then creates it, outside one transaction: two
    workers started together on a fresh file both find a table missing and the second CREATE
    fails (`table studies already exists`). An exclusive flock on a file beside the database
    makes the check-and-create one step per worker; the second finds the tables made. flock
    locks belong to the open file, so threads with their own engines are serialized too."""
    if path is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file is closed
        yield


def _retry() -> Any:
    """Optuna's callback that queues a trial again (WAITING) with its parameters, its user
    attributes and `failed_trial` / `retry_history` in its system attributes, at most MAX_RETRY
    times. Optuna 4.9 renamed RetryFailedTrialCallback; both names are supported."""
    storages = optuna.storages
    callback = getattr(storages, "RetryHeartbeatStaleTrialCallback", None)
    return (callback or storages.RetryFailedTrialCallback)(max_retry=MAX_RETRY)


def _retry_callback() -> dict[str, Any]:
    """Re-queue a stale trial with its parameters (the keyword was renamed with the class)."""
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):
        return {"heartbeat_stale_trial_callback": _retry()}
    return {"failed_trial_callback": _retry()}


def queue_again(handle: optuna.Study, trial: FrozenTrial) -> None:
    """Queue `trial` again as a stale trial is: an interrupted trial (Ctrl-C, SIGTERM, the
    search process gone) was not judged, so a re-run of the command runs it with the same
    parameters, counted once, and shown as its retry (`retry_of`)."""
    with quiet():
        _retry()(handle, trial)


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _sqlite_wal(path: str) -> None:
    with sqlite3.connect(path, timeout=60) as connection:
        connection.execute("PRAGMA journal_mode=WAL")


def make_sampler(study: StudyDef, seed: int | None) -> optuna.samplers.BaseSampler:
    """TPE (grouped: conditional parameters are modelled per branch), NSGA-II, random, or the
    grid of every configuration."""
    spec = study.sampler_def()
    if spec.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if spec.kind == "grid":
        with quiet():
            return grid_sampler(seed)
    if spec.kind == "nsga2":
        size = spec.population_size or max(4, min(50, study.trials // 3))
        return optuna.samplers.NSGAIISampler(population_size=size, seed=seed)
    startup = spec.startup_trials
    if startup is None:
        startup = max(3, min(10, study.trials // 4))
    with quiet():
        return optuna.samplers.TPESampler(
            n_startup_trials=startup, seed=seed, multivariate=True, group=True, constant_liar=True
        )


def make_pruner(study: StudyDef) -> optuna.pruners.BasePruner:
    spec = study.pruner_def()
    if spec.kind == "median":
        return _EvalMedianPruner(spec.startup_trials, spec.warmup_evals)
    if spec.kind == "hyperband":
        # Resources are training steps; 'auto' reads the largest from the first finished trial.
        return optuna.pruners.HyperbandPruner(reduction_factor=spec.reduction_factor)
    return optuna.pruners.NopPruner()


class _EvalMedianPruner(optuna.pruners.MedianPruner):
    """Optuna's median pruner, with its warm-up counted in evaluations of the trial rather than
    in training steps (a study's `eval_every` may be searched)."""

    def __init__(self, startup_trials: int, warmup_evals: int):
        super().__init__(n_startup_trials=startup_trials)
        self._warmup_evals = warmup_evals

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if len(trial.intermediate_values) <= self._warmup_evals:
            return False
        return super().prune(study, trial)


def open_study(study: StudyDef, storage: RDBStorage, name: str) -> optuna.Study:
    """Create the study in storage, or load it (resume). A stored study made from another
    definition is refused rather than mixed."""
    try:
        handle = optuna.create_study(
            study_name=name,
            storage=storage,
            sampler=make_sampler(study, study.sampler_def().seed),
            pruner=make_pruner(study),
            directions=study.directions,
            load_if_exists=True,
        )
    except ValueError as err:  # e.g. the stored study has other directions
        raise SearchError(f"study {name!r}: {err}") from None
    stored = handle.user_attrs.get("digest")
    if stored is None:
        handle.set_user_attr("digest", study.digest())
        handle.set_user_attr("definition", study.model_dump(mode="json"))
    elif stored != study.digest():
        raise SearchError(
            f"study {name!r} in this storage was made from another definition (task, space, "
            "objectives, sampler or pruner differ); pass --name to start a new study, or "
            "restore the definition it was made from"
        )
    return handle


def stored_definition(handle: optuna.Study) -> StudyDef | None:
    data = handle.user_attrs.get("definition")
    return load_study(data) if isinstance(data, dict) else None


def open_existing(
    source: str, storage: str | None = None, name: str | None = None
) -> tuple[optuna.Study, StudyDef]:
    """A study already in storage, for reading (report, export). `source` is the study YAML
    (its name and default storage follow from it) or the study's name."""
    from miras.search.study import StudyError

    path = Path(source)
    definition = None
    if path.suffix in (".yaml", ".yml") or path.is_file():
        definition = resolve_directions(load_study(path))  # StudyError when it does not exist
        name = name or definition.name
    else:
        name = name or source
    url = storage or default_storage(name)
    from sqlalchemy.engine import make_url

    database = make_url(url).database if url.startswith("sqlite") else None
    if database and not Path(database).is_file():
        raise SearchError(f"storage: no such file {database}; run `miras search` first")
    rdb = open_storage(url, interval=60, grace=120)
    try:
        handle = optuna.load_study(study_name=name, storage=rdb, sampler=None)
    except KeyError:
        names = [s.study_name for s in optuna.get_all_study_summaries(rdb)]
        raise SearchError(
            f"no study named {name!r} in {masked(url)}; studies there: {', '.join(names) or 'none'}"
        ) from None
    try:
        stored = stored_definition(handle)
    except StudyError as err:  # stored by another miras version
        raise SearchError(
            f"study {name!r}: its stored definition no longer validates: {err}"
        ) from None
    if stored is not None:
        definition = resolve_directions(stored)
    if definition is None:
        raise SearchError(f"study {name!r} was not made by `miras search`: no definition stored")
    return handle, definition
