"""The HTML report in headless Chromium (Debian's chromium and chromium-driver, driven by
selenium): the page loads without JavaScript errors and every figure renders.

Missing browser binaries fail the test (they are not skipped): `make test` installs them through
scripts/ensure-test-services.sh. The studies here are made up (no training): a single-objective
one and a two-objective one, so every kind of figure is drawn.
"""

from __future__ import annotations

import random
import shutil
import tempfile
import time

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution
from optuna.trial import TrialState, create_trial

from miras.search import load_study
from miras.search.report import write_report
from tests.search_support import TINY

pytestmark = pytest.mark.services  # headless Chromium
INSTALL = "run scripts/ensure-test-services.sh (as root; `make test` runs it) to install them"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    # Plotly's parallel coordinates draw with WebGL: software WebGL without a GPU, which newer
    # Chromium builds give only when asked.
    "--enable-unsafe-swiftshader",
]


def made_up_study(objectives: list[str], trials: int = 12) -> tuple[optuna.Study, object]:
    definition = load_study({**TINY, "objectives": objectives, "pruner": None})
    handle = optuna.create_study(directions=definition.directions, study_name="made-up")
    rng = random.Random(0)
    distributions = {
        "bias": CategoricalDistribution(["l2", "dot", "lp"]),
        "retention": CategoricalDistribution(["none", "l2"]),
        "train.lr": FloatDistribution(1e-3, 1e-2, log=True),
    }
    for i in range(trials):
        params = {
            "bias": rng.choice(["l2", "dot", "lp"]),
            "retention": rng.choice(["none", "l2"]),
            "train.lr": 10 ** rng.uniform(-3, -2),
        }
        values = [rng.random(), rng.randint(100, 1000)][: len(objectives)]
        pruned = i % 5 == 4
        handle.add_trial(
            create_trial(
                state=TrialState.PRUNED if pruned else TrialState.COMPLETE,
                values=None if pruned else values,
                params=params,
                distributions=distributions,
                user_attrs={"spec": "name: x\n", "reason": "pruned at step 5" if pruned else ""},
            )
        )
    return handle, definition


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not chromium or not driver_path:
        pytest.fail(f"headless Chromium (chromium, chromedriver) not found; {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("selenium is missing: pip install -e '.[dev]' (make test does)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in FLAGS:
        options.add_argument(flag)
    profile = tempfile.mkdtemp(prefix="miras-chromium-")
    options.add_argument(f"--user-data-dir={profile}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit chromedriver path: selenium's driver manager (which downloads) stays unused.
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def rendered(driver, expected: int, timeout: float = 30.0) -> int:
    """How many plotly figures have drawn their SVG, once `expected` have or time is up."""
    script = (
        "return Array.from(document.querySelectorAll('.js-plotly-plot'))"
        ".filter(p => p.querySelector('.main-svg')).length"
    )
    deadline = time.monotonic() + timeout
    while True:
        count = driver.execute_script(script)
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("objectives", "titles"),
    [
        (["accuracy"], {"Optimization history", "Parallel coordinates", "Parameter importances"}),
        (["accuracy", "state_size"], {"Pareto front"}),
    ],
    ids=["single", "multi"],
)
def test_report_renders_in_headless_chromium(browser, tmp_path, objectives, titles):
    handle, definition = made_up_study(objectives)
    report = write_report(handle, definition, tmp_path)
    assert titles <= set(report.figures)
    assert {"accuracy by bias", "accuracy by retention"} <= set(report.figures)
    browser.get(report.html.resolve().as_uri())
    assert browser.execute_script("return document.readyState") == "complete"
    declared = int(browser.find_element("css selector", "body").get_attribute("data-figures"))
    assert declared == len(report.figures)
    assert rendered(browser, declared) == declared
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def made_up_sweep_study(trials: int = 8) -> tuple[optuna.Study, object]:
    """Replicated trials of a study with an lr sweep inside each: the selected point's test
    records hold per-slice accuracies, and every trial records its state size."""
    train = {**TINY["train"], "lr": {"sweep": [1.0e-3, 1.0e-2]}}
    definition = load_study({**TINY, "train": train, "replicates": 2, "pruner": None})
    handle = optuna.create_study(directions=definition.directions, study_name="made-up-sweep")
    rng = random.Random(1)
    distributions = {
        "bias": CategoricalDistribution(["l2", "dot"]),
        "model.chunk_size": CategoricalDistribution([16, 32]),
    }
    for i in range(trials):
        params = {"bias": rng.choice(["l2", "dot"]), "model.chunk_size": rng.choice([16, 32])}
        sweep, tests = [], []
        for point, lr in enumerate((1.0e-3, 1.0e-2)):
            for seed in (0, 1):
                valid = {"accuracy": rng.random()}
                test = {"accuracy": rng.random(), "accuracy_n4": rng.random()}
                test["accuracy_n8"] = rng.random()
                sweep.append({"point": point, "values": {"lr": lr}, "seed": seed})
                sweep[-1] |= {"valid": valid, "test": test, "seconds": 1.0}
                if point == 1:
                    tests.append(test)
        mean = sum(t["accuracy"] for t in tests) / 2
        handle.add_trial(
            create_trial(
                state=TrialState.COMPLETE,
                values=[mean],
                params=params,
                distributions=distributions,
                user_attrs={
                    "spec": "name: x\n",
                    "sweep": sweep,
                    "selected": {"point": 1, "values": {"lr": 1.0e-2}, "valid": 0.5},
                    "replicates": [
                        {"seed": s, "metrics": t, "seconds": 1.0} for s, t in enumerate(tests)
                    ],
                    "metrics": {"accuracy": mean, "state_bytes": 256.0 * (1 + i % 4)},
                },
            )
        )
    return handle, definition


def test_sweep_state_size_and_slice_figures_render(browser, tmp_path):
    handle, definition = made_up_sweep_study()
    report = write_report(handle, definition, tmp_path)
    expected = {
        "accuracy against state size, per model family",
        "accuracy per slice of the test split",
        "validation accuracy against lr (the sweep inside each trial)",
    }
    assert expected <= set(report.figures), report.figures
    browser.get(report.html.resolve().as_uri())
    declared = int(browser.find_element("css selector", "body").get_attribute("data-figures"))
    assert declared == len(report.figures)
    assert rendered(browser, declared) == declared
    # The state-size figure: one line per family (bias), x on a log axis, error bars drawn.
    index = report.figures.index("accuracy against state size, per model family")
    traces = browser.execute_script(
        f"const d = document.getElementById('figure-{index}');"
        "return [d.data.map(t => t.name), d.layout.xaxis.type,"
        f" document.querySelectorAll('#figure-{index} .errorbar').length];"
    )
    assert sorted(traces[0]) == ["bias=dot", "bias=l2"] and traces[1] == "log"
    assert traces[2] > 0
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors
