"""Ctrl-C during a training run (docs/training.md, "Resume"): the first one lets the step in
progress finish, the run then saves a checkpoint there and raises `TrainingInterrupted`; a
second one stops at once.

    interrupts = Interrupts(enabled=out_dir is not None, world=ranks.world)
    with interrupts:
        interrupts.between_steps(step)      # the state is whole: a save here is good
        if interrupts.pending: ...          # stop before the next step
        interrupts.mid_update()             # from here to the step's end, half an update

Imports no torch beyond the RNG record of a clean step (`checkpoint.rng_state`).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Any

from miras.training.checkpoint import rng_state


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a run. `checkpoint`: the run's checkpoint file (None when it has none),
    `step`: that checkpoint's step, `saved`: whether it was written at the interrupt (False:
    the checkpoint written before it stands). A KeyboardInterrupt, so callers that stop on
    Ctrl-C still do."""

    def __init__(self, step: int | None, checkpoint: Path | None, saved: bool):
        self.step, self.checkpoint, self.saved = step, checkpoint, saved
        if checkpoint is None:
            text = "interrupted before the run wrote a checkpoint: nothing was saved"
        else:
            what = "saved the checkpoint" if saved else "the last checkpoint is"
            text = f"interrupted: {what} {checkpoint} (step {step})"
        super().__init__(text)


class DeferredInterrupt:
    """While active (a run with a directory, in the main thread, under Python's default Ctrl-C
    handler), the first Ctrl-C only sets `requested`: the run stops at the next step boundary,
    where its state is consistent, and saves it there. A second Ctrl-C interrupts at once."""

    def __init__(self, enabled: bool):
        self.requested = False
        self.active = (
            enabled
            and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        )

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nCtrl-C: stopping after this step to save a checkpoint (Ctrl-C again: stop now)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> DeferredInterrupt:
        if self.active:
            signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.active:
            signal.signal(signal.SIGINT, signal.default_int_handler)


class Interrupts:
    """A run's view of Ctrl-C: whether one is pending, and which step's state a save at an
    interrupt may write.

    One process stops at its own Ctrl-C; several stop together, at the step after any of them
    saw one: `local` travels with each step's loss all-reduce and comes back as `shared`. The
    state is whole between steps (`between_steps`: the step and torch's RNG state there) and
    half-updated from the optimizer's step to the step's end (`mid_update`); a
    KeyboardInterrupt then finds no state to save (`clean` None)."""

    def __init__(self, enabled: bool, world: int, start: int):
        self.deferred = DeferredInterrupt(enabled)
        self.world = world
        self.shared = False  # a Ctrl-C on any rank, as of the last step's all-reduce
        self.clean: int | None = start  # the step whose state the model holds, None mid-update
        self.rng = rng_state()

    def __enter__(self) -> Interrupts:
        self.deferred.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deferred.__exit__(*exc)

    @property
    def local(self) -> bool:
        """A Ctrl-C seen by this process."""
        return self.deferred.requested

    @property
    def pending(self) -> bool:
        """Whether the run stops before its next step."""
        return self.local if self.world == 1 else self.shared

    def between_steps(self, step: int) -> None:
        self.clean, self.rng = step, rng_state()

    def mid_update(self) -> None:
        self.clean = None
