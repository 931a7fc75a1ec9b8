"""`vlm-pack plan` / `analyze` with the model's own cost (issue 34): `--model-config config.json`.

Real parts: a ``datasets`` folder of conversations with PNG images made by Pillow (a mix of its own: 0-2
images of 40-700 px, answers of 1 to ~600 words, log-normal), the offline Qwen2-VL tokenizer and image
processor, and two ``config.json`` files in the layout of the released Qwen2-VL-2B-Instruct and
Qwen2-VL-72B-Instruct checkpoints (top-level language-model fields, ``vision_config``), read by the CLI with
transformers' ``AutoConfig``. Oracles from outside the code under test: each image's ViT patches from the
image processor's own ``image_grid_thw``, and each pack's training FLOPs written here from the transformer's
arithmetic and the config's numbers (not ``PackCost``), reduced here to the step imbalance.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from vlm_pack.cli.main import main
from vlm_pack.data import Plan
from vlm_pack.offline import image_processor

N = 480
CAPACITY = 2048
WORLD = 8

VISION = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3, "patch_size": 14,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "hidden_act": "quick_gelu"}  # fmt: skip
CONFIGS = {  # Qwen2-VL-2B-Instruct's and Qwen2-VL-72B-Instruct's config.json, as released
    "2b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
           "num_key_value_heads": 2, "vocab_size": 151936, "vision_config": {**VISION, "hidden_size": 1536}},
    "72b": {"hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "vocab_size": 152064, "vision_config": {**VISION, "hidden_size": 8192}},
}  # fmt: skip


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def pool() -> list[bytes]:
    rng = np.random.default_rng(0)
    return [_png((int(rng.integers(40, 700)), int(rng.integers(40, 700))), i) for i in range(24)]


@pytest.fixture(scope="module")
def data_dir(pool, tmp_path_factory):
    rng = np.random.default_rng(1)
    words = "the a photo chart table dog street read describe left right shown what where".split()
    images, messages = [], []
    for _ in range(N):
        k = int(rng.choice([0, 1, 1, 2]))
        question = " ".join(rng.choice(words, size=int(rng.integers(3, 40))))
        answer = " ".join(rng.choice(words, size=int(rng.lognormal(3.5, 1.0)) % 600 + 1))
        user = [{"type": "image", "text": None}] * k + [{"type": "text", "text": question}]
        images.append([pool[j] for j in rng.integers(0, len(pool), size=k)])
        messages.append([{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": answer}]}])
    ds = datasets.Dataset.from_dict({"images": images, "messages": messages})
    folder = tmp_path_factory.mktemp("data") / "train"
    ds.cast_column("images", datasets.List(datasets.Image())).save_to_disk(str(folder))
    return folder


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("models")
    paths = {}
    for name, fields in CONFIGS.items():
        (folder / name).mkdir()
        path = folder / name / "config.json"
        path.write_text(json.dumps({"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
                                    **fields}))  # fmt: skip
        paths[name] = str(path)
    return paths


def _patches_per_row(data_dir) -> list[list[int]]:
    """ViT patches of each row's images, from the image processor's own grid (t * h * w)."""
    ip = image_processor("qwen2_vl")
    ds = datasets.load_from_disk(str(data_dir))
    out = []
    for row in ds:
        out.append([int(np.prod(ip(images=[im])["image_grid_thw"][0])) for im in row["images"]])
    return out


def _flops(length: int, patches: list[int], cfg: dict) -> float:
    """Forward FLOPs of one sample in a pack: the language model over its tokens (causal attention within the
    sample), the ViT over each image (full attention within the image)."""
    h, f, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    linear = 2 * length * (2 * h * h + 2 * h * kv + 3 * h * f)  # q, o; k, v; gated MLP
    attention = 2 * h * length * length  # QK^T and AV over the causal half
    total = layers * (linear + attention) + 2 * length * h * cfg["vocab_size"]
    v = cfg["vision_config"]
    d, fv = v["embed_dim"], v["embed_dim"] * v["mlp_ratio"]
    for p in patches:
        total += v["depth"] * (2 * p * (4 * d * d + 2 * d * fv) + 4 * d * p * p)
    return float(total)


def _imbalance(plan: Plan, patches: list[list[int]], cfg: dict) -> float:
    """Sum over optimizer steps of the slowest rank's FLOPs / sum of the mean rank's."""
    pack = np.array(
        [sum(_flops(int(n), patches[int(r)], cfg) for r, n in zip(plan.rows_of(b), plan.lengths_of(b)))
         for b in range(plan.num_bins)]
    )  # fmt: skip
    k = plan.grad_accum
    slowest = mean = 0.0
    for g in range(0, plan.micro_steps, k):
        per_rank = pack[plan.rank_bins[:, g : g + k]].sum(axis=1)
        slowest, mean = slowest + per_rank.max(), mean + per_rank.mean()
    return slowest / mean


def _plan(data_dir, out, *extra: str) -> Plan:
    argv = ["plan", str(data_dir), "--family", "qwen2_vl", "--capacity", str(CAPACITY), "--world-size", str(WORLD),
            "--no-progress", "--out", str(out), *extra]  # fmt: skip
    assert main(argv) == 0
    return Plan.load(out)


@pytest.fixture(scope="module")
def patches(data_dir) -> list[list[int]]:
    return _patches_per_row(data_dir)


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 4])
def test_each_model_config_plans_its_own_balance(data_dir, configs, patches, accum, tmp_path, capsys):
    plans = {name: _plan(data_dir, tmp_path / f"{name}.plan", "--model-config", path, "--grad-accum", str(accum))
             for name, path in configs.items()}  # fmt: skip
    printed = capsys.readouterr().out
    assert "costed by qwen2_vl config" in printed and "28 layers x 1536" in printed and "80 layers x 8192" in printed
    own = {name: _imbalance(plan, patches, CONFIGS[name]) for name, plan in plans.items()}
    cross = {name: _imbalance(plan, patches, CONFIGS["72b" if name == "2b" else "2b"]) for name, plan in plans.items()}
    default = _plan(data_dir, tmp_path / "default.plan", "--grad-accum", str(accum))  # PackCost(): a 7B
    untold = {name: _imbalance(default, patches, cfg) for name, cfg in CONFIGS.items()}
    with capsys.disabled():  # the table of docs/data.md, "The model's own cost"
        print(f"\ngrad-accum {accum}, step imbalance by the FLOPs of the model it was costed for: {own}; "
              f"by the other model's: {cross}; the plan without --model-config, by each model's: {untold}")
    assert own["2b"] <= 1.02 and own["72b"] <= 1.02, own
    assert all(p.grad_accum == accum and p.steps == -(-p.micro_steps // accum) for p in plans.values())
    # costed for the other model, the same data waits longer: the 72B's plan trained on the 2B
    assert cross["72b"] > 1.05 > own["2b"]
    if accum > 1:
        return
    # the plan records the cost it was dealt by, and its key holds it: a consumer with another cost is refused
    for name, plan in plans.items():
        assert plan.cost["hidden_size"] == CONFIGS[name]["hidden_size"]
        assert plan.key["packing"]["balance"]["cost"] == plan.cost
    assert plans["2b"].digest != plans["72b"].digest
    assert sorted(np.concatenate([p.rows for p in plans.values()]).tolist()) == sorted(list(range(N)) * 2)
    # the checkpoint folder reads as its config.json; without --model-config: PackCost() (7B), not in the key
    folder = _plan(data_dir, tmp_path / "folder.plan", "--model-config", str(Path(configs["2b"]).parent))
    assert folder.digest == plans["2b"].digest
    assert default.key["packing"]["balance"]["cost"] is None and default.cost["hidden_size"] == 3584


def test_a_bad_model_config_stops_before_the_forecast(data_dir, tmp_path, capsys):
    argv = ["plan", str(data_dir), "--family", "qwen2_vl", "--capacity", "2048", "--out", str(tmp_path / "p.plan")]
    assert main([*argv, "--model-config", str(tmp_path / "missing.json")]) == 1
    assert "no such file or folder; give the config.json" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"hidden_size": 64}))  # no model_type: not a transformers config
    assert main([*argv, "--model-config", str(bad)]) == 1
    assert "transformers cannot read it as a model config" in capsys.readouterr().err
    assert not (tmp_path / "p.plan").exists()


@pytest.mark.slow
def test_analyze_world_size_measures_the_wait_with_the_model_config(data_dir, configs, tmp_path):
    base = ["analyze", str(data_dir), "--family", "qwen2_vl", "--capacity", "2048", "--world-size", str(WORLD),
            "--grad-accum", "1", "--no-plots", "--no-progress"]  # fmt: skip
    reports = {}
    for name in ("72b", None):
        out = tmp_path / str(name)
        assert main([*base, "--out", str(out), *(["--model-config", configs[name]] if name else [])]) == 0
        reports[name] = json.loads((out / "report.json").read_text())
    big, default = reports["72b"], reports[None]
    assert big["cost_model"]["hidden_size"] == 8192 and "72b/config.json" in big["cost_model"]["source"]
    assert default["cost_model"]["hidden_size"] == 3584 and default["cost_model"]["source"].startswith("PackCost()")
    balance = big["capacities"][0]["step_balance"]
    assert balance["world_size"] == WORLD and balance["step_plan"] <= 1.02
    # the 72B weighs a long answer against an image otherwise than the 7B: the measured waits differ
    assert balance["epoch_plan"] != default["capacities"][0]["step_balance"]["epoch_plan"]
