"""Videos in plans and pack costs: a video feeds the vision tower as an image does, and costs what the tower
attends over.

The plan tests build :class:`LengthTable` s from numbers (no video decoded: main venv). Oracles from outside
the code under test: transformers' own ``get_vision_cu_seqlens`` (the segments Qwen-VL's tower attends
within), the cost of ``t`` images of ``h * w`` patches written out, the samples each pack holds, and one
end-to-end forecast of PyAV-encoded clips checked against the video processor's ``video_grid_thw``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from vlm_pack.data.forecast import LengthTable
from vlm_pack.data.plan import plan_from_lengths, sample_costs, table_patches, vision_inputs
from vlm_pack.packing import PackCost
from vlm_pack.packing.steps import steps_short_of_images

CAPACITY = 8192


def video_mix(n: int = 1200, seed: int = 0, grids: bool = False) -> LengthTable:
    """``n`` samples: 77% text only (lognormal, median 1,500 tokens), 20% one video alone (1,000-3,000 video
    tokens, Qwen-VL: 4 patches a token), 3% one image (300-1,500 tokens); ``grids``: each video's grid
    ``(t, h, w)`` too. Fewer vision packs than packs: where the videos go decides which ranks run the tower."""
    rng = np.random.default_rng([seed, 0x7334])
    kind = rng.choice(3, n, p=[0.77, 0.20, 0.03])
    videos, images = (kind == 1).astype(np.int64), (kind == 2).astype(np.int64)
    v, m = int(videos.sum()), int(images.sum())
    t = rng.integers(2, 9, v)  # frame groups
    hw = (rng.integers(1000, 3000, v) * 4 // t // 4) * 4  # patches per group, a multiple of the 2x2 merge
    video_tokens, image_tokens = np.zeros(n, np.int64), rng.integers(300, 1500, m)
    video_tokens[videos > 0] = t * hw // 4
    vision = np.zeros(n, np.int64)
    vision[images > 0] = image_tokens
    text = np.maximum(8, rng.lognormal(np.log(1500), 0.8, n)).astype(np.int64)
    text = np.minimum(text, CAPACITY - video_tokens - vision)
    extra = {"video_groups": t, "video_group_patches": hw} if grids else {}
    return LengthTable(
        keys=[str(i) for i in range(n)], sources=["generated"] * n, text_tokens=text, vision_tokens=vision,
        num_patches=4 * (video_tokens + vision), image_ptr=np.concatenate([[0], np.cumsum(images)]),
        image_tokens=image_tokens, image_starts=np.zeros(m, np.int64), index=np.arange(n),
        num_videos=videos, video_tokens=video_tokens, **extra,
    )  # fmt: skip


def _pack_has_vision(table: LengthTable, plan) -> np.ndarray:
    """bool ``[B]``: packs holding an image or a video, counted from the plan's rows (not the planner's)."""
    vision = (np.diff(table.image_ptr) + np.asarray(table.num_videos))[np.asarray(plan.rows)]
    return np.add.reduceat(vision, np.asarray(plan.bin_ptr)[:-1]) > 0


@pytest.mark.parametrize("world, accum, grids", [(8, 1, False), (8, 4, False), (16, 1, True)])
def test_a_plan_gives_every_rank_vision_input_in_every_step_with_video_only_samples(world, accum, grids):
    """A mix of text, video-only and a few image samples: every step the plan's vision packs can fill
    (``world_size`` of them each) has one on every rank; only the steps they cannot (``forced``) lack one.
    On the main before this change a video did not count (``has_image`` read images only): 21 (8 ranks) and
    4 (8 ranks, grad-accum 4) steps left ranks without the tower while video packs went to other steps."""
    table = video_mix(grids=grids)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_from_lengths(table, capacity=CAPACITY, world_size=world, grad_accum=accum)
    rows = np.sort(np.asarray(plan.rows))
    assert rows.tolist() == list(range(len(table)))  # every sample once
    short = steps_short_of_images(_pack_has_vision(table, plan), np.asarray(plan.rank_bins), accum)
    assert short["forced"] < short["steps"]  # the plan holds vision packs for some steps: the rule binds there
    assert short["avoidable"] == 0 and short["short"] == short["forced"], short


def test_vision_inputs_count_videos_beside_images():
    table = video_mix(n=400)
    want = np.diff(table.image_ptr) + np.asarray(table.num_videos)
    assert vision_inputs(table).tolist() == want.tolist() and want.max() == 1 and table.num_videos.any()


def test_a_video_costs_as_t_images_of_its_frame_group():
    """A video of grid ``(t, h, w)`` costs as ``t`` images of ``h * w`` patches; an image beside it keeps its
    own patches (the video's are not shared among the images); the units are transformers' own segments."""
    torch = pytest.importorskip("torch")
    # the oracle: transformers' own segments (transformers.vision_utils, 5.1x on; the matrix's 5.6 lacks it)
    get_vision_cu_seqlens = pytest.importorskip("transformers.vision_utils").get_vision_cu_seqlens

    grid = (3, 8, 10)  # t, h, w of the video; the image: 100 patches (25 tokens)
    video_tokens, image_tokens = int(np.prod(grid)) // 4, 25
    text = 40
    table = LengthTable(
        keys=["v", "iv", "t"], sources=["x"] * 3, text_tokens=np.array([text, text, text]),
        vision_tokens=np.array([0, image_tokens, 0]), num_patches=np.array([240, 340, 0]),
        image_ptr=np.array([0, 0, 1, 1]), image_tokens=np.array([image_tokens]), image_starts=np.array([3]),
        num_videos=np.array([1, 1, 0]), video_tokens=np.array([video_tokens, video_tokens, 0]),
        video_groups=np.array([3, 3]), video_group_patches=np.array([80, 80]),
    )  # fmt: skip
    seqlens = np.diff(get_vision_cu_seqlens(torch.tensor([grid])).numpy()).tolist()  # the tower's segments
    patches, ptr = table_patches(table)
    assert patches[ptr[0] : ptr[1]].tolist() == seqlens == [80, 80, 80]
    assert patches[ptr[1] : ptr[2]].tolist() == [100, *seqlens] and ptr[3] == ptr[2]
    for cost in (PackCost(), PackCost(vision_window=64, vision_full_layers=4)):
        got = sample_costs(table, table.lengths, cost)
        lone = [cost(np.array([n]), np.array(p, dtype=np.int64)) for n, p in
                [(table.lengths[0], [80] * 3), (table.lengths[1], [100] + [80] * 3), (table.lengths[2], [])]]  # fmt: skip
        np.testing.assert_allclose(got, lone, rtol=1e-12)
        assert got[0] > cost(np.array([table.lengths[0]]), np.zeros(0, np.int64))  # the video is not free
        assert got[0] < cost(np.array([table.lengths[0]]), np.array([240]))  # nor one 240-patch image


def test_a_format_2_table_without_grids_still_counts_its_videos(tmp_path):
    """A lengths file written before grids (format 2) reads with ``video_groups`` None and its videos still
    count as vision input; a format-3 file round-trips the grids."""
    pytest.importorskip("pyarrow")
    import json

    import pyarrow.parquet as pq

    from vlm_pack.data.lengths import read_lengths, write_lengths

    table = video_mix(n=50, grids=True)
    path = write_lengths(table, tmp_path / "l.parquet")
    back = read_lengths(path)
    assert back.video_groups.tolist() == table.video_groups.tolist()
    assert back.video_group_patches.tolist() == table.video_group_patches.tolist()
    arrow = pq.read_table(path).drop_columns(["video_groups", "video_group_patches"])
    meta = json.loads(arrow.schema.metadata[b"vlm_pack"])
    pq.write_table(arrow.replace_schema_metadata({b"vlm_pack": json.dumps({**meta, "format": 2}).encode()}),
                   tmp_path / "old.parquet")  # fmt: skip
    old = read_lengths(tmp_path / "old.parquet")
    assert old.video_groups is None and vision_inputs(old).tolist() == vision_inputs(table).tolist()


def test_the_report_counts_video_packs_for_the_image_rule():
    """``analyze``'s step balance reports the rule over images and videos: video packs counted, no short
    step; the pack metrics count vision inputs per pack."""
    from vlm_pack.config import PackingConfig
    from vlm_pack.report.analysis import _pack_metrics, step_balance

    table = video_mix(grids=True)
    result = table.pack(PackingConfig(CAPACITY, oversized="skip"))
    got = step_balance(table, result, 8, 2)
    rule = got["short_of_images"]
    videos = np.asarray(table.num_videos)
    image_only = np.add.reduceat(np.diff(table.image_ptr)[result.order], result.bin_offsets[:-1]) > 0
    assert rule["image_packs"] > int(image_only.sum())  # the video packs are counted
    assert rule["avoidable"] == 0 and rule["short"] == rule["forced"] < rule["steps"], rule
    metrics = _pack_metrics(table, result, np.zeros(len(table), np.int64))
    per_pack = np.add.reduceat((videos + np.diff(table.image_ptr))[result.order], result.bin_offsets[:-1])
    assert metrics["vision_inputs_per_pack"]["mean"] == pytest.approx(per_pack.mean())
    assert metrics["vision_inputs_per_pack"]["mean"] > metrics["images_per_pack"]["mean"]


def test_a_stream_costs_a_video_by_its_frame_groups():
    """``StreamBalance``'s per-sample units: each image's patches (the image processor's own grid), then each
    video's ``t`` groups of ``h * w``; a family without a grid adds none."""
    from PIL import Image

    from vlm_pack.data.stream import _vision_units
    from vlm_pack.offline import build_tokenizer, image_processor
    from vlm_pack.preprocessor import Preprocessor
    from vlm_pack.vision.video.forecast import VideoForecast

    ip = image_processor("qwen2_vl")
    pre = Preprocessor(tokenizer=build_tokenizer("qwen2_vl"), image_processor=ip)
    grid = ip(images=[Image.new("RGB", (200, 120))], return_tensors="np")["image_grid_thw"][0]
    video = VideoForecast(indices=tuple(range(6)), grid_thw=(3, 8, 10), frame_tokens=(20,) * 3, tokens=60,
                          num_patches=240)  # fmt: skip
    no_grid = VideoForecast(indices=(0, 1), grid_thw=None, frame_tokens=(196, 196), tokens=392)
    assert _vision_units(pre, [(200, 120)], [video, no_grid]) == (int(np.prod(grid)), 80, 80, 80)


# ------------------------------------------------------------------------------ end to end, real clips
@pytest.mark.torchvision
def test_forecast_sources_records_each_videos_grid_as_the_processor_makes_it(tmp_path):
    """PyAV clips through ``forecast_sources``: each video's ``(t, h * w)`` equals the video processor's
    ``video_grid_thw`` of the decoded frames, and the plan's cost of a video sample is ``t`` images of
    ``h * w`` patches."""
    pytest.importorskip("torchvision")
    av = pytest.importorskip("av")
    import json

    from vlm_pack.data.forecast import forecast_sources
    from vlm_pack.preprocessor import Preprocessor
    from vlm_pack.testing.clips import encode_clip, processor_with_video

    proc = processor_with_video("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 64 * 28 * 28})
    pre = Preprocessor(processor=proc)
    specs = [(9, 96, 64), (4, 64, 64), (7, 80, 112)]
    lines = []
    for i, spec in enumerate(specs):
        (tmp_path / f"c{i}.mp4").write_bytes(encode_clip(*spec, fps=10))
        lines.append({"id": f"v{i}", "videos": [f"c{i}.mp4"],
                      "messages": [{"role": "user", "content": "<video>What moves?"},
                                   {"role": "assistant", "content": "A ramp."}]})  # fmt: skip
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    table = forecast_sources(str(manifest), preprocessor=pre, progress=False, on_error="raise")
    grids = []
    for i in range(len(specs)):
        with av.open(str(tmp_path / f"c{i}.mp4")) as container:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
        grids.append(proc.video_processor(videos=[frames], return_tensors="pt")["video_grid_thw"][0].tolist())
    assert table.video_groups.tolist() == [g[0] for g in grids]
    assert table.video_group_patches.tolist() == [g[1] * g[2] for g in grids]
    got = sample_costs(table, table.lengths, PackCost())
    want = [PackCost()(np.array([n]), np.array([g[1] * g[2]] * g[0])) for n, g in zip(table.lengths, grids)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
