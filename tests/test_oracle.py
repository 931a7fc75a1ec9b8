"""The exact route (``vlm_pack.vision.oracle``) and the end of rules by resemblance (``vision_spec_from_processor``).

The oracle of every test is the real transformers processor's ``__call__`` on a real Pillow image with content
(not the blank canvas the exact route runs): its ``input_ids``. The exact route's text for each image, put in
the prompt by the processor's own ``get_text_with_replacements`` and tokenized, must give those ids exactly,
and its counts the embedding tokens in them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from PIL import Image

from vlm_pack import offline
from vlm_pack.families import FAMILIES, owner
from vlm_pack.vision import Qwen2VLSpec, vision_spec_from_processor
from vlm_pack.vision.oracle import ProcessorSpec, drives, exact_spec, memo_stats

#: The exact route runs the processor's own image step (transformers >= 5.18); before, it refuses (tested below).
EXACT = pytest.mark.skipif(
    not hasattr(transformers.ProcessorMixin, "_process_images"),
    reason=f"transformers {transformers.__version__} has no ProcessorMixin._process_images (5.18 added it)",
)
SIZES = [(640, 480), (300, 900), (37, 1200), (1200, 37), (64, 64)]
SMALL_QWEN = {"size": {"shortest_edge": 3136, "longest_edge": 200704}}
_PROCESSORS: dict[str, object] = {}


def _processor(family: str):
    if family not in _PROCESSORS:
        _PROCESSORS[family] = offline.processor(family, **(SMALL_QWEN if family.startswith("qwen") else {}))
    return _PROCESSORS[family]


def _photo(width: int, height: int, seed: int = 0) -> Image.Image:
    """A real image with content (not a blank canvas): a gradient the image processor must really resize."""
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    return Image.merge("RGB", [band.point(lambda v, s=seed + i: (v * (3 + s)) % 256) for i, band in enumerate(image.split())])


def _processed_ids(proc, text: str, images: list[Image.Image]) -> list[int]:
    return [int(i) for i in proc(text=[text], images=[images])["input_ids"][0]]  # one sample, as process_sample


def _exact_ids(proc, spec: ProcessorSpec, text: str, sizes: list[tuple[int, int]]) -> list[int]:
    """The prompt with each placeholder replaced by the exact route's text (by the processor's own
    replacement step), tokenized as the processor tokenizes."""
    (expanded,), _ = proc.get_text_with_replacements([text], spec.sample_replacements(sizes))
    return list(proc.tokenizer(expanded)["input_ids"])


def _stand_in_length(proc, spec: ProcessorSpec, text: str, sizes: list[tuple[int, int]]) -> int:
    """The forecast the generic route makes: runs collapsed to one token each, tokenized, plus what they left out."""
    stand_ins = spec.stand_ins(sizes)
    (collapsed,), _ = proc.get_text_with_replacements([text], [s for s, _ in stand_ins])
    return len(proc.tokenizer(collapsed)["input_ids"]) + sum(left for _, left in stand_ins)


# One family of each way a processor writes text around an image: none (LLaVA, Qwen: the template does),
# start / end tokens (InternVL), tile markers and newlines (Idefics3), text that merges with the prompt
# (Gemma 3), row breaks (Pixtral), counts that depend on the sample's other images (LLaVA-OneVision).
EXACT_CASES = ["qwen2_vl", "llava", "internvl", "idefics3", "gemma3", "mistral3", "llava_onevision"]


@EXACT
@pytest.mark.parametrize("family", EXACT_CASES)
def test_the_exact_route_writes_what_the_processor_writes(family):
    proc = _processor(family)
    spec = exact_spec(proc)
    token_id = proc.tokenizer.convert_tokens_to_ids(spec.image_token)
    sizes = SIZES[:3] if family in ("idefics3", "llava_onevision") else SIZES  # the slowest processors
    for i, (w, h) in enumerate(sizes):
        text = f"Look: {proc.image_token} What is it?"
        ids = _processed_ids(proc, text, [_photo(w, h, i)])
        assert _exact_ids(proc, spec, text, [(w, h)]) == ids, (family, w, h)
        assert spec.num_tokens(w, h) == ids.count(token_id), (family, w, h)
        assert _stand_in_length(proc, spec, text, [(w, h)]) == len(ids), (family, w, h)
    # two images in one sample, run together as __call__ runs them (OneVision counts them otherwise)
    pair = [(640, 480), (300, 900)]
    text = f"{proc.image_token} and {proc.image_token}?"
    ids = _processed_ids(proc, text, [_photo(w, h, 7) for w, h in pair])
    assert _exact_ids(proc, spec, text, pair) == ids
    assert sum(spec.sample_tokens(pair)) == ids.count(token_id)
    if family == "llava_onevision":
        assert spec.sample_tokens(pair) != [spec.num_tokens(w, h) for w, h in pair]


@EXACT
@pytest.mark.torchvision
def test_the_exact_route_writes_what_lfm2_vls_processor_writes():
    """LFM2-VL's image step takes an argument its __call__ computes (``use_image_special_tokens``)."""
    pytest.importorskip("torchvision")
    test_the_exact_route_writes_what_the_processor_writes("lfm2_vl")


@EXACT
def test_the_exact_route_refuses_the_sizes_the_processor_refuses():
    spec = exact_spec(_processor("qwen2_vl"))
    with pytest.raises(ValueError, match=r"Qwen2VLProcessor refuses image\(s\) 603x2.*aspect ratio"):
        spec.num_tokens(603, 2)
    with pytest.raises(ValueError, match=r"image 1 \(603x2\)"):  # the batch path names the image
        spec.num_tokens_batch([640, 603], [480, 2])
    with pytest.raises(ValueError, match="positive"):
        spec.num_tokens(0, 10)


@EXACT
def test_the_memo_runs_each_size_once_per_settings():
    memo_stats(reset=True)
    proc = _processor("llava")
    spec = exact_spec(proc)
    counts = spec.num_tokens_batch([640, 640, 320, 640], [480, 480, 240, 480]).tolist()
    assert counts[0] == counts[1] == counts[3]
    again = exact_spec(proc)  # another spec of the same settings shares the memo
    assert again.num_tokens(640, 480) == counts[0]
    assert memo_stats()["misses"] == 2 and memo_stats()["hits"] >= 1
    other = offline.processor("llava", crop_size={"height": 224, "width": 224}, size={"shortest_edge": 224})
    assert exact_spec(other).settings != spec.settings  # other settings: other entries
    assert exact_spec(other).num_tokens(640, 480) == 256


# ------------------------------------------------------------------------------ no rule by resemblance


def _marked(base):
    """A processor class of a new model: Qwen2-VL's image processor and tokens, but it writes its own markers
    around each image (as processors built on Qwen2VLProcessor do), so Qwen2-VL's rule would be wrong."""

    class MarkedVLProcessor(base):
        def replace_image_token(self, image_inputs, image_idx, **kwargs):
            inner = super().replace_image_token(image_inputs, image_idx, **kwargs)
            return f"<|vision_start|><|vision_start|>{inner}<|vision_end|>\n"

    return MarkedVLProcessor


@EXACT
def test_a_processor_that_writes_other_text_around_the_same_images_is_not_given_the_records_rule():
    """Must show (issue 38): a processor subclass of Qwen2VLProcessor with the same image processor is not
    forecast with Qwen2-VL's rule; it takes the exact route, whose forecast is its own processed length."""
    qwen = _processor("qwen2_vl")
    assert isinstance(vision_spec_from_processor(qwen), Qwen2VLSpec)  # the record's own class: fast rule
    proc = _marked(type(qwen))(image_processor=qwen.image_processor, tokenizer=qwen.tokenizer, video_processor=None)
    spec = vision_spec_from_processor(proc)
    assert isinstance(spec, ProcessorSpec) and spec.family is None
    assert spec.processor_class == "MarkedVLProcessor"
    for i, (w, h) in enumerate(SIZES):
        text = f"<|im_start|>user\n<|vision_start|>{proc.image_token}<|vision_end|>Hi<|im_end|>\n"
        ids = _processed_ids(proc, text, [_photo(w, h, i)])
        assert _exact_ids(proc, spec, text, [(w, h)]) == ids
        assert _stand_in_length(proc, spec, text, [(w, h)]) == len(ids)
        qwen_rule = vision_spec_from_processor(qwen)  # what resemblance gave: short by the markers and newline
        assert len(ids) - (len(qwen.tokenizer(text)["input_ids"]) + qwen_rule.num_tokens(w, h) - 1) >= 4


@EXACT
def test_a_class_named_like_a_records_outside_transformers_is_not_the_records():
    qwen = _processor("qwen2_vl")
    lookalike = type("Qwen2VLProcessor", (transformers.ProcessorMixin,), {})  # same name, not the class
    assert owner("processors", lookalike.__name__) is FAMILIES["qwen2_vl"]
    plain = lookalike.__new__(lookalike)
    plain.image_processor, plain.tokenizer, plain.image_token = qwen.image_processor, qwen.tokenizer, "<|image_pad|>"
    with pytest.raises(ValueError, match=r"no family record names processor 'Qwen2VLProcessor'.*replace_image_token"):
        vision_spec_from_processor(plain)


@EXACT
def test_a_processor_the_exact_route_cannot_run_is_refused_by_name():
    qwen = _processor("qwen2_vl")
    cls = type("NoTextProcessor", (transformers.ProcessorMixin,), {})  # writes its text in its own __call__
    proc = cls.__new__(cls)
    proc.image_processor, proc.tokenizer, proc.image_token = qwen.image_processor, qwen.tokenizer, "<|image_pad|>"
    with pytest.raises(ValueError, match=r"'NoTextProcessor'.*does not implement replace_image_token.*Fast rules: Qwen2VLProcessor"):
        vision_spec_from_processor(proc)


def test_before_5_18_a_processor_without_a_record_is_refused_by_name():
    if hasattr(transformers.ProcessorMixin, "_process_images"):
        pytest.skip(f"transformers {transformers.__version__} runs the exact route (tested above)")
    qwen = _processor("qwen2_vl")
    proc = _marked(type(qwen))(image_processor=qwen.image_processor, tokenizer=qwen.tokenizer, video_processor=None)
    with pytest.raises(ValueError, match=r"MarkedVLProcessor rewrites.*has no ProcessorMixin._process_images"):
        vision_spec_from_processor(proc)


def test_each_class_names_one_record_and_each_named_record_has_a_rule():
    for record in FAMILIES.values():
        for name in record.processors:
            assert owner("processors", name) is record and record.vision is not None
        for name in record.image_processors:
            assert owner("image_processors", name) is record and record.processors
    assert owner("processors", "Lfm3VlProcessor") is None  # new model types: the exact route


def test_a_bare_image_processor_no_record_names_is_refused():
    with pytest.raises(ValueError, match="bare SiglipImageProcessorPil does not say which model"):
        vision_spec_from_processor(offline.image_processor("gemma3n"))


# ------------------------------------------------------------------------------ fast rules check themselves


def _coarse_qwen_processor():
    """Qwen2-VL's own processor class around an image processor that resizes to whole 2x2-merged blocks of
    twice the side (a user's subclass, as for coarser grids): Qwen2-VL's fast rule reads the same settings off
    it and would forecast every image wrong; nothing is patched."""
    qwen = _processor("qwen2_vl")

    class CoarseQwen2VLImageProcessor(type(qwen.image_processor)):
        def resize(self, image, size, resample, factor, **kwargs):
            return super().resize(image, size, resample, factor * 2, **kwargs)

    coarse = CoarseQwen2VLImageProcessor(**SMALL_QWEN)
    return type(qwen)(image_processor=coarse, tokenizer=qwen.tokenizer, video_processor=None,
                      chat_template=qwen.chat_template)  # fmt: skip


@EXACT
def test_a_fast_rule_that_disagrees_with_the_installed_processor_stops_the_run_before_any_sample():
    from vlm_pack import Preprocessor
    from vlm_pack.vision.selfcheck import FastRuleMismatch

    proc = _coarse_qwen_processor()
    with pytest.raises(
        FastRuleMismatch,
        match=rf"family 'qwen2_vl' disagrees with Qwen2VLProcessor on transformers {transformers.__version__}: "
        r"for a sample with image\(s\) 640x480 it forecasts \d+ tokens .* while the processor writes \d+ tokens.*"
        r"spec=vlm_pack.vision.oracle.exact_spec\(processor\)",
    ):
        Preprocessor(processor=proc)
    # the fix the error names: the exact route, whose forecast is the processed length
    pre = Preprocessor(processor=proc, spec=exact_spec(proc))
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A gradient."}]},
    ]
    for i, (w, h) in enumerate(SIZES):
        out = pre.process([_photo(w, h, i)], conversation)
        assert pre.forecast(conversation, [(w, h)]) == (len(out["input_ids"]), out["tokens_per_image"].tolist())


@EXACT
def test_the_records_own_processors_pass_their_check():
    """The check itself: a record's processor as released passes (and is checked once per instance)."""
    from vlm_pack import Preprocessor
    from vlm_pack.vision import selfcheck

    proc = offline.processor("llava", chat_template=offline.processor("llava").chat_template)
    pre = Preprocessor(processor=proc, family="llava")
    assert len(selfcheck._CHECKED[proc]) == 1
    Preprocessor(processor=proc, family="llava")  # memoized: no second entry, no second run
    assert len(selfcheck._CHECKED[proc]) == 1 and pre.spec.family == "llava"


# ------------------------------------------------------------------------------ processors without a record


def test_an_exact_route_whose_text_holds_the_templates_placeholder_is_forecast_exactly():
    """A Gemma 3 processor subclass (the exact route: a class of its own) writes ``<start_of_image>``, the
    template's placeholder, inside its own text around ``<image_soft_token>`` runs: the forecast marks each image
    by its embedding token, so two images forecast what the processor's own call gives."""
    from vlm_pack import Preprocessor

    base = offline.processor("gemma3", chat_template=(Path(__file__).parent / "templates" / "gemma3.jinja").read_text())

    class OwnGemma3(type(base)):
        def replace_image_token(self, image_inputs, image_idx, **kwargs):  # the same text, its own class
            return super().replace_image_token(image_inputs, image_idx, **kwargs)

    proc = OwnGemma3(image_processor=base.image_processor, tokenizer=base.tokenizer, chat_template=base.chat_template,
                     image_seq_length=base.image_seq_length)  # fmt: skip
    if drives(proc):
        pytest.skip(f"transformers {transformers.__version__} runs no exact route")
    pre = Preprocessor(processor=proc)
    assert isinstance(pre.spec, ProcessorSpec)
    conversation = [{"role": "user", "content": "<image>What is it? <image>"}, {"role": "assistant", "content": "Two."}]
    sizes = [(640, 480), (300, 900)]
    images = [_photo(w, h, i) for i, (w, h) in enumerate(sizes)]
    own = proc(text=[pre.render(conversation, 2)], images=[images], add_special_tokens=False)["input_ids"][0]
    assert pre.forecast(conversation, sizes)[0] == len(own) == len(pre.process(images, conversation)["input_ids"])


def test_a_processor_whose_call_adds_text_of_its_own_is_refused_before_any_sample():
    """PaliGemma's processor writes a prefix of its own in ``__call__`` beyond its replacement text (its
    BOS-and-newline layout): the exact route would forecast every sample short. Refused by name at start-up,
    the processor's own call the oracle; a processor whose call adds nothing (Exaone 4.5) passes."""
    from vlm_pack import Preprocessor
    from vlm_pack.offline.model_types import processor_for_type

    def template(conversation, num_images):
        return [("User: " + "<image>" * num_images + "Describe it.\n", False), ("Assistant: A card.", True)]

    if drives(processor_for_type("paligemma")):  # a release without the replacement API
        pytest.skip(f"transformers {transformers.__version__} runs no exact route")
    with pytest.raises(ValueError, match=r"PaliGemmaProcessor .*its own call writes \d+ tokens, its replacement "
                                         r"text gives \d+"):  # fmt: skip
        Preprocessor(processor=processor_for_type("paligemma"), template=template)
    pre = Preprocessor(processor=processor_for_type("exaone4_5"), template=template)
    assert isinstance(pre.spec, ProcessorSpec)


def test_a_model_type_without_a_record_is_forecast_and_processed_by_its_own_processor():
    """LFM3-VL (transformers 5.25): Qwen2-VL's image processor and tokens under a processor class of its own.
    Its forecast (the exact route) is its processed length, and the ids are its processor's."""
    cls = getattr(transformers, "Lfm3VlProcessor", None)
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no Lfm3VlProcessor (5.25 added it)")
    from vlm_pack import Preprocessor
    from vlm_pack.offline.processors import _without_video

    qwen = _processor("qwen2_vl")
    proc = _without_video(cls)(image_processor=qwen.image_processor, tokenizer=qwen.tokenizer, video_processor=None,
                               chat_template=(offline.processor("qwen2_vl").chat_template or None))  # fmt: skip
    pre = Preprocessor(processor=proc, family="qwen2_vl")  # the chat format only: the images are the processor's
    assert isinstance(pre.spec, ProcessorSpec) and pre.spec.processor_class == "Lfm3VlProcessor"
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And?"}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Two gradients."}]},
    ]
    for i, pair in enumerate([[(640, 480), (37, 1200)], [(64, 64), (1200, 37)]]):
        images = [_photo(w, h, i) for w, h in pair]
        out = pre.process(images, conversation)
        assert pre.forecast(conversation, pair) == (len(out["input_ids"]), out["tokens_per_image"].tolist())
        text = pre.render(conversation, 2)
        assert out["input_ids"].tolist() == _processed_ids(proc, text, images)


@EXACT
def test_a_processor_that_writes_prompts_of_its_own_is_refused_when_processing():
    """A processor that turns one prompt into several rows (task prompts of its own) would give a sample that
    is not the user's text: refused by name, not cut to its first row."""
    from vlm_pack import Preprocessor
    from vlm_pack.failures import InternalCheckError

    llava = _processor("llava")

    class TaskPromptsProcessor(type(llava)):
        def __call__(self, images=None, text=None, **kwargs):
            tasks = [f"{t} {task}" for task in ("Caption.", "Detect.", "Read.") for t in text]
            return super().__call__(images=images * 3, text=tasks, padding=True, **kwargs)

    proc = TaskPromptsProcessor(image_processor=llava.image_processor, tokenizer=llava.tokenizer,
                                patch_size=14, vision_feature_select_strategy="default")  # fmt: skip
    with pytest.raises(ValueError, match=r"TaskPromptsProcessor .*adds text of its own"):  # at start-up
        Preprocessor(processor=proc, family="llava")
    pre = Preprocessor(processor=proc, family="llava", spec=exact_spec(proc))  # a spec given: no start-up check
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    with pytest.raises(InternalCheckError, match="TaskPromptsProcessor made 3 rows of one sample's prompt"):
        pre.process([_photo(64, 48)], conversation)


# ------------------------------------------------------------------------------ videos


@EXACT
@pytest.mark.torchvision
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl", "llava_onevision", "internvl", "glm4v"])
def test_the_exact_route_writes_what_the_processor_writes_for_a_video(family):
    """The processor's own sampling on the header's metadata, then its video step on blank frames of the
    header's size: the text, tokens and grid it makes of the real decoded clip (processed as process_sample
    hands it over: kept frames, metadata, sampling off)."""
    pytest.importorskip("torchvision")
    pytest.importorskip("av")
    from vlm_pack.processing.videos import load_videos
    from vlm_pack.testing.clips import encode_clip, processor_with_video
    from vlm_pack.vision.video import read_video_header

    proc = processor_with_video(family)
    spec = exact_spec(proc)
    for frames, (w, h), fps in [(40, (160, 96), 10), (9, (64, 120), 3)]:
        clip = encode_clip(frames=frames, width=w, height=h, fps=fps)
        header = read_video_header(clip)
        decoded = load_videos([clip], proc, "k")
        enc = proc(text=[f"Watch {proc.video_token} now"], return_text_replacement_offsets=True,
                   **decoded.processor_kwargs())  # fmt: skip
        (written,) = [o["replacement"] for o in enc["text_replacement_offsets"][0]]
        assert spec.video_replacement(header) == written, (family, frames)
        forecast = spec.video_forecast(header)
        token, collapsed, left = spec.video_stand_in(header)
        assert forecast.tokens == written.count(token) and left == forecast.tokens - collapsed.count(token)
        assert forecast.indices == decoded[0].forecast.indices  # the sampling the decoder used
        if "video_grid_thw" in enc:
            assert forecast.grid_thw == tuple(int(x) for x in enc["video_grid_thw"][0])


def _tv_processor(family: str):
    """The family's processor with its video processor and released chat template (torchvision)."""
    from vlm_pack.testing.clips import processor_with_video

    path = Path(__file__).parent / "templates" / f"{family}.jinja"
    return processor_with_video(family, chat_template=path.read_text() if path.exists() else None)


@EXACT
@pytest.mark.torchvision
@pytest.mark.parametrize(
    "family",
    ["qwen2_vl", "qwen2_5_vl", "llava_onevision", "internvl", "glm46v", "qwen3_vl", "qwen3_5"],
)
def test_each_video_familys_processor_passes_its_start_up_check_on_the_installed_release(family):
    """A release that changes a family's video text fails here, naming the family, the release and the clip."""
    pytest.importorskip("torchvision")
    from vlm_pack import Preprocessor
    from vlm_pack.vision import selfcheck

    proc = _tv_processor(family)
    Preprocessor(processor=proc)
    assert len(selfcheck._CHECKED[proc]) == 1


@EXACT
@pytest.mark.torchvision
def test_a_fast_video_rule_that_disagrees_with_the_installed_processor_stops_the_run():
    """Qwen2-VL's processor class with a video processor that resizes to blocks twice as coarse (a user's
    subclass): the images pass their check, the clips do not."""
    pytest.importorskip("torchvision")
    from vlm_pack import Preprocessor
    from vlm_pack.vision.selfcheck import FastRuleMismatch

    released = _tv_processor("qwen2_vl")

    class CoarseQwen2VLVideoProcessor(type(released.video_processor)):
        def resize(self, videos, size, resample, factor, **kwargs):
            return super().resize(videos, size, resample, factor * 2, **kwargs)

    proc = type(released)(image_processor=released.image_processor, tokenizer=released.tokenizer,
                          video_processor=CoarseQwen2VLVideoProcessor(), chat_template=released.chat_template)  # fmt: skip
    with pytest.raises(
        FastRuleMismatch,
        match=rf"family 'qwen2_vl' disagrees with Qwen2VLProcessor on transformers {transformers.__version__}: "
        r"for a sample with video a 40-frame 160x96 clip at 10 fps it forecasts \d+ tokens \(per video \[\d+\]\)",
    ):
        Preprocessor(processor=proc)
