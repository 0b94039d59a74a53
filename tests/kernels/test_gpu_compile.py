"""Compile-only GPU checks (`miras.checks.gpu_compile`): every kernel a shipped spec runs on,
compiled for sm_80 and sm_90 by Triton and the ptxas its wheel ships (no GPU), with the
launcher's block sizes and each autotune config; and, under the interpreter, every autotune
config giving the same results.

ptxas takes seconds a kernel at d = 64 and chunk 16 and minutes at d = 128 and chunk 64, so the
default run compiles every kernel of every covered spec at the small size, first config, on
both targets (started at collection, gpu_compile_support.py), one d = 128 kernel under TF32,
and checks that the jobs are the launcher's; the whole matrix (every covered spec x form x
config x d in {64, 128, 256} x {sm_80, sm_90}) is one `slow` test that runs only with
MIRAS_COMPILE_MATRIX=1 (28 minutes from a cold cache on 2 cores, beyond make test's budget), cached on disk
under pytest's cache directory by kernel source, constexprs, config and target, so a rerun
compiles only what changed.
"""

import dataclasses
import json
import os

import pytest
import torch
import triton.language as tl

import miras
from miras.checks import gpu_compile
from miras.compiler.pipeline import compile_ir
from miras.kernels.common import tuning
from miras.runtime import triton_backend
from miras.spec import load_spec
from tests.helpers import random_inputs
from tests.kernels.gpu_compile_support import (
    COVERED,
    EARLY,
    EARLY_TEST,
    HAS_PTXAS,
    PTXAS,
    ROOT,
    cache_dir,
    small_pairs,
)

needs_ptxas = pytest.mark.skipif(
    not HAS_PTXAS,
    reason=f"the triton wheel's ptxas is absent ({PTXAS}): Triton ships it for Linux x86-64",
)


# Arguments ------------------------------------------------------------------------------------


def test_bad_target_and_width_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"target: expected one of sm_80, sm_90, got 'sm_86'"):
        gpu_compile.check_target("sm_86")
    with pytest.raises(ValueError, match=r"dim: expected one of 64, 128, 256 .*got 96"):
        gpu_compile.check_width(96)
    with pytest.raises(ValueError, match=r"shape: expected B,T,H .*got '2,64'"):
        gpu_compile.parse_shape("2,64")


def test_cli_report_refuses_a_bad_target_and_width():
    from typer.testing import CliRunner

    from miras.cli import app

    spec = str(ROOT / "specs" / "deltanet.yaml")
    result = CliRunner().invoke(app, ["kernel", spec, "--report", "--target", "sm_75"])
    assert result.exit_code == 1
    assert "target: expected one of sm_80, sm_90, got 'sm_75'" in result.output
    result = CliRunner().invoke(app, ["kernel", spec, "--report", "--dim", "32"])
    assert result.exit_code == 1
    assert "dim: expected one of 64, 128, 256" in result.output
    result = CliRunner().invoke(app, ["kernel", spec, "--report", "--precision", "fp16"])
    assert result.exit_code == 1
    assert "precision: expected one of ieee, tf32, tf32x3, got 'fp16'" in result.output
    result = CliRunner().invoke(app, ["kernel", spec, "--report", "--dtype", "fp16"])
    assert result.exit_code == 1
    assert "dtype: expected one of fp32, bf16, got 'fp16'" in result.output


def test_every_autotune_config_states_the_register_cap():
    """Left unstated, the ptxas of triton 3.9 gives these loop-carried kernels 32 registers a
    thread and spills their state tiles (kernels/common/tuning.py)."""
    chunk = tuning.configs(tuning.CHUNK) + tuning.configs(tuning.CHUNK_WIDE)
    for config in chunk + tuning.scan_configs():
        assert config.maxnreg == tuning.MAX_REGISTERS == 255


# The jobs are the launcher's -------------------------------------------------------------------


def test_jobs_take_the_launchers_block_sizes_configs_and_grids():
    spec = load_spec(ROOT / "specs" / "gated_deltanet.yaml")
    found = gpu_compile.jobs(spec, d=128, chunk_size=64, shape=(2, 1000, 4))
    kernels = {(j.kernel, j.variant) for j in found}
    assert kernels == {
        ("general_forward", ""), ("general_backward", ""),
        ("linear_state", ""), ("linear_output", ""),
        ("linear_state_backward", ""), ("linear_scores", ""), ("linear_backward", ""),
        ("linear_backward_keys", ""),
        ("exact_scan_forward", "per head"), ("exact_scan_backward", "per head"),
        ("exact_scan_forward", "per channel"), ("exact_scan_backward", "per channel"),
    }  # fmt: skip
    compiled = compile_ir(spec)
    for job in found:
        meta = dict(job.constexprs)
        assert job.maxnreg == tuning.MAX_REGISTERS
        assert meta["DOT_PRECISION"] == "tf32" and meta["ACC"] == "fp32"  # the default
        if job.form == "scan":  # BV is the config's; the state in [64, BV] key tiles
            per_channel = job.variant == "per channel"
            configs = tuning.scan_layout_configs(tuning.scan_configs(), per_channel, 128)
            config = configs[job.config]
            assert (job.num_warps, job.num_stages) == (config.num_warps, config.num_stages)
            assert meta["BV"] == config.kwargs["BV"]
            assert meta["BV"] == 16 if job.variant == "per channel" else meta["BV"] in (32, 64)
            assert (meta["BR"], meta["BK"], meta["NK"], meta["DK"]) == (64, 64, 2, 128)
            assert job.grid == (128 // meta["BV"], 8)
        else:
            wide = job.kernel in ("linear_output", "linear_backward", "general_backward")
            chunk = tuning.CHUNK_WIDE if wide else tuning.CHUNK
            assert (job.num_warps, job.num_stages) == chunk[job.config]
            linear = job.form == "linear"
            block_v = triton_backend.choose_kernels(compiled, 128, 128, not linear)[1]
            # the key side's kernels have no BK (they own one key tile), the scores no BV
            assert (meta["BT"], meta.get("BK", 128), meta.get("BV", block_v)) == (64, 128, block_v)
            blocks = 128 // block_v
            if job.kernel in ("linear_output", "linear_backward"):  # every chunk at once
                assert job.grid == (-(-1000 // 64), 8, blocks)
            elif job.kernel == "linear_backward_keys":  # every chunk and key tile at once
                assert "BK" not in meta and meta["KT"] == 64
                assert job.grid == (-(-1000 // 64), 8, 128 // meta["KT"])
            elif job.kernel == "linear_scores":  # every chunk, for all value blocks
                assert job.grid == (-(-1000 // 64), 8)
            else:
                assert job.grid == (8, blocks)
    # at d = 128 the per-head scan's two-stage config is not tried (tuning.TWO_STAGE_MAX_DK)
    per_head = tuning.scan_layout_configs(tuning.scan_configs(), False, 128)
    assert len(per_head) == len(tuning.SCAN) - 1
    scan_configs = len(per_head) + len(tuning.SCAN_PER_CHANNEL)
    # 8 chunk kernels (general fwd / bwd; linear state, output, state bwd, scores, bwd, bwd
    # keys: the linear forward is two, its backward four)
    assert len(found) == 8 * len(tuning.CHUNK) + 2 * scan_configs


def test_the_scan_tries_two_stages_only_where_they_fit():
    """Two stages of the per-head scan need more shared memory than a block has past
    Dphi = 64 (246272 B of 232448 in the backward at 128 on sm_90): a launch's prune leaves
    them out there, and keeps them at 64 and below."""
    configs = tuning.scan_configs()
    for dk, stages in ((32, {1, 2}), (64, {1, 2}), (128, {1}), (256, {1})):
        kept = tuning.scan_layout(configs, {}, PER_CHANNEL=False, DK=dk)
        if triton_backend.runs_on_cpu():
            assert kept == configs[:1]  # the interpreter tries one
            kept = tuning.scan_layout_configs(configs, False, dk)
        assert {c.num_stages for c in kept} == stages, dk


def test_the_default_chunk_is_the_layers():
    """Without a chunk size the jobs take the one a layer of the spec runs at: 64 // c with
    the exact form, so omeganet's window of 4 gives chunk 16 and a scan of 64 rows (at chunk 64
    it would compile [256, .] tiles no launch uses), and swla's window of 8 chunk 8 (a 16-row
    tile, tl.dot's least)."""
    omega = load_spec(ROOT / "specs" / "omeganet.yaml")
    assert gpu_compile.default_chunk(omega) == 16
    meta = {(j.kernel, j.variant): dict(j.constexprs) for j in gpu_compile.jobs(omega, d=64)}
    assert meta[("exact_scan_forward", "per head")]["BR"] == 64
    assert meta[("general_forward", "")]["BT"] == 16
    wide = {j.kernel: dict(j.constexprs) for j in gpu_compile.jobs(omega, d=64, chunk_size=64)}
    assert wide["exact_scan_forward"]["BR"] == 256
    assert gpu_compile.default_chunk(ROOT / "specs" / "swla.yaml") == 8
    assert gpu_compile.default_chunk(ROOT / "specs" / "gated_deltanet.yaml") == 64


def test_a_bias_with_channel_sums_above_64_channels_has_no_linear_jobs():
    """The launcher runs such a spec on the general kernels there; nothing else is compiled."""
    spec = load_spec({"name": "cauchy", "bias": {"kind": "custom", "loss": "log(1 + sum(e**2))"}})
    forms = {j.form for j in gpu_compile.jobs(spec, d=128)}
    assert "linear" not in forms and "general" in forms
    assert "linear" in {j.form for j in gpu_compile.jobs(spec, d=64)}


def test_the_general_kernels_are_refused_above_128_by_128():
    """At 256 x 256 general_forward needs 320 KiB of shared memory per block (compiled for
    sm_90), past every target's limit: when every value channel must stay in one program (a
    bias with channel sums), the launcher refuses it before any work, naming the widths, the
    limit and what to use instead, and the checks compile no general job there. Rows that
    evolve apart run in blocks of 32 channels, a [32, 256] tile (48 KiB on sm_90)."""
    sums = {"kind": "custom", "loss": "log(1 + sum(e**2))"}
    rule = miras.compile({"name": "wide-sums", "bias": sums, "optimizer": "momentum"})
    q, k, v, gates = random_inputs(rule, b=1, t=2, h=1, dk=256, dv=256, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"Dv = 256, Dphi = 256: the general kernels .*128 x 128"):
        rule(q, k, v, gates, backend="triton", chunk_size=16, chunk_mode="start")
    assert triton_backend.general_refusal(128, 128) is None
    assert "general" not in {j.form for j in gpu_compile.jobs(rule.spec, d=256)}
    assert "general" in {j.form for j in gpu_compile.jobs(rule.spec, d=128)}
    apart = miras.compile({"name": "wide-momentum", "bias": "l2", "optimizer": "momentum"})
    assert triton_backend.choose_kernels(apart.program, 256, 256, True) == (False, 32)
    assert "general" in {j.form for j in gpu_compile.jobs(apart.spec, d=256)}


def test_jobs_hold_the_launchs_integer_arguments():
    """The jobs are recorded from the launchers' own code on meta tensors: the sizes and gate
    strides a launch at (B, T, H) = (2, 100, 3), chunk 16, passes, and pointers by dtype."""
    spec = load_spec(ROOT / "specs" / "gated_deltanet.yaml")
    found = {
        (j.kernel, j.variant): j
        for j in gpu_compile.jobs(spec, d=64, chunk_size=16, shape=(2, 100, 3))
        if j.config == 0
    }
    state = found[("linear_state", "")]  # the linear forward's sequential half
    assert state.args[-5:] == (100, 16, 7, 64, 64)  # T, CS, NC = ceil(100 / 16), DK, DV
    assert state.args[5:7] == (1, 0)  # a per-head gate after its pointer: width 1, stride 0
    # (B*H, value blocks): 32 value channels a program on tensor cores (choose_kernels)
    assert state.args[0] == ("tensor", "float32") and state.grid == (6, 2)
    assert found[("linear_output", "")].grid == (7, 6, 2)  # (chunks, B*H, value blocks)
    assert found[("linear_backward_keys", "")].grid == (7, 6, 1)  # (chunks, B*H, key tiles)
    scan = found[("exact_scan_backward", "per channel")]
    assert scan.args[-1] == 7  # NC, its one integer argument: R, DK, DV are constexprs
    assert {k: dict(scan.constexprs)[k] for k in ("R", "DK", "DV", "BV")} == dict(
        R=16, DK=64, DV=64, BV=16
    )
    assert scan.grid == (4, 6)  # (value blocks, B*H)


def test_jobs_record_with_the_written_check_on(monkeypatch):
    """MIRAS_TRITON_CHECK=1 checks real buffers after each launch; the recorded launches'
    meta tensors hold no values, so the check passes over them instead of failing on them."""
    from miras.runtime import triton_backend

    monkeypatch.setenv(triton_backend.CHECK_ENV, "1")
    spec = load_spec(ROOT / "specs" / "retnet.yaml")
    found = {j.kernel for j in gpu_compile.jobs(spec, d=32, chunk_size=16, shape=(1, 40, 2))}
    assert {"linear_state", "linear_scores", "linear_backward_keys", "general_backward"} <= found


def _tiny(x_ptr, n, stride, width, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets * stride, tl.load(x_ptr + offsets, mask=offsets < n) * width)


def test_the_compile_specializes_integers_as_a_launch_does():
    """`launch_specialization` is Triton's own binder: each argument gets what Triton's
    `native_specialize_impl` gives it at a launch (an int equal to 1 a constant, a multiple
    of 16, or 0, `tt.divisibility = 16`, an aligned pointer the same), where the checks used to
    give the hint to pointers only."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, MockTensor

    fn = JITFunction(_tiny)  # compiled, not interpreted, whatever TRITON_INTERPRET says
    args = [MockTensor(torch.float32), 4096, 1, 17]
    _, signature, constexprs, attrs = gpu_compile.launch_specialization(
        fn, args, {"BLOCK": 64, "num_warps": 4}, 90
    )
    assert signature == {"x_ptr": "*fp32", "n": "i32", "stride": "constexpr", "width": "i32",
                         "BLOCK": "constexpr"}  # fmt: skip
    assert constexprs == {(2,): 1, (4,): 64}
    divisible = [["tt.divisibility", 16]]
    assert attrs == {(0,): divisible, (1,): divisible, (2,): [], (3,): [], (4,): []}
    for i, value in enumerate(args):  # the same as Triton's per-argument rule
        kind, mark = native_specialize_impl(BaseBackend, value, False, True, True)
        assert signature[fn.arg_names[i]] == kind
        if kind != "constexpr":
            assert attrs[(i,)] == ([["tt.divisibility", 16]] if mark == "D" else [])


def test_the_instruction_mix_counts_ptx_instructions():
    ptx = """
    mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%f1, %f2}, {%r1}, {%r2}, {%f3};
    @%p1 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%f1}, {%r1}, {%r2}, {%f3};
    wgmma.mma_async.sync.aligned.m64n64k8.f32.tf32.tf32 {%f1}, %rd1, %rd2, p, 1, 1;
    wgmma.fence.sync.aligned;
    fma.rn.f32 %f4, %f5, %f6, %f7;
    fma.rn.ftz.f32 %f4, %f5, %f6, %f7;
    fma.rn.f64 %fd1, %fd2, %fd3, %fd4;
    ld.local.f32 %f8, [%rd3];
    st.local.v2.f32 [%rd3], {%f8, %f9};
    ld.global.f32 %f8, [%rd4];
    """
    assert gpu_compile.instruction_mix(ptx) == dict(
        mma=2, wgmma=1, fma_f32=1, fma_f64=1, local_loads=1, local_stores=1
    )


def test_bf16_jobs_hold_what_a_bf16_launch_passes():
    """--dtype bf16 builds the launches a bf16 call makes on a GPU: the linear kernels take q
    and k as bf16 operands, the exact scan bf16 copies of its keys and systems, the general
    kernels the runtime's float32 copy; a bad dtype is refused with the allowed ones."""
    spec = load_spec(ROOT / "specs" / "gated_deltanet.yaml")
    with pytest.raises(ValueError, match=r"dtype: expected one of fp32, bf16, got 'fp8'"):
        gpu_compile.jobs(spec, d=64, dtype="fp8")
    found = [j for j in gpu_compile.jobs(spec, d=64, dtype="bf16") if j.config == 0]
    assert all(j.dtype == "bf16" for j in found)
    half = {j.kernel for j in found if ("tensor", "bfloat16") in j.args}
    assert half == {
        "linear_state", "linear_output", "linear_state_backward", "linear_backward",
        "linear_scores", "linear_backward_keys", "exact_scan_forward", "exact_scan_backward",
    }  # fmt: skip
    fp32 = [j for j in gpu_compile.jobs(spec, d=64) if j.config == 0]
    assert not any(("tensor", "bfloat16") in j.args for j in fp32)


def test_limits_flag_errors_shared_memory_and_spills():
    def row(**found):
        base = dict(registers=96, spills=0, stack=0, shared=1024, error="", target="sm_80")
        base.update(found)
        return gpu_compile.Row("general", "general_forward", "", 0, 4, 1, (1, 1), **base)

    limit = gpu_compile.TARGETS["sm_80"].shared_limit
    assert gpu_compile.over_limits([row(shared=limit)]) == []
    (shared,) = gpu_compile.over_limits([row(shared=limit + 1)])
    assert f"{limit + 1} bytes of shared memory, over the {limit}" in shared
    (spills,) = gpu_compile.over_limits([row(spills=gpu_compile.SPILL_BOUND + 4)])
    assert "spill stores, over the bound" in spills
    (error,) = gpu_compile.over_limits([row(error="CompilationError: boom")])
    assert "does not compile: CompilationError: boom" in error


def test_cached_results_are_read_and_countless_ones_compiled_again(tmp_path, monkeypatch):
    """A cached result is read without a child process; one without ptxas's counts (-1, which
    a Triton cache hit gave before every compile was forced) is compiled again, in a child
    that `cancel` stops, removing its files."""
    spec = load_spec(ROOT / "specs" / "deltanet.yaml")
    job = gpu_compile.jobs(spec, d=64, chunk_size=16)[0]
    target = gpu_compile.TARGETS["sm_90"]
    good = dict(registers=200, spills=8, stack=16, shared=4096, error="", ptxas_s=1.5)
    good |= dict(mma=4, wgmma=2, fma_f32=10, fma_f64=0, local_loads=3, local_stores=5)
    (tmp_path / f"{job.key(target)}.json").write_text(json.dumps(good))
    monkeypatch.setattr(gpu_compile, "_DONE", {})  # this process's results, kept apart
    compiles = gpu_compile.start_compiles([(job, target)], tmp_path)
    assert compiles.process is None and compiles.todo == []
    (row,) = compiles.rows()
    assert (row.registers, row.spills, row.shared, row.target) == (200, 8, 4096, "sm_90")
    assert (row.tensor_core, row.fma_f32, row.local_stores, row.ptxas_s) == (6, 10, 5, 1.5)

    other = gpu_compile.TARGETS["sm_80"]
    countless = dict(good, registers=-1, spills=-1, stack=-1)
    (tmp_path / f"{job.key(other)}.json").write_text(json.dumps(countless))
    compiles = gpu_compile.start_compiles([(job, other)], tmp_path)
    assert [key for key, _, _ in compiles.todo] == [job.key(other)]
    files = compiles.files
    assert compiles.process.poll() is None and (files / "jobs.json").exists()
    compiles.cancel()
    assert compiles.process is None and not files.exists()

    # An entry of the previous version (no instruction mix, no ptxas time) is compiled again:
    # its missing counts are never reported as 0.
    old = {k: good[k] for k in ("registers", "spills", "stack", "shared", "error")}
    (tmp_path / f"{job.key(other)}.json").write_text(json.dumps(old))
    compiles = gpu_compile.start_compiles([(job, other)], tmp_path)
    assert [key for key, _, _ in compiles.todo] == [job.key(other)]
    compiles.cancel()


def test_a_failed_worker_is_an_error_with_its_message(tmp_path, monkeypatch):
    """A worker that dies (here: its kernel's module is gone) raises with the end of its
    stderr, and leaves no files behind."""
    spec = load_spec(ROOT / "specs" / "deltanet.yaml")
    job = dataclasses.replace(
        gpu_compile.jobs(spec, d=64, chunk_size=16)[0], module=str(tmp_path / "gone.py")
    )
    monkeypatch.setattr(gpu_compile, "_DONE", {})
    compiles = gpu_compile.start_compiles([(job, gpu_compile.TARGETS["sm_90"])])
    files = compiles.files
    with pytest.raises(RuntimeError, match=r"(?s)gpu_compile worker failed:.*gone\.py"):
        compiles.rows()
    assert not files.exists()


# Real compiles -------------------------------------------------------------------------------


@pytest.mark.slow  # from a cold cache; a rerun reads pytest's cache
@needs_ptxas
def test_every_kernel_of_every_covered_spec_compiles_small(request):
    """Every kernel each covered shipped spec runs on (general, linear, the exact scan per head
    and per channel; forward and backward) at d = 64 and chunk 16, first autotune config,
    compiled for sm_80 and sm_90 through the whole path (child process, ptxas log, disk
    cache): no compile error, within the limits, and the configs' register cap taken (32
    registers without it, ptxas's choice for a full SM). The compiles started when collection
    ended (tests/conftest.py); about 5 minutes of one core from a cold cache."""
    assert request.node.originalname == EARLY_TEST
    pairs = small_pairs()
    compiles = request.config.stash.get(EARLY, None)
    if compiles is None:  # not started early (a run that collected this test another way)
        compiles = gpu_compile.start_compiles(pairs, cache_dir(request.config))
    rows = compiles.rows()
    assert [(r.kernel, r.variant, r.target) for r in rows] == [
        (job.kernel, job.variant, target.name) for job, target in pairs
    ]
    assert {r.target for r in rows} == {"sm_80", "sm_90"}
    assert {r.form for r in rows} == {"general", "linear", "scan", "dual"}  # dual: MLP memories
    for row in rows:
        assert row.error == "" and row.registers > 32 and row.shared > 0, row
    assert gpu_compile.over_limits(rows) == []


def test_tensor_cores_split_the_linear_kernels_value_channels_to_32_from_d_64():
    """On tensor cores (TF32, or half inputs) from d = 64 the linear kernels take 32 value
    channels a program: compiled for sm_80, retnet's value-side backward kernel spills 28 to
    40 B at 64 a program and d = 64; for sm_90 at d = 128, gated_deltanet's linear backward
    spilled 816 to 1680 B at 64 before its split (and needed 278528 B of shared memory before
    that, past the 232448 B a block may use). Under ieee (FMA products) and below d = 64
    every channel stays in one program."""
    compiled = compile_ir(load_spec(ROOT / "specs" / "gated_deltanet.yaml"))
    choose = triton_backend.choose_kernels
    assert choose(compiled, 128, 128, False, "ieee") == (True, 64)
    assert choose(compiled, 128, 128, False, "tf32") == (True, 32)
    assert choose(compiled, 128, 128, False, "tf32x3") == (True, 32)
    assert choose(compiled, 64, 64, False, "tf32") == (True, 32)
    assert choose(compiled, 64, 64, False, "ieee") == (True, 64)
    assert choose(compiled, 32, 32, False, "tf32") == (True, 32)
    assert choose(compiled, 128, 128, True, "tf32") == (False, 32)  # general: rows apart


@needs_ptxas
def test_the_tf32_linear_backward_at_d_128_fits_sm_90(pytestconfig):
    spec = load_spec(ROOT / "specs" / "gated_deltanet.yaml")
    (job,) = [
        j
        for j in gpu_compile.jobs(spec, d=128, precision="tf32")
        if j.kernel == "linear_backward" and j.config == 0
    ]
    assert dict(job.constexprs)["DOT_PRECISION"] == "tf32"
    assert dict(job.constexprs)["BV"] == 32 and job.grid == (32, 8, 4)  # chunk-parallel
    (row,) = gpu_compile.compile_jobs([job], gpu_compile.TARGETS["sm_90"], cache_dir(pytestconfig))
    assert row.error == ""
    assert 0 < row.shared <= gpu_compile.TARGETS["sm_90"].shared_limit


@pytest.mark.slow
@needs_ptxas
@pytest.mark.skipif(
    os.environ.get("MIRAS_COMPILE_MATRIX") != "1",
    reason="the whole compile matrix takes about 28 minutes of ptxas on 2 cores from a cold "
    "cache, beyond make test's budget: run it with MIRAS_COMPILE_MATRIX=1",
)
@pytest.mark.parametrize("d", gpu_compile.WIDTHS)
@pytest.mark.parametrize("target", list(gpu_compile.TARGETS))
def test_every_kernel_of_every_covered_spec_fits(target, d, pytestconfig):
    """Every covered shipped spec x form x autotune config at width d on the target: compiles,
    shared memory within the block limit, spills within SPILL_BOUND. Kernels shared by specs
    (the exact scan; identical sources) compile once."""
    jobs = [job for path in COVERED for job in gpu_compile.jobs(path, d=d)]
    rows = gpu_compile.compile_jobs(jobs, gpu_compile.TARGETS[target], cache_dir(pytestconfig))
    assert gpu_compile.over_limits(rows) == []


# Autotune configs under the interpreter ---------------------------------------------------------


def test_the_interpreter_tries_one_config():
    """Under TRITON_INTERPRET=1 (which ignores num_warps and num_stages) a launch runs the first
    config alone: autotuning does not multiply the interpreted tests' time."""
    assert triton_backend.runs_on_cpu() or torch.cuda.is_available()
    configs = tuning.configs(tuning.CHUNK)
    assert len(configs) > 1
    expected = configs[:1] if triton_backend.runs_on_cpu() else configs
    assert tuning.first_under_interpreter(configs, {}) == expected


CONFIG_CASES = {  # which kernels run: chunk_mode and spec
    "linear": ("start", {"bias": "l2", "retention": {"kind": "l2", "grad_at": "retained"}}),
    "general": ("start", {"bias": "l2", "retention": "l2", "optimizer": "momentum"}),
    "scan": ("exact", {"bias": "l2", "retention": {"kind": "l2", "grad_at": "retained"}}),
}


def _outputs_and_grads(rule, mode):
    q, k, v, gates = random_inputs(rule, b=1, t=20, h=2, dk=16, dv=16, dtype=torch.float32)
    leaves = [q, k, v, *gates.values()]
    for x in leaves:
        x.requires_grad_(True)
    o, _ = rule(q, k, v, gates, backend="triton", chunk_size=16, chunk_mode=mode)
    grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.shape[-1])).sum(), leaves)
    return [o.detach(), *grads]


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_every_autotune_config_gives_the_same_result(case, monkeypatch):
    mode, fields = CONFIG_CASES[case]
    rule = miras.compile({"name": f"configs-{case}", **fields})
    monkeypatch.delenv(triton_backend.CONFIG_ENV, raising=False)
    want = _outputs_and_grads(rule, mode)
    for i in range(len(tuning.SCAN if case == "scan" else tuning.CHUNK)):
        monkeypatch.setenv(triton_backend.CONFIG_ENV, str(i))
        got = _outputs_and_grads(rule, mode)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"config {i} differs"


def test_a_config_index_out_of_range_is_refused(monkeypatch):
    rule = miras.compile({"name": "configs-bad", "bias": "l2", "retention": "l2"})
    monkeypatch.setenv(triton_backend.CONFIG_ENV, "9")
    with pytest.raises(ValueError, match=r"MIRAS_TRITON_CONFIG: expected an index into .*got '9'"):
        _outputs_and_grads(rule, "start")
