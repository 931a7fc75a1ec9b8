"""Videos of model types without a record: the exact route (the processor's own video step) forecasts them, the
processor processes them, packed = alone on tiny genuine models; what cannot be driven so is refused by name.

Oracles from outside vlm-pack's forecast: the processor's own call on the sample alone (its own frame sampling of
the whole clip decoded here with PyAV) for the ids and the length, and each sample alone through the model for
the packed row (``vlm_pack.testing.model_types.certify_model_type(..., videos=True)``). The full sweep over the
model types with video processors is ``scripts/families_table.py --videos``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from vlm_pack.failures import InternalCheckError

pytestmark = pytest.mark.torchvision

QUESTION = "What moves in the clip?"


def _needs(model_type: str) -> None:
    pytest.importorskip("torchvision")
    pytest.importorskip("av")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no model type {model_type}")
    from vlm_pack.offline.model_types import processor_for_type
    from vlm_pack.vision.oracle import drives

    why = drives(processor_for_type(model_type))
    if why:  # before 5.18: no replacement API, no exact route
        pytest.skip(f"transformers {transformers.__version__}: {why}")


def _chat_processor(model_type: str):
    """The type's real processor (stand-in tokenizer, its video processor) with a plain chat template."""
    from vlm_pack.offline.model_types import placeholder_for_type, processor_for_type
    from vlm_pack.testing.model_types import _TEMPLATE

    proc = processor_for_type(model_type)
    proc.chat_template = _TEMPLATE.replace("IMAGE", placeholder_for_type(model_type, proc)).replace(
        "VIDEO", proc.video_token
    )
    return proc


def _own_ids(proc, prompt: str, clip: bytes, images=()) -> list[int]:
    """The processor's own ids for the sample alone: every frame decoded, its own sampling."""
    from vlm_pack.processing.videos import decode_frames
    from vlm_pack.vision.video import read_video_header

    header = read_video_header(clip)
    metadata = header.metadata()
    metadata.frames_indices = list(range(header.frames))  # as transformers' own video loaders set it
    kwargs = dict(images=[list(images)]) if images else {}
    out = proc(text=[prompt], videos=[decode_frames(clip, range(header.frames))], video_metadata=[metadata],
               return_tensors="pt", **kwargs)  # fmt: skip
    return out["input_ids"][0].tolist()


@pytest.mark.parametrize("model_type", ["llava_onevision1_5", "video_llama_3", "hy_v4_vl", "ovis2_5"])
def test_a_record_less_processors_video_sample_is_forecast_to_its_processed_length(model_type):
    """A sample with an image and a video (and one with the video alone, two clips): the forecast from the
    image size and the clip's header equals the processed length, and the ids are the processor's own."""
    _needs(model_type)
    from PIL import Image

    from vlm_pack import Preprocessor
    from vlm_pack.offline.model_types import placeholder_for_type
    from vlm_pack.testing.clips import encode_clip
    from vlm_pack.vision.video import read_video_header

    proc = _chat_processor(model_type)
    pre = Preprocessor(processor=proc)
    image = Image.new("RGB", (80, 64), (40, 90, 200))
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": QUESTION}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A square."}]},
    ]
    placeholder = placeholder_for_type(model_type, proc)
    prompt = (f"<|im_start|>user\n{placeholder}{proc.video_token}{QUESTION}<|im_end|>\n"
              "<|im_start|>assistant\nA square.<|im_end|>\n")  # fmt: skip
    for frames, (w, h), fps in [(7, (96, 64), 4.0), (4, (64, 112), 2.0)]:
        clip = encode_clip(frames=frames, width=w, height=h, fps=fps, seed=frames)
        out = pre.process([image], conversation, videos=[clip])
        length, counts = pre.forecast(conversation, [image.size], videos=[read_video_header(clip)])
        assert (length, counts) == (len(out["input_ids"]), out["tokens_per_image"].tolist()), (model_type, frames)
        assert int(out["tokens_per_video"].sum()) > 0
        assert out["input_ids"].tolist() == _own_ids(proc, prompt, clip, [image]), (model_type, frames)


def test_a_record_less_processor_is_never_given_the_video_rule_its_video_processor_resembles():
    """Exaone 4.5's processor carries Qwen2-VL's video processor: its videos are forecast by its own video step
    (the forecast carries the processor's own text), not by the Qwen2-VL record's rule."""
    _needs("exaone4_5")
    from vlm_pack.families import video_family
    from vlm_pack.testing.clips import encode_clip
    from vlm_pack.vision.video import forecast_video, read_video_header

    proc = _chat_processor("exaone4_5")
    assert video_family(proc.video_processor) is not None  # the resemblance is there
    forecast = forecast_video(read_video_header(encode_clip(frames=5)), proc)
    assert forecast.stand_in is not None and forecast.stand_in[0] == proc.video_token


def test_a_processor_whose_video_length_depends_on_its_frames_is_refused_by_name():
    """Video-LLaMA 3 with its token compression on drops patches equal to the previous frame's: the length
    is not a function of the header. Refused naming the processor and the setting, before any decode."""
    _needs("video_llama_3")
    from vlm_pack import Preprocessor
    from vlm_pack.testing.clips import encode_clip
    from vlm_pack.vision.video import read_video_header

    proc = _chat_processor("video_llama_3")
    proc.video_processor.use_token_compression = True  # the released default
    pre = Preprocessor(processor=proc)
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    clip = encode_clip(frames=6)
    with pytest.raises(InternalCheckError, match=r"VideoLlama3Processor: .*depends on what its frames show.*"
                                                 r"use_token_compression"):  # fmt: skip
        pre.forecast(conversation, [], videos=[read_video_header(clip)])
    with pytest.raises(InternalCheckError, match="VideoLlama3Processor"):
        pre.process([], conversation, videos=[clip])


def test_a_processor_whose_own_video_step_fails_is_refused_by_name():
    """Cosmos3-Edge's replace_video_token reads video metadata its video step does not return by default: its
    own call fails on every video, and vlm-pack says so naming it instead of counting each clip as bad data."""
    _needs("cosmos3_edge")
    from vlm_pack.testing.clips import encode_clip
    from vlm_pack.vision.video import forecast_video, read_video_header

    proc = _chat_processor("cosmos3_edge")
    with pytest.raises(InternalCheckError, match=r"Cosmos3EdgeProcessor .*no vlm-pack record.*own video step fails"):
        forecast_video(read_video_header(encode_clip(frames=5)), proc)


def test_a_recorded_processor_subclass_that_writes_other_video_text_is_forecast_by_its_own_step():
    """A Qwen2-VL processor subclass that writes a caption before each video's tokens: not the record's rule
    (which would forecast it short) but its own text, forecast = processed = its own ids."""
    pytest.importorskip("torchvision")
    pytest.importorskip("av")
    from vlm_pack import Preprocessor
    from vlm_pack.testing.clips import encode_clip, processor_with_video
    from vlm_pack.vision.oracle import drives
    from vlm_pack.vision.video import read_video_header

    released = processor_with_video("qwen2_vl")
    if drives(released):
        pytest.skip(f"transformers {transformers.__version__} runs no exact route")

    class CaptionedQwen2VLProcessor(transformers.Qwen2VLProcessor):
        def replace_video_token(self, video_inputs, video_idx, **kwargs):
            return "A clip follows." + super().replace_video_token(video_inputs, video_idx, **kwargs)

    template = (Path(__file__).parent / "templates" / "qwen2_vl.jinja").read_text()
    proc = CaptionedQwen2VLProcessor(image_processor=released.image_processor, tokenizer=released.tokenizer,
                                     video_processor=released.video_processor, chat_template=template)  # fmt: skip
    conversation = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}]
    clip = encode_clip(frames=6)
    header = read_video_header(clip)
    own = Preprocessor(processor=proc)
    out = own.process([], conversation, videos=[clip])
    length, _ = own.forecast(conversation, [], videos=[header])
    assert length == len(out["input_ids"])
    rule, _ = Preprocessor(processor=processor_with_video("qwen2_vl", chat_template=template)).forecast(
        conversation, [], videos=[header]
    )
    caption = len(proc.tokenizer("A clip follows.", add_special_tokens=False)["input_ids"])
    assert length == rule + caption


@pytest.mark.parametrize("model_type", ["video_llama_3", pytest.param("hy_v4_vl", marks=pytest.mark.slow)])
def test_a_record_less_type_packs_a_video_an_image_and_text_as_each_sample_alone(model_type):
    """One row: a video sample (vlm-pack's forecast and processing), a two-image sample, an image sample and a
    text sample, on the type's tiny genuine model, sdpa and eager; each scored against itself alone (the
    processor's own outputs for the video sample)."""
    _needs(model_type)
    from vlm_pack.testing.model_types import TOLERANCE, certify_model_type

    cert = certify_model_type(model_type, videos=True)
    assert cert.exact, str(cert)
    # HY-V4-VL's model has no sdpa attention (the certificate notes it): eager alone there
    styles = {"eager"} if any("sdpa: the model has no such attention" in n for n in cert.notes) else {"sdpa", "eager"}
    assert set(cert.errors) == styles and all(e <= TOLERANCE for e in cert.errors.values())
    assert cert.video.startswith("forecast") and "ids = the processor's own" in cert.video


@pytest.mark.slow
@pytest.mark.parametrize(
    "model_type", ["llava_onevision1_5", "lfm3_vl", "exaone4_5", "hyperclovax_vision_v2", "ovis2_5", "video_llava",
                   "ernie4_5_vl_moe"]
)
def test_more_record_less_types_pack_videos_as_each_sample_alone(model_type):
    _needs(model_type)
    from vlm_pack.testing.model_types import certify_model_type

    cert = certify_model_type(model_type, videos=True)
    assert cert.exact, str(cert)


@pytest.mark.slow
def test_a_record_less_types_video_stream_packs_every_sample_at_its_forecast_length(tmp_path):
    """The user's path: a PackedWebDataset epoch over shards of video, video + image and text samples for
    LLaVA-OneVision-1.5 (no record; Qwen2-VL's video processor under a processor of its own): every sample
    packed once, at its forecast length (no forecast mismatch, nothing bad), its video tokens the processor's
    own count for the clip alone."""
    _needs("llava_onevision1_5")
    import io

    from PIL import Image

    from vlm_pack import Preprocessor
    from vlm_pack.data import write_shards
    from vlm_pack.data.pipeline import PackedWebDataset
    from vlm_pack.offline.model_types import tiny_config_for_type
    from vlm_pack.testing.clips import encode_clip

    proc = _chat_processor("llava_onevision1_5")
    clips = [encode_clip(frames=4, width=64, height=48, fps=2.0, seed=1),
             encode_clip(frames=3, width=48, height=64, fps=3.0, container="webm", seed=2)]  # fmt: skip
    png = io.BytesIO()
    Image.new("RGB", (56, 84), (10, 200, 90)).save(png, format="PNG")
    records = []
    for i in range(6):
        turn, record = "Describe.", {"key": f"s{i}"}
        if i % 3 == 0:
            record["videos"], turn = [clips[i % 2]], "<video>" + turn
        elif i % 3 == 1:
            record["videos"], record["images"], turn = [clips[1]], [png.getvalue()], "<video><image>" + turn
        record["conversation"] = [{"role": "user", "content": turn}, {"role": "assistant", "content": f"Answer {i}."}]
        records.append(record)
    urls = write_shards(records, str(tmp_path / "g-%06d.tar"), maxcount=3)
    config = tiny_config_for_type("llava_onevision1_5", proc)  # the model's ids, as model.config gives them
    ds = PackedWebDataset(urls, Preprocessor(processor=proc), capacity=2048, shuffle_seed=None,
                          collator_kwargs=dict(model_config=config))  # fmt: skip
    batches = list(ds)
    assert sorted(k for b in batches for k in b.metadata["__key__"]) == [r["key"] for r in records]
    assert ds.stats.forecast_mismatches == 0 and ds.stats.samples_bad == 0
    video_id = proc.tokenizer.convert_tokens_to_ids(proc.video_token)
    alone = {}
    for b in batches:
        bounds = b.cu_seqlens.tolist()
        for key, start, end in zip(b.metadata["__key__"], bounds, bounds[1:]):
            alone[key] = int((b.input_ids[0, start:end] == video_id).sum())
    for record in records:
        want = 0
        for clip in record.get("videos", []):
            text = f"{proc.video_token}x"
            want += _own_ids(proc, text, clip).count(video_id)
        assert alone[record["key"]] == want, record["key"]
