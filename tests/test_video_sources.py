"""Videos from every source: WebDataset members, parquet / ``datasets`` video columns, LLaVA-Video and ShareGPT
JSON, messages with video parts; their headers read without decoding; bad videos counted with their reason.

Clips are encoded here with PyAV (MP4 / H.264, WebM / VP8, MKV / MPEG-4 Part 2) and written the way each
tool stores them. Oracles from outside the code under test: the bytes written, and PyAV decoding every
frame of each clip (the frame count and size a decoder yields).
"""

from __future__ import annotations

import io
import json
import re
import sys
import tarfile
import warnings
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from vlm_pack.data.records import normalise_record
from vlm_pack.data.shards import SampleError, video_fields, write_shards
from vlm_pack.data.sources import iter_samples
from vlm_pack.failures import SampleCodeError

# (container, codec, frames, fps, width, height): odd and even counts, the three containers sources carry.
CLIPS = {
    "mp4": ("mp4", "libx264", 9, Fraction(10), 96, 64),
    "webm": ("webm", "libvpx", 6, Fraction(8), 64, 48),
    "mkv": ("matroska", "mpeg4", 7, Fraction(25), 80, 80),
}


def _encode(fmt: str, codec: str, frames: int, fps: Fraction, width: int, height: int, seed: int = 0) -> bytes:
    """A clip of moving noise, encoded by PyAV (``fmt`` the muxer, ``codec`` the encoder)."""
    import av

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def _decoded(data: bytes) -> tuple[int, int, int]:
    """``(frames, width, height)`` a PyAV decoder yields from ``data``: the oracle of every header read."""
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    return len(frames), frames[0].shape[1], frames[0].shape[0]


@pytest.fixture(scope="module")
def clips() -> dict[str, bytes]:
    pytest.importorskip("av")
    return {ext: _encode(*spec, seed=i) for i, (ext, spec) in enumerate(CLIPS.items())}


def _png(size: tuple[int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.effect_noise(size, 40).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


# ---------------------------------------------------------------------------------------------- WebDataset
@pytest.mark.torchvision
def test_shards_store_videos_as_members_in_placeholder_order(clips, tmp_path):
    """write_shards stores a video as ``KEY.mp4`` and several as ``KEY.0.webm``, ``KEY.1.mkv``; both readers
    give them back in that order, beside the images; each header equals a full decode, and the lazy reader
    leaves every member unread (headers only)."""
    from vlm_pack.data.reader import lazy_tar_samples, read_header, stream_tar_samples

    conv = [{"role": "user", "content": "<image><video><video>Compare."}, {"role": "assistant", "content": "Alike."}]
    records = [
        {"key": "one", "videos": clips["mp4"], "caption": "noise"},
        {"key": "two", "images": [_png((64, 48))], "videos": [clips["webm"], clips["mkv"]], "conversation": conv},
    ]
    (shard,) = write_shards(records, str(tmp_path / "s-%06d.tar"))
    with tarfile.open(shard) as tar:
        names = sorted(tar.getnames())
        assert names == ["one.mp4", "one.txt", "two.0.webm", "two.1.mkv", "two.json", "two.png"]
        assert tar.extractfile("two.1.mkv").read() == clips["mkv"]  # stored as given, not re-encoded
    streamed = list(stream_tar_samples(shard))
    with tarfile.open(shard) as tar:
        lazy = list(lazy_tar_samples(tar, shard))
        headers = [read_header(s) for s in lazy]
        assert all(not isinstance(s[n], bytes) and s[n].tell() == 0 for s in lazy for n in video_fields(s))
    assert [h.video_names for h in headers] == [["mp4"], ["0.webm", "1.mkv"]]
    assert [read_header(s).video_names for s in streamed] == [h.video_names for h in headers]
    for header, clip_names in zip(headers, (["mp4"], ["webm", "mkv"])):
        for video, ext in zip(header.videos, clip_names):
            assert (video.frames, video.width, video.height) == _decoded(clips[ext]), ext
    assert headers[1].image_sizes == [(64, 48)]


@pytest.mark.torchvision
def test_a_corrupt_video_member_is_bad_data_named_with_its_reason(clips, tmp_path):
    from vlm_pack.data.reader import read_header

    sample = {"__key__": "k", "txt": b"a caption", "mp4": clips["mp4"][: len(clips["mp4"]) // 3]}
    sample_webm = {"__key__": "w", "txt": b"a caption", "0.webm": b"\x1a\x45\xdf\xa3 not really matroska"}
    for bad, name in ((sample, "k.mp4"), (sample_webm, "w.0.webm")):
        with pytest.raises(SampleError, match=rf"{name}: not a readable video container") as err:
            read_header(bad)
        assert err.value.reason == "corrupt_video"


# ------------------------------------------------------------------------------- JSON, parquet, datasets
def _clip_files(clips: dict[str, bytes], folder: Path) -> dict[str, str]:
    (folder / "videos").mkdir(parents=True, exist_ok=True)
    paths = {}
    for ext, data in clips.items():
        (folder / "videos" / f"clip.{ext}").write_bytes(data)
        paths[ext] = f"videos/clip.{ext}"
    return paths


@pytest.mark.torchvision
def test_llava_video_and_sharegpt_json_carry_their_videos(clips, tmp_path):
    """LLaVA-Video-178K rows (``"video": path``, the clip marked ``<image>``) and LLaMA-Factory ShareGPT rows
    (``"videos": [...]``, ``<video>`` markers, beside ``"images"``): paths resolved against the JSON's folder,
    in order, and a LLaVA-Video ``<image>`` read as the video it marks."""
    paths = _clip_files(clips, tmp_path)
    (tmp_path / "frame.png").write_bytes(_png((32, 32)))
    llava_video = {
        "id": "lv-1",
        "video": paths["mp4"],
        "conversations": [{"from": "human", "value": "<image>\nWhat happens?"}, {"from": "gpt", "value": "Noise."}],
    }
    sharegpt = {
        "messages": [
            {"role": "user", "content": "<video><image>Then <video>?"},
            {"role": "assistant", "content": "Both noise."},
        ],
        "videos": [paths["webm"], paths["mkv"]],
        "images": ["frame.png"],
    }
    path = tmp_path / "train.json"
    path.write_text(json.dumps([llava_video, sharegpt]))
    (_, _, first), (_, _, second) = iter_samples(str(path), on_error="raise")
    assert first.videos == (str(tmp_path / paths["mp4"]),) and first.images == ()
    assert first.conversation[0]["content"] == "<video>\nWhat happens?"  # LLaVA-Video's <image> is the clip
    assert second.videos == (str(tmp_path / paths["webm"]), str(tmp_path / paths["mkv"]))
    assert second.images == (str(tmp_path / "frame.png"),)
    assert second.conversation[0]["content"] == "<video><image>Then <video>?"  # kept as written
    # A LLaVA row with an image and a video keeps its <image> an image.
    both = {**llava_video, "image": "frame.png"}
    sample = normalise_record(both, where="x", image_root=tmp_path)
    assert sample.conversation[0]["content"] == "<image>\nWhat happens?" and len(sample.videos) == 1
    # A missing clip is bad data naming the record, the video and where it was looked for.
    gone = {**llava_video, "video": "videos/gone.mp4"}
    with pytest.raises(SampleError, match=r"x \(key 'lv-1'\): video 0 'videos/gone.mp4' not found") as err:
        normalise_record(gone, where="x", image_root=tmp_path)
    assert err.value.reason == "corrupt_video"


@pytest.mark.torchvision
def test_parquet_and_dataset_video_columns_bytes_or_paths(clips, tmp_path):
    """A parquet file with a column of video bytes and a ``datasets.Dataset`` with a ``Video`` feature (bytes
    in one row, a path in the other) give each row's videos as stored."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths = _clip_files(clips, tmp_path)
    text = [{"role": "user", "content": "<video>What is it?"}, {"role": "assistant", "content": "Noise."}]
    table = pa.table({
        "messages": [text, text],
        "videos": [[clips["mp4"]], [clips["webm"]]],
    })  # fmt: skip
    pq.write_table(table, tmp_path / "train.parquet")
    rows = [s for _, _, s in iter_samples(str(tmp_path / "train.parquet"), on_error="raise")]
    assert [s.videos for s in rows] == [(clips["mp4"],), (clips["webm"],)]
    assert [s.where for s in rows] == [f"{tmp_path / 'train.parquet'}:0", f"{tmp_path / 'train.parquet'}:1"]

    features = datasets.Features({
        "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
        "videos": datasets.List(datasets.Video(decode=False)),
    })  # fmt: skip
    ds = datasets.Dataset.from_dict(
        {"messages": [text, text], "videos": [[{"bytes": clips["mkv"], "path": None}],
                                              [{"bytes": None, "path": str(tmp_path / paths["mp4"])}]]},
        features=features,
    )  # fmt: skip
    rows = [s for _, _, s in iter_samples(ds, on_error="raise")]
    assert [s.videos for s in rows] == [(clips["mkv"],), (str(tmp_path / paths["mp4"]),)]


@pytest.mark.torchvision
def test_messages_with_video_parts_name_their_clips_or_take_the_videos_column(clips, qwen_video, tmp_path):
    """TRL / HF-style messages: ``{"type": "video"}`` parts with a ``videos`` column, or parts naming their
    own file (``"video"`` / ``"path"``, as HF chat templates take them), in the order of the parts; each
    row's header forecast is the length processing gives."""
    paths = _clip_files(clips, tmp_path)
    (tmp_path / "frame.png").write_bytes(_png((32, 32)))

    def user(*parts):
        return [{"role": "user", "content": list(parts)}, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]

    rows = [
        {"messages": user({"type": "video"}, {"type": "image"}, {"type": "text", "text": "Which?"}),
         "videos": [paths["mp4"]], "images": ["frame.png"]},
        {"messages": user({"type": "video", "video": paths["mkv"]}, {"type": "text", "text": "And?"},
                          {"type": "video", "path": paths["webm"]})},
    ]  # fmt: skip
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    first, second = (s for _, _, s in iter_samples(str(path), on_error="raise"))
    assert first.videos == (str(tmp_path / paths["mp4"]),) and first.images == (str(tmp_path / "frame.png"),)
    assert second.videos == (str(tmp_path / paths["mkv"]), str(tmp_path / paths["webm"])) and second.images == ()
    kinds = [[p["type"] for p in turn["content"]] for turn in second.conversation]
    assert kinds[0] == ["video", "text", "video"]
    from vlm_pack.data.forecast import forecast_sources

    _, pre = qwen_video
    table = forecast_sources(str(path), preprocessor=pre, progress=False, on_error="raise")
    processed = [pre.process(list(s.images), s.conversation, s.key, videos=list(s.videos)) for s in (first, second)]
    assert table.lengths.tolist() == [int(p["input_ids"].shape[0]) for p in processed]
    assert table.video_tokens.tolist() == [int(p["tokens_per_video"].sum()) for p in processed]
    assert table.num_videos.tolist() == [1, 2]


# ----------------------------------------------------------------------------------------- without PyAV
def test_without_pyav_a_video_sample_names_the_extra_and_image_samples_are_unchanged(monkeypatch, tmp_path):
    """Runs in the main venv (no PyAV) and, with ``av`` hidden, anywhere: an image-only source forecasts as
    before, and a sample with a video raises ``SampleCodeError`` naming it and ``vlm-pack[video]`` (every
    video sample would fail alike: never counted as bad data). No video byte is read, so none is encoded."""
    from vlm_pack.data.forecast import forecast_sources
    from vlm_pack.offline import build_tokenizer, image_processor
    from vlm_pack.preprocessor import Preprocessor

    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError
    (tmp_path / "a.png").write_bytes(_png((64, 48)))
    (tmp_path / "clip.mp4").write_bytes(b"never opened: PyAV is missing")
    image_row = {"messages": [{"role": "user", "content": "<image>Hi"}, {"role": "assistant", "content": "Yo"}],
                 "images": ["a.png"]}  # fmt: skip
    video_row = {"id": "v1", "messages": [{"role": "user", "content": "<video>Hi"},
                                         {"role": "assistant", "content": "Yo"}], "videos": ["clip.mp4"]}  # fmt: skip
    images_only = tmp_path / "images.jsonl"
    images_only.write_text(json.dumps(image_row) + "\n")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(image_row) + "\n" + json.dumps(video_row) + "\n")
    pre = Preprocessor(tokenizer=build_tokenizer("qwen2_vl"), image_processor=image_processor("qwen2_vl"))
    table = forecast_sources(str(images_only), preprocessor=pre, progress=False)
    want = pre.forecast(image_row["messages"], [(64, 48)])[0]
    assert table.lengths.tolist() == [want] and not table.invalid
    with pytest.raises(SampleCodeError, match=r"mixed.jsonl:2 \(key 'v1'\), video 0.*pip install \"vlm-pack\[video\]\""):
        forecast_sources(str(mixed), preprocessor=pre, progress=False)


# ------------------------------------------------------------------------------ end to end, with a processor
CAPACITY = 2048


@pytest.fixture(scope="module")
def qwen_video():
    """Qwen2-VL's processor with its video processor (no frame sampling: every frame kept), a small budget."""
    pytest.importorskip("torchvision")
    from vlm_pack.preprocessor import Preprocessor
    from vlm_pack.testing.clips import processor_with_video

    proc = processor_with_video("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 64 * 28 * 28})
    return proc, Preprocessor(processor=proc)


def _video_tokens_by_the_processor(proc, data: bytes) -> int:
    """Placeholders the HF video processor makes of every decoded frame of ``data`` (its grid / merge**2)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    grid = proc.video_processor(videos=[frames], return_tensors="pt")["video_grid_thw"]
    return int(grid.prod()) // proc.video_processor.merge_size**2


def _video_records(clips: dict[str, bytes], n: int) -> list[dict]:
    """``n`` samples cycling: a video alone (mp4, webm, mkv), two videos and an image, an image alone."""
    out = []
    for i in range(n):
        kind = i % 5
        turn = "Describe." if kind < 4 else "What is it?"
        record: dict = {"key": f"v{i:03d}"}
        if kind < 3:
            record["videos"] = [list(clips.values())[kind]]
            turn = "<video>" + turn
        elif kind == 3:
            record["videos"], record["images"] = [clips["webm"], clips["mp4"]], [_png((56, 84))]
            turn = "<video><image>Then <video>?"
        else:
            record["images"] = [_png((84, 56))]
            turn = "<image>" + turn
        record["conversation"] = [{"role": "user", "content": turn}, {"role": "assistant", "content": f"Answer {i}."}]
        out.append(record)
    return out


@pytest.mark.torchvision
def test_a_video_stream_forecasts_from_headers_what_processing_gives(clips, qwen_video, tmp_path):
    """PackedWebDataset over shards of video, video + image and image samples: every sample packed once, its
    header forecast equal to its processed length (no forecast mismatch), and each clip's placeholders what
    the HF video processor makes of all its decoded frames."""
    from vlm_pack.data.pipeline import PackedWebDataset
    from vlm_pack.data.stream_meta import stream_info

    proc, pre = qwen_video
    records = _video_records(clips, 10)
    urls = write_shards(records, str(tmp_path / "v-%06d.tar"), maxcount=4)
    ds = PackedWebDataset(urls, pre, capacity=CAPACITY, shuffle_seed=None)
    batches = list(ds)
    keys = [k for b in batches for k in b.metadata["__key__"]]
    assert sorted(keys) == [r["key"] for r in records]
    for b in batches:
        info = stream_info(b)
        assert info["lengths"] == info["forecast"]
    assert ds.stats.forecast_mismatches == 0 and ds.stats.samples_bad == 0
    video_id = proc.tokenizer.convert_tokens_to_ids(proc.video_token)
    per_key = {}
    for b in batches:
        bounds = b.cu_seqlens.tolist()
        for key, start, end in zip(b.metadata["__key__"], bounds, bounds[1:]):
            per_key[key] = int((b.input_ids[0, start:end] == video_id).sum())
    for record in records:
        want = sum(_video_tokens_by_the_processor(proc, v) for v in record.get("videos", []))
        assert per_key[record["key"]] == want, record["key"]


@pytest.mark.torchvision
def test_a_stream_reads_each_video_header_once_and_decodes_the_frames_it_forecast(clips, qwen_video, tmp_path, monkeypatch):
    """The sample contract carries each clip's forecast (its kept frames) from the header forecast to the
    decoder (``SampleJob``): a PackedWebDataset epoch reads every container header once, decodes each clip at the
    frames forecast, and the processed length is still the forecast (the real video processor's output)."""
    from vlm_pack.data.pipeline import PackedWebDataset
    from vlm_pack.data.stream_meta import stream_info
    from vlm_pack.processing import videos as decoding
    from vlm_pack.vision import video as video_headers

    _, pre = qwen_video
    records = _video_records(clips, 5)  # 5 clips: mp4, webm, mkv alone, then webm + mp4 with an image
    urls = write_shards(records, str(tmp_path / "h-%06d.tar"), maxcount=3)
    headers, decoded = [], []
    read, decode = video_headers.read_video_header, decoding.decode_frames
    monkeypatch.setattr(video_headers, "read_video_header", lambda v, **k: headers.append(k.get("name")) or read(v, **k))
    monkeypatch.setattr(decoding, "decode_frames", lambda v, idx, *a: decoded.append(list(idx)) or decode(v, idx, *a))
    ds = PackedWebDataset(urls, pre, capacity=CAPACITY, shuffle_seed=None)
    batches = list(ds)
    assert sorted(k for b in batches for k in b.metadata["__key__"]) == [r["key"] for r in records]
    assert all(stream_info(b)["lengths"] == stream_info(b)["forecast"] for b in batches)
    clips_in = sum(len(r.get("videos", [])) for r in records)
    assert len(headers) == clips_in == len(decoded) == 5  # one header read and one decode per clip


@pytest.mark.torchvision
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_qwen3_video_streams_pack_every_sample_at_the_processors_own_length(clips, family, tmp_path):
    """Qwen3-VL / Qwen3.5 (frame sampling, ``<t seconds>`` per temporal group): a PackedWebDataset epoch packs
    every video, video + image and image sample with no forecast mismatch, and each sample's span in its
    pack is as long as the HF processor's own output for that sample alone (it samples the whole decoded
    clip itself). transformers 5.25 drops the template's <|vision_start|>/<|vision_end|> around each video
    (processing_qwen3_vl.py ``get_text_with_replacements``): 2 tokens per video fewer than 5.24, which the
    forecast must follow on whichever release is installed (the matrix runs this on both)."""
    import av

    from vlm_pack.data.pipeline import PackedWebDataset
    from vlm_pack.data.stream_meta import stream_info
    from vlm_pack.preprocessor import Preprocessor
    from vlm_pack.processing.render import _render
    from vlm_pack.testing.clips import processor_with_video
    from vlm_pack.vision.video import read_video_header

    template = Path(__file__).parent / "templates" / f"{family}.jinja"  # Qwen3.5's checkpoint template
    proc = processor_with_video(family, chat_template=template.read_text() if template.exists() else None,
                                size={"shortest_edge": 4096, "longest_edge": 64 * 32 * 32})
    pre = Preprocessor(processor=proc)
    records = _video_records(clips, 10)
    urls = write_shards(records, str(tmp_path / "q-%06d.tar"), maxcount=4)
    ds = PackedWebDataset(urls, pre, capacity=CAPACITY, shuffle_seed=None)
    spans = {}
    for batch in ds:
        info = stream_info(batch)
        assert info["lengths"] == info["forecast"]
        spans.update(zip(batch.metadata["__key__"], info["lengths"]))
    assert ds.stats.forecast_mismatches == 0 and ds.stats.samples_bad == 0
    assert sorted(spans) == [r["key"] for r in records]

    def frames(data: bytes) -> np.ndarray:
        with av.open(io.BytesIO(data)) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])

    for record in records:
        from PIL import Image

        videos = record.get("videos", [])
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in record.get("images", [])]
        text = _render(record["conversation"], proc.tokenizer, proc, None, None, len(images), record["key"],
                       num_videos=len(videos)).text  # fmt: skip
        own = proc(text=[text], images=images or None, videos=[frames(v) for v in videos] or None,
                   video_metadata=[read_video_header(v).metadata() for v in videos] or None,
                   do_sample_frames=True if videos else None, return_tensors="pt")  # fmt: skip
        assert spans[record["key"]] == own["input_ids"].shape[1], record["key"]


@pytest.mark.torchvision
def test_a_video_stream_resumes_exactly_once_and_counts_a_corrupt_video(clips, qwen_video, tmp_path):
    """A shuffled stream of video samples with one corrupt clip, checkpointed after every batch: resumed
    from the middle (a new dataset, the state through JSON) it gives the packs left, so every good sample
    arrives exactly once; the corrupt clip is counted once, under ``corrupt_video``, naming its member."""
    from vlm_pack.data.pipeline import PackedDataLoader, PackedWebDataset
    from vlm_pack.data.stats import BadSampleWarning

    _, pre = qwen_video
    records = _video_records(clips, 12)
    records.insert(5, {"key": "broken", "videos": [(clips["mp4"][:300], "mp4")], "caption": "cut short"})
    urls = write_shards(records, str(tmp_path / "r-%06d.tar"), maxcount=4)

    def dataset():
        # samples of 29-74 tokens: packs of a few, so checkpoints fall between packs and inside buffers
        return PackedWebDataset(urls, pre, capacity=128, shuffle_seed=3, shuffle_buffer=3, buffer_size=3)

    first = dataset()
    loader = PackedDataLoader(first, num_workers=0)
    packs, states = [], []
    with pytest.warns(BadSampleWarning, match=r"corrupt_video.*broken\.mp4"):
        for batch in loader:
            packs.append(tuple(batch.metadata["__key__"]))
            states.append(json.loads(json.dumps(loader.state_dict())))
    good = sorted(r["key"] for r in records if r["key"] != "broken")
    assert sorted(k for p in packs for k in p) == good and len(packs) >= 4
    assert first.stats.reasons == {"corrupt_video": 1}
    for k in (1, len(packs) // 2, len(packs) - 1):
        resumed = dataset()
        resumed.load_state_dict(states[k - 1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", BadSampleWarning)
            tail = [tuple(b.metadata["__key__"]) for b in PackedDataLoader(resumed, num_workers=0)]
        assert packs[:k] + tail == packs, k
        assert resumed.stats.reasons == {"corrupt_video": 1} and resumed.stats.samples_read == len(records)


def _video_dataset(clips: dict[str, bytes]):
    import datasets

    rows = []
    for record in _video_records(clips, 8):
        messages = record["conversation"]
        rows.append({"messages": messages, "videos": record.get("videos", []), "images": record.get("images", [])})
    return datasets.Dataset.from_list(rows)


@pytest.mark.torchvision
def test_map_style_packs_of_video_rows_are_their_forecast(clips, qwen_video):
    """PackedMapDataset over a ``datasets.Dataset`` with a column of video bytes: every row in one pack, and
    each pack's processed lengths equal the lengths the plan forecast from the clips' headers."""
    from vlm_pack.config import PackingConfig
    from vlm_pack.data.map_style import PackedMapDataset, plan_info

    _, pre = qwen_video
    ds = _video_dataset(clips)
    packed = PackedMapDataset(ds, pre, PackingConfig(capacity=CAPACITY), cache=None)
    rows = []
    for i in range(len(packed)):
        batch = packed[i]
        info = plan_info(batch)
        assert info["lengths"] == packed.lengths_of(info["bin"]).tolist() and not info["left_out"]
        assert batch.pixel_values_videos is not None or all(not ds[r]["videos"] for r in info["rows"])
        rows += info["rows"]
    assert sorted(rows) == list(range(len(ds)))


@pytest.mark.torchvision
def test_analyze_forecasts_video_records_and_lists_a_corrupt_one(clips, qwen_video, tmp_path, capsys):
    """``vlm-pack analyze`` on a ShareGPT JSONL of videos (paths) with the checkpoint's processor folder: the
    lengths it writes are what processing gives each sample, and a corrupt clip is listed with its reason."""
    import pyarrow.parquet as pq

    from vlm_pack.cli.main import main

    proc, pre = qwen_video
    proc.save_pretrained(tmp_path / "ckpt")
    paths = _clip_files(clips, tmp_path)
    (tmp_path / "videos" / "bad.mp4").write_bytes(clips["mp4"][:200])
    lines = []
    for i, ext in enumerate([*paths, "bad"]):
        video = paths.get(ext, "videos/bad.mp4")
        lines.append({"id": f"j{i}", "messages": [{"role": "user", "content": "<video>What moves?"},
                                                 {"role": "assistant", "content": "Noise."}], "videos": [video]})  # fmt: skip
    manifest = tmp_path / "train.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = ["analyze", str(manifest), "--processor", str(tmp_path / "ckpt"), "--out", str(tmp_path / "r"),
            "--no-plots", "--json", "--lengths", str(tmp_path / "lengths.parquet")]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    (bad,) = report["dataset"]["invalid"]
    assert bad["key"] == "j3" and "train.jsonl:4 (key 'j3'), video 0: not a readable video container" in bad["reason"]
    assert "videos/bad.mp4" in bad["reason"]  # the file itself, and what to do: re-encode or drop
    from vlm_pack.data.forecast import forecast_sources

    table = forecast_sources(str(manifest), preprocessor=pre, progress=False)
    assert table.invalid_reasons == ["corrupt_video"] and list(table.keys) == ["j0", "j1", "j2"]
    written = pq.read_table(tmp_path / "lengths.parquet").to_pylist()
    video_tokens = []
    for row, line in zip(written, lines):
        sample = pre.process([], line["messages"], videos=[tmp_path / line["videos"][0]])
        assert row["length"] == int(sample["input_ids"].shape[0]), line["id"]
        video_tokens.append(int(sample["tokens_per_video"].sum()))
    d = report["dataset"]  # the report counts the videos and their tokens (the processor's), not as text
    assert (d["videos"], d["images"], d["text_only_samples"]) == (3, 0, 0)
    assert d["video_tokens"] == sum(video_tokens) and d["video_tokens_per_sample"]["max"] == max(video_tokens)
    from vlm_pack.report import format_report

    assert "(0 images, 3 videos, 0 text-only)" in format_report(report)
    assert re.search(rf"video  mean +{sum(video_tokens) / 3:,.0f} ", format_report(report))


@pytest.mark.torchvision
def test_a_clip_over_capacity_is_refused_before_any_frame_is_decoded(clips, qwen_video, tmp_path, monkeypatch):
    """A clip whose header forecast exceeds ``capacity`` is counted as ``too_long`` (``oversized="skip"``) and
    never decoded: the decoder is asked only for the clips that were packed."""
    from vlm_pack.data.forecast import forecast_sources
    from vlm_pack.data.pipeline import PackedWebDataset
    from vlm_pack.data.stats import BadSampleWarning
    from vlm_pack.processing import videos as decoding

    _, pre = qwen_video
    long_clip = _encode("mp4", "libx264", 40, Fraction(10), 224, 224, seed=9)
    records = [
        {"key": "short", "videos": [clips["mp4"]], "caption": "short"},
        {"key": "long", "videos": [long_clip], "caption": "long"},
    ]
    urls = write_shards(records, str(tmp_path / "c-%06d.tar"))
    table = forecast_sources(urls, preprocessor=pre, progress=False)  # header forecasts: nothing decoded
    short, long = (int(n) for n in table.lengths)
    assert table.keys == ["short", "long"] and long > short + 8
    opened = []
    real = decoding.decode_frames
    monkeypatch.setattr(decoding, "decode_frames", lambda source, *a, **k: opened.append(source) or real(source, *a, **k))
    ds = PackedWebDataset(urls, pre, capacity=short + 8, oversized="skip")
    with pytest.warns(BadSampleWarning, match=r"too_long"):
        keys = [k for b in ds for k in b.metadata["__key__"]]
    assert keys == ["short"] and ds.stats.reasons == {"too_long": 1}
    assert len(opened) == 1


@pytest.mark.torchvision
def test_trl_rows_carry_videos_and_the_collator_processes_them(clips, qwen_video, tmp_path):
    """TRL's ``packed_dataset`` over shards of video samples: each row holds its samples' clips as stored
    (``video_bytes``, beside ``image_bytes``), and ``TRLPackingCollator`` turns it into one packed row with
    ``pixel_values_videos`` / ``video_grid_thw`` whose real tokens are the row's forecast lengths."""
    pytest.importorskip("trl")
    from vlm_pack.integrations.trl import NUM_TOKENS_KEY, TRLPackingCollator, packed_dataset

    _, pre = qwen_video
    records = _video_records(clips, 6)
    urls = write_shards(records, str(tmp_path / "t-%06d.tar"), maxcount=3)
    rows = packed_dataset(urls, pre, capacity=CAPACITY, cache_dir=str(tmp_path / "cache"))
    stored = {r["key"]: list(r.get("videos", [])) for r in records}
    seen = []
    collator = TRLPackingCollator(CAPACITY, pre)
    for row in rows:
        assert [list(v) for v in row["video_bytes"]] == [stored[k] for k in row["keys"]]
        inputs = collator([row])
        assert int(inputs[NUM_TOKENS_KEY]) == sum(row["lengths"])
        n_videos = sum(len(v) for v in row["video_bytes"])
        assert (inputs.get("video_grid_thw") is None) == (n_videos == 0)
        if n_videos:
            assert inputs["video_grid_thw"].shape[0] == n_videos and inputs["pixel_values_videos"].dim() == 2
        seen += row["keys"]
    assert sorted(seen) == sorted(stored)
