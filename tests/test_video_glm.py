"""GLM-4.1V videos: per temporal group ``<|begin_of_image|>`` + its image tokens + ``<|end_of_image|>{int t}``
inside the template's ``<|begin_of_video|>`` .. ``<|end_of_video|>``, forecast from the clip's header and
packed = alone.

Oracles from outside the code under test: PyAV decoding the WHOLE clip, transformers' Glm4vProcessor given all
of it with its metadata, sampling frames itself (models/glm4v/processing_glm4v.py,
video_processing_glm4v.py), and the tiny random GLM-4.1V model (built from config) run on each sample alone.

transformers' GLM-4.1V model takes images OR videos in one forward (``get_placeholder_mask`` makes every
``<|image|>`` token both an image and a video token, modeling_glm4v.py), so the packed row holds video and text
samples; image + video samples are forecast and processed, not run.

Needs torchvision (transformers' video processors) and PyAV: ``scripts/test_torchvision.sh``.
"""

from __future__ import annotations

import functools
import io
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("torchvision")
pytest.importorskip("av")
pytestmark = pytest.mark.torchvision

from PIL import Image  # noqa: E402

from vlm_pack import Preprocessor, offline  # noqa: E402
from vlm_pack.testing import check_packed_equivalence, encode_clip, processor_with_video  # noqa: E402
from vlm_pack.vision.video import read_video_header  # noqa: E402

TOL = 1.0001
WRONG = 1.01
# the test template with GLM-4.1V's video part (zai-org/GLM-4.1V-9B-Thinking chat_template.jinja writes it so)
_TEMPLATES = {
    "glm4v": (Path(__file__).parent / "templates" / "glm4v.jinja").read_text().replace(
        "{%- elif item.type == 'text' %}",
        "{%- elif item.type == 'video' %}<|begin_of_video|><|video|><|end_of_video|>{%- elif item.type == 'text' %}",
    ),
    "glm4v_moe": (Path(__file__).parent / "templates" / "glm4v_moe.jinja").read_text(),  # GLM-4.5V
    "glm46v": (Path(__file__).parent / "templates" / "glm46v.jinja").read_text(),  # its own video processor
}
FAMILIES = tuple(_TEMPLATES)
_SIZE = {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}}  # small grids for a CPU
_MODES = {"fps2": {}, "fps1": dict(fps=1)}  # the processor's own sampling (its default 2 fps), and 1 fps
# (frames, width, height, fps, container): odd and even counts, 64 px to 640 px, 2 to 60 fps, three containers
_CLIPS = [
    (10, 96, 64, 5.0, "mp4"),
    (7, 64, 128, 2.0, "webm"),
    (31, 320, 240, 30.0, "mkv"),
    (45, 640, 360, 15.0, "mp4"),
    (90, 160, 90, 60.0, "mkv"),
    (25, 64, 48, 24.0, "webm"),
]
_TURNS = [
    {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What moves?"}]},
    {"role": "assistant", "content": "A square."},
]


@functools.cache
def _pre(mode: str, family: str = "glm4v") -> Preprocessor:
    proc = processor_with_video(family, chat_template=_TEMPLATES[family], image_overrides=_SIZE, **_SIZE, **_MODES[mode])
    return Preprocessor(processor=proc)


@functools.cache
def _clip(frames: int, width: int, height: int, fps: float, container: str, seed: int = 0) -> bytes:
    return encode_clip(frames, width, height, fps, container, seed)


def _all_frames(clip: bytes) -> torch.Tensor:
    import av

    with av.open(io.BytesIO(clip)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(container.streams.video[0])]
    return torch.from_numpy(np.stack(frames))


def _own(pre: Preprocessor, images: list, clips: list[bytes], conversation: list) -> dict:
    from vlm_pack.processing.render import _render

    proc = pre.processor
    text = _render(conversation, proc.tokenizer, proc, None, None, len(images), "own", num_videos=len(clips)).text
    metadata = [read_video_header(c).metadata() for c in clips]
    return proc(
        text=[text], images=[images] if images else None, videos=[_all_frames(c) for c in clips],
        video_metadata=metadata, return_tensors="pt",
    )  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", list(_MODES))
def test_forecast_is_the_processors_own_output_per_clip(mode, family):
    pre = _pre(mode, family)
    for k, spec in enumerate(_CLIPS):
        clip = _clip(*spec, seed=k)
        forecast = pre.forecast_rows([(_TURNS, [], k, [read_video_header(clip)])])[0]
        assert not isinstance(forecast, Exception), (spec, forecast)
        own = _own(pre, [], [clip], _TURNS)
        assert forecast.length == own["input_ids"].shape[1], (mode, spec)
        sample = pre.process([], _TURNS, key=f"c{k}", videos=[clip])
        assert torch.equal(sample["input_ids"], own["input_ids"][0])
        assert torch.equal(sample["pixel_values_videos"], own["pixel_values_videos"])
        assert torch.equal(sample["video_grid_thw"], own["video_grid_thw"])
        assert torch.equal(sample["mm_token_type_ids"], own["mm_token_type_ids"][0])
        video_tokens = int((own["mm_token_type_ids"][0] == 2).sum())
        assert forecast.video_counts == sample["tokens_per_video"].tolist() == [video_tokens]


def test_forecast_with_an_image_and_two_videos():
    pre = _pre("fps2")
    clips = [_clip(10, 96, 64, 5.0, "mp4", 1), _clip(25, 64, 48, 24.0, "webm", 2)]
    picture = Image.new("RGB", (200, 120), (20, 140, 60))
    conversation = [
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "and"}, {"type": "image"},
                                     {"type": "text", "text": "then"}, {"type": "video"}]},
        {"role": "assistant", "content": "Both move."},
    ]  # fmt: skip
    row = (conversation, [picture.size], "m", [read_video_header(c) for c in clips])
    forecast = pre.forecast_rows([row])[0]
    assert not isinstance(forecast, Exception), forecast
    own = _own(pre, [picture], clips, conversation)
    sample = pre.process([picture], conversation, key="m", videos=clips)
    assert forecast.length == own["input_ids"].shape[1] == len(sample["input_ids"])
    assert torch.equal(sample["input_ids"], own["input_ids"][0])
    assert torch.equal(sample["mm_token_type_ids"], own["mm_token_type_ids"][0])
    assert forecast.counts == sample["tokens_per_image"].tolist() == [int((own["mm_token_type_ids"][0] == 1).sum())]
    assert forecast.video_counts == sample["tokens_per_video"].tolist()
    assert forecast.starts == [int((own["mm_token_type_ids"][0] == 1).nonzero()[0])]


# ----------------------------------------------------------------------------- packed == alone (tiny model)


@functools.cache
def _model(family: str):
    return offline.tiny_model(family, _pre("fps2", family).tokenizer, initializer_range=0.2, seed=0)


@functools.cache
def _samples(family: str) -> tuple:
    """Two video samples (2 and 4 temporal groups), text only, and a sample with two videos."""
    pre = _pre("fps2", family)
    video_a, video_b = _clip(10, 96, 64, 5.0, "mp4", 1), _clip(7, 64, 128, 2.0, "webm", 2)
    cases = [
        ([video_a], _TURNS),
        ([video_b], [{"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "video"}]},
                     {"role": "assistant", "content": "It moves."}]),
        ([], [{"role": "user", "content": "Say something short."}, {"role": "assistant", "content": "Short."}]),
        ([video_b, video_a], [{"role": "user", "content": [{"type": "video"}, {"type": "video"}]},
                              {"role": "assistant", "content": "Two clips."}]),
    ]  # fmt: skip
    out = []
    for k, (videos, conversation) in enumerate(cases):
        sample = pre.process([], conversation, key=f"{family}/{k}", videos=videos)
        length, _ = pre.forecast(conversation, [], key=k, videos=[read_video_header(v) for v in videos])
        assert length == len(sample["input_ids"]), k
        out.append(sample)
    return tuple(out)


def _report(family: str, **kwargs):
    samples, pre, model = list(_samples(family)), _pre("fps2", family), _model(family)
    capacity = sum(len(s["input_ids"]) for s in samples)
    batch = pre.collator(capacity, model_config=model.config, max_samples_per_bin=len(samples))(samples)
    assert batch.num_rows == 1
    report = check_packed_equivalence(model, samples, None, packed_batch=batch, tokenizer=pre.tokenizer, **kwargs)
    return report, batch


@pytest.mark.parametrize("family", FAMILIES)
def test_video_samples_packed_equal_alone(family):
    report, batch = _report(family)
    print(f"{family} video: token_mult_prob_error {report.metric:.7f}, max |diff| {report.max_abs_diff:.2e}")
    assert report.passed and report.metric <= TOL, str(report)
    assert batch.video_grid_thw.shape[0] == sum(len(s.get("video_grid_thw", [])) for s in _samples(family))


def _positions_as_one_sequence(model, batch):
    kwargs = dict(batch.model_inputs("sdpa"))
    rows, length = batch.input_ids.shape
    rope, _ = model.model.get_rope_index(
        batch.input_ids, mm_token_type_ids=batch.mm_token_type_ids, image_grid_thw=batch.image_grid_thw,
        video_grid_thw=batch.video_grid_thw,
    )  # fmt: skip
    kwargs["position_ids"] = torch.cat([torch.arange(length).expand(rows, length)[None], rope])
    return model(**kwargs).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_not_restarted_fail(family):
    report, _ = _report(family, packed_forward=_positions_as_one_sequence)
    print(f"{family} video, positions not restarted: token_mult_prob_error {report.metric:.4f}")
    assert not report.passed and report.metric > WRONG, str(report)


def _video_pixels_replaced(model, batch):
    kwargs = dict(batch.model_inputs("sdpa"))
    pixels = kwargs["pixel_values_videos"]
    kwargs["pixel_values_videos"] = torch.randn(pixels.shape, generator=torch.Generator().manual_seed(0))
    return model(**kwargs).logits


def test_the_videos_reach_the_logits():
    """Control: the same row with other video pixels fails, so the frames' embeddings are in the check."""
    report, _ = _report("glm4v", packed_forward=_video_pixels_replaced)
    print(f"glm4v video pixels replaced: token_mult_prob_error {report.metric:.4f}")
    assert not report.passed and report.metric > WRONG, str(report)


def test_a_row_of_images_and_videos_is_refused_naming_both(monkeypatch):
    """GLM's model takes images or videos per forward (get_placeholder_mask): the collator says so, naming the
    samples, where the model would fail with a token/feature count mismatch."""
    pre, video_samples, model = _pre("fps2"), _samples("glm4v"), _model("glm4v")
    picture = Image.new("RGB", (200, 120), (20, 140, 60))
    turns = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
             {"role": "assistant", "content": "Green."}]  # fmt: skip
    samples = [pre.process([picture], turns, key="picture"), video_samples[0]]
    capacity = sum(len(s["input_ids"]) for s in samples)
    collator = pre.collator(capacity, model_config=model.config, max_samples_per_bin=2)
    with pytest.raises(ValueError, match=r"images or videos in one forward.*images \(sample 0\) and videos \(sample 1\).*separate rows"):
        collator(samples)
    assert collator([video_samples[0], video_samples[2]]).num_rows == 1  # videos and text only: packed
    # the oracle: without the check, transformers' model itself fails on such a row
    monkeypatch.setattr("vlm_pack.collate.samples.check_images_beside_videos", lambda *args: None)
    with torch.no_grad(), pytest.raises(ValueError, match=r"(?i)tokens.*features|features.*tokens"):
        model(**collator(samples).model_inputs())
