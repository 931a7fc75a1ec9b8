"""benchmarks/bench_at_size.py at a tiny size on CPU: the GPU run at released shapes (benchmarks/gpu_checks.sh)
is known to work before a GPU is lent. Packed (varlen attention, token mixers isolated) and padded (sdpa,
attention_mask) steps from the same initial weights on the same demo samples give the same first-step loss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from vlm_pack._compat import mixers_refuse_packed_rows

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_at_size.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_at_size", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 1-4 minutes on a loaded 2-core machine (demo images at real sizes, processed)
@pytest.mark.parametrize("model", ["tiny_qwen3_5", "tiny_qwen2_5_vl"])
def test_the_at_size_steps_run_tiny_on_cpu_with_equal_first_losses(model):
    if model == "tiny_qwen3_5" and not mixers_refuse_packed_rows():
        pytest.skip("the at-size steps run Qwen3.5's mixers from seq_idx, which transformers < 5.24 does not pass on")
    result = _bench().main(["--model", model, "--device", "cpu", "--dtype", "float32", "--capacity", "1024",
                            "--samples", "12", "--steps", "2", "--max-pixels", "200000"])  # fmt: skip
    assert result["losses_equal"] and result["first_loss_gap"] < 1e-4
    assert result["packed"]["padding_share"] < result["padded"]["padding_share"]
    assert result["padding_bound"] > 1 and result["speedup"] > 0
    if model == "tiny_qwen3_5":
        assert result["packed"]["mixers"] == ["per_sample"]  # no CUDA here: vlm-pack's loop


def test_the_shapes_are_the_released_ones():
    bench = _bench()
    from vlm_pack import offline

    config = bench.model_config("qwen2_5_vl_3b", offline.build_tokenizer("qwen2_5_vl"))
    text, vision = config.text_config, config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.intermediate_size) == (2048, 36, 11008)
    assert (text.num_attention_heads, text.num_key_value_heads) == (16, 2)
    assert (vision.hidden_size, vision.depth, vision.out_hidden_size) == (1280, 32, 2048)
    config = bench.model_config("qwen3_5_2b", offline.build_tokenizer("qwen3_5"))
    assert config.text_config.layer_types.count("linear_attention") == 18
