"""benchmarks/gpu.py, the prepared GPU run, without a GPU: --dry-run lists every check item
(spec x form x dtype x T), every timing pair and the compile reports and exits 0; without CUDA
a real run says why and exits 0; the run itself, on the CPU under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1) at a small shape, writes its JSON report; an item
past its cap is timed out and one that finds its section's budget spent is skipped; the
compile reports come back from their child process, unfinished specs skipped at the budget."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gpu_benchmark", ROOT / "benchmarks" / "gpu.py")
gpu = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpu  # dataclasses look their module up by name
spec.loader.exec_module(gpu)

TINY = dict(batch=1, heads=2, dim=16)


def test_dry_run_lists_every_item_and_exits_0(capsys):
    assert gpu.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    plan = gpu.check_plan()
    lines = [line.strip() for line in out.splitlines()]
    for spec_name, form, dtype, t in plan.items():
        assert f"check  {spec_name} {form} {dtype} T={t}" in lines
    assert len(plan.items()) == len(plan.forms) * 2 * 3  # two dtypes, three lengths
    assert {t for *_, t in plan.items()} == {512, 2048, 8192}
    # Every shipped spec is either checked or named with the reason it is not.
    checked = {s for s, _ in plan.forms}
    for path in gpu.shipped_specs():
        label = gpu.spec_label(path)
        assert label in checked or f"not checked  {label}: Triton does not cover it" in out
    assert ("deltanet", "exact") in plan.forms and ("deltanet", "start") in plan.forms
    # Each rule against fla's op at fla's benchmark shapes, (8, 1024, 8, 64) to (1, 8192, 16, 128).
    ops = ("chunk_delta_rule", "chunk_gated_delta_rule", "chunk_simple_gla", "chunk_linear_attn")
    for op in ops:
        for b, t, h, d in gpu.FLA_SHAPES:
            assert f"time  {op} B{b} T{t} H{h} D{d}: " in out
    assert gpu.FLA_SHAPES[0] == (8, 1024, 8, 64) and gpu.FLA_SHAPES[-1] == (1, 8192, 16, 128)
    assert "time  titans_mlp: " in out
    assert "compile  deltanet" in out


def test_without_cuda_a_real_run_says_why_and_exits_0(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out_file = tmp_path / "report.json"
    assert gpu.main(["--out", str(out_file)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not out_file.exists()


def test_run_on_the_interpreter_writes_the_report(tmp_path, monkeypatch, capsys):
    """The whole run at T = 20, D = 16: one spec's two forms in both dtypes, an absent timing
    pair and an absent compile module, in the JSON and the table."""
    monkeypatch.setattr(gpu, "COMPILE_MODULES", ("miras.compiler.no_such_module",))
    plan = gpu.CheckPlan(forms=[("deltanet", "exact"), ("omeganet", "start")])
    plan.left_out["titans"] = "Triton does not cover it: mlp memory"
    pairs = [gpu.TimingPair("chunk_delta_rule", "miras", "fla", absent="fla is not installed")]
    out = tmp_path / "report.json"
    assert gpu.run_all("cpu", plan, pairs, 600.0, out, shape=TINY, lengths=(20,)) == 0
    report = json.loads(out.read_text())
    checks = report["sections"]["check"]["rows"]
    assert [r["status"] for r in checks] == ["not checked"] + ["ok"] * 4
    for row in checks[1:]:
        assert row["forward_rel_rms"] <= row["tolerance"]
        assert row["backward_rel_rms"] <= row["tolerance"]
    assert {(r["spec"], r["dtype"]) for r in checks[1:]} == {
        (s, d) for s in ("deltanet", "omeganet") for d in ("float32", "bfloat16")
    }
    timing = report["sections"]["timing"]["rows"]
    assert timing == [timing[0]] and timing[0]["status"] == "absent"
    (compiled,) = report["sections"]["compile"]["rows"]
    assert compiled["status"] == "absent" and "no_such_module" in compiled["reason"]
    assert report["summary"] == {"not checked": 1, "ok": 4, "absent": 2}
    printed = capsys.readouterr().out
    assert "deltanet exact bfloat16 T=20" in printed and "written to" in printed


def test_time_pair_reports_both_sides():
    x = torch.ones(3, requires_grad=True)
    row = gpu.time_pair({"miras": lambda: 2 * x, "other": lambda: x.exp()}, 1e6)
    assert row["status"] == "ok"
    for part in ("fwd", "fwd+bwd"):
        assert row[part]["miras_ms"] >= 0 and row[part]["other_ms"] >= 0
        assert row[part]["miras_tflops"] > 0


def test_an_item_past_its_cap_times_out_and_a_spent_budget_skips(monkeypatch, capsys):
    monkeypatch.setitem(gpu.ITEM_CAP_S, "check", 0.2)
    section = gpu.Section("check", 10.0, gpu.Table())
    start = time.perf_counter()
    row = section.run("slow", lambda: time.sleep(5) or {"status": "ok"})
    assert row["status"] == "timed out" and time.perf_counter() - start < 2
    spent = gpu.Section("check", gpu.MIN_START_S - 1, gpu.Table())
    row = spent.run("late", lambda: {"status": "ok"})
    assert row["status"] == "skipped" and "budget" in row["reason"]
    failing = section.run("broken", lambda: 1 / 0)
    assert failing["status"] == "error" and "ZeroDivisionError" in failing["reason"]
    assert "timed out" in capsys.readouterr().out


def test_the_miras_side_of_each_timing_pair_runs_and_binds_fla_s_signature(monkeypatch):
    """Each fla pair's inputs, at a small shape, through the miras.ops alias on triton (the
    interpreter), and bound to the fla op's own signature; the titans pairs' miras layers."""
    import inspect
    import warnings

    from miras import ops

    seen = set()
    for pair in gpu.timing_plan():
        if pair.name.startswith("titans") or pair.absent is not None or pair.op in seen:
            continue
        seen.add(pair.op)  # one small shape per op
        leaves, kwargs = gpu.op_inputs(pair.op, "cpu", (1, 20, 2, 16))
        o, _ = getattr(ops, pair.op)(*leaves, backend="triton", **kwargs)
        assert o.shape == (1, 20, 2, 16), pair.name
        module_name, op = pair.other.rsplit(".", 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fla_fn = getattr(importlib.import_module(module_name), op)
        inspect.signature(fla_fn).bind(*leaves, **kwargs)
    for depth in (1, 2):
        layer = gpu.miras_titans_layer(depth, 16, 2, 4)
        assert layer(torch.randn(1, 8, 16))[0].shape == (1, 8, 16)


def test_an_op_and_width_that_timed_out_skips_its_later_shapes(tmp_path, monkeypatch):
    """A fla pair past its cap (its first run compiles the kernels) skips the later shapes of
    the same op and D, naming it; another D of the op still runs."""
    monkeypatch.setattr(gpu, "COMPILE_MODULES", ("miras.compiler.no_such_module",))
    monkeypatch.setitem(gpu.ITEM_CAP_S, "timing", 0.3)

    def fake_pair(op, module_name, device, shape):
        if shape[3] == 64:
            time.sleep(5)
        return {"status": "ok"}

    monkeypatch.setattr(gpu, "fla_pair", fake_pair)
    pairs = [
        gpu.TimingPair(f"op {s}", "miras", "fla.ops.x.op", None, s, "op")
        for s in ((8, 1024, 8, 64), (4, 2048, 8, 64), (2, 4096, 16, 128))
    ]
    out = tmp_path / "report.json"
    assert gpu.run_all("cpu", gpu.CheckPlan(forms=[]), pairs, 600.0, out, shape=TINY) == 0
    rows = [r["status"] for r in json.loads(out.read_text())["sections"]["timing"]["rows"]]
    assert rows == ["timed out", "skipped", "ok"]


def test_a_spec_and_form_that_timed_out_is_not_run_again(tmp_path, monkeypatch):
    """After one item of a (spec, form) runs past its cap (a compile that does not fit), its
    later items are skipped, naming it; the other specs still run."""
    monkeypatch.setattr(gpu, "COMPILE_MODULES", ("miras.compiler.no_such_module",))
    monkeypatch.setitem(gpu.ITEM_CAP_S, "check", 0.3)

    def fake_check(spec_name, form, dtype, t, device, shape):
        if spec_name == "slow":
            time.sleep(5)
        return {"status": "ok"}

    monkeypatch.setattr(gpu, "check_item", fake_check)
    plan = gpu.CheckPlan(forms=[("slow", "start"), ("fast", "start")])
    out = tmp_path / "report.json"
    start = time.perf_counter()
    assert gpu.run_all("cpu", plan, [], 600.0, out, shape=TINY, lengths=(20, 40)) == 0
    assert time.perf_counter() - start < 3
    rows = {r["item"]: r for r in json.loads(out.read_text())["sections"]["check"]["rows"]}
    first = "slow start float32 T=20"
    assert rows[first]["status"] == "timed out"
    for dtype, t in [("bfloat16", 20), ("float32", 40), ("bfloat16", 40)]:
        assert rows[f"slow start {dtype} T={t}"] == {
            "item": f"slow start {dtype} T={t}",
            "status": "skipped",
            "reason": f"{first} timed out",
        }
        assert rows[f"fast start {dtype} T={t}"]["status"] == "ok"


def test_compile_item_passes_what_the_report_function_names():
    import dataclasses
    import types

    @dataclasses.dataclass
    class Kernel:
        name: str
        registers: int

    seen = {}

    def report(spec, *, target, d, chunk_size=64, shape=None):
        seen.update(spec=spec, target=target, d=d, chunk_size=chunk_size, shape=shape)
        return [Kernel("linear_forward", 96), Kernel("linear_backward", 128)]

    row = gpu.compile_item(types.SimpleNamespace(report=report), "swla", "sm_90", 128)
    assert row["status"] == "ok" and row["summary"].startswith("2 kernels")
    assert row["report"] == [
        {"name": "linear_forward", "registers": 96},
        {"name": "linear_backward", "registers": 128},
    ]
    # swla: the exact form with window c = 8, so the layer's chunk is 64 // 8.
    assert seen == dict(
        spec=ROOT / "specs" / "swla.yaml", target="sm_90", d=128, chunk_size=8,
        shape=(8, 4096, 16),
    )  # fmt: skip

    def needs_more(spec, target, registers_bound):
        return []

    def over_limits(rows):
        return [f"{k.name}: too many registers" for k in rows if k.registers > 100]

    module = types.SimpleNamespace(report=report, over_limits=over_limits)
    row = gpu.compile_item(module, "swla", "sm_90", 128)
    assert row["status"] == "over limits"
    assert row["problems"] == ["linear_backward: too many registers"]

    row = gpu.compile_item(types.SimpleNamespace(report=needs_more), "swla", "sm_90", 128)
    assert row["status"] == "error" and "registers_bound" in row["reason"]
    row = gpu.compile_item(
        types.SimpleNamespace(other=needs_more, __name__="fake"), "swla", "sm_90", 128
    )
    assert row["status"] == "error" and "'other'" in row["reason"]


FAKE_REPORT = """
import time


def report(spec, target, d):
    if spec.stem == "retnet":
        time.sleep(60)  # never finished: the test ends the child first
    return [{"kernel": "scan", "spec": spec.stem, "target": target, "d": d}]
"""


def test_compile_reports_run_in_a_child_process_beside_the_checks(tmp_path, monkeypatch):
    """The compile section's child process: its rows come back into the run's section, and
    a spec it has not finished when the budget ends is skipped, naming why."""
    (tmp_path / "fake_gpu_report.py").write_text(FAKE_REPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(gpu, "COMPILE_MODULES", ("fake_gpu_report",))
    out = tmp_path / "report.json"
    reports = gpu.start_compile_reports(["deltanet", "retnet"], "sm_90", 16, 600.0, out)
    assert reports.process is not None
    start = time.perf_counter()
    while not reports.rows_path.exists() and time.perf_counter() - start < 60:
        time.sleep(0.2)  # until the child has written deltanet's row (retnet then sleeps)
    section = gpu.Section("compile", 600.0, gpu.Table())
    gpu.finish_compile_reports(section, reports, time.perf_counter() + 1)
    assert reports.process.returncode is not None  # ended at the deadline
    by_item = {r["item"]: r for r in section.rows}
    assert by_item["deltanet"]["status"] == "ok"
    assert by_item["deltanet"]["report"] == [
        {"kernel": "scan", "spec": "deltanet", "target": "sm_90", "d": 16}
    ]
    assert by_item["retnet"]["status"] == "skipped" and "ended" in by_item["retnet"]["reason"]
    assert (tmp_path / "report.compile.log").exists()
