"""`vlm-pack analyze | pack | demo`: the table, the report folder, the pack plan and the errors users see.

Everything runs on the embedded demo data (real WebDataset shards and real image files written by
vlm_pack.demo) with the real HF image processors and the offline tokenizers.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlm_pack import Preprocessor, forecast_sources
from vlm_pack.cli.main import main
from vlm_pack.demo import demo_jsonl, demo_plan, demo_records, demo_shards, draw_image
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.report import Baseline, padded_batches

SMALL = 200704  # Qwen max_pixels: <= 256 tokens per image, cheap to process for real


@pytest.fixture(scope="module")
def shards() -> list[Path]:
    return demo_shards()  # cached after the first call of the session (or of an earlier run)


@pytest.fixture(scope="module")
def raw_samples(shards) -> dict[str, tuple[list[bytes], object]]:
    """key -> (image bytes, conversation) of the first two demo shards, read back with webdataset."""
    import webdataset as wds

    from vlm_pack.data import image_fields, parse_text

    return {
        s["__key__"]: ([s[f] for f in image_fields(s)], parse_text(s))
        for s in wds.WebDataset([str(p) for p in shards[:2]], shardshuffle=False)
    }


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, shards):
    """`vlm-pack demo`, the README's main-job command, with plots."""
    out = tmp_path_factory.mktemp("demo") / "report"
    return out, main(["demo", "--out", str(out), "--no-progress"])


def _run(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ------------------------------------------------------------------------------------------------ demo


@pytest.mark.slow
def test_demo_is_deterministic_and_realistic():
    a, b = demo_plan(64), demo_plan(64)
    assert a == b
    assert [r["images"] for r in demo_records(3)] == [r["images"] for r in demo_records(3)]  # same bytes
    plan = demo_plan()
    kinds = {im.kind for it in plan for im in it["images"]}
    assert kinds == {"photo", "document", "screenshot", "chart", "icon"}
    counts = np.bincount([len(it["images"]) for it in plan])
    assert counts[0] > 0 and counts[1] > counts[2] > 0 and counts[3] > 0
    sizes = [im.display_size for it in plan for im in it["images"]]
    assert max(max(s) for s in sizes) >= 4032 and min(min(s) for s in sizes) <= 64
    assert any(im.orientation == 6 for it in plan for im in it["images"])
    # The files really are what the plan says: format, stored size, EXIF orientation, not blank.
    spec = next(im for it in plan for im in it["images"] if im.orientation == 6)
    data, ext = draw_image(spec), spec.ext
    im = Image.open(io.BytesIO(data))
    assert ext == "jpg" and im.format == "JPEG" and im.getexif().get(0x0112) == 6
    assert im.size[0] > im.size[1]  # stored landscape, displayed portrait
    assert np.asarray(im.convert("L").reduce(16)).std() > 5


@pytest.mark.slow
def test_demo_command_prints_the_table_and_writes_the_report(demo_run, capsys):
    out, code = demo_run
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert [c["capacity"] for c in report["capacities"]] == [8192, 12288, 16384]
    d = report["dataset"]
    assert d["samples"] == 320 and d["images"] > 320 and d["text_only_samples"] > 0
    b = report["baseline"]
    for c in report["capacities"]:
        pk = c["packed"]
        # Nothing lost: every sample packed or reported.
        assert c["packed_samples"] + len(c["oversized_skipped"]) == d["samples"]
        assert all(s["reason"].startswith("length") for s in c["oversized_skipped"])
        assert pk["efficiency"] == pytest.approx(c["tokens"] / (pk["bins"] * c["capacity"]))
        assert pk["bins"] >= pk["lower_bound"] == math.ceil(c["tokens"] / c["capacity"])
        assert pk["samples_per_pack"]["mean"] == pytest.approx(c["packed_samples"] / pk["bins"])
        # Padded batches waste far more than packs on this data.
        assert c["padded"]["random"]["waste"] > 0.3 > 0.05 > pk["waste"]
        ga = c["grad_accum"]["packed"]
        per_step = pk["samples_per_pack"]["mean"] * b["world_size"] * b["packs_per_device"]
        target = b["samples_per_update"]
        miss = [abs(g * per_step - target) for g in range(1, ga["grad_accum"] + 3)]
        assert miss[ga["grad_accum"] - 1] == min(miss)  # the recommendation is closest to the target
        assert ga["min_grad_accum_reaching_target"] == math.ceil(target / per_step)
        assert ga["min_reaching_samples_per_update"] >= target
        # The padded run has no capacity: every sample at full length, the same in every column.
        assert c["padded"] == report["capacities"][0]["padded"]
        assert c["padded"]["random"]["real_tokens"] == d["text_tokens"] + d["vision_tokens"]
    oversized = [len(c["oversized_skipped"]) for c in report["capacities"]]
    assert oversized[0] >= oversized[1] >= oversized[2]
    text = (out / "report.txt").read_text()
    for row in ("padding waste, random order", "efficiency", "samples/pack mean p50 p95", "GRAD ACCUM",
                "(1) recommended: samples per update closest to", "(2) the fewest steps"):  # fmt: skip
        assert row in text
    assert set(report["plots"]) == {"lengths.png", "efficiency.png", "packs.png"}
    for name in report["plots"]:
        with Image.open(out / name) as im:
            assert im.format == "PNG" and im.size[0] > 600
            assert np.asarray(im.convert("L")).std() > 20  # a drawing, not a blank canvas


@pytest.mark.slow
def test_analyze_without_sources_uses_the_demo(tmp_path, demo_run, capsys):
    code, out, err = _run(capsys, ["analyze", "--capacity", "12288", "--out", str(tmp_path), "--no-plots"])
    assert code == 0 and "vlm-pack demo (320 samples)" in out and "stand-in" not in err
    mine = json.loads((tmp_path / "report.json").read_text())["capacities"][0]
    demo = json.loads((demo_run[0] / "report.json").read_text())["capacities"][1]
    assert mine == demo


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "vlm_pack", "analyze", "--help"], capture_output=True, text=True
    )
    assert (
        proc.returncode == 0 and "--capacity" in proc.stdout and "--target-samples-per-update" in proc.stdout
    )


# ------------------------------------------------------------------------------------------------ forecast


@pytest.mark.parametrize("family", ["qwen2_vl", "llava_next"])
@pytest.mark.slow
def test_forecast_equals_processed_length(shards, raw_samples, family):
    """Header-only lengths == real processor output, EXIF-rotated photos, WebP and 3-image samples included."""
    wanted = {"demo-000003", "demo-000016", "demo-000066", "demo-000075"}  # text-only, 3 images, EXIF 6, WebP
    kw = {"size": {"shortest_edge": 3136, "longest_edge": SMALL}} if family == "qwen2_vl" else {}
    proc = image_processor(family, **kw)
    tok = build_tokenizer(family)
    pre = Preprocessor(tok, proc, family=family)
    table = forecast_sources(shards[:2], preprocessor=pre, progress=False)
    assert wanted <= set(table.keys)
    records = {r["key"]: r for r in demo_records(80)}
    for key in sorted(wanted):
        i = table.keys.index(key)
        out = pre.process([data for data, _ in records[key]["images"]], records[key]["conversation"])
        assert table.lengths[i] == len(out["input_ids"]), key
        assert table.vision_tokens[i] == int(out["tokens_per_image"].sum()), key
        # Where each image's tokens start, as drawn in packs.png.
        is_img = (out["input_ids"] == tok.image_token_id).int().numpy()
        starts = np.flatnonzero(np.diff(np.concatenate([[0], is_img])) == 1)
        lo, hi = table.image_ptr[i], table.image_ptr[i + 1]
        if family == "qwen2_vl":  # Qwen wraps each image, so runs are one per image
            assert table.image_starts[lo:hi].tolist() == starts.tolist(), key


@pytest.mark.slow
def test_jsonl_manifest_matches_shards(tmp_path, capsys):
    n = 24
    manifest = demo_jsonl(tmp_path / "jsonl", num_samples=n)
    shard_dir = tmp_path / "shards"
    demo_shards(shard_dir, num_samples=n, samples_per_shard=10)
    reports = []
    for src in (str(manifest), str(shard_dir / "demo-{00000..00002}.tar")):
        out = tmp_path / f"r{len(reports)}"
        code, _, err = _run(capsys, ["analyze", src, "--capacity", "4096", "--out", str(out), "--no-plots"])
        assert code == 0 and "stand-in tokenizer" in err  # the user is told text counts are approximate
        reports.append(json.loads((out / "report.json").read_text()))
    assert reports[0]["dataset"] == reports[1]["dataset"]
    assert reports[0]["capacities"][0]["packed"] == reports[1]["capacities"][0]["packed"]


def test_a_saved_offline_processor_is_a_processor_folder_for_the_cli(tmp_path, shards, capsys):
    """The first hour (docs/your-data.md): the offline stand-in processor saved with save_pretrained (it raised
    AttributeError on its missing video processor) is a folder `analyze --processor` reads, with the same
    counts as the processor itself forecasts."""
    from vlm_pack import Preprocessor
    from vlm_pack.offline import processor

    proc = processor("qwen2_vl", build_tokenizer("qwen2_vl"), size={"shortest_edge": 3136, "longest_edge": SMALL})
    folder = tmp_path / "ckpt"
    proc.save_pretrained(folder)
    code, out, err = _run(capsys, ["analyze", str(shards[0]), "--processor", str(folder), "--json", "--no-plots",
                                   "--out", str(tmp_path / "r")])  # fmt: skip
    assert code == 0 and "stand-in" not in err, err
    report = json.loads(out)
    assert report["tokenizer"] == "exact" and report["vision_spec"]["max_pixels"] == SMALL
    from vlm_pack.data import forecast_sources

    table = forecast_sources(str(shards[0]), preprocessor=Preprocessor(processor=proc), progress=False)
    assert report["dataset"]["samples"] == len(table.lengths)
    dataset = report["dataset"]
    assert dataset["text_tokens"] + dataset["vision_tokens"] == int(table.lengths.sum())


def test_processor_folder_gives_the_same_as_family_flags(tmp_path, shards, capsys):
    folder = tmp_path / "ckpt"
    image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": SMALL}).save_pretrained(folder)
    build_tokenizer("qwen2_vl").save_pretrained(folder)
    src = str(shards[0])
    code, out1, err = _run(
        capsys,
        ["analyze", src, "--processor", str(folder), "--out", str(tmp_path / "a"), "--json", "--no-plots"],
    )
    assert code == 0 and "stand-in" not in err
    rep1 = json.loads(out1)
    assert rep1["tokenizer"] == "exact" and rep1["vision_spec"]["max_pixels"] == SMALL
    code, out2, _ = _run(
        capsys,
        [
            "analyze",
            src,
            "--family",
            "qwen2_vl",
            "--max-pixels",
            str(SMALL),
            "--out",
            str(tmp_path / "b"),
            "--json",
            "--no-plots",
        ],
    )
    rep2 = json.loads(out2)
    assert rep1["dataset"] == rep2["dataset"] and rep1["capacities"] == rep2["capacities"]
    # Capped images: nothing is oversized any more at 8192.
    assert rep1["capacities"][0]["oversized_skipped"] == []


# ------------------------------------------------------------------------------------------------ pack plan


@pytest.mark.slow
def test_pack_plan_holds_every_sample_once(tmp_path, shards, capsys):
    plan = tmp_path / "plans" / "plan.jsonl"
    base = ["pack", *map(str, shards), "--capacity", "8192", "--oversized", "skip", "--no-progress"]
    code, out, _ = _run(capsys, [*base, "--out", str(plan)])
    assert code == 0 and "packs of 8,192 tokens" in out
    packs = [json.loads(line) for line in plan.read_text().splitlines()]
    meta = json.loads((tmp_path / "plans" / "plan.meta.json").read_text())
    keys = [k for p in packs for k in p["keys"]]
    skipped = [s["key"] for s in meta["skipped"]]
    assert len(keys) == len(set(keys)) and not set(keys) & set(skipped)
    assert len(keys) + len(skipped) == meta["samples"] == 320
    assert skipped and all("capacity 8192" in s["reason"] for s in meta["skipped"])
    for p in packs:
        assert p["tokens"] == sum(p["lengths"]) <= 8192
        assert len(p["keys"]) == len(p["lengths"]) == len(p["sources"])
    assert meta["packs"] == len(packs) >= meta["lower_bound"]
    # Creation order by default (shuffle_seed=None, PackingConfig's default); shuffled with --shuffle-seed.
    firsts = [p["lengths"][0] for p in packs]
    assert firsts == sorted(firsts, reverse=True) and meta["shuffle_seed"] is None
    plan2 = tmp_path / "plan2.jsonl"
    assert main([*base, "--shuffle-seed", "0", "--out", str(plan2)]) == 0
    packs2 = [json.loads(line) for line in plan2.read_text().splitlines()]
    assert sorted(map(tuple, (p["keys"] for p in packs))) == sorted(map(tuple, (p["keys"] for p in packs2)))
    assert [p["lengths"][0] for p in packs2] != firsts
    assert json.loads((tmp_path / "plan2.meta.json").read_text())["packing_config"]["shuffle_seed"] == 0


def test_pack_plan_vision_budget_and_truncation(tmp_path, shards, capsys):
    plan = tmp_path / "plan.jsonl"
    args = ["pack", str(shards[0]), "--capacity", "8192", "--out", str(plan), "--vision-capacity", "2",
            "--vision-cost", "images"]  # fmt: skip
    assert main([*args, "--oversized", "truncate"]) == 0
    packs = [json.loads(line) for line in plan.read_text().splitlines()]
    meta = json.loads((tmp_path / "plan.meta.json").read_text())
    truncated = {k: v for p in packs for k, v in p.get("truncated_from", {}).items()}
    assert meta["truncated"] == len(truncated) and all(v > 8192 for v in truncated.values())
    # A sample with 3 images cannot fit a 2-image budget: reported, not dropped silently.
    assert any("vision cost 3" in s["reason"] for s in meta["skipped"])
    capsys.readouterr()


def test_padded_batches_by_hand():
    # Grouped: sorted longest first inside a mega-batch -> [5, 1] [1, 1]: 10 + 2 tokens computed for 8 real.
    r = padded_batches(np.array([1, 5, 1, 1]), 2, order="grouped")
    assert (r["batches"], r["real_tokens"], r["padded_tokens"], r["max_batch_tokens"]) == (2, 8, 12, 10)
    assert r["waste"] == pytest.approx(1 / 3)
    # A last partial batch is padded only for the samples it has.
    r = padded_batches(np.array([4, 4, 4]), 2, order="random")
    assert r["padded_tokens"] == 12 and r["waste"] == 0.0
    with pytest.raises(ValueError):
        Baseline(batch_size=0)


# ------------------------------------------------------------------------------------------------ errors


def test_clear_errors(tmp_path, shards, capsys):
    code, _, err = _run(capsys, ["analyze", str(tmp_path / "missing.tar")])
    assert code == 1 and "missing.tar" in err and "does not exist" in err
    (tmp_path / "notes.txt").write_text("hi")
    code, _, err = _run(capsys, ["analyze", str(tmp_path / "notes.txt")])
    assert code == 1 and "is not a source vlm-pack reads" in err
    code, _, err = _run(capsys, ["analyze", str(shards[0]), "--family", "internvl"])
    assert code == 1 and "--family 'internvl'" in err
    code, _, err = _run(capsys, ["analyze", str(shards[0]), "--processor", str(tmp_path / "nope")])
    assert code == 1 and "is not a directory" in err
    with pytest.raises(SystemExit) as exc:
        main(["analyze", "--capacity", "-5"])
    assert exc.value.code == 2 and "positive integer" in capsys.readouterr().err
    code, _, err = _run(capsys, ["pack", str(shards[0]), "--capacity", "8192", "--out", str(tmp_path)])
    assert code == 1 and "is a directory" in err

    # A manifest line whose image is missing: named by file, line and key.
    manifest = tmp_path / "m.jsonl"
    good = {
        "key": "ok",
        "conversation": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
    }
    manifest.write_text(
        json.dumps(good) + "\n" + json.dumps({**good, "key": "bad", "images": ["gone.jpg"]}) + "\n"
    )
    code, _, err = _run(capsys, ["analyze", str(manifest), "--no-plots", "--out", str(tmp_path / "r")])
    assert code == 0 and "m.jsonl:2" in err and "'bad'" in err and "gone.jpg" in err  # skipped, named
    argv = ["analyze", str(manifest), "--no-plots", "--on-error", "raise", "--out", str(tmp_path / "r")]
    code, _, err = _run(capsys, argv)
    assert code == 1 and "m.jsonl:2" in err and "'bad'" in err and "gone.jpg" in err


def test_bad_samples_skip_mode_lists_them(tmp_path, capsys, write_tar):
    # A shard whose second sample says 2 images but carries 1, and whose third image header is corrupt.
    shard = tmp_path / "bad.tar"
    rec = demo_records(1)[0]
    conv2 = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "two"},
    ]
    members = {
        "a.json": json.dumps({"messages": rec["conversation"]}).encode(),
        "a.jpg": rec["images"][0][0],
        "b.json": json.dumps({"messages": conv2}).encode(),
        "b.jpg": rec["images"][0][0],
        "c.txt": b"a caption",
        "c.png": b"\x89PNG\r\n\x1a\n-truncated",
    }
    write_tar(shard, list(members.items()))
    argv = ["analyze", str(shard), "--no-plots", "--on-error", "raise", "--out", str(tmp_path / "r1")]
    code, _, err = _run(capsys, argv)
    assert code == 1 and "'b'" in err and "placeholder" in err
    # on_error="skip" is the default, as everywhere: listed in the report and named on stderr
    code, out, err = _run(capsys, ["analyze", str(shard), "--no-plots", "--out", str(tmp_path / "r2")])
    assert code == 0 and "invalid samples skipped: 2" in out
    assert "2 sample(s) could not be read" in err and "'b'" in err and "--on-error raise" in err
    invalid = json.loads((tmp_path / "r2" / "report.json").read_text())["dataset"]["invalid"]
    assert [i["key"] for i in invalid] == ["b", "c"]


@pytest.mark.slow
def test_errors_say_what_to_do(tmp_path, shards, capsys, write_tar):
    # A corrupt image stops the run: the message names shard, key and field, and the way to go on.
    shard = tmp_path / "corrupt.tar"
    write_tar(shard, [("x.txt", b"a caption"), ("x.jpg", b"\xff\xd8 not a jpeg")])
    argv = ["analyze", str(shard), "--no-plots", "--on-error", "raise", "--out", str(tmp_path / "r0")]
    code, _, err = _run(capsys, argv)
    assert code == 1 and "corrupt.tar" in err and "'x'" in err and "--on-error skip" in err

    # An empty shard: named, not "the sources are empty".
    empty = tmp_path / "empty-000.tar"
    tarfile.open(empty, "w").close()
    code, _, err = _run(capsys, ["analyze", str(empty), "--no-plots", "--out", str(tmp_path / "r1")])
    assert code == 1 and "empty-000.tar" in err and "no samples" in err
    code, _, err = _run(
        capsys, ["pack", str(empty), "--capacity", "8192", "--out", str(tmp_path / "p.jsonl")]
    )
    assert code == 1 and "empty-000.tar" in err

    # A capacity below every sample is a mistake, not a table of zeros or an empty plan.
    lengths = forecast_sources(
        [shards[0]], tokenizer=build_tokenizer("qwen2_vl"), spec=_qwen2_spec(), progress=False
    ).lengths
    shortest = int(lengths.min())
    argv = ["analyze", str(shards[0]), "--no-plots", "--no-progress", "--capacity", "16"]
    code, out, err = _run(capsys, [*argv, "--out", str(tmp_path / "r2")])
    assert code == 1 and out == "" and f"shortest sample is {shortest:,} tokens" in err
    assert "--oversized truncate" in err and not (tmp_path / "r2" / "report.json").exists()
    plan = tmp_path / "plan.jsonl"
    argv_pack = ["pack", str(shards[0]), "--capacity", "16", "--out", str(plan)]
    code, out, err = _run(capsys, [*argv_pack, "--oversized", "skip"])
    assert code == 1 and f"shortest sample is {shortest:,} tokens" in err and not plan.exists()
    # oversized="raise", the default of a plan as everywhere: the first too-long sample, and the way on
    code, out, err = _run(capsys, argv_pack)
    assert code == 1 and "fit no pack of capacity 16" in err and "(key '" in err and not plan.exists()
    assert "--oversized skip" in err and "--oversized truncate" in err
    # One capacity too small among good ones: the table is printed, with a warning on stderr.
    code, out, err = _run(capsys, [*argv, "8192", "--out", str(tmp_path / "r3")])
    assert code == 0 and "8,192" in out and "capacity 16 packs none of the 64 samples" in err


def _qwen2_spec():
    from vlm_pack.vision import vision_spec

    return vision_spec("qwen2_vl")


@pytest.mark.slow
def test_table_shows_per_pack_numbers_exactly(demo_run):
    out, code = demo_run
    assert code == 0
    rows = [r for r in (out / "report.txt").read_text().splitlines() if r.startswith("  largest micro-batch")]
    # The packed micro-batch is one pack: the capacities themselves, not "12.3k".
    assert rows[1].split()[-3:] == ["8,192", "12,288", "16,384"]


# ------------------------------------------------------------------------------------------------ issue 13 / 18


def _hand_table(lengths: list[int]):
    from vlm_pack.report import LengthTable

    n = len(lengths)
    zeros = np.zeros(n, np.int64)
    return LengthTable([f"s{i}" for i in range(n)], ["hand"] * n, np.asarray(lengths, np.int64), zeros,
                       zeros, np.zeros(n + 1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))  # fmt: skip


def test_help_is_lazy_and_every_option_says_what_it_does():
    probe = (
        "import sys\nfrom vlm_pack.cli.main import main\ntry:\n    main(['analyze', '--help'])\nexcept SystemExit:\n"
        "    pass\nprint([m for m in ('torch', 'transformers', 'megatron', 'matplotlib', 'numpy') if m in sys.modules])"
    )
    proc = subprocess.run([sys.executable, "-W", "default", "-c", probe], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("[]") and "Warning" not in proc.stderr
    from vlm_pack.cli.main import build_parser

    for sub in build_parser()._subparsers._group_actions[0].choices.values():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help and len(action.help) > 10, (sub.prog, action.option_strings)
    help_text = " ".join(build_parser()._subparsers._group_actions[0].choices["analyze"].format_help().split())
    assert "The folder that the image paths in JSONL manifests are relative to" in help_text
    assert "header-only" in help_text and "--verify" in help_text


def test_family_is_case_insensitive(tmp_path, shards, capsys):
    outs = []
    for name in ("QWEN2_VL", "qwen2-vl"):
        code, out, _ = _run(capsys, ["analyze", str(shards[0]), "--family", name, "--capacity", "8192",
                                     "--json", "--no-plots", "--out", str(tmp_path / name)])  # fmt: skip
        assert code == 0
        outs.append(json.loads(out))
    assert outs[0]["family"] == outs[1]["family"] == "qwen2_vl"
    assert outs[0]["capacities"] == outs[1]["capacities"]


def test_padded_baseline_does_not_depend_on_capacity():
    from vlm_pack.report import analyze, plot_efficiency

    table = _hand_table([100, 200, 300, 5000, 9000, 150, 120, 7000])
    report, _ = analyze(table, [4096, 8192, 16384], baseline=Baseline(batch_size=2))
    padded = [c["padded"] for c in report["capacities"]]
    assert padded[0] == padded[1] == padded[2]
    assert [c["packed_samples"] for c in report["capacities"]] == [5, 7, 8]  # packing does change
    assert padded[0]["random"]["real_tokens"] == 21870  # every sample, at full length
    fig = plot_efficiency(table, [4096, 8192], baseline=Baseline(batch_size=2), points=6)
    flat = [line for line in fig.axes[0].lines if str(line.get_label()).startswith("padded")]
    assert len(flat) == 2 and all(len(set(line.get_ydata())) == 1 for line in flat)


def test_grad_accum_recommends_the_closest_to_the_target():
    from vlm_pack.report import analyze_capacity, format_report

    # 26 samples of 100 tokens, 13 per pack of 1300: one micro step is 13 samples, the target 4 x 1 x 4 = 16.
    metrics, _ = analyze_capacity(_hand_table([100] * 26), 1300, baseline=Baseline(4, 1, 4))
    ga = metrics["grad_accum"]["packed"]
    assert (ga["grad_accum"], ga["samples_per_update"]) == (1, 13.0)  # |13 - 16| < |26 - 16|
    assert (ga["min_grad_accum_reaching_target"], ga["min_reaching_samples_per_update"]) == (2, 26.0)
    report = {"dataset": {"samples": 26, "images": 0, "text_only_samples": 26, "invalid": [],
                          **{k: dict(mean=100, p50=100, p95=100, max=100) for k in (
                              "text_tokens_per_sample", "vision_tokens_per_sample", "length_per_sample")}},
              "baseline": {"batch_size": 4, "world_size": 1, "grad_accum": 4, "packs_per_device": 1,
                           "samples_per_update": 16}, "capacities": [metrics]}  # fmt: skip
    text = format_report(report)
    assert "1 (13.0)" in text and "2 (26.0)" in text and "closest to 16" in text


@pytest.mark.slow
def test_packs_png_shows_every_capacity(shards):
    from vlm_pack.report import analyze, plot_packs

    table = forecast_sources([shards[0]], tokenizer=build_tokenizer("qwen2_vl"), spec=_qwen2_spec(), progress=False)
    _, results = analyze(table, [8192, 12288, 16384])
    fig = plot_packs(table, results, num_packs=3)
    titles = [ax.get_title() for ax in fig.axes]
    assert [t.split(":")[0] for t in titles] == ["capacity 8,192", "capacity 12,288", "capacity 16,384"]


def test_error_messages_name_the_thing_and_the_fix(tmp_path, shards, capsys, write_tar):
    # A tar whose first sample is broken (one field twice): the shard is named and the first sample blamed.
    bad = write_tar(tmp_path / "dup.tar", [("a.txt", b"x"), ("a.txt", b"y")])
    code, _, err = _run(capsys, ["analyze", str(bad), "--no-plots", "--out", str(tmp_path / "r0")])
    assert code == 1 and "dup.tar" in err and "first sample" in err and "None" not in err
    # A JSON record in no layout vlm-pack reads: its own keys and the accepted ones.
    odd = write_tar(tmp_path / "odd.tar", [("k.json", json.dumps({"prompt": "hi", "answer": "yo"}).encode())])
    code, _, err = _run(capsys, ["analyze", str(odd), "--no-plots", "--out", str(tmp_path / "r1")])
    assert code == 1 and "['answer', 'prompt']" in err and '"messages"' in err and "'k'" in err
    # --spec with a key the spec lacks: the valid keys, not a TypeError's text.
    code, _, err = _run(capsys, ["analyze", str(shards[0]), "--spec", "foo=1", "--out", str(tmp_path / "r2")])
    assert code == 1 and "--spec foo=..." in err and "max_pixels" in err and "unexpected keyword" not in err
    # An --out that cannot be written: named as --out with its path, before any work.
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    for argv in (["analyze", str(shards[0])], ["pack", str(shards[0]), "--capacity", "8192"]):
        target = str(blocker / "sub" / ("plan.jsonl" if argv[0] == "pack" else "report"))
        code, _, err = _run(capsys, [*argv, "--out", target])
        assert code == 1 and "--out" in err and target in err and "writable" in err


def test_pack_without_processor_says_it_uses_the_stand_in_tokenizer(tmp_path, shards, capsys):
    code, _, err = _run(capsys, ["pack", str(shards[0]), "--capacity", "16384", "--out", str(tmp_path / "p.jsonl")])
    assert code == 0 and "stand-in tokenizer" in err and "--processor" in err
    meta = json.loads((tmp_path / "p.meta.json").read_text())
    assert meta["tokenizer"] == "vlm-pack offline stand-in" and meta["packing_config"]["capacity"] == 16384


def test_verify_decodes_images_and_catches_truncated_ones(tmp_path, capsys, write_tar):
    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (240, 320, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    whole = buf.getvalue()
    cut = whole[: len(whole) // 2]  # header intact, scan data cut short
    with Image.open(io.BytesIO(cut)) as im:
        assert im.size == (320, 240)  # Pillow itself reads the header fine ...
        with pytest.raises(OSError):
            im.load()  # ... and fails on the pixels
    text = json.dumps({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]},
                                    {"role": "assistant", "content": "a"}]}).encode()  # fmt: skip
    shard = write_tar(tmp_path / "cut.tar", [("good.json", text), ("good.jpg", whole), ("bad.json", text), ("bad.jpg", cut)])
    base = [str(shard), "--capacity", "4096", "--no-plots"]
    code, out, _ = _run(capsys, ["analyze", *base, "--out", str(tmp_path / "r0")])
    assert code == 0 and "2 samples" in out  # header-only: the truncated image passes
    code, _, err = _run(capsys, ["analyze", *base, "--verify", "--on-error", "raise", "--out", str(tmp_path / "r1")])
    assert code == 1 and "cut.tar" in err and "'bad'" in err and "truncated" in err
    code, _, _ = _run(capsys, ["analyze", *base, "--verify", "--on-error", "skip", "--out", str(tmp_path / "r2")])
    report = json.loads((tmp_path / "r2" / "report.json").read_text())
    assert code == 0 and [i["key"] for i in report["dataset"]["invalid"]] == ["bad"]
    assert report["images_checked"] == "decoded (--verify)" and report["dataset"]["samples"] == 1
    plan = tmp_path / "plan.jsonl"
    code, _, err = _run(
        capsys, ["pack", str(shard), "--capacity", "4096", "--verify", "--on-error", "raise", "--out", str(plan)]
    )
    assert code == 1 and "'bad'" in err and not plan.exists()


# the token each family's model scatters image features into (the released vocabularies' names)
_EMBEDDING_TOKEN = {"llava": "<image>", "idefics3": "<image>", "internvl": "<IMG_CONTEXT>", "gemma3": "<image_soft_token>"}


@pytest.mark.parametrize("family", list(_EMBEDDING_TOKEN))
@pytest.mark.slow
def test_processor_folder_of_any_family_counts_with_its_own_template(tmp_path, capsys, family):
    """`analyze --processor DIR` on a checkpoint folder whose chat template vlm-pack has no format for: the
    template, the tokenizer and the image processor saved there give transformers' own lengths."""
    from transformers import ProcessorMixin

    from vlm_pack import offline

    template = (Path(__file__).parent / "templates" / f"{family}.jinja").read_text()
    proc = offline.processor(family, build_tokenizer(family), chat_template=template)
    folder = tmp_path / "ckpt"
    try:  # as released: the processor class with its template (Idefics3, LLaVA)
        proc.save_pretrained(folder)
    except AttributeError:  # a class built here without its video processor does not save: its parts do
        proc.tokenizer.save_pretrained(folder)
        proc.image_processor.save_pretrained(folder)
        (folder / "chat_template.jinja").write_text(template)
    images = [Image.effect_noise(size, 40).convert("RGB") for size in [(640, 480), (300, 900), (1280, 720)]]
    lines, expected, vision = [], 0, 0
    embedding_id = proc.tokenizer.convert_tokens_to_ids(_EMBEDDING_TOKEN[family])
    for i, used in enumerate([[0], [1, 2], []]):
        names = []
        for j in used:
            images[j].save(tmp_path / f"{j}.png")
            names.append(f"{j}.png")
        user = [{"type": "image"}] * len(used) + [{"type": "text", "text": "What is this? " * (i + 1)}]
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": "A thing."}]}]
        lines.append(json.dumps({"key": f"s{i}", "images": names, "messages": messages}))
        text = ProcessorMixin.apply_chat_template(proc, messages)
        bos = proc.tokenizer.bos_token
        enc = proc(text=[text], images=[[images[j] for j in used]] if used else None,
                   add_special_tokens=not (bos and text.startswith(bos)))
        expected += len(enc["input_ids"][0])
        vision += sum(int(t == embedding_id) for t in enc["input_ids"][0])
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    code, out, err = _run(
        capsys, ["analyze", str(tmp_path / "data.jsonl"), "--processor", str(folder), "--json", "--no-plots",
                 "--out", str(tmp_path / "r"), "--capacity", "16384"],
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["tokenizer"] == "exact" and report["checkpoint_chat_template"] is True
    assert report["dataset"]["text_tokens"] + report["dataset"]["vision_tokens"] == expected
    assert report["dataset"]["vision_tokens"] == vision
