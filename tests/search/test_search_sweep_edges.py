"""Does a sweep bracket its selection? The logspace sweep form (`{logspace: [lo, hi, n],
extend, max_extend}`) and its validation; the edge mark of a trial whose selected point lies at
the lowest or highest value of a numeric sweep; `extend: true`, which runs the values past
that edge until the selection is bracketed or `max_extend` is reached, resumably; and the
mark in the leaderboard, the summary table and the report."""

from __future__ import annotations

import math

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from miras.search import StudyError, load_study, open_storage, open_study, search
from miras.search import objective as objective_module
from miras.search.edges import edge, edge_text, edges_of
from miras.search.objective import run_trial
from miras.search.space import grid, logspace_value, parse
from miras.search.study import resolve_directions
from tests.search_support import TINY

FIXED_SPEC = {**TINY["spec"], "bias": {"choices": ["l2"]}, "model": {**TINY["spec"]["model"]}}
FIXED_SPEC["model"]["chunk_size"] = 16


def study_with(lr, name: str = "edges", replicates: int = 2, **train):
    """The tiny study, its spec fixed, with `lr` as the train section's lr (a sweep)."""
    settings = {**TINY["train"], "steps": 10, "lr": lr, **train}
    data = {**TINY, "name": name, "spec": FIXED_SPEC, "train": settings}
    return {**data, "replicates": replicates, "pruner": "none"}


def problems_of(data) -> dict[str, str]:
    with pytest.raises(StudyError) as caught:
        load_study(data)
    return {p.path: p.message for p in caught.value.problems}


# ---------------------------------------------------------------------------------------------
# The logspace form


def test_a_logspace_gives_n_values_from_lo_to_hi_on_a_log_scale():
    node, problems = parse({"lr": {"sweep": {"logspace": [1.0e-4, 1.0e-2, 4]}}}, "train")
    assert not problems
    values = [point["lr"] for point in grid(node)]
    # 1e-4 x 100 ** (i / 3): the ends exactly as written, the ratio 100 ** (1/3) = 4.6416.
    assert values[0] == 1.0e-4 and values[3] == 1.0e-2
    assert values[1:3] == pytest.approx([4.6415888e-4, 2.1544347e-3], rel=1e-7)
    sweep = node.fields["lr"]
    assert (sweep.extend, sweep.max_extend, sweep.logspace) == (False, 0, (1.0e-4, 1.0e-2, 4))
    # Past the ends the same ratio goes on: one step below lo, one above hi.
    assert sweep.value_at(-1) == pytest.approx(1.0e-4 / 100 ** (1 / 3), rel=1e-12)
    assert sweep.value_at(4) == pytest.approx(1.0e-2 * 100 ** (1 / 3), rel=1e-12)
    assert logspace_value((1.0, 8.0, 4), 1) == pytest.approx(2.0, rel=1e-12)


def test_extend_defaults_to_three_points_and_a_list_sweep_still_works():
    study = load_study(study_with({"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "extend": True}}))
    sweep = study.train_space.fields["lr"]
    assert sweep.extend and sweep.max_extend == 3
    assert [p["lr"] for p in study.sweep_points] == pytest.approx([1e-3, 10**-2.5, 1e-2])
    bounded = {"logspace": [1.0e-3, 1.0e-2, 3], "extend": True, "max_extend": 10}
    assert load_study(study_with({"sweep": bounded})).train_space.fields["lr"].max_extend == 10
    off = load_study(study_with({"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "extend": False}}))
    assert not off.train_space.fields["lr"].extend
    listed = load_study(study_with({"sweep": [1.0e-3, 3.0e-3]}))
    assert listed.sweep_points == [{"lr": 1.0e-3}, {"lr": 3.0e-3}]
    assert not listed.train_space.fields["lr"].extend


def test_bad_logspace_values_are_named_with_their_path_and_the_allowed_values():
    paths = problems_of(
        study_with(
            {"sweep": {"logspace": [0, 1.0e-2, 1.5], "extend": "yes", "max_extend": 11}},
            weight_decay={"sweep": {"logspace": [0.1, 0.01, 3], "extnd": True}},
            grad_clip={"sweep": {"logspace": ["1e-3", 1.0, 2]}},
        )
    )
    assert paths["train.lr.sweep.logspace[0]"] == (
        "expected the lowest value, a number > 0 (a log scale), got 0"
    )
    assert paths["train.lr.sweep.logspace[2]"] == (
        "expected how many values, an integer from 2 to 64, got 1.5"
    )
    assert paths["train.lr.sweep.extend"] == "expected true or false, got 'yes'"
    assert paths["train.lr.sweep.max_extend"] == "expected an integer from 1 to 10, got 11"
    assert paths["train.weight_decay.sweep.logspace[1]"] == (
        "expected the highest value, a number > lo = 0.1, got 0.01"
    )
    assert paths["train.weight_decay.sweep.extnd"] == (
        "unknown key of a logspace sweep; allowed: logspace, extend, max_extend "
        "(did you mean 'extend'?)"
    )
    assert "YAML reads 1e-3 as text" in paths["train.grad_clip.sweep.logspace[0]"]


@pytest.mark.parametrize(
    ("lr", "path", "words"),
    [
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2]}}, "train.lr.sweep.logspace", "[lo, hi, n]"),
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2, 1]}}, "train.lr.sweep.logspace[2]", "from 2"),
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2, True]}}, "train.lr.sweep.logspace[2]", "got True"),
        ({"sweep": {"logspace": [1.0e-3, 1.0e-2, 65]}}, "train.lr.sweep.logspace[2]", "to 64"),
        ({"sweep": {"logspace": [-1.0, 1.0, 3]}}, "train.lr.sweep.logspace[0]", "> 0"),
        ({"sweep": {"logspace": [1.0, 1.0, 3]}}, "train.lr.sweep.logspace[1]", "> lo = 1.0"),
        ({"sweep": {"extend": True}}, "train.lr.sweep", "needs logspace: [lo, hi, n]"),
        (
            {"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "max_extend": 2}},
            "train.lr.sweep.max_extend",
            "only with extend: true",
        ),
        (
            {"sweep": {"logspace": [1.0e-3, 1.0e-2, 3], "extend": True, "max_extend": 0}},
            "train.lr.sweep.max_extend",
            "an integer from 1 to 10, got 0",
        ),
        (
            {"sweep": [1.0e-3, 1.0e-2], "extend": True},
            "train.lr.extend",
            "extend goes inside a logspace sweep: {sweep: {logspace: [lo, hi, n], extend: true}}",
        ),
        ({"sweep": {}}, "train.lr.sweep", "needs logspace"),
        ({"sweep": 3}, "train.lr.sweep", "a non-empty list of values or {logspace: [lo, hi, n]}"),
    ],
)
def test_each_bad_sweep_form_is_one_named_problem(lr, path, words):
    paths = problems_of(study_with(lr))
    assert list(paths) == [path] and words in paths[path]


def test_the_problem_names_the_file(tmp_path):
    import yaml

    file = tmp_path / "edges.yaml"
    file.write_text(yaml.safe_dump(study_with({"sweep": {"logspace": [0, 1.0, 3]}})))
    with pytest.raises(StudyError) as caught:
        load_study(file)
    assert str(caught.value).startswith(f"{file}: 1 problem in the study")
    assert "train.lr.sweep.logspace[0]" in str(caught.value)


def test_a_logspace_sweeps_real_valued_settings_only():
    paths = problems_of(study_with(1.0e-3, steps={"sweep": {"logspace": [10, 1000, 3]}}))
    assert paths == {
        "train.steps.sweep.logspace": "a logspace gives real numbers, and steps is not one; "
        "give its values as a list ({sweep: [...]})"
    }
    # early_stop is `float | None`: a real number, so a logspace may sweep it.
    assert load_study(study_with(1.0e-3, early_stop={"sweep": {"logspace": [0.5, 0.9, 3]}}))


def test_a_logspace_of_an_unknown_setting_is_named_at_its_ends():
    # The probes check a logspace at its ends, which bracket every value between (as a
    # range's bounds do).
    paths = problems_of(study_with(1.0e-3, lr2={"sweep": {"logspace": [1.0e-3, 1.0e-2, 3]}}))
    assert list(paths) == ["train.lr2.sweep.logspace[0]", "train.lr2.sweep.logspace[1]"]
    assert "unknown setting 'lr2'" in paths["train.lr2.sweep.logspace[0]"]


def test_extension_points_count_toward_the_grid_limit():
    lr = {"sweep": {"logspace": [1.0e-4, 1.0e-2, 8], "extend": True, "max_extend": 10}}
    paths = problems_of(
        study_with(lr, weight_decay={"sweep": [0.0, 0.01, 0.1, 0.2, 0.3, 0.4, 0.5]})
    )
    assert paths["train"] == (
        "the sweeps make 56 points (lr 8 x weight_decay 7), and up to 10 more past their edges "
        "(extend); at most 64, each trained on every seed"
    )
    lr["sweep"]["max_extend"] = 8
    weights = {"sweep": [0.0, 0.01, 0.1, 0.2, 0.3, 0.4, 0.5]}
    assert load_study(study_with(lr, weight_decay=weights)), "56 + 8 = 64 points fit"


# ---------------------------------------------------------------------------------------------
# The edge mark and the extension, with scripted runs


class Scripted:
    """sweep_run with a known optimum: the validation accuracy is 0.9 at lr = `peak` and falls
    by 0.1 per decade away from it (0.01 lower on seed 1); the test accuracy is 0.05 below.
    Runs whose lr is in `diverge` diverge; a run at `kill` = (lr, seed) raises, as a killed
    worker stops. Records (lr, seed, prunes) per call."""

    def __init__(self, peak: float, diverge=(), kill=None):
        self.peak, self.diverge, self.kill = peak, diverge, kill
        self.calls: list[tuple[float, int, bool]] = []

    def __call__(self, study, task, trial, spec, args, prunes):
        lr, seed = args["lr"], args["seed"]
        if self.kill is not None and (lr, seed) == pytest.approx(self.kill, rel=1e-9):
            raise RuntimeError("worker killed")
        self.calls.append((lr, seed, prunes))
        if any(lr == pytest.approx(d, rel=1e-9) for d in self.diverge):
            raise objective_module.SeedDiverged("training loss is nan at step 3")
        valid = 0.9 - 0.1 * abs(math.log10(lr / self.peak)) - 0.01 * seed
        measures = {"params": 10.0, "throughput": 1.0}
        return {"accuracy": valid, **measures}, {"accuracy": valid - 0.05, **measures}

    def lrs(self) -> list[float]:
        return [lr for lr, _, _ in self.calls]


def run_scripted(monkeypatch, lr, runs: Scripted, **train) -> optuna.trial.BaseTrial:
    monkeypatch.setattr(objective_module, "sweep_run", runs)
    definition = resolve_directions(load_study(study_with(lr, **train)))
    trial = optuna.create_study(direction="maximize").ask()
    run_trial(definition, definition.make_task(), trial)
    return trial


LISTED = {"sweep": [1.0e-3, 3.0e-3, 1.0e-2]}
DECADES = {"sweep": {"logspace": [1.0e-4, 1.0e-2, 3], "extend": True}}  # 1e-4, 1e-3, 1e-2


def test_edge_names_the_lowest_and_highest_numbers_only():
    assert (
        edge(1, [1, 2, 3]) == "low" and edge(3, [3, 1, 2]) == "high" and edge(2, [1, 2, 3]) is None
    )
    assert edge(1, [1]) is None, "one value brackets nothing"
    assert edge("a", ["a", "b"]) is None and edge(None, [None, 1.0]) is None, "no order"
    assert edge(True, [True, False]) is None, "true/false is not a number here"
    points = [{"lr": 1, "wd": 0.0}, {"lr": 2, "wd": 0.1}, {"lr": 3, "wd": 0.0}]
    assert edges_of(points, {"lr": 3, "wd": 0.0}) == {"lr": "high", "wd": "low"}
    assert edge_text({"lr": "high", "wd": "low"}) == "lr at the high edge, wd at the low edge"
    assert edge_text({}) == ""


@pytest.mark.parametrize(
    ("peak", "selected", "at_edge"),
    [(1.0e-1, 1.0e-2, {"lr": "high"}), (1.0e-5, 1.0e-3, {"lr": "low"}), (3.0e-3, 3.0e-3, {})],
)
def test_a_selection_at_the_edge_of_a_list_sweep_is_marked(monkeypatch, peak, selected, at_edge):
    runs = Scripted(peak)
    trial = run_scripted(monkeypatch, LISTED, runs)
    assert trial.user_attrs["selected"]["values"] == {"lr": selected}
    assert trial.user_attrs["at_edge"] == at_edge
    assert runs.lrs() == [1.0e-3, 1.0e-3, 3.0e-3, 3.0e-3, 1.0e-2, 1.0e-2], "a list never extends"
    assert "extended" not in trial.user_attrs


def test_a_diverged_neighbour_brackets_the_selection(monkeypatch):
    # The optimum lies past 1e-2, but 1e-2 diverged: 3e-3 is selected between a worse point
    # and a diverged one, so the sweep brackets it.
    trial = run_scripted(monkeypatch, LISTED, Scripted(1.0e-1, diverge=[1.0e-2]))
    assert trial.user_attrs["selected"]["values"] == {"lr": 3.0e-3}
    assert trial.user_attrs["at_edge"] == {}
    assert trial.user_attrs["reason"] == "1 of 3 sweep points diverged"


def test_extend_runs_past_the_high_edge_until_the_selection_is_bracketed(monkeypatch):
    runs = Scripted(1.0e-1)  # past the sweep's top, 1e-2
    trial = run_scripted(monkeypatch, DECADES, runs)
    # 1e-2 selected at the high edge: 1e-1 runs on both seeds and wins, at the edge again, so
    # 1 runs and loses: 1e-1 is bracketed.
    assert runs.lrs() == pytest.approx([1e-4, 1e-4, 1e-3, 1e-3, 1e-2, 1e-2, 0.1, 0.1, 1, 1])
    assert [seed for _, seed, _ in runs.calls] == [0, 1] * 5
    assert [prunes for *_, prunes in runs.calls] == [True] + [False] * 9, "first run only"
    selected = trial.user_attrs["selected"]
    assert selected["point"] == 3 and selected["values"]["lr"] == pytest.approx(0.1)
    assert selected["valid"] == pytest.approx((0.9 + 0.89) / 2)
    assert trial.user_attrs["at_edge"] == {}
    assert trial.user_attrs["extended"] == {"lr": {"low": 0, "high": 2}}
    sweep = trial.user_attrs["sweep"]
    assert [(r["point"], r["seed"]) for r in sweep] == [(p, s) for p in range(5) for s in (0, 1)]
    assert sweep[9]["values"]["lr"] == pytest.approx(1.0)
    assert sweep[9]["valid"]["accuracy"] == pytest.approx(0.9 - 0.1 - 0.01)
    # The trial reports the extension point's test metrics, and trains it when exported.
    assert trial.user_attrs["metrics"]["accuracy"] == pytest.approx((0.85 + 0.84) / 2)
    assert trial.user_attrs["train"]["lr"] == pytest.approx(0.1)


def test_extend_runs_past_the_low_edge_and_stops_at_max_extend_keeping_the_mark(monkeypatch):
    lr = {"sweep": {**DECADES["sweep"], "max_extend": 2}}
    runs = Scripted(1.0e-9)  # far below: each step down wins
    trial = run_scripted(monkeypatch, lr, runs)
    assert runs.lrs() == pytest.approx([1e-4, 1e-4, 1e-3, 1e-3, 1e-2, 1e-2, 1e-5, 1e-5, 1e-6, 1e-6])
    assert trial.user_attrs["selected"]["values"]["lr"] == pytest.approx(1e-6)
    assert trial.user_attrs["at_edge"] == {"lr": "low"}, "stopped at the limit, still unbracketed"
    assert trial.user_attrs["extended"] == {"lr": {"low": 2, "high": 0}}


def test_the_default_limit_is_three_points(monkeypatch):
    runs = Scripted(1.0e3)
    trial = run_scripted(monkeypatch, DECADES, runs)
    assert runs.lrs()[6:] == pytest.approx([0.1, 0.1, 1, 1, 10, 10])
    assert trial.user_attrs["at_edge"] == {"lr": "high"}
    assert trial.user_attrs["extended"] == {"lr": {"low": 0, "high": 3}}


def test_a_diverged_extension_point_brackets_the_edge(monkeypatch):
    runs = Scripted(1.0e3, diverge=[0.1])
    trial = run_scripted(monkeypatch, DECADES, runs)
    assert runs.lrs()[6:] == pytest.approx([0.1, 0.1]), "one step: it diverged, so no further"
    assert trial.user_attrs["selected"]["values"] == {"lr": 1.0e-2}
    assert trial.user_attrs["at_edge"] == {}
    assert trial.user_attrs["reason"] == "1 of 4 sweep points diverged"


def test_a_selection_inside_the_sweep_runs_nothing_more(monkeypatch):
    runs = Scripted(1.0e-3)
    trial = run_scripted(monkeypatch, DECADES, runs)
    assert len(runs.calls) == 6
    assert trial.user_attrs["at_edge"] == {}
    assert trial.user_attrs["extended"] == {"lr": {"low": 0, "high": 0}}


def test_with_two_sweeps_the_extension_point_keeps_the_other_selected_values(monkeypatch):
    # weight_decay is a list: marked when at its edge, never extended. The scripted accuracy
    # ignores it, so the tie goes to the earlier point, weight_decay 0.0 (its low edge).
    runs = Scripted(1.0e-1)
    trial = run_scripted(monkeypatch, DECADES, runs, weight_decay={"sweep": [0.0, 0.1]})
    assert len(runs.calls) == 3 * 2 * 2 + 2 * 2, "the grid, then one point per extension"
    sweep = trial.user_attrs["sweep"]
    assert [r["values"]["weight_decay"] for r in sweep[12:]] == [0.0] * 4
    assert [r["values"]["lr"] for r in sweep[12:]] == pytest.approx([0.1, 0.1, 1, 1])
    assert trial.user_attrs["selected"]["values"] == {"lr": pytest.approx(0.1), "weight_decay": 0.0}
    assert trial.user_attrs["at_edge"] == {"weight_decay": "low"}
    assert trial.user_attrs["extended"] == {"lr": {"low": 0, "high": 2}}


def test_a_retried_trial_resumes_its_extension_points(tmp_path, monkeypatch):
    """A worker killed during the second extension point (lr 1, seed 1) left nine runs; its
    retry runs only the missing one, then goes on extending from the same selection."""
    killed = Scripted(1.0e3, kill=(1.0, 1))
    monkeypatch.setattr(objective_module, "sweep_run", killed)
    definition = resolve_directions(load_study(study_with(DECADES)))
    first = optuna.create_study(direction="maximize").ask()
    with pytest.raises(RuntimeError, match="worker killed"):
        run_trial(definition, definition.make_task(), first)
    kept = first.user_attrs["sweep"]
    assert [(r["point"], r["seed"]) for r in kept] == [(p, s) for p in range(5) for s in (0, 1)][:9]

    storage = f"sqlite:///{tmp_path / 'edges.db'}"
    rdb = open_storage(storage, 1, 3)
    handle = open_study(load_study(study_with(DECADES)), rdb, "edges")
    handle.add_trial(
        create_trial(
            state=TrialState.FAIL,
            params={"bias": "l2"},
            distributions={"bias": CategoricalDistribution(["l2"])},
            user_attrs={"sweep": kept},
        )
    )
    rdb.get_heartbeat_stale_trial_callback()(handle, handle.get_trials()[0])
    runs = Scripted(1.0e3)
    monkeypatch.setattr(objective_module, "sweep_run", runs)
    search(study_with(DECADES), storage=storage, trials=1)
    assert runs.calls == [
        (pytest.approx(1.0), 1, False),
        (pytest.approx(10.0), 0, False),
        (pytest.approx(10.0), 1, False),
    ]
    (retry,) = [t for t in handle.get_trials() if t.system_attrs.get("failed_trial") == 0]
    assert retry.state == TrialState.COMPLETE
    assert retry.user_attrs["sweep"][:9] == kept
    assert [r["point"] for r in retry.user_attrs["sweep"][9:]] == [4, 5, 5]
    assert retry.user_attrs["at_edge"] == {"lr": "high"}
    assert retry.user_attrs["selected"]["point"] == 5


# ---------------------------------------------------------------------------------------------
# The mark in the leaderboard, the summary table and the report


def finished(number: int, chosen: float, at_edge=None, bias: str = "l2"):
    """A complete trial that swept lr over 1e-3, 3e-3, 1e-2 on two seeds and selected `chosen`
    (its test accuracy 0.8 and 0.9). Without `at_edge` it is a trial stored before that
    attribute existed: the report works the edge out from its records."""
    lrs = (1.0e-3, 3.0e-3, 1.0e-2)
    sweep = [
        {"point": i, "values": {"lr": lr}, "seed": seed, "valid": {"accuracy": 0.5}, "test": {}}
        for i, lr in enumerate(lrs)
        for seed in (0, 1)
    ]
    seeds = [{"accuracy": 0.8 + 0.1 * seed} for seed in (0, 1)]
    attrs = {
        "sweep": sweep,
        "selected": {"point": lrs.index(chosen), "values": {"lr": chosen}, "valid": 0.5},
        "replicates": [{"seed": i, "metrics": m, "seconds": 1.0} for i, m in enumerate(seeds)],
        "metrics": {"accuracy": 0.85},
    }
    if at_edge is not None:
        attrs["at_edge"] = at_edge
    trial = create_trial(
        state=TrialState.COMPLETE,
        values=[0.85 - number / 100],
        params={"bias": bias},
        distributions={"bias": CategoricalDistribution(["l2", "dot"])},
        user_attrs=attrs,
    )
    trial.number = number
    return trial


MARKED = [
    finished(0, 1.0e-2, at_edge={"lr": "high"}),
    finished(1, 3.0e-3, at_edge={}, bias="dot"),
    finished(2, 1.0e-3),  # stored before at_edge: lr 1e-3 is the lowest of its records
]


def test_the_leaderboard_and_the_summary_flag_a_sweep_that_did_not_bracket():
    from miras.search.report import leaderboard, summary_data

    board = leaderboard(MARKED, ["accuracy"], ["maximize"])
    assert dict(zip(board["trial"], board["at_edge"], strict=True)) == {
        0: "lr at the high edge",
        1: "",
        2: "lr at the low edge",
    }
    summary = summary_data(MARKED, ["accuracy"], ["maximize"])
    assert list(summary["at_edge"]) == ["lr at the high edge", "", "lr at the low edge"]
    assert list(summary["configuration"]) == [
        "bias=l2 lr=0.01",
        "bias=dot lr=0.003",
        "bias=l2 lr=0.001",
    ]


def test_a_study_without_sweeps_has_no_edge_column():
    from miras.search.report import edge_note, leaderboard, summary_data

    plain = create_trial(
        state=TrialState.COMPLETE,
        values=[0.5],
        params={"bias": "l2"},
        distributions={"bias": CategoricalDistribution(["l2", "dot"])},
        user_attrs={"metrics": {"accuracy": 0.5}},
    )
    plain.number = 0
    assert "at_edge" not in leaderboard([plain], ["accuracy"], ["maximize"])
    assert list(summary_data([plain], ["accuracy"], ["maximize"])["at_edge"]) == [""]
    assert edge_note([plain]) is None


def test_the_summary_table_names_the_setting_and_the_edge():
    import io

    from rich.console import Console

    from miras.cli import print_summary
    from miras.search.report import summary_data

    frame = summary_data(MARKED, ["accuracy"], ["maximize"])

    def render(width: int) -> str:
        console = Console(width=width, file=io.StringIO(), record=True)
        print_summary(console, frame, ["accuracy"], top=10, name="lrs")
        text = console.export_text()
        assert max(map(len, text.splitlines())) <= min(width, 100)
        return text

    rows = {line.split()[0]: line for line in render(300).splitlines() if line[:6].strip()}
    assert "bias=l2 lr=0.01 (lr at the high edge)" in rows["0"]
    assert "bias=l2 lr=0.001 (lr at the low edge)" in rows["2"]
    assert "edge" not in rows["1"], "trial 1 is bracketed: no mark"
    assert "the sweep did not bracket it" in " ".join(render(300).split())
    narrow = render(60).split()  # the label folds over lines, between the other columns
    assert "(lr" in narrow and narrow.count("edge)") == 2
    bracketed = summary_data(MARKED[1:2], ["accuracy"], ["maximize"])
    console = Console(width=300, file=io.StringIO(), record=True)
    print_summary(console, bracketed, ["accuracy"], top=10, name="lrs")
    assert "edge" not in console.export_text()


def test_the_report_notes_each_trial_at_an_edge(tmp_path):
    import yaml
    from typer.testing import CliRunner

    from miras.cli import app
    from miras.search.report import edge_note, write_report

    note = edge_note(MARKED)
    assert note is not None
    assert note.startswith(
        "the selected sweep value lies at the edge of its sweep in trial 0 (lr at the high "
        "edge), trial 2 (lr at the low edge): the sweep did not bracket it"
    )
    assert note.endswith("let it extend ({sweep: {logspace: [lo, hi, n], extend: true}})")
    storage = f"sqlite:///{tmp_path / 'edges.db'}"
    data = study_with(LISTED)
    handle = open_study(load_study(data), open_storage(storage, 1, 3), "edges")
    handle.add_trials(MARKED)
    report = write_report(handle, resolve_directions(load_study(data)), tmp_path / "report")
    assert note in report.notes
    page = report.html.read_text()
    assert "trial 0 (lr at the high edge), trial 2 (lr at the low edge)" in page
    assert "lr at the high edge" in report.csv.read_text()
    # `miras report` prints the summary with its marks and the note as written (its brackets
    # are not read as markup).
    file = tmp_path / "edges.yaml"
    file.write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(
        app, ["report", str(file), "--storage", storage, "-o", str(tmp_path / "cli")]
    )
    assert result.exit_code == 0, result.output
    words = " ".join(result.output.split())
    assert "lr=0.01 (lr at the high edge)" in words and "lr=0.001 (lr at the low edge)" in words
    assert f"note: {note}" in words


def test_a_tiny_extending_study_trains_end_to_end(tmp_path):
    """Real training, one seed: two logspace values, so the selection is at an edge and one
    value past it runs (max_extend 1); the trial, the leaderboard and the report agree."""
    import torch

    from miras.search.report import write_report

    lr = {"sweep": {"logspace": [1.0e-3, 1.0e-2, 2], "extend": True, "max_extend": 1}}
    data = {**study_with(lr, replicates=1), "trials": 1}
    storage = f"sqlite:///{tmp_path / 'edges.db'}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = search(data, storage=storage, trials=1)
    finally:
        torch.set_num_threads(threads)
    (trial,) = summary.trials
    assert trial.state == TrialState.COMPLETE
    runs = trial.user_attrs["sweep"]
    assert [(r["point"], r["seed"]) for r in runs] == [(0, 0), (1, 0), (2, 0)]
    assert all("accuracy" in r["valid"] and "accuracy" in r["test"] for r in runs)
    # The first selection was at an edge of two values; the third run is one ratio (10) past it.
    first = 0 if runs[0]["valid"]["accuracy"] >= runs[1]["valid"]["accuracy"] else 1
    past = runs[2]["values"]["lr"]
    assert past == pytest.approx(1.0e-4 if first == 0 else 1.0e-1)
    side = "low" if first == 0 else "high"
    assert trial.user_attrs["extended"] == {
        "lr": {"low": int(side == "low"), "high": int(side == "high")}
    }
    # At the limit: still at that edge when the value past it won, bracketed otherwise.
    chosen = trial.user_attrs["selected"]["point"]
    assert trial.user_attrs["at_edge"] == ({"lr": side} if chosen == 2 else {})
    assert trial.values == [pytest.approx(runs[chosen]["test"]["accuracy"])]
    report = write_report(
        open_study(load_study(data), open_storage(storage, 1, 3), "edges"),
        resolve_directions(load_study(data)),
        tmp_path / "report",
    )
    mark = f"lr at the {side} edge" if chosen == 2 else ""
    assert list(report.leaderboard["at_edge"]) == [mark]
    assert list(report.summary["at_edge"]) == [mark]
    assert any("edge of its sweep" in note for note in report.notes) == bool(mark)
