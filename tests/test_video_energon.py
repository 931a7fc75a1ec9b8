"""Video samples through the Energon task encoder: real tar shards (PyAV-encoded clips beside images),
``energon prepare``, a real Energon loader epoch.

Oracles from outside the encoder: each sample processed alone by ``Preprocessor.process`` (the family's own HF
processor and video processor on the decoded frames) gives the length and ids its packed segment must have.
Energon's own default error handler is used where a dropped buffer would show: it logs and drops what a hook
raises, so only the encoder's own counting keeps a bad video from taking good samples with it.
"""

from __future__ import annotations

import functools
import gc
import io
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.energon", reason="needs the [energon] extra")
pytest.importorskip("torchvision", reason="video processors are torchvision classes")
pytest.importorskip("av", reason="videos are read with PyAV")

from megatron.energon import WorkerConfig, get_savable_loader
from megatron.energon.errors import FatalSampleError, reraise_exception

from vlm_pack import Preprocessor
from vlm_pack.data import stream_tar_samples, write_shards
from vlm_pack.integrations.energon import VLMPackingTaskEncoder, packed_train_dataset
from vlm_pack.testing import encode_clip, processor_with_video
from vlm_pack.testing.clips import truncated_clip

pytestmark = pytest.mark.torchvision

_TEMPLATES = Path(__file__).parent / "templates"
CAPACITY = 256
# a clip whose forecast is over CAPACITY on its own (Qwen2.5-VL at 2 fps: 20 s -> 40 frames -> 20 x 16 tokens)
LONG_CLIP = dict(frames=200, width=112, height=112, fps=10.0, container="mp4", seed=9)


def energon_prepare(path: Path) -> None:
    # the `energon` command of this interpreter's environment, run by it (an overlay venv has no script of its own)
    energon = "import sys; from megatron.energon.cli.main import main; sys.argv[0] = 'energon'; sys.exit(main())"
    cmd = [sys.executable, "-c", energon, "prepare", str(path), "--non-interactive", "--split-ratio", "1,0,0",
           "--sample-type", "CrudeWebdataset"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@functools.cache
def _processor():
    """Qwen2.5-VL (its processor's own 2 fps frame sampling, ``second_per_grid_ts``) with small frames."""
    return processor_with_video(
        "qwen2_5_vl",
        chat_template=(_TEMPLATES / "qwen2_5_vl.jinja").read_text(),
        image_overrides=dict(size={"shortest_edge": 4 * 28 * 28, "longest_edge": 64 * 28 * 28}),
        size={"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28},
        cap_pixels_per_frame=False,
        do_sample_frames=True,
        fps=2,
    )


def _png(width: int, height: int, colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def _turns(parts: list[dict], answer: str) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "What happens?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


_VIDEO = {"type": "video"}
_IMAGE = {"type": "image"}


def _records() -> list[dict]:
    """Good samples (video alone in MP4 / WebM / MKV, two videos, video + image, image alone, text alone), a
    container that does not open, one that opens but does not decode, and one clip over ``CAPACITY``."""
    clip = lambda *a: encode_clip(*a)  # noqa: E731  (frames, width, height, fps, container, seed)
    good = [
        {"key": "mp4-odd", "videos": [(clip(9, 96, 64, 5.0, "mp4", 1), "mp4")], "conversation": _turns([_VIDEO], "A square moves.")},
        {"key": "webm", "videos": [(clip(12, 64, 96, 6.0, "webm", 2), "webm")], "conversation": _turns([_VIDEO], "It slides.")},
        {"key": "mkv", "videos": [(clip(16, 80, 80, 8.0, "mkv", 3), "mkv")], "conversation": _turns([_VIDEO], "Nothing.")},
        {"key": "two-videos", "videos": [(clip(7, 64, 64, 3.0, "mp4", 4), "mp4"), (clip(10, 96, 64, 4.0, "mkv", 5), "mkv")],
         "conversation": _turns([_VIDEO, {"type": "text", "text": "then"}, _VIDEO], "Both move.")},
        {"key": "video-and-image", "images": [(_png(90, 60, (20, 140, 60)), "png")],
         "videos": [(clip(20, 112, 84, 10.0, "mp4", 6), "mp4")], "conversation": _turns([_IMAGE, _VIDEO], "Green, then motion.")},
        {"key": "image", "images": [(_png(64, 64, (200, 30, 30)), "png")], "conversation": _turns([_IMAGE], "Red.")},
        {"key": "text", "images": [], "conversation": _turns([], "Words only.")},
        {"key": "mp4-long-ok", "videos": [(clip(60, 64, 48, 30.0, "mp4", 7), "mp4")], "conversation": _turns([_VIDEO], "Fast.")},
    ]  # fmt: skip
    corrupt = encode_clip(10, 96, 64, 5.0, "mp4", 8)
    bad = [
        {"key": "corrupt", "videos": [(corrupt[:64] + bytes(len(corrupt) - 64), "mp4")],
         "conversation": _turns([_VIDEO], "Unreadable.")},
        {"key": "truncated", "videos": [(truncated_clip(), "mp4")], "conversation": _turns([_VIDEO], "Cut.")},
        {"key": "oversized", "videos": [(encode_clip(**LONG_CLIP), "mp4")], "conversation": _turns([_VIDEO], "Long.")},
    ]
    # the bad samples spread between good ones, so that they share packing buffers and packs with them
    return [good[0], bad[0], *good[1:4], bad[1], *good[4:7], bad[2], good[7]]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    path = tmp_path_factory.mktemp("energon-video")
    records = _records()
    write_shards(records, str(path / "part-%05d.tar"), maxcount=4)
    energon_prepare(path)
    return path, {r["key"]: r for r in records}


@pytest.fixture(autouse=True)
def _collect_decoder_garbage():
    """Collect garbage after each test, while the process still has its decoder threads. Known bug (reported to
    the lead): a clip that does not decode, skipped through ``failures.Guard.call`` in this process, leaves its
    PyAV container (a frame-threaded codec context) in a reference cycle (the caught error, held in a local of the
    frame its traceback holds); when Energon later forks loader workers, a collection in the child frees it and
    hangs in ``avcodec_free_context`` (its threads do not exist there). Breaking that cycle in ``Guard.call``
    (``error = None`` once reported) fixes it; this fixture keeps the in-process tests from tripping the next."""
    yield
    gc.collect()


def _alone(record: dict) -> dict:
    """The oracle: the sample processed on its own, outside Energon and the encoder."""
    pre = Preprocessor(processor=_processor())
    images = [data for data, _ in record.get("images", [])]
    videos = [data for data, _ in record.get("videos", [])]
    return pre.process(images, record["conversation"], key=record["key"], videos=videos)


def _loader(path: Path, encoder: VLMPackingTaskEncoder, workers: int, handler=None, buffer: int = 6, repeat=False):
    extra = {} if handler is None else {"global_error_handler": handler}
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers, **extra)
    ds = packed_train_dataset(str(path), encoder, worker_config=wc, packing_buffer_size=buffer, repeat=repeat)
    return get_savable_loader(ds, watchdog_timeout_seconds=None)


@functools.cache
def _model_config():
    """A tiny Qwen2.5-VL config (the released ``tokens_per_second``) for the collator's time positions."""
    from vlm_pack.offline import tiny_model_config

    return tiny_model_config("qwen2_5_vl", _processor().tokenizer)


def _encoder(**knobs) -> VLMPackingTaskEncoder:
    pre = Preprocessor(processor=_processor())
    return VLMPackingTaskEncoder(pre, CAPACITY, model_config=_model_config(), **knobs)


GOOD = ["image", "mkv", "mp4-long-ok", "mp4-odd", "text", "two-videos", "video-and-image", "webm"]


@pytest.mark.slow
def test_an_epoch_packs_every_good_video_sample_once_at_its_processed_length(shards):
    """2 workers, Energon's default handler (logs and drops what a hook raises): every good sample is packed
    exactly once, at the length and with the ids it has processed alone; the unreadable container (cooker),
    the clip that does not decode (packer, sharing a pack with good samples) and the clip over capacity are
    each reported once with their reason."""
    path, records = shards
    packs = list(_loader(path, _encoder(oversized="skip"), workers=2))
    keys = [k for p in packs for k in p.keys]
    assert sorted(keys) == GOOD
    left = dict(item for p in packs for item in p.left_out)
    assert sum(len(p.left_out) for p in packs) == 3 and sorted(left) == ["corrupt", "oversized", "truncated"]
    assert left["corrupt"].startswith("corrupt_video: corrupt.mp4: not a readable video container")
    assert left["truncated"].startswith("decode_error: sample 'truncated', video 0 does not decode")
    assert left["oversized"].startswith("too_long: ") and left["oversized"].endswith(f"> capacity {CAPACITY}")
    assert len(packs) < len(GOOD)  # packed, not one sample per item
    for pack in packs:
        batch = pack.batch
        assert batch.num_rows == 1 and batch.row_length == CAPACITY
        alone = [_alone(records[k]) for k in pack.keys]
        assert batch.seq_lens.tolist() == [len(a["input_ids"]) for a in alone]
        starts = batch.cu_seqlens.tolist()
        for i, a in enumerate(alone):
            assert batch.input_ids[0, starts[i] : starts[i + 1]].tolist() == a["input_ids"].tolist()
        videos = [a["pixel_values_videos"] for a in alone if "pixel_values_videos" in a]
        if videos:
            import torch

            assert torch.equal(batch.pixel_values_videos, torch.cat(videos))
            grids = torch.cat([a["video_grid_thw"] for a in alone if "video_grid_thw" in a])
            assert torch.equal(batch.video_grid_thw, grids)
            seconds = torch.cat([a["second_per_grid_ts"].reshape(-1) for a in alone if "second_per_grid_ts" in a])
            torch.testing.assert_close(batch.second_per_grid_ts.reshape(-1), seconds.to(batch.second_per_grid_ts.dtype))
        else:
            assert batch.pixel_values_videos is None


@pytest.mark.slow
def test_the_cooker_forecasts_from_the_header_and_never_decodes_a_clip_it_refuses(shards, monkeypatch):
    """In-process (0 workers), decoding spied: the forecast the cooker plans on equals the processed length,
    each good clip is decoded once (in the packer), and neither the clip over capacity nor the unreadable
    container is ever decoded; the forecast stage counts both, the packing stage the clip that does not decode
    (leaving its pack's good samples packed)."""
    from vlm_pack.processing import videos as videos_module

    path, records = shards
    decoded: list[str] = []
    real = videos_module.decode_frames

    def spy(source, indices, name="video"):
        decoded.append(name)
        return real(source, indices, name)

    monkeypatch.setattr(videos_module, "decode_frames", spy)
    cooker = _encoder(oversized="skip")  # the cooker alone, on the same shards, for its forecasts
    cooked = {s["__key__"]: cooker.cook_sample(s) for shard in sorted(path.glob("*.tar"))
              for s in stream_tar_samples(str(shard))}
    assert not decoded  # forecasts read headers only
    encoder = _encoder(oversized="skip")
    packs = list(_loader(path, encoder, workers=0, handler=reraise_exception))
    assert sorted(k for p in packs for k in p.keys) == GOOD
    assert all(not name.startswith(("sample 'oversized'", "sample 'corrupt'")) for name in decoded), decoded
    with_video = [k for k in GOOD if records[k].get("videos")]
    videos_decoded = sorted(name.split("'")[1] for name in decoded)
    want = sorted(itertools.chain.from_iterable([k] * len(records[k]["videos"]) for k in with_video))
    assert videos_decoded == sorted([*want, "truncated"])
    for key in GOOD:
        assert cooked[key].length == len(_alone(records[key])["input_ids"])
    assert cooked["oversized"].length > CAPACITY
    failed = {key: s.failure.split(":")[0] for key, s in cooked.items() if s.failure is not None}
    assert failed == {"corrupt": "corrupt_video", "oversized": "too_long"}
    # the packer on a pack of the clip that does not decode and two good samples: those two are packed
    pack = cooker.pack_selected_samples([cooked["mkv"], cooked["truncated"], cooked["video-and-image"]])
    assert pack.keys == ["mkv", "video-and-image"]
    assert [(k, why.split(":")[0]) for k, why in pack.left_out] == [("truncated", "decode_error")]
    assert cooker.left_out[-1][0] == "truncated"


@pytest.mark.slow
def test_a_clip_over_capacity_stops_the_run_by_default_before_it_is_decoded(shards, monkeypatch):
    """oversized="raise" (default), Energon's default handler: the cooker stops the run naming the sample."""
    from vlm_pack.processing import videos as videos_module

    decoded: list[str] = []
    real = videos_module.decode_frames
    monkeypatch.setattr(videos_module, "decode_frames", lambda s, i, name="video": decoded.append(name) or real(s, i, name))
    with pytest.raises(FatalSampleError, match=rf"sample 'oversized': \d+ tokens > capacity {CAPACITY}; raise capacity"):
        list(_loader(shards[0], _encoder(), workers=0))
    assert not any("oversized" in name for name in decoded)


def _take(loader, n: int, what) -> list:
    """``what`` of the next ``n`` packs; then stop the loader's worker processes now (an abandoned iterator is
    otherwise shut down by a later garbage collection, stalling whatever runs then)."""
    out = [what(p) for p in itertools.islice(loader, n)]
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_restore_mid_epoch_gives_the_same_video_packs_and_reports(shards, workers):
    """Saved after two packs and restored in a new loader (repeat=True, as in training; Energon's default
    handler): the packs that follow, their ids, video pixels and left-out reports, are the uninterrupted run's,
    across the bad videos (the buffers are re-read and re-cooked on restore, so the cooker must be stateless)."""

    def loader():  # a buffer smaller than the dataset: with repeat=True a larger one would repeat samples
        return _loader(shards[0], _encoder(oversized="skip"), workers=workers, buffer=4, repeat=True)

    def seen(pack):
        videos = pack.batch.pixel_values_videos
        return pack.keys, pack.left_out, pack.batch.input_ids.tolist(), None if videos is None else videos.sum().item()

    full = _take(loader(), 6, seen)
    first = loader()
    head = [seen(p) for p in itertools.islice(first, 2)]
    state = first.save_state_rank()
    _take(first, 0, seen)
    restored = loader()
    restored.restore_state_rank(state)
    assert head + _take(restored, 4, seen) == full
    reported = {key for _, left_out, _, _ in full for key, _ in left_out}
    assert reported == {"corrupt", "oversized", "truncated"}  # every bad video is in the compared packs
    assert any(v is not None for *_, v in full)  # video pixels are among what is compared


@pytest.mark.slow
def test_videos_in_the_collapsed_layout_pack_at_their_expanded_lengths(shards):
    """Megatron's collapsed layout (one placeholder per video, per image) through the encoder: every good
    sample is packed once, each sample's collapsed span holds one video token per video, and its span in the
    expanded space (what the model attends over once it expands the placeholders) is the length the sample
    has processed alone in the expanded layout."""
    import torch

    path, records = shards
    pre = Preprocessor(processor=_processor(), layout="collapsed")
    encoder = VLMPackingTaskEncoder(pre, CAPACITY, model_config=_model_config(), oversized="skip")
    packs = list(_loader(path, encoder, workers=0))
    assert sorted(k for p in packs for k in p.keys) == GOOD, [p.left_out for p in packs]
    video_id = _processor().video_token_id
    for pack in packs:
        batch = pack.batch
        alone = [_alone(records[k]) for k in pack.keys]
        assert batch.layout == "collapsed"
        assert batch.seq_lens_expanded.tolist() == [len(a["input_ids"]) for a in alone]
        starts = batch.cu_seqlens.tolist()
        for i, key in enumerate(pack.keys):
            span = batch.input_ids.reshape(-1)[starts[i] : starts[i + 1]]
            assert int((span == video_id).sum()) == len(records[key].get("videos", [])), key
        grids = [a["video_grid_thw"] for a in alone if "video_grid_thw" in a]
        if grids:
            assert torch.equal(batch.video_grid_thw, torch.cat(grids))
