"""Cost-aware studies: the measures (state size in floats and bytes, parameters, throughput) as
objectives beside quality, the Pareto front over every objective, and the window's carried
keys counted at the feature width."""

from __future__ import annotations

import random

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from miras.models.model import build_model
from miras.search import load_study, search
from miras.search.objective import state_size
from miras.search.report import pareto_data, write_report
from miras.spec import load_spec
from tests.search.test_report_browser import browser, rendered  # noqa: F401  (browser: the fixture)
from tests.search_support import TINY


def complete(number: int, values: list[float], **user_attrs):
    trial = create_trial(state=TrialState.COMPLETE, values=values, user_attrs=user_attrs)
    trial.number = number
    return trial


def test_the_front_is_exactly_the_non_dominated_set():
    metrics = ["accuracy", "state_bytes", "throughput"]
    directions = ["maximize", "minimize", "maximize"]
    points = [
        (0.9, 100, 50),  # 0: on the front
        (0.8, 100, 40),  # 1: dominated by 0 on every objective
        (0.9, 100, 50),  # 2: equal to 0, so neither dominates: both on the front
        (0.7, 50, 10),  # 3: the smallest state
        (0.6, 60, 60),  # 4: beaten by 3 on accuracy and state, but the fastest
        (0.7, 50, 5),  # 5: as 3 but slower: dominated
    ]
    trials = [complete(i, list(p)) for i, p in enumerate(points)]
    front = pareto_data(trials, metrics, directions)
    assert front["pareto"].tolist() == [True, False, True, True, True, False]
    assert front[metrics].values.tolist() == [list(p) for p in points]
    # Against Optuna's own front on random trials (ties made likely by a coarse grid).
    rng = random.Random(0)
    study = optuna.create_study(directions=directions)
    for _ in range(60):
        study.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                values=[rng.randint(0, 5) / 5, rng.randint(1, 6) * 10, rng.randint(1, 6)],
            )
        )
    front = pareto_data(study.get_trials(), metrics, directions)
    expected = {t.number for t in study.best_trials}
    assert set(front.loc[front["pareto"], "trial"]) == expected


def test_the_window_carries_keys_at_the_feature_width():
    def size(**fields):
        model = {"d_model": 32, "n_heads": 2, "n_layers": 2}
        return state_size(load_spec({"name": "x", "model": model, **fields}), seq_len=128)

    taylor = {"kind": "taylor"}  # d_phi = 1 + 16 + 16 * 17 / 2 = 153 at d_head 16
    memory = 2 * 2 * 16 * 153  # layers x heads x W [Dv, Dphi]
    assert size(feature_map=taylor) == memory
    # c - 1 = 3 carried tokens per head: phi(k) [153] and v [16].
    assert size(feature_map=taylor, window={"c": 4}) == memory + 2 * 2 * 3 * (153 + 16)


def test_cost_objectives_in_a_study_and_the_report(tmp_path):
    objectives = ["accuracy", "throughput", "state_bytes", "params"]
    spec = {**TINY["spec"], "model": {**TINY["spec"]["model"], "n_heads": {"choices": [1, 2]}}}
    train = {**TINY["train"], "steps": 5}
    data = {**TINY, "name": "cost", "spec": spec, "train": train, "objectives": objectives}
    data.update(pruner="none", trials=3)
    storage = f"sqlite:///{tmp_path / 'cost.db'}"
    search(data, storage=storage)
    handle = optuna.load_study(study_name="cost", storage=storage)
    definition = load_study(data)
    assert definition.directions == ["maximize", "maximize", "minimize", "minimize"]
    assert definition.sampler_def().kind == "nsga2"
    done = [t for t in handle.get_trials() if t.state == TrialState.COMPLETE]
    assert done
    for t in done:
        spec = load_spec(t.user_attrs["spec"])
        metrics = t.user_attrs["metrics"]
        floats = state_size(spec, seq_len=32)
        assert metrics["state_size"] == floats and metrics["state_bytes"] == 4 * floats
        model = build_model(spec, 32)
        assert metrics["params"] == sum(p.numel() for p in model.parameters())
        assert metrics["throughput"] > 0
        assert t.values == [metrics[m] for m in objectives]
    report = write_report(handle, definition, tmp_path / "report")
    assert "Pareto front" in report.figures
    page = report.html.read_text()
    assert "<h2>Pareto-optimal configurations</h2>" in page
    front = report.leaderboard[report.leaderboard["pareto"]]
    assert not front.empty and set(front["trial"]) <= {t.number for t in done}


@pytest.mark.services  # headless Chromium, as tests/search/test_report_browser.py
def test_replicated_multi_objective_report_renders(tmp_path, browser):  # noqa: F811
    objectives = ["accuracy", "state_bytes", "throughput"]
    definition = load_study({**TINY, "objectives": objectives, "pruner": None, "replicates": 3})
    handle = optuna.create_study(directions=definition.directions, study_name="made-up")
    rng = random.Random(1)
    bias = CategoricalDistribution(["l2", "dot"])
    for _ in range(8):
        seeds = [rng.uniform(0.5, 1.0) for _seed in range(3)]
        records = [
            {"seed": s, "metrics": {"accuracy": a, "state_bytes": 512.0, "throughput": 9.0}}
            for s, a in enumerate(seeds)
        ]
        values = [sum(seeds) / 3, rng.choice([256.0, 512.0]), rng.uniform(1, 10)]
        handle.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                values=values,
                params={"bias": rng.choice(["l2", "dot"])},
                distributions={"bias": bias},
                user_attrs={"spec": "name: x\n", "replicates": records},
            )
        )
    report = write_report(handle, definition, tmp_path)
    assert {"accuracy: mean and 95% interval over the seeds", "Pareto front"} <= set(report.figures)
    browser.get(report.html.resolve().as_uri())
    declared = int(browser.find_element("css selector", "body").get_attribute("data-figures"))
    assert declared == len(report.figures)
    assert rendered(browser, declared) == declared
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_the_untrained_parameter_count_includes_the_tasks_own_layers():
    # A study that trains nothing counts the model's parameters without training it; a task
    # with its own input layer and readout (continuous MQAR) has no token embedding, so the
    # count must be the trained model's, not that of a model with a V x d embedding.
    import miras
    from miras.search.objective import parameter_count
    from miras.tasks import make_task

    spec = load_spec(
        {"name": "cq", "memory": "matrix", "bias": "l2", "model": {"d_model": 16, "n_layers": 1}}
    )
    task = make_task("continuous_mqar", vocab_size=512, embed_dim=8, num_pairs=4)
    trained = miras.train(spec, task, steps=1, eval_batches=1, batch_size=2, progress=False)
    assert parameter_count(spec, task, trial=None) == trained.parameters
