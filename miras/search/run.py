"""Running a study: workers, the trial budget, heartbeats and retries, Ctrl-C and SIGTERM.

    summary = search("studies/quickstart.yaml", trials=12, workers=2)

Storage (storage.py) is Optuna's RDB storage: a SQLite file under runs/ by default, or any
SQLAlchemy URL (postgresql://user:pass@host/db) shared by workers on many machines, each
running the same command. Every trial writes a heartbeat; a trial whose worker died (SIGKILL, a lost machine) is
failed after the grace period by the next worker that looks, and re-queued with the same
parameters (`RetryHeartbeatStaleTrialCallback`, Optuna 5's name for RetryFailedTrialCallback).

The budget is the number of finished trials (complete or pruned) in the study, across every
worker and every run: re-running the same command resumes and stops at the same total. Workers
start a trial only while fewer than `trials` are finished, running or queued, and a trial checks
its rank among those when it starts, so two workers that race for the last slot cannot both run
it: the loser is marked failed with reason 'over budget' before it samples anything.

Ctrl-C, SIGTERM and the end of the search process (by any signal, SIGKILL included) stop the
workers of `--workers N`: each marks its running trial failed ('interrupted (...)') and queues
it again with its parameters, so the next run of the command runs it and nothing is lost.
"""

from __future__ import annotations

import _thread
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.storages import fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from miras.search.objective import run_trial
from miras.search.report import summary_data
from miras.search.storage import (
    SearchError,
    default_storage,
    make_sampler,
    open_storage,
    open_study,
    queue_again,
    quiet,
)
from miras.search.study import StudyDef, load_study, objective_order, resolve_directions

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)
LIVE = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
MAX_FAILURES = 3  # consecutive failed trials (errors, not prunes) that stop a worker

log = logging.getLogger("miras.search")


class OverBudget(Exception):
    """Another worker took the last slot of the budget first; this trial does not run."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, or the search process gone: the search stops as on Ctrl-C (the running trial is
    marked failed and queued again), and the command exits with status 143 instead of 130."""


# ---------------------------------------------------------------------------------------------
# Counting


@dataclass(frozen=True)
class Counts:
    complete: int = 0
    pruned: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    retried: int = 0  # trials that re-run a trial whose worker died

    @property
    def finished(self) -> int:
        return self.complete + self.pruned

    @property
    def live(self) -> int:
        return self.finished + self.running + self.waiting


def count(trials: list[FrozenTrial]) -> Counts:
    states = [t.state for t in trials]
    return Counts(
        complete=states.count(TrialState.COMPLETE),
        pruned=states.count(TrialState.PRUNED),
        failed=states.count(TrialState.FAIL),
        running=states.count(TrialState.RUNNING),
        waiting=states.count(TrialState.WAITING),
        retried=sum("failed_trial" in t.system_attrs and t.state in FINISHED for t in trials),
    )


def rank(trials: list[FrozenTrial], number: int) -> int:
    """How many live trials (finished, running or queued) come before trial `number`."""
    return sum(t.state in LIVE and t.number < number for t in trials)


def best(trials: list[FrozenTrial], directions: list[str]) -> FrozenTrial | None:
    """The best complete trial on the first objective (ties: the next objectives, in order)."""
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.values]
    if not done:
        return None
    return min(done, key=lambda t: (objective_order(t.values, directions), t.number))


# ---------------------------------------------------------------------------------------------
# One worker


@dataclass
class WorkerOptions:
    study: dict[str, Any]  # the definition, as JSON (processes receive it pickled)
    storage: str
    name: str
    trials: int
    timeout: float | None = None
    index: int = 0  # this worker's index on this machine
    workers: int = 1  # workers on this machine
    threads: int = 1  # torch threads per worker


def run_worker(options: WorkerOptions, on_trial: Callable[[], None] | None = None) -> Counts:
    """Run trials until the study holds `trials` finished ones, or `timeout` s have passed.

    A KeyboardInterrupt (Ctrl-C) or a SIGTERM (`Terminated`) inside a trial marks it failed
    with reason 'interrupted (...)', queues it again with its parameters and propagates; the
    storage stays consistent and the next run of the command runs the queued trial."""
    import torch

    # Small models train fastest on one thread; more threads per worker than cores / workers
    # oversubscribe the CPU, and OpenMP threads that spin for a core slow down tenfold.
    previous = torch.get_num_threads()
    torch.set_num_threads(options.threads)
    try:
        with _Interrupts() as interrupts:
            return _run_worker(options, on_trial, interrupts)
    finally:
        torch.set_num_threads(previous)  # an in-process search leaves the caller's setting


_TRITON = os.sep + "triton" + os.sep


def _under_triton(frame: Any) -> bool:
    """Whether the main thread runs inside triton (torch imports and calls it), where its
    Python may have been called from its C++ extension."""
    while frame is not None:
        if _TRITON in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


class _Interrupts:
    """Ctrl-C and SIGTERM raise at once (KeyboardInterrupt, `Terminated`) and are also
    remembered (`seen`, the signal's number): Python drops an exception raised while it runs a
    weakref callback or a `__del__` (SQLAlchemy's class registry has one), so an interrupt that
    lands there would let the trial run on to the end. The worker checks `seen` after each trial
    and between trials. Python prints such a dropped exception as an "Exception ignored in ..."
    traceback; that one is not printed (the interrupt is not lost: `seen` holds it). Active
    only in the main thread, for each signal still under Python's default handling."""

    def __init__(self):
        self.seen: int | None = None
        self.previous: dict[int, Any] = {}
        self.unraisable: Any = None
        # An interrupt is on its way out of the running trial: a further one (a search process
        # killed by SIGKILL sends two, the parent-death signal and then the parent watch's) is
        # remembered in `seen` but raises nothing. Raised while the trial is marked, queued
        # again and told failed, it would leave it failed with no reason and not queued, or
        # RUNNING until the heartbeat's grace ran out (seen in the full suite under load).
        self.stopping = False

    def error(self) -> KeyboardInterrupt:
        return Terminated() if self.seen == signal.SIGTERM else KeyboardInterrupt()

    def _handle(self, signum: int, frame: Any) -> None:
        self.seen = signum
        if self.stopping:
            return
        if _under_triton(frame):
            # Raised here, the interrupt could cross a frame of triton's C++ extension, which
            # cannot carry it and aborts the process (`terminate called after throwing an
            # instance of 'nanobind::python_error'`: the trial stays RUNNING). Ask again shortly,
            # when the main thread is likely elsewhere.
            threading.Timer(0.01, _thread.interrupt_main, args=(signum,)).start()
            return
        raise self.error()

    def _drop_interrupt(self, unraisable: Any) -> None:
        if not isinstance(unraisable.exc_value, KeyboardInterrupt):
            self.unraisable(unraisable)

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is not threading.main_thread():
            return self
        defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
        for signum, default in defaults.items():
            if signal.getsignal(signum) is default:
                self.previous[signum] = signal.signal(signum, self._handle)
        if self.previous:
            self.unraisable, sys.unraisablehook = sys.unraisablehook, self._drop_interrupt
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self.previous.items():
            signal.signal(signum, previous)
        if self.previous:
            sys.unraisablehook = self.unraisable


def _run_worker(
    options: WorkerOptions, on_trial: Callable[[], None] | None, interrupts: _Interrupts
) -> Counts:
    study = resolve_directions(load_study(options.study))
    storage = open_storage(options.storage, study.heartbeat.interval, study.heartbeat.grace)
    handle = open_study(study, storage, options.name)
    handle.sampler = make_sampler(study, _worker_seed(study, handle, options))
    task = study.make_task()
    deadline = None if options.timeout is None else time.monotonic() + options.timeout
    poll = min(1.0, study.heartbeat.interval)

    def objective(trial: optuna.Trial) -> Any:
        # Everything from the trial's start inside the try: an interrupt that lands in the
        # budget check's storage read (the trial is already RUNNING) is marked and queued
        # again like one in training (the full suite under load saw a trial failed with no
        # reason there).
        try:
            trials = handle.get_trials(deepcopy=False)
            if rank(trials, trial.number) >= options.trials:
                trial.set_user_attr("reason", "over budget: another worker took the last trial")
                raise OverBudget(f"trial {trial.number} is over the budget of {options.trials}")
            value = run_trial(study, task, trial)
            if interrupts.seen:  # an interrupt whose exception Python dropped
                raise interrupts.error()
            return value
        except KeyboardInterrupt as stop:
            interrupts.stopping = True  # this one ends the worker: no other may cut it short
            try:  # queued before the reason is set: the copy starts without it
                _queue_again_if_sampled(handle, trial.number)
            except Exception as err:  # the interrupt goes on; a re-run samples a new trial
                log.warning("trial %d could not be queued again: %s", trial.number, err)
            trial.set_user_attr("reason", _interrupt_reason(stop))
            raise
        except (optuna.TrialPruned, OverBudget):
            raise
        except Exception as err:
            trial.set_user_attr("error", f"{type(err).__name__}: {err}")
            raise

    failures = 0
    while True:
        if interrupts.seen:
            raise interrupts.error()
        with quiet():
            fail_stale_trials(handle)  # a dead worker's trial: failed and re-queued
        counts = count(handle.get_trials(deepcopy=False))
        if counts.finished >= options.trials:
            return counts
        if deadline is not None and time.monotonic() >= deadline:
            return counts
        if counts.waiting == 0 and counts.live >= options.trials:
            # The last trials run elsewhere; wait in case one dies and is re-queued.
            time.sleep(poll)
            continue
        trial = _optimize_one(handle, objective)
        if trial is None:
            continue
        reason = trial.user_attrs.get("reason", "")
        if trial.state == TrialState.FAIL and not reason.startswith("over budget"):
            failures += 1
            log.warning("trial %d failed: %s", trial.number, trial.user_attrs.get("error"))
        else:
            failures = 0
        if failures >= MAX_FAILURES:
            raise SearchError(
                f"{failures} trials in a row failed; the last: {trial.user_attrs.get('error')}. "
                "Finished trials are kept; fix the cause and re-run the same command to resume "
                "(MIRAS_DEBUG=1 shows the tracebacks)"
            )
        if on_trial is not None:
            on_trial()


def _optimize_one(
    handle: optuna.Study, objective: Callable[[optuna.Trial], Any]
) -> FrozenTrial | None:
    """One trial through `study.optimize`, which brings the heartbeat thread and the
    fail-stale check; returns the finished trial, or None when another worker failed it first."""
    seen: list[FrozenTrial] = []

    # Errors of a trial are caught (the trial is marked failed; MAX_FAILURES stops the worker);
    # KeyboardInterrupt is not an Exception, so Ctrl-C still propagates after the mark. Optuna
    # logs each failure with its traceback: shown only with MIRAS_DEBUG=1, the error itself is
    # logged in one line by the caller.
    debug = os.environ.get("MIRAS_DEBUG", "") not in ("", "0")
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING if debug else optuna.logging.ERROR)
    try:
        handle.optimize(
            objective,
            n_trials=1,
            catch=(Exception,),
            callbacks=[lambda _study, trial: seen.append(trial)],
            gc_after_trial=False,
        )
    except optuna.exceptions.UpdateFinishedTrialError as err:
        # This worker was too slow to beat (a machine swapping, a paused process): another
        # worker took its trial for dead, failed it and queued a retry, which counts instead.
        log.warning(
            "a running trial was failed by another worker (its heartbeats came later than "
            "heartbeat.grace; raise it if this repeats): %s",
            err,
        )
        return None
    finally:
        optuna.logging.set_verbosity(verbosity)
    return seen[-1]


def _worker_seed(study: StudyDef, handle: optuna.Study, options: WorkerOptions) -> int | None:
    """The sampler's seed. A fresh study run by one worker uses the study's seed, so it is
    reproducible. Any other worker, or a resumed run, mixes in the trials already stored and
    where it runs: equal seeds would sample the same points again (random start-up trials)."""
    seed = study.sampler_def().seed
    if seed is None:
        return None
    existing = len(handle.get_trials(deepcopy=False))
    if options.workers == 1 and existing == 0:
        return seed
    where = f"{seed}:{existing}:{options.index}:{socket.gethostname()}:{os.getpid()}"
    return zlib.crc32(where.encode())


def _queue_again_if_sampled(handle: optuna.Study, number: int) -> None:
    """Trial `number`, interrupted while running, is queued again with its parameters (a trial
    interrupted before it sampled any has nothing to keep: its slot is simply not counted)."""
    running = handle.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for frozen in running:
        if frozen.number == number and frozen.params:
            queue_again(handle, frozen)


# The search process that started this worker process (worker_main), None in the search's own.
_search_process: int | None = None


def _search_process_gone() -> bool:
    """An orphan's parent is its adopter (init, or a subreaper): another pid than its own."""
    return _search_process is not None and os.getppid() != _search_process


def _interrupt_reason(stop: KeyboardInterrupt) -> str:
    if _search_process_gone():
        return "interrupted (the search process exited)"
    return "interrupted (SIGTERM)" if isinstance(stop, Terminated) else "interrupted (Ctrl-C)"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _signal_on_parent_death(signum: int) -> bool:
    """Linux: ask the kernel to send `signum` to this process when the thread that started it
    exits, however it ends (SIGKILL included). False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class _ParentWatch:
    """Interrupts this worker, as SIGTERM would, once the process that started it is gone: the
    portable check (every `interval` s) beside Linux's parent-death signal. Python drops an
    interrupt raised inside a finalizer or a callback (`_Interrupts` then stops the worker at
    the end of its trial), so it is repeated, `patience` s apart, `repeats` times; a worker
    still alive then exits at once and leaves its trial to the heartbeat's grace period."""

    def __init__(self, parent: int, interval: float = 1.0, repeats: int = 3, patience=5.0):
        self.parent, self.interval, self.repeats, self.patience = (
            parent,
            interval,
            repeats,
            patience,
        )
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="parent-watch", daemon=True)

    def start(self) -> _ParentWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        while os.getppid() == self.parent:
            if self.stopped.wait(self.interval):
                return
        for _ in range(self.repeats):
            _thread.interrupt_main(signal.SIGTERM)  # the SIGTERM path: trial queued, exit 143
            if self.stopped.wait(self.patience):
                return
        log.error("worker %d did not stop after %d interrupts: exiting", os.getpid(), self.repeats)
        os._exit(143)


def worker_main(options: WorkerOptions, parent: int | None = None) -> None:
    """The entry point of a worker process (`--workers N`): quiet, one share of the CPU.

    `parent`: the pid of the search process; the worker never outlives it. On Linux the kernel
    sends it SIGTERM when the search process ends (PR_SET_PDEATHSIG, set here, as soon as the
    worker runs Python code); a search process that died before that is seen at once, in
    os.getppid(); and a thread checks the parent every second everywhere. SIGTERM stops the
    worker as Ctrl-C does: its running trial is marked failed and queued again, exit 143."""
    global _search_process
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        if parent is not None:
            _signal_on_parent_death(signal.SIGTERM)
            _search_process = parent
            if _search_process_gone():  # it died before the prctl: no signal will come
                raise Terminated
            _ParentWatch(parent).start()
        run_worker(options)
    except KeyboardInterrupt as stop:
        if _search_process_gone():
            log.error("the search process %d exited: worker %d stopped", parent, options.index)
        raise SystemExit(143 if isinstance(stop, Terminated) else 130) from None
    except SearchError as err:
        logging.getLogger("miras.search").error("worker %d: %s", options.index, err)
        raise SystemExit(1) from None


# ---------------------------------------------------------------------------------------------
# The command


@dataclass
class Summary:
    name: str
    storage: str
    counts: Counts
    best: FrozenTrial | None
    seconds: float
    trials: list[FrozenTrial] = field(default_factory=list)  # every trial, as stored at the end
    table: Any = None  # miras.search.report.summary_data of the trials (a pandas frame)


def search(
    source: Any,
    *,
    trials: int | None = None,
    timeout: float | None = None,
    storage: str | None = None,
    workers: int = 1,
    name: str | None = None,
    threads: int = 1,
    progress: Any = None,
) -> Summary:
    """Run (or resume, or join) a study until it holds `trials` finished trials.

    `progress`, when given, is called as progress(counts, best) after each trial (one worker)
    or every second (several); `miras.search.progress.SearchProgress` draws a bar."""
    study = resolve_directions(load_study(source))
    name = name or study.name
    url = storage or default_storage(name)
    budget = trials or study.trials
    timeout = timeout if timeout is not None else study.timeout
    if workers < 1 or threads < 1:
        raise SearchError(f"workers, threads: expected integers >= 1, got {workers}, {threads}")
    if study.sampler_def().kind == "grid" and budget > study.grid_size:
        raise SearchError(
            f"trials: the grid has {study.grid_size} configurations and each is tried once; "
            f"got {budget}"
        )
    # Open once here: an unreachable storage or a mismatched study fails before any worker.
    handle = open_study(
        study, open_storage(url, study.heartbeat.interval, study.heartbeat.grace), name
    )
    began = time.monotonic()
    options = [
        WorkerOptions(
            study.model_dump(mode="json"), url, name, budget, timeout, i, workers, threads
        )
        for i in range(workers)
    ]

    def report() -> None:
        if progress is not None:
            trials_now = handle.get_trials(deepcopy=False)
            progress(count(trials_now), best(trials_now, study.directions))

    report()
    if workers == 1:
        run_worker(options[0], on_trial=report)
    else:
        _run_processes(options, report)
    trials_now = handle.get_trials(deepcopy=False)
    return Summary(
        name,
        url,
        count(trials_now),
        best(trials_now, study.directions),
        time.monotonic() - began,
        trials_now,
        summary_data(trials_now, study.metrics, study.directions),
    )


def _run_processes(options: list[WorkerOptions], report: Callable[[], None]) -> None:
    """N worker processes (spawned: torch does not survive fork well), watched every second.

    Ctrl-C reaches every process of the terminal's group: each marks its trial and exits.
    SIGTERM reaches this process alone: it is forwarded to the workers, which do the same, and
    the search raises `Terminated` once they are gone. A worker still running 30 s later is
    killed (its trial is then retried through the heartbeat). Should this process die without
    a word (SIGKILL), the workers see it and stop (worker_main)."""
    context = multiprocessing.get_context("spawn")
    parent = os.getpid()
    processes = [
        context.Process(target=worker_main, args=(o, parent), daemon=False) for o in options
    ]
    with _Interrupts() as interrupts:
        try:
            for process in processes:
                process.start()
            while any(p.is_alive() for p in processes):
                if interrupts.seen:  # an interrupt whose exception Python dropped
                    raise interrupts.error()
                report()
                for p in processes:
                    p.join(timeout=1.0 / len(processes))
        except KeyboardInterrupt as stop:
            _stop_workers(processes, forward=isinstance(stop, Terminated))
            raise
    report()
    codes = [p.exitcode for p in processes]
    if 143 in codes:
        raise Terminated
    if 130 in codes:
        raise KeyboardInterrupt
    if any(code != 0 for code in codes):
        raise SearchError(
            f"worker exit codes {codes}: see the messages above; finished trials are kept, "
            "re-run the same command to resume"
        )


def _stop_workers(processes: list[Any], forward: bool, grace: float = 30.0) -> None:
    """Wait up to `grace` s for the started workers to mark their trials and exit (`forward`:
    send them SIGTERM first); kill any still running then."""
    started = [p for p in processes if p.pid is not None]
    if forward:
        for p in started:
            if p.is_alive():
                p.terminate()  # SIGTERM
    deadline = time.monotonic() + grace
    for p in started:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in started:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
