"""The runnable examples run (a smoke run of a few steps on CPU) and do what they print."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_train_loop_with_pack_plan(capsys):
    result = _load("train_loop").main(
        ["--steps", "2", "--max-samples", "16", "--target-samples-per-update", "4"]
    )
    out = capsys.readouterr().out
    assert "samples/pack -> grad_accum" in out and out.count("step ") == 2
    losses = result["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    # ln(vocab) at init, then learning: the per-token loss of the update goes down.
    assert abs(losses[0] - math.log(1024)) < 0.3 and losses[-1] < losses[0]
    assert result["efficiency"] > 0.8 and result["grad_accum"] >= 1


@pytest.mark.slow
def test_hf_trainer_with_packing_collator(capsys):
    pytest.importorskip("accelerate", reason="transformers' Trainer requires accelerate")
    result = _load("train_hf_trainer").main(
        ["--steps", "2", "--max-samples", "12", "--batch-size", "4", "--grad-accum", "1"]
    )
    out = capsys.readouterr().out
    assert "packed into" in out
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    # In-batch packing: 4 samples per micro-batch fit in fewer rows than a padded batch's 4.
    assert result["rows"] and max(result["rows"]) < 4


@pytest.mark.slow
def test_megatron_collapsed(capsys):
    result = _load("megatron_collapsed").main(["--max-samples", "4", "--cp", "2"])
    out = capsys.readouterr().out
    assert "checks passed" in out and "PackedSeqParams(qkv_format='thd'" in out
    collapsed, expanded = result["cu_seqlens_collapsed"], result["cu_seqlens_expanded"]
    assert len(collapsed) == len(expanded) == 5 and collapsed[0] == expanded[0] == 0
    # LLaVA-NeXT images expand to thousands of embeddings: expanded boundaries lie far beyond collapsed ones.
    assert all(e > c for c, e in zip(collapsed[1:], expanded[1:]))
    assert all(e % 4 == 0 for e in expanded)  # 2 * CP padding, in expanded space


@pytest.mark.slow
def test_trl_sft_packed_matches_unpacked(capsys):
    pytest.importorskip("trl", reason="needs the [trl] extra")
    result = _load("train_trl_sft").main(["--steps", "1", "--max-samples", "8"])
    assert "PASS" in capsys.readouterr().out and result["ok"]
    assert result["diffs"]["loss"] <= 1e-5 and result["num_tokens"][0] == result["num_tokens"][1] > 0


@pytest.mark.slow
def test_energon_restart_gives_every_sample_once(capsys):
    pytest.importorskip("megatron.energon", reason="needs the [energon] extra")
    result = _load("train_energon").main(["--samples", "8", "--ranks", "2", "--workers", "0"])
    assert "PASS" in capsys.readouterr().out and result["ok"]
    assert sorted(result["seen"]) == [f"demo-{i:06d}" for i in range(8)]


@pytest.mark.parametrize("family", ["qwen3_5", "glm4v_moe"])
def test_check_equivalence_passes_this_years_families_through_varlen_attention(family, capsys):
    """The GPU check's command on CPU: varlen attention fed position ids only (GLM-4.5V's text model hands
    its layers the bare 3-row mRoPE ids), Qwen3.5's gated delta-net isolated by use_varlen_attention."""
    status = _load("check_equivalence").main(["--family", family, "--attn", "varlen", "--capacity", "2048"])
    out = capsys.readouterr().out
    assert status == 0 and "PASS: token_mult_prob_error 1.00000" in out


def test_check_equivalence_fails_qwen3_5_whose_delta_net_is_left_to_transformers(capsys):
    status = _load("check_equivalence").main(["--family", "qwen3_5", "--mistake", "mixers", "--capacity", "2048"])
    out = capsys.readouterr().out
    assert status == 1 and "linear_attn mixes tokens without attention" in out
    metric = float(out.split("token_mult_prob_error ")[1].split()[0])
    assert metric > 1.0001  # the leak itself, not only the structural problem
