"""``python -m tools bench NAME``: one experiment a name, the configuration as train.py takes it,
GPU experiments refused at once without a GPU, and the ones that run on a CPU."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pytest

from runtime import device_policy
from tools.__main__ import main as tools
from tools.bench import EXPERIMENTS, runs

from tests.helpers import ROOT

GPU_EXPERIMENTS = ["trainer", "observe", "reference", "workers", "scaling", "probe-timing", "memory-sweep"]


@pytest.fixture
def no_gpu(monkeypatch):
    """No CUDA device, and nothing past the refusal may run: the test never starts a GPU run, fixed or not."""
    monkeypatch.setattr(device_policy, "cuda_present", lambda: False)

    def started(*args, **kwargs):
        raise AssertionError("a GPU experiment went on without a GPU")

    monkeypatch.setattr(runs, "prepare", started)


@pytest.mark.parametrize("name", GPU_EXPERIMENTS)
def test_a_gpu_experiment_is_refused_in_one_line_without_a_gpu(no_gpu, capsys, tmp_path, name):
    out = tmp_path / "bench-out"
    assert tools(["bench", name, "--out", str(out), "--model.n_layer", "2"]) == 2
    captured = capsys.readouterr()
    assert f"bench {name}: needs a CUDA GPU" in captured.err and "host-pipeline" in captured.err
    assert captured.err.count("\n") == 1 and captured.out == ""
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["--set", "model.n_layer=2"], "unrecognized option --set; configuration keys are given as --section.key VALUE"),
    (["--model.n_layer", "two"], "model.n_layer"),
    (["--model.no_such_key", "1"], "--model.no_such_key"),
    (["stray"], "unexpected 'stray'"),
    (["--compare", "model.no_such_key=1"], "--compare model.no_such_key=1"),
])
def test_a_bad_override_is_refused_before_anything_runs(no_gpu, capsys, tmp_path, argv, says):
    out = tmp_path / "bench-out"
    with pytest.raises(SystemExit) as exit_status:
        tools(["bench", "trainer", "--out", str(out), *argv])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "needs a CUDA GPU" not in err, err
    assert not out.exists()


def test_overrides_reach_the_runs_as_train_py_reads_them(tmp_path):
    """The host pipeline (the experiment that runs on a CPU) with the small tokenizer, set the way train.py takes it."""
    out = tmp_path / "bench-out"
    result = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "host-pipeline", "--copies", "1", "--docs", "300", "--out", str(out),
         "--data.tokenizer", "conf/tokenizer.json", "--model.vocab_size=8192"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads((out / "host-pipeline.json").read_text())
    assert {figures[kind]["tokenizer_path"] for kind in ("text", "input_ids")} == {"conf/tokenizer.json"}
    assert all(figures[kind]["target_tokens"] > 0 for kind in ("text", "input_ids"))


@pytest.mark.parametrize("name", list(EXPERIMENTS))
def test_every_experiment_describes_itself(name, capsys):
    with pytest.raises(SystemExit) as exit_status:
        tools(["bench", name, "--help"])
    assert exit_status.value.code == 0
    assert f"usage: python -m tools bench {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name, says", [("kernels", "needs a CUDA device"),
                                        ("allreduce", "needs 2 or more CUDA GPUs; this machine has 0")])
def test_the_kernel_and_all_reduce_experiments_are_refused_without_their_gpus(monkeypatch, capsys, name, says):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert tools(["bench", name]) == 2  # refused, like every tool's usage error: not a crash (1)
    captured = capsys.readouterr()
    assert says in captured.err and captured.err.count("\n") == 1 and captured.out == ""


def test_balancing_evens_out_the_ranks_attention_work_on_realistic_documents():
    records = subprocess.run([sys.executable, "-m", "tools", "bench", "synthetic-records", "--docs", "2500"], cwd=ROOT,
                             capture_output=True, check=True, timeout=120).stdout
    result = subprocess.run([sys.executable, "-m", "tools", "bench", "rank-balance"], input=records, cwd=ROOT,
                            capture_output=True, check=True, timeout=120)
    found = re.search(rb"stream order ([0-9.]+), balanced ([0-9.]+)", result.stdout)
    assert found, result.stdout + result.stderr
    in_order, balanced = float(found[1]), float(found[2])
    assert 1.0 <= balanced < 1.01 and balanced < in_order  # the busiest rank within 1 % of the mean


def test_trace_summary_counts_overlapping_kernels_once_and_groups_them_by_family(tmp_path, capsys):
    events = [  # two streams overlap for 5 us; a CPU event is not GPU time
        {"cat": "kernel", "name": "nvjet_sm90_tst_192x192", "ts": 0, "dur": 10},
        {"cat": "kernel", "name": "pytorch_flash::flash_fwd_kernel", "ts": 5, "dur": 10},
        {"cat": "kernel", "name": "triton_red_fused_logsumexp_0", "ts": 30, "dur": 20},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 100},
    ]
    for name, kept in (("gpu.json", events), ("cpu.json", events[3:])):
        (tmp_path / name).write_text(json.dumps({"traceEvents": kept}))
    assert tools(["bench", "trace-summary", str(tmp_path / "gpu.json"), "--top", "2"]) == 0
    text = capsys.readouterr().out
    first = text.splitlines()[0]
    assert "(70.0%), 3 kernels" in first  # busy 35 us of a 50 us window
    families = {line.split()[0] for line in text.splitlines()[1:4]}
    assert families == {"matmul", "attention", "compiled"}
    assert tools(["bench", "trace-summary", str(tmp_path / "cpu.json")]) == 0
    assert "no GPU kernels" in capsys.readouterr().out


def test_trace_summary_by_shape_finds_the_operator_that_launched_each_product(tmp_path, capsys):
    launch = {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "dur": 1}
    events = [  # thread 1: a module op around an aten::mm; thread 2 (autograd): an addmm with its bias first
        {"cat": "cpu_op", "name": "nn.Module: Linear", "tid": 1, "ts": 0, "dur": 50, "args": {}},
        {"cat": "cpu_op", "name": "aten::mm", "tid": 1, "ts": 5, "dur": 20,
         "args": {"Input Dims": [[1024, 1024], [1024, 1024]]}},
        {**launch, "tid": 1, "ts": 10, "args": {"correlation": 1}},
        {**launch, "tid": 1, "ts": 30, "args": {"correlation": 2}},  # after the mm closed: no operator with shapes
        {"cat": "cpu_op", "name": "aten::addmm", "tid": 2, "ts": 10, "dur": 20,
         "args": {"Input Dims": [[1, 16], [2048, 4096], [4096, 16], [], []]}},
        {**launch, "tid": 2, "ts": 12, "args": {"correlation": 3}},
        {"cat": "cpu_op", "name": "runfab::fa4_forward", "tid": 2, "ts": 40, "dur": 20,
         "args": {"Input Dims": [[4096, 3, 12, 64], [3]]}},
        {**launch, "tid": 2, "ts": 45, "args": {"correlation": 4}},
        {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 100, "dur": 2, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "nvjet_sm90_tst_128x256", "ts": 110, "dur": 2, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 120, "dur": 1, "args": {"correlation": 3}},
        {"cat": "kernel", "name": "nvjet_sm90_tss_64x64", "ts": 130, "dur": 3, "args": {"correlation": 2}},
        {"cat": "kernel", "name": "flash_fwd_sm90", "ts": 140, "dur": 9, "args": {"correlation": 4}},
    ]
    (tmp_path / "gpu.json").write_text(json.dumps({"traceEvents": events}))
    assert tools(["bench", "trace-summary", str(tmp_path / "gpu.json"), "--by-shape"]) == 0
    text = capsys.readouterr().out
    rows = text[text.index("matrix products by operator"):].splitlines()
    mm = next(r for r in rows if "aten::mm" in r)
    assert "x2" in mm and "0.002 ms a call" in mm and " 1074 TFLOP/s" in mm  # 2 * 1024^3 FLOP in 2 us
    addmm = next(r for r in rows if "aten::addmm" in r)
    assert " 268 TFLOP/s" in addmm  # 2 * 2048 * 4096 * 16 in 1 us: the bias is not an operand
    assert any("(no operator with shapes)" in r for r in rows)
    assert not any("fa4_forward" in r for r in rows)  # attention is not a matrix product here


def step_run(tokens_per_second: float, peak_gib: float = 20.0) -> dict:
    return {"tokens_per_second": tokens_per_second, "peak_allocated_gib": peak_gib}


def test_step_variants_recommends_only_what_is_faster_learns_the_same_and_fits():
    from tools.bench import step_variants

    learning = {"chunked": 3.000, "chunked (again)": 3.001, "chunked-compiled": 3.0, "cce": 3.5}
    result = {"loss_kernels": {"chunked": step_run(500_000), "chunked-compiled": step_run(490_000),
                               "cce": step_run(600_000)},
              "learning": {"runs": {k: {"held_out_loss": v} for k, v in learning.items()}},
              "inductor_loss": "chunked",
              "inductor": {"budget-1": step_run(520_000, peak_gib=43.0),  # 0.336 MiB per token: over 0.30
                           "budget-0.9": step_run(507_000, peak_gib=36.0), "budget-0.8": step_run(502_000),
                           "max-autotune-triton": step_run(530_000)}}
    # cce is faster but learns worse; budget-1 is faster but too large; budget-0.9 pays; max-autotune is not a budget
    assert step_variants.recommend(result, 32) == ["model.loss_kernel=chunked", "model.loss_softmax=gemm_lse",
                                                   "model.activation_memory_budget=0.9"]
    result["loss_kernels"]["chunked-compiled"] = step_run(510_000)
    assert step_variants.recommend(result, 32)[:2] == ["model.loss_kernel=chunked", "model.loss_softmax=compiled"]


@pytest.mark.parametrize("value, ok", [("budget-0.85", True), ("budget-1", True), ("max-autotune-triton", True),
                                        ("budget-1.5", False), ("budget-x", False), ("autotune", False)])
def test_step_variants_takes_inductor_variants_it_can_run(value, ok):
    from tools.bench import step_variants

    if ok:
        assert step_variants.inductor_variant(value) == value
    else:
        with pytest.raises(ValueError, match="not an inductor variant"):
            step_variants.inductor_variant(value)


def test_trainer_against_a_folder_without_train_py_is_refused_before_anything_runs(no_gpu, capsys, tmp_path):
    out = tmp_path / "bench-out"
    with pytest.raises(SystemExit) as exit_status:
        tools(["bench", "trainer", "--out", str(out), "--against", str(tmp_path)])
    assert exit_status.value.code == 2
    err = capsys.readouterr().err
    assert f"--against {tmp_path}: no train.py there" in err and "needs a CUDA GPU" not in err
    assert not out.exists()


def test_trainer_against_another_checkout_runs_its_train_py_on_the_same_records(monkeypatch, tmp_path):
    from tools.bench import training

    calls = []
    monkeypatch.setattr(device_policy, "cuda_present", lambda: True)
    monkeypatch.setattr(runs, "prepare", lambda args: None)
    monkeypatch.setattr(runs, "run_plain", lambda layout, args: {"tokens_per_second": 1.0})
    monkeypatch.setattr(runs, "save", lambda *a: None)
    monkeypatch.setattr(runs, "print_table", lambda *a, **k: None)

    def run_lightning(layout, args, name="lightning", extra=(), cold=False, tree=runs.ROOT):
        calls.append((layout, name, tree))
        return {"tokens_per_second": 1.0}

    monkeypatch.setattr(runs, "run_lightning", run_lightning)
    other = tmp_path / "before"
    other.mkdir()
    (other / "train.py").write_text("")
    assert training.trainer(["--layouts", "realistic", "--out", str(tmp_path / "o"), "--against", str(other)]) == 0
    assert calls == [("realistic", "lightning", runs.ROOT), ("realistic", "against0", other.resolve())]


def test_step_variants_compares_the_model_settings_a_variant_changes_and_restores_them():
    from config import load_config
    from tools.bench import step_variants

    cfg = load_config("conf/smoke.yaml")
    variant = load_config("conf/smoke.yaml", ["model.residual_in_fp32=true", "model.mlp_kernel=torch"])
    settings = step_variants.model_differences(cfg.model, variant.model)
    assert settings == {"residual_in_fp32": True, "mlp_kernel": "torch"}
    with pytest.raises(RuntimeError, match="step failed"):
        with step_variants.model_settings(cfg.model, settings):
            assert cfg.model.residual_in_fp32 is True and cfg.model.mlp_kernel == "torch"
            raise RuntimeError("step failed")
    assert cfg.model.residual_in_fp32 is False and cfg.model.mlp_kernel == "auto"


def test_step_variants_refuses_to_compare_a_setting_read_only_when_the_model_is_compiled(capsys):
    from tools.bench import step_variants

    with pytest.raises(SystemExit) as stopped:
        step_variants.main(["--compare", "model.activation_memory_budget=0.5", "--config", "conf/smoke.yaml"])
    assert stopped.value.code == 2
    assert "model.activation_memory_budget take effect when the model is built or compiled" in capsys.readouterr().err


def test_step_variants_refuses_a_compared_value_the_config_refuses(capsys):
    from tools.bench import step_variants

    with pytest.raises(SystemExit) as stopped:
        step_variants.main(["--compare", "model.mlp_kernel=fast", "--config", "conf/smoke.yaml"])
    assert stopped.value.code == 2
    assert "--compare model.mlp_kernel=fast: " in capsys.readouterr().err


def test_tiles_asks_what_to_sweep_and_needs_a_gpu(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit_status:
        tools(["bench", "tiles"])
    assert exit_status.value.code == 2 and "say what to sweep" in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert tools(["bench", "tiles", "--mlp"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_tiles_products_times_each_quack_tile_against_cublas_and_goes_on_past_a_failing_tile(monkeypatch, capsys):
    """Each wide product runs through cuBLAS, then through quack's plain GEMM (no activation, no second output)
    under every candidate config in turn; times and outputs are compared with cuBLAS's. quack and CUDA are
    stood in for on the CPU."""
    import argparse
    import sys
    import types

    import torch

    from model import fused_mlp
    from tools.bench import tiles

    seen = []

    def gemm_act(a, b, activation="gelu", store_preact=True, tuned=True, config=None, **kwargs):
        assert activation is None and not store_preact and not tuned
        seen.append(config)
        if config is not None and config.tile_n == 160:
            raise ValueError("tile does not divide")
        scale = 1.25 if config is not None and config.tile_m == 192 else 1.0  # an output that differs: reported
        return None, (a @ b) * scale

    # quack's config as a namespace of the fields the candidates set
    monkeypatch.setitem(sys.modules, "quack.gemm_config", types.SimpleNamespace(GemmConfig=types.SimpleNamespace))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", types.SimpleNamespace(gemm_act=gemm_act))
    monkeypatch.setattr(fused_mlp, "quack_unavailable_reason", lambda device, dtype, width: None)
    monkeypatch.setattr(tiles, "wide_products", lambda microbatch: {"logits": (8, 16, 24)})
    times = iter([2.0] + [1.0] * 20)  # cuBLAS first, then each quack tile that runs
    monkeypatch.setattr(tiles, "cuda_median_ms", lambda fn, repeats: next(times))
    monkeypatch.setattr("torch.cuda.synchronize", lambda *args: None)
    tiles.products(argparse.Namespace(microbatch=1, repeats=1), device=torch.device("cpu"))
    out = capsys.readouterr().out
    candidates = list(tiles.quack_configs().values())
    assert len(seen) == len(candidates) and seen[0] is None  # quack's default first, then every pinned tile
    assert [(c.tile_m, c.tile_n, c.pingpong) for c in seen[1:]] == [
        (c.tile_m, c.tile_n, c.pingpong) for c in candidates[1:]]
    assert re.search(r"cuBLAS\s+2\.000 ms", out)
    assert re.search(r"quack default\s+1\.000 ms .* x2\.000 against cuBLAS, output against cuBLAS's 0\.0e\+00", out)
    assert re.search(r"quack pingpong 192x128 .* output against cuBLAS's 2\.5e-01", out)
    assert "quack pingpong 128x160" in out and "failed: ValueError: tile does not divide" in out


def test_tiles_gelu_times_each_formula_and_says_how_often_a_gelu_rounds_as_the_exact_one(monkeypatch, capsys):
    """The two GELU epilogue products run under each formula in turn (a failing one is reported and skipped), each
    timed against the first; the dact product's activation output is held to the exact GELU. quack is stood in
    for on the CPU by the formulas themselves: the model's from model/quack_gelu.py, PyTorch's exact GELU for
    quack's, and the true floors."""
    import argparse
    import sys
    import types

    import torch

    from model import fused_mlp, quack_gelu
    from tools.bench import tiles

    def activate(preact, activation):
        if activation == "relu":
            raise RuntimeError("no ReLU today")
        if activation == fused_mlp.ACTIVATION:
            return (preact.float() * quack_gelu.cdf_and_density(preact.float())[0]).to(preact.dtype)
        return torch.nn.functional.gelu(preact) if activation == "gelu_erf" else preact

    calls = []

    def gemm_act(a, b, activation, tuned):
        calls.append(("act", activation))
        preact = a @ b
        return preact, activate(preact, activation)

    def gemm_dact(dout, b, preact, activation, tuned, config):
        calls.append(("dact", activation))
        return dout @ b, activate(preact, activation), None

    monkeypatch.setitem(sys.modules, "quack.gemm_interface", types.SimpleNamespace(gemm_act=gemm_act, gemm_dact=gemm_dact))
    monkeypatch.setattr(fused_mlp, "quack_unavailable_reason", lambda device, dtype, width: None)
    monkeypatch.setattr(tiles, "WIDTH", 16)
    monkeypatch.setattr(tiles, "ROW", 1024)
    times = iter([2.0, 1.0, 0.5] * 2)  # quack's GELU, the model's, no activation (the ReLU fails)
    monkeypatch.setattr(tiles, "cuda_median_ms", lambda fn, repeats: next(times))
    monkeypatch.setattr("torch.cuda.synchronize", lambda *args: None)
    tiles.gelu(argparse.Namespace(microbatch=8, repeats=1), dev=torch.device("cpu"))
    out = capsys.readouterr().out
    formulas = list(tiles.gelu_formulas().values())
    assert calls == [("act", f) for f in formulas] + [("dact", f) for f in formulas]
    assert re.search(r"the model's \(model/quack_gelu.py\)\s+1\.000 ms .* x2\.000", out)
    assert out.count("failed: RuntimeError: no ReLU today") == 2
    shares = [float(share) for share in re.findall(r"equal to the exact GELU's rounding: (\d\.\d+)", out)]
    assert len(shares) == 2 and min(shares) > 0.99  # the dact product's two GELUs only; PyTorch's is the line above
    assert re.search(r"PyTorch's F.gelu \(fp32\) [01]\.\d{5}\n", out)


def test_tiles_attention_sweep_restores_fa4s_backward_chooser_and_goes_on_past_a_failing_tile(monkeypatch, capsys):
    """The backward candidates replace FA4's private tile chooser one at a time: each call sees its own candidate,
    FA4's own chooser is back after the sweep, and a candidate that fails is one line, not the end of the sweep.
    FA4 and CUDA are stood in for on the CPU."""
    import argparse
    import dataclasses
    import types

    import torch

    from model import flash4
    from tools.bench import tiles

    @dataclasses.dataclass(frozen=True)
    class Config:  # the fields of FA4's BwdConfig that the candidates change
        m_block_size: int = 128
        n_block_size: int = 128
        SdP_swapAB: bool = True
        AtomLayoutMSdP: int = 1
        AtomLayoutNdKV: int = 2
        AtomLayoutMdQ: int = 2
        dQ_single_wg: bool = False

    def chooser(*args, **kwargs):
        return Config()

    seen = []

    def forward(q, k, v, tile_mn=None, mma_pv_is_rs=None, **kwargs):
        if tile_mn == (192, 192):
            raise ValueError("too much shared memory")
        return q * 2, q.sum(-1)

    def backward(q, k, v, out, dout, lse, **kwargs):
        config = fa._tile_size_bwd_sm90(64, 64, True, False)
        seen.append(config)
        if config.n_block_size == 64:
            raise RuntimeError("does not launch")
        return q * config.m_block_size, k, v

    fa = types.SimpleNamespace(_tile_size_bwd_sm90=chooser, _flash_attn_fwd=forward, _flash_attn_bwd=backward)
    monkeypatch.setattr(flash4, "fa4_interface", lambda: fa)
    monkeypatch.setattr(tiles, "cuda_median_ms", lambda fn, repeats: 1.0)
    monkeypatch.setattr("torch.cuda.synchronize", lambda *args: None)
    qkv = torch.randn(8, 3, 2, 4)
    monkeypatch.setattr(tiles, "attention_inputs", lambda layout, microbatch: (qkv, torch.tensor([0, 8]), 8, 36))
    tiles.attention(argparse.Namespace(layouts=["realistic"], microbatch=1, repeats=1, only=None))
    out = capsys.readouterr().out
    assert fa._tile_size_bwd_sm90 is chooser
    assert [c.m_block_size for c in seen] == [128, 64, 64, 128, 128]  # default, the two 64-row ones, no swap, 128x64
    assert "forward 192x192" in out and "failed: ValueError: too much shared memory" in out
    assert "backward 128x64" in out and "failed: RuntimeError: does not launch" in out
    assert re.search(r"backward 64x128 dQ in one warp group\s+1\.000 ms", out)


def test_tiles_head_chunk_times_both_softmax_routes_and_holds_the_single_pass_to_the_two_pass(monkeypatch, capsys):
    """quack's product then the two-pass kernel against the product with its log-sum-exp then the single pass:
    each whole and in parts, with the single pass's loss and gradient against the two-pass's. quack's GEMMs and the
    Triton kernels are stood in for on the CPU by their PyTorch references."""
    import argparse
    import sys
    import types

    import torch

    import model
    from model import fused_mlp, loss, quack_linear
    from tools.bench import tiles

    def two_pass(logits, targets, vocab, ignore_index):
        value, grad = loss.chunk_loss_and_grad(logits, targets, vocab, logits.dtype)
        logits.copy_(grad)
        return value

    def single_pass(logits, lse, targets, vocab, ignore_index):
        value = two_pass(logits, targets, vocab, ignore_index)
        return value * 1.5  # a single pass that is off: reported against the two-pass

    reference_lse = types.SimpleNamespace(logits_and_tile_log_normalizers=loss.reference_logits_and_tile_log_normalizers)
    monkeypatch.setitem(sys.modules, "model.quack_lse", reference_lse)
    # `from model import quack_lse` takes the package's attribute where an earlier test imported the real module
    monkeypatch.setattr(model, "quack_lse", reference_lse, raising=False)
    monkeypatch.setitem(sys.modules, "model.triton_cross_entropy", types.SimpleNamespace(
        loss_and_gradient_in_place=two_pass, gradient_in_place=single_pass))
    monkeypatch.setattr(quack_linear, "quack_product", quack_linear.torch_product)
    monkeypatch.setattr(fused_mlp, "quack_unavailable_reason", lambda device, dtype, width: None)
    monkeypatch.setattr(tiles, "WIDTH", 16)
    monkeypatch.setattr(tiles, "head_chunk_shape", lambda: (32, 200))
    times = iter([2.0, 1.0, 1.5, 0.5, 0.75, 0.25])  # the two routes, then each one's parts
    monkeypatch.setattr(tiles, "cuda_median_ms", lambda fn, repeats: next(times))
    monkeypatch.setattr("torch.cuda.synchronize", lambda *args: None)
    tiles.head_chunk(argparse.Namespace(repeats=1), device=torch.device("cpu"))
    out = capsys.readouterr().out
    assert "32 x 16 -> 256" in out
    assert re.search(r"triton\s+2\.000 ms\s+x1\.000 against triton\s+\(quack's product 1\.500, two-pass kernel 0\.500\)"
                     r"\s+loss, gradient against triton 0\.0e\+00 0\.0e\+00", out), out
    assert re.search(r"gemm_lse\s+1\.000 ms\s+x2\.000 against triton\s+\(quack's product with the log-sum-exp 0\.750, "
                     r"single pass 0\.250\)\s+loss, gradient against triton 5\.0e-01 0\.0e\+00", out), out


def fake_nvidia_smi(tmp_path, lines: list[str]):
    """An executable that prints ``lines`` as nvidia-smi's sampling loop would, then keeps looping (sleeps)."""
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo '{line}'\n" for line in lines) + "exec sleep 60\n")
    script.chmod(0o755)
    return str(script)


def test_gpu_clocks_summarize_the_busy_samples_and_stop_the_sampling_loop(tmp_path):
    import time

    from tools.bench.gpu_clocks import GpuClocks

    lines = ["0, 345, 75.10, 31",  # idle before the run: left out
             "99, 1980, 690.5, 60", "100, 1830, 700.0, 66", "97, 1900, 695.2, 64",
             "[N/A], 1980, 700, 60",  # a field the GPU does not report: skipped
             "45, 1980, 300.0, 62"]  # compiling: left out
    with GpuClocks(command=fake_nvidia_smi(tmp_path, lines), gpu="3") as clocks:
        deadline = time.monotonic() + 10
        while len(clocks.samples) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        process = clocks._process
    assert process.poll() is not None, "the sampling loop outlived the block"
    assert clocks.argv[-1] == "--id=3" and len(clocks.samples) == 5
    assert clocks.summary() == {"sm_clock_mhz": 1900.0, "power_watts": 695.2, "max_temperature_c": 66.0,
                                "busy_samples": 3}


def test_gpu_clocks_give_no_figures_where_nvidia_smi_is_absent_or_nothing_was_busy(tmp_path):
    from tools.bench.gpu_clocks import GpuClocks

    with GpuClocks(command=str(tmp_path / "no-such-nvidia-smi")) as clocks:
        pass
    assert clocks.summary() == {}
    clocks.stop()  # stopping twice is harmless
    idle = GpuClocks(command=fake_nvidia_smi(tmp_path, ["3, 345, 75, 31"])).start()
    idle.stop()
    assert idle.summary() == {}


def test_gpu_clocks_name_the_first_visible_gpu(monkeypatch):
    from tools.bench.gpu_clocks import visible_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8f1c, 2")
    assert visible_gpu() == "GPU-8f1c"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpu() == "0"


def test_the_trainer_table_shows_each_runs_clock_and_power_where_measured(monkeypatch, capsys):
    import argparse

    monkeypatch.setattr(runs.torch.cuda, "get_device_name", lambda: "a GPU")
    args = argparse.Namespace(microbatch=32, steps=25, warmup=8, train_flags=[])
    base = {"tokens_per_second": 500_000.0, "mfu": 0.5, "peak_allocated_gib": 37.5}
    runs.print_table({"one-doc": {"plain": base, "lightning": {**base, "sm_clock_mhz": 1830.0, "power_watts": 699.6}}},
                     args, baseline="plain")
    out = capsys.readouterr().out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("one-doc")}
    assert "SM MHz/W" in out
    assert rows["lightning"].rstrip().endswith("1830/700") and rows["plain"].rstrip().endswith("-")


def test_trainer_runs_read_records_written_once_beforehand_enough_for_their_updates(tmp_path):
    """Every run of a layout reads one file written before the first run, holding at least the rows of --steps
    updates (and the feeder's read-ahead); one-doc records fill exactly one 4096-token row each."""
    import train
    from pipeline.stages import StreamStats, pack_rows

    args = runs.parse(runs.parser("trainer", "records"), ["--steps", "3", "--out", str(tmp_path / "o")])
    needed_rows = (args.steps + 2) * train.EFFECTIVE_BATCH_SIZE
    for layout in ("realistic", "one-doc"):
        path = runs.records_for(layout, args)
        written = path.stat().st_mtime_ns
        assert runs.records_for(layout, args) == path and path.stat().st_mtime_ns == written  # written once
        docs = [np.array([*json.loads(line)["input_ids"], 0]) for line in path.read_text().splitlines()]
        rows = list(pack_rows(docs, 4096, StreamStats()))
        assert needed_rows <= len(rows) <= 2 * needed_rows, (layout, len(rows))
        if layout == "one-doc":
            assert {len(doc) for doc in docs} == {4096} and len(rows) == len(docs)
    given = tmp_path / "mine.jsonl"
    given.write_text('{"input_ids": [1, 2, 3]}\n')
    mine = runs.parse(runs.parser("trainer", "records"), ["--records", str(given), "--out", str(tmp_path / "p")])
    assert runs.records_for("realistic", mine) == given and not (tmp_path / "p").exists()
