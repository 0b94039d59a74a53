"""The reproduction scripts (benchmarks/zoology_mqar.py, zoology_forgetting.py,
zoology_continuous.py, zoology_continuous_marked.py, mad_protocol.py, mad_memorization.py and their shared benchmarks/reproduction.py): the per-model studies they
build load, and their tables and verdicts read hand-made per-seed numbers as stated. No
training here: the scripts' --quick runs are the end-to-end check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from miras.search.study import load_study
from miras.stats import welch_p

ROOT = Path(__file__).resolve().parents[2]


def script(name: str, registered_as: str | None = None):
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(registered_as or f"{name}_script", path)
    module = importlib.util.module_from_spec(spec)
    if registered_as:
        sys.modules[registered_as] = module
    spec.loader.exec_module(module)
    return module


# The scripts `import reproduction` (run as scripts, benchmarks/ is their sys.path[0]): it is
# registered first, so their import finds it without benchmarks/ on every test's path.
rep = script("reproduction", registered_as="reproduction")
mqar = script("zoology_mqar")
forgetting = script("zoology_forgetting")
continuous = script("zoology_continuous", registered_as="zoology_continuous")
marked = script("zoology_continuous_marked")
mad = script("mad_protocol", registered_as="mad_protocol")  # mad_memorization imports it
memorization = script("mad_memorization")

HIGH = [0.95, 0.96, 0.97]
LOW = [0.40, 0.42, 0.44]
NOISY = [0.30, 0.90, 0.60]  # overlaps both


def row(model, seeds, **params):
    extra = {"task": params.pop("task")} if "task" in params else {}
    return rep.Row(model, "family", list(seeds), {"lr": 0.01}, 1024.0, params, extra)


@pytest.mark.parametrize(
    "path",
    [
        "studies/zoology_mqar.yaml",
        "studies/zoology_forgetting.yaml",
        "studies/zoology_continuous.yaml",
        "studies/mad.yaml",
        "studies/mad_memorization.yaml",
        "studies/zoology_continuous_marked.yaml",
    ],
)
def test_the_study_files_load(path):
    study = load_study(ROOT / path)
    assert study.sweeps and study.replicates == 3 and study.sampler_def().kind == "grid"


@pytest.mark.parametrize(
    "module", [mqar, forgetting, continuous], ids=["mqar", "forgetting", "continuous"]
)
@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_every_model_study_loads(module, quick):
    found = module.jobs(quick)
    assert list(dict.fromkeys(j.label for j in found)) == list(module.MODELS)
    for job in found:
        study = load_study(job.study)
        assert study.name == job.study["name"]
    if quick:
        assert all(j.study["train"]["steps"] <= 10 for j in found)


def test_mad_studies_cover_every_subtask_and_atlas_only_where_asked():
    found = mad.jobs(False, ["memorization"], [0.0, 0.1])
    pairs = {(j.label, j.extra["task"]) for j in found}
    assert ("atlas", "memorization") in pairs and ("atlas", "compression") not in pairs
    assert len(pairs) == 4 * len(mad.TASKS) + 1
    copying = next(j for j in found if j.extra["task"] == "selective_copying")
    study = load_study(copying.study)
    assert study.task.options["subtask"] == "selective_copying"
    assert study.sweep_points == [
        {"lr": lr, "weight_decay": wd} for lr in (3e-3, 1e-2, 3e-2) for wd in (0.0, 0.1)
    ]
    atlas = next(j for j in found if j.label == "atlas")
    assert load_study(atlas.study).spec["optimizer"]["kind"] == "muon"


def test_model_study_swaps_components_and_keeps_the_model_section():
    base = rep.load_yaml("studies/zoology_forgetting.yaml")
    study = rep.model_study(base, "la", rep.spec_fields("specs/linear_attention.yaml"))
    assert study["name"] == "zoology_forgetting-la"
    assert study["spec"]["bias"] == "dot" and study["spec"]["retention"] == "none"
    assert study["spec"]["optimizer"] == {"kind": "gd", "lr": 1}
    assert "feature_map" not in study["spec"] and "window" not in study["spec"]  # GDN's, dropped
    assert study["spec"]["model"] == base["spec"]["model"]
    assert base["spec"]["bias"] == "l2"  # the base is not changed


def test_quick_study_cuts_the_sweeps_seeds_and_steps():
    base = rep.load_yaml("studies/mad.yaml")
    base["train"]["weight_decay"] = {"sweep": [0.0, 0.1]}
    quick = rep.quick_study(base, steps=6, points=1, seeds=2)
    assert quick["train"]["lr"] == {"sweep": [3e-3]}
    assert quick["train"]["weight_decay"] == {"sweep": [0.0]}
    assert quick["replicates"] == 2 and quick["train"]["steps"] == 6
    assert base["train"]["steps"] == 250


def test_quick_study_takes_a_logspace_sweep_as_its_lowest_values():
    base = rep.load_yaml("studies/mad.yaml")
    base["train"]["lr"] = {"sweep": {"logspace": [1e-3, 1e-1, 3], "extend": True}}
    quick = rep.quick_study(base, points=2)
    assert quick["train"]["lr"] == {"sweep": [1e-3, pytest.approx(1e-2)]}  # a list: no extension
    assert load_study(quick).sweep_points[0] == {"lr": 1e-3}
    assert rep.sweep_values({"logspace": [1e-4, 1e-2, 3]}) == [1e-4, pytest.approx(1e-3), 1e-2]
    assert rep.sweep_values([3e-3, 1e-2]) == [3e-3, 1e-2]


def test_mqar_studies_run_the_four_models_at_each_width_the_widest_first():
    found = mqar.jobs(False)
    models = ["deltanet", "gated_deltanet", "linear_attention", "retnet"]
    assert [(j.label, j.extra["d_model"]) for j in found] == [
        *((m, 128) for m in models),
        *((m, 64) for m in models),
    ]
    assert len({j.study["name"] for j in found}) == 8  # one SQLite file each
    for job in found:
        study = load_study(job.study)
        assert study.spec["model"]["d_model"] == job.extra["d_model"]
        assert study.spec["model"]["conv_size"] == 4 and study.spec["model"]["n_heads"] == 4
        assert [p["lr"] for p in study.sweep_points] == [3e-3, 1e-2]  # and one past the edge
        assert job.study["train"]["lr"]["sweep"]["max_extend"] == 1
    assert [j.extra["d_model"] for j in mqar.jobs(False, [64])] == [64] * 4


def mqar_rows(gdn=HIGH, dn=HIGH, la=LOW, ret=LOW, width=64):
    rows = forgetting_rows(gdn, dn, la, ret)
    for r in rows:
        r.extra = {"d_model": width}
        r.state_bytes = 2 * 4 * (width // 4) ** 2 * 4  # 2 layers x 4 heads x d_k^2 floats
        r.slices = {"n4": [1.0] * 3, "n16": list(r.seeds)}
        r.points = [({"lr": 1e-3}, 0.3), ({"lr": 0.01}, 0.6), ({"lr": 0.0031}, 0.5)]
    rows[0].at_edge, rows[0].extended = {"lr": "high"}, {"lr": {"low": 0, "high": 1}}
    return rows


def test_mqar_verdict_needs_both_delta_models_above_both_additive_where_the_state_binds():
    assert mqar.verdict(mqar_rows())[0].startswith("verdict: reproduced")
    line = mqar.verdict(mqar_rows(gdn=NOISY))[0]
    assert line.startswith("verdict: not reproduced")
    assert "gated_deltanet vs linear_attention" in line and "gated_deltanet vs retnet" in line
    assert "deltanet vs" not in line.replace("gated_deltanet vs", "")
    # The wider run is context: the verdict is read at d_model 64 alone.
    lines = mqar.verdict(mqar_rows() + mqar_rows(gdn=NOISY, width=128))
    assert lines[0].startswith("verdict: reproduced")
    assert lines[1].startswith("at d_model 128: not reproduced") and "gated_deltanet vs" in lines[1]
    assert mqar.verdict(mqar_rows(width=128))[0].startswith("verdict: not reproduced (d_model 64")
    both = mqar.verdict(mqar_rows() + mqar_rows(width=128))
    assert both[1] == f"at d_model 128: reproduced: {mqar.AT_OTHER_WIDTHS}"


def test_mqar_curve_line_compares_each_models_largest_state_with_its_smallest():
    lines = mqar.verdict(mqar_rows(la=LOW) + mqar_rows(la=HIGH, width=128))
    curve = lines[-1]
    assert curve.startswith("curve rises")
    assert f"linear_attention yes (p = {welch_p(HIGH, LOW):.3g})" in curve
    assert "deltanet no" in curve and "retnet no" in curve  # LOW at both widths


def test_mqar_table_marks_the_edge_and_lists_every_lr_run():
    text = mqar.table(mqar_rows() + mqar_rows(width=128))
    gdn = next(line for line in text.splitlines() if line.startswith("| 64 | gated_deltanet"))
    assert "lr=0.01 (lr at the high edge; lr +1 above)" in gdn
    assert "n4 1.000, n16 0.960" in gdn and "8,192" in gdn
    wide = next(line for line in text.splitlines() if line.startswith("| 128 | gated_deltanet"))
    assert "32,768" in wide
    dn = next(line for line in text.splitlines() if line.startswith("| 64 | deltanet"))
    assert "edge" not in dn
    listed = next(line for line in text.splitlines() if line.startswith("  retnet at d_model 64"))
    assert listed.endswith("lr=0.001 0.300, lr=0.0031 0.500, lr=0.01 0.600*")


def test_mqar_figure_draws_each_model_against_its_state_size():
    from miras.search import plots

    rows = mqar_rows(la=LOW) + mqar_rows(la=HIGH, width=128)
    frame = mqar.state_size_frame(rows)
    la = frame[frame.family == "linear_attention"]
    assert list(la.state_bytes) == [8192, 32768] and list(la.d_model) == [64, 128]
    assert la["mean"].tolist() == pytest.approx([sum(LOW) / 3, sum(HIGH) / 3])
    figure = plots.state_size_figure(frame, "accuracy")
    line = next(t for t in figure.data if t.name == "linear_attention")
    assert list(line.x) == [8192, 32768] and list(line.text) == ["d_model 64", "d_model 128"]
    assert len(figure.data) == 4


def test_beats_needs_a_higher_mean_and_p_below_005():
    assert rep.beats(HIGH, LOW) == (True, welch_p(HIGH, LOW))
    assert rep.beats(LOW, HIGH)[0] is False  # separated, but below
    assert rep.beats(NOISY, LOW)[0] is False  # above, but p >= 0.05
    assert welch_p(NOISY, LOW) >= 0.05


def forgetting_rows(gdn=HIGH, dn=HIGH, la=LOW, ret=LOW):
    return [row("gated_deltanet", gdn), row("deltanet", dn), row("linear_attention", la),
            row("retnet", ret)]  # fmt: skip


def test_forgetting_verdict():
    assert forgetting.verdict(forgetting_rows()).startswith("verdict: reproduced")
    line = forgetting.verdict(forgetting_rows(dn=NOISY))
    assert line.startswith("verdict: not reproduced")
    assert "deltanet vs linear_attention" in line and "deltanet vs retnet" in line
    assert "gated_deltanet vs" not in line
    missing = forgetting.verdict(forgetting_rows()[:3])
    assert "not reproduced" in missing and "retnet" in missing


def test_forgetting_table_has_the_four_p_values_best_first():
    text = forgetting.table(forgetting_rows(dn=NOISY))
    lines = text.splitlines()
    assert lines[2].startswith("| gated_deltanet")  # the highest mean first
    dn = next(line for line in lines if line.startswith("| deltanet "))
    assert f"{welch_p(NOISY, LOW):.3g}" in dn
    la = next(line for line in lines if line.startswith("| linear_attention"))
    assert la.rstrip().endswith("|  |  |")  # the additive rows have no p of their own


def continuous_rows(dn_small=HIGH):
    rows = []
    for heads, la, dn in ((1, LOW, HIGH), (4, [0.1, 0.12, 0.11], dn_small)):
        rows += [
            row("linear_attention", la, **{"model.n_heads": heads}),
            row("deltanet", dn, **{"model.n_heads": heads}),
            row("gated_deltanet", dn, **{"model.n_heads": heads}),
        ]
    for r in rows:
        r.state_bytes = 4096.0 / r.params["model.n_heads"]
    return rows


def test_continuous_verdict_and_curve_line():
    first, second = continuous.verdict(continuous_rows())
    assert first.startswith("verdict: reproduced")
    assert "linear_attention yes" in second and "deltanet no" in second  # HIGH at both sizes
    first, _ = continuous.verdict(continuous_rows(dn_small=[0.05, 0.30, 0.12]))
    assert first.startswith("verdict: not reproduced") and "at 4 heads" in first
    assert "at 1 head" not in first


def test_continuous_table_marks_the_best_per_head_count():
    lines = continuous.table(continuous_rows()).splitlines()[2:]
    assert [line.split("|")[1].strip() for line in lines[:2]] == ["linear_attention"] * 2
    assert lines[0].split("|")[3].strip() == "4"  # by model, then state size (4 heads: smaller)
    best = [line for line in lines if line.rstrip().endswith("| best |")]
    assert len(best) == 2  # one per head count (deltanet: the first of the tied pair)


def mad_rows(atlas=HIGH, titans=LOW):
    rows = [row(m, [0.5, 0.5, 0.5], task=t) for m in ("linear_attention", "swa") for t in mad.TASKS]
    rows += [row("atlas", atlas, task="memorization"), row("titans", titans, task="memorization")]
    return rows


def test_mad_verdict():
    assert "holds: Atlas is above every other" in mad.verdict(mad_rows())
    fails = mad.verdict(mad_rows(atlas=LOW, titans=HIGH))
    assert "does not hold" in fails and "titans" in fails
    tied = mad.verdict(mad_rows(atlas=NOISY))
    assert "not reproduced" in tied and "linear_attention" in tied
    assert "not shown" in mad.verdict([r for r in mad_rows() if r.model != "atlas"])


def test_mad_scores_average_each_seed_over_the_six_subtasks():
    rows = [row("swa", [0.1 * i, 0.2, 0.3], task=t) for i, t in enumerate(mad.TASKS)]
    rows.append(row("atlas", HIGH, task="memorization"))
    scores = mad.mad_scores(rows)
    assert list(scores) == ["swa"]  # atlas ran on one subtask: no score
    assert scores["swa"] == pytest.approx([0.1 * sum(range(6)) / 6, 0.2, 0.3])


def test_mad_table_says_not_run_and_ends_with_the_scores():
    lines = mad.table(mad_rows()).splitlines()
    assert any("| compression | atlas |" in line and "not run" in line for line in lines)
    assert lines[-1].startswith("| MAD score (mean of 6)")
    memorization = [line for line in lines if line.startswith("| memorization")]
    assert memorization[0].startswith("| memorization | atlas |")  # best first


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_mad_memorization_runs_the_five_models_at_the_hard_setting(quick):
    found = memorization.jobs(quick)
    atlas = [j for j in found if j.label == "atlas"]
    assert [j.label for j in found] == ["atlas"] * len(atlas) + list(mad.MODELS)[1:]
    assert len(atlas) == (2 if quick else 12)  # one study per lr and seed, run in parallel
    assert len({j.study["name"] for j in found}) == len(found)
    assert [j.study["train"]["seed"] for j in atlas] == [0, 1, 2, 0, 1, 2][: len(atlas)] * (
        1 if quick else 2
    )
    for job in found:
        study = load_study(job.study)
        options = job.study["task"]["options"]
        assert (options["vocab_size"], options["train_examples"]) == (4096, 256)
        assert job.extra == {"task": "memorization"}
        if quick:
            continue
        if job.label == "atlas":
            assert len(study.sweep_points) == 1 and study.replicates == 1
        else:
            assert job.study["train"]["lr"]["sweep"]["extend"] is True
            lrs = [p["lr"] for p in study.sweep_points]
            assert lrs == pytest.approx([5e-3, 1e-2, 2e-2])
    swa = next(j for j in found if j.label == "swa")
    assert swa.study["spec"]["memory"] == {"kind": "nonparametric", "window": 16}


def atlas_run(lr, value, valid):
    r = row("atlas", [value], task="memorization")
    r.selected, r.points = {"lr": lr}, [({"lr": lr}, valid)]
    return r


def test_mad_memorization_merges_atlas_runs_as_the_sweep_selects():
    other = row("swa", LOW, task="memorization")
    runs = [atlas_run(0.01, v, 0.4) for v in LOW] + [atlas_run(0.02, v, 0.9) for v in HIGH]
    rows = memorization.merged([*runs, other])
    assert [r.model for r in rows] == ["atlas", "swa"] and rows[1] is other
    assert rows[0].seeds == HIGH and rows[0].selected == {"lr": 0.02}
    assert rows[0].at_edge == {"lr": "high"}
    assert rows[0].points == [
        ({"lr": 0.01}, pytest.approx(0.4)),
        ({"lr": 0.02}, pytest.approx(0.9)),
    ]
    assert runs[0].points == [({"lr": 0.01}, 0.4)]  # the parts are left as they were
    runs[3].points = [({"lr": 0.02}, float("nan"))]  # a diverged lr is never selected
    assert memorization.merged(runs)[0].seeds == LOW
    one = memorization.merged([atlas_run(0.01, v, 0.4) for v in HIGH])[0]
    assert one.seeds == HIGH and one.at_edge == {} and one.extra["note"] == "one lr, not swept"
    line = memorization.table([atlas_run(0.01, v, 0.4) for v in HIGH]).splitlines()[2]
    assert "lr=0.01 (one lr, not swept)" in line


def test_mad_memorization_ceiling_is_the_share_of_test_facts_the_training_set_shows():
    assert 0.82 < memorization.ceiling() < 0.9  # 1 - e^-2 = 0.865 expected (V 4096)


def test_mad_memorization_table_and_verdict():
    rows = [r for r in mad_rows() if r.extra["task"] == "memorization"]
    for r in rows:
        r.points = [({"lr": 0.03}, 0.5), ({"lr": 0.003}, 0.2)]
    next(r for r in rows if r.model == "atlas").at_edge = {"lr": "high"}
    lines = memorization.table(rows).splitlines()
    assert lines[2].startswith("| atlas |") and lines[2].endswith("|  |")  # best, no p to itself
    assert "lr at the high edge" in lines[2] and "0.003: 0.200, 0.03: 0.500" in lines[2]
    assert all(line.split("|")[-2].strip() for line in lines[3:])  # Welch p vs atlas
    said = memorization.verdict(rows)
    assert said[0].startswith("ceiling") and "holds: Atlas is above every other" in said[1]


@pytest.mark.parametrize("quick", [False, True], ids=["full", "quick"])
def test_marked_continuous_studies_mark_the_queries_and_sweep_an_extending_logspace(quick):
    found = marked.jobs(quick, retnet=True)
    assert [j.label for j in found] == [*marked.MODELS, "retnet"]
    for job in found:
        study = load_study(job.study)
        assert job.study["task"]["options"]["query_marker"] is True
        assert study.spec["model"]["conv_size"] == 0
        if not quick:
            assert job.study["train"]["lr"]["sweep"]["extend"] is True
            lrs = [p["lr"] for p in study.sweep_points]
            assert lrs == pytest.approx([1e-3, 10**-2.5, 1e-2])


def test_marked_continuous_table_curves_and_the_curve_command(tmp_path):
    rows = [row(m, s, **{"model.n_heads": 2}) for m, s in
            (("deltanet", HIGH), ("linear_attention", LOW))]  # fmt: skip
    rows[0].points = [({"lr": 0.01}, 0.9), ({"lr": 0.001}, 0.5)]
    rows[0].at_edge = {"lr": "high"}
    lines = marked.table(rows).splitlines()
    assert lines[2].startswith("| deltanet | 2 |") and "lr at the high edge" in lines[2]
    assert "0.001: 0.500, 0.01: 0.900" in lines[2]
    assert lines[2].split("|")[-2].strip() == f"{welch_p(HIGH, LOW):.3g}"
    study = marked.jobs(False)[0].study
    cmd = marked.curve_command(study, "specs/deltanet.yaml", 4, 0.01, tmp_path / "c")
    assert cmd[1:3] == ["train", "specs/deltanet.yaml"]
    assert "query_marker=true" in " ".join(cmd) and "n_heads=4" in " ".join(cmd)
    assert cmd[cmd.index("--lr") + 1] == "0.01" and cmd[cmd.index("--seed") + 1] == "0"
    log = tmp_path / "metrics.jsonl"
    log.write_text(
        '{"step": 0, "split": "run"}\n{"step": 100, "split": "valid", "accuracy": 0.5}\n'
        '{"step": 100, "split": "train", "accuracy": 0.9}\n{"step": 200, "split": "valid", '
        '"accuracy": 0.75}\n'
    )
    curve = marked.validation_curve(log)
    assert curve == {100: 0.5, 200: 0.75}
    text = marked.curves_table({("linear_attention", 2): {100: 0.4}, ("deltanet", 2): curve})
    assert text.splitlines()[0] == "| step | deltanet h2 | linear_attention h2 |"
    assert text.splitlines()[-1] == "| 200 | 0.750 |  |"


def test_cost_line_names_resumed_studies():
    cost = rep.Cost(cpu=12.4, wall=7.6)
    fresh = rep.StudyResult("a", "a", [], [], 1.0)
    again = rep.StudyResult("b", "b", [], [], 1.0, resumed=True)
    assert rep.cost_line(cost, 2, [fresh]) == (
        "CPU time 12 s (this process and its 2 workers), wall 8 s"
    )
    assert rep.cost_line(cost, 2, [fresh, again]).endswith(
        "1 of 2 studies resumed from storage, their earlier time not counted: b"
    )
