"""Records where users keep them: every record format normalised, every source forecast exactly.

The same samples (images made with Pillow, conversations written by hand) are stored in each record format the
way its tools write it (``datasets`` with ``Image`` features, ``to_parquet``, ``save_to_disk``, a
LLaVA-Instruct JSON array with an image folder, ShareGPT / LLaMA-Factory JSON and JSONL, vlm-pack's JSONL,
WebDataset shards). The oracle is the real HF image processor and tokenizer through ``process_sample`` on
the original images and conversation.
"""

from __future__ import annotations

import copy
import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
from PIL import Image

from vlm_pack.data.forecast import forecast_sources
from vlm_pack.data.records import RECORD_FORMATS, detect_record_format, normalise_record
from vlm_pack.data.shards import SampleError, write_shards
from vlm_pack.data.sources import chunks, iter_samples
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.processing import process_sample
from vlm_pack.vision import vision_spec_from_processor

# (image sizes, question, answer): no image, one, two; sizes give different token counts.
SAMPLES = [
    ([(96, 64)], "What is shown?", "A square of noise."),
    ([(40, 120), (75, 75)], "Compare the two pictures.", "The first is tall, the second square."),
    ([], "Say hello.", "Hello there, how can I help?"),
    ([(150, 50)], "Describe it in detail please.", "A wide strip."),
]


def _png(size: tuple[int, int], seed: int) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def model():
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl")
    return tok, ip, vision_spec_from_processor(ip)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The samples as image files + bytes, and their canonical vlm-pack conversations."""
    root = tmp_path_factory.mktemp("data")
    (root / "images").mkdir()
    out = []
    for i, (sizes, question, answer) in enumerate(SAMPLES):
        names, blobs = [], []
        for j, size in enumerate(sizes):
            blob = _png(size, 10 * i + j)
            name = f"images/s{i}_{j}.png"
            (root / name).write_bytes(blob)
            names.append(name)
            blobs.append(blob)
        conversation = [
            {"role": "user", "content": "<image>" * len(sizes) + question},
            {"role": "assistant", "content": answer},
        ]
        out.append(
            {
                "key": f"s{i}",
                "names": names,
                "blobs": blobs,
                "q": question,
                "a": answer,
                "conversation": conversation,
            }
        )
    return root, out


def _processed(model, data, llava: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Processed length and vision tokens of every sample, by the real processor on decoded images; with
    ``llava``, of the text a LLaVA record holds (``"<image>\\n"`` before the question: the newline is text)."""
    tok, ip, _ = model
    _, samples = data
    lengths, vision = [], []
    for s in samples:
        images = [Image.open(io.BytesIO(b)) for b in s["blobs"]]
        conversation = s["conversation"]
        if llava:
            question = "<image>\n" * len(s["names"]) + s["q"]
            conversation = [{"role": "user", "content": question}, {"role": "assistant", "content": s["a"]}]
        out = process_sample(images, conversation, tokenizer=tok, image_processor=ip)
        lengths.append(int(out["input_ids"].shape[0]))
        vision.append(int(out["tokens_per_image"].sum()))
    return np.asarray(lengths), np.asarray(vision)


@pytest.fixture(scope="module")
def oracle(model, data):
    return _processed(model, data)


@pytest.fixture(scope="module")
def llava_oracle(model, data):
    return _processed(model, data, llava=True)


def _messages_parts(s) -> list[dict]:
    # TRL / HF hub record format: content parts; Arrow stores every struct field, so "text" is None on images
    user = [{"type": "image", "text": None} for _ in s["blobs"]] + [{"type": "text", "text": s["q"]}]
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [{"type": "text", "text": s["a"]}]},
    ]


def _hf_dataset(samples, paths_root: Path | None = None) -> datasets.Dataset:
    images = [
        [{"bytes": None, "path": str(paths_root / n)} for n in s["names"]] if paths_root else s["blobs"]
        for s in samples
    ]
    ds = datasets.Dataset.from_dict({"images": images, "messages": [_messages_parts(s) for s in samples]})
    return ds.cast_column("images", datasets.List(datasets.Image()))


def _llava(s) -> dict:
    image = s["names"][0] if len(s["names"]) == 1 else s["names"]
    record = {
        "id": s["key"],
        "conversations": [
            {"from": "human", "value": "<image>\n" * len(s["names"]) + s["q"]},
            {"from": "gpt", "value": s["a"]},
        ],
    }
    if s["names"]:
        record["image"] = image
    return record


def _sharegpt(s) -> dict:
    return {
        "messages": [
            {"role": "user", "content": "<image>" * len(s["names"]) + s["q"]},
            {"role": "assistant", "content": s["a"]},
        ],
        "images": s["names"],
    }


def _own(s) -> dict:
    return {"key": s["key"], "images": s["names"], "conversation": _messages_parts(s)}


def _write_source(kind: str, root: Path, samples, tmp: Path):
    """The samples stored as source ``kind``; returns what to pass as the source."""
    if kind == "dataset":
        return _hf_dataset(samples)
    if kind == "iterable":
        return _hf_dataset(samples).to_iterable_dataset()
    if kind == "parquet":
        _hf_dataset(samples).to_parquet(str(tmp / "train.parquet"))
        return str(tmp / "train.parquet")
    if kind == "parquet-paths":  # an Image column holding absolute paths only
        _hf_dataset(samples, paths_root=root).to_parquet(str(tmp / "paths.parquet"))
        return str(tmp / "paths.parquet")
    if kind == "save_to_disk":
        _hf_dataset(samples).save_to_disk(str(tmp / "saved"))
        return str(tmp / "saved")
    if kind in ("llava", "sharegpt-json"):
        fn = _llava if kind == "llava" else _sharegpt
        path = root / f"{kind}.json"
        path.write_text(json.dumps([fn(s) for s in samples], indent=1))
        return str(path)
    if kind in ("sharegpt-jsonl", "own-jsonl"):
        fn = _sharegpt if kind == "sharegpt-jsonl" else _own
        path = root / f"{kind}.jsonl"
        path.write_text("".join(json.dumps(fn(s)) + "\n" for s in samples))
        return str(path)
    assert kind == "webdataset"
    records = [{"key": s["key"], "images": s["blobs"], "conversation": _messages_parts(s)} for s in samples]
    return write_shards(records, tmp / "shards", maxcount=3)


KINDS = [
    "dataset",
    "iterable",
    "parquet",
    "parquet-paths",
    "save_to_disk",
    "llava",
    "sharegpt-json",
    "sharegpt-jsonl",
    "own-jsonl",
    "webdataset",
]


@pytest.mark.parametrize("kind", KINDS)
def test_forecast_is_the_processed_length_on_every_source(kind, model, data, oracle, llava_oracle, tmp_path):
    tok, _, spec = model
    root, samples = data
    source = _write_source(kind, root, samples, tmp_path)
    table = forecast_sources(source, tokenizer=tok, spec=spec, progress=False)
    lengths, vision = llava_oracle if kind == "llava" else oracle  # LLaVA's text holds "<image>\n"
    assert len(table) == len(SAMPLES) and not table.invalid
    np.testing.assert_array_equal(table.lengths, lengths)
    np.testing.assert_array_equal(table.vision_tokens, vision)
    np.testing.assert_array_equal(table.num_images, [len(s[0]) for s in SAMPLES])
    np.testing.assert_array_equal(table.index, np.arange(len(SAMPLES)))


def test_forecast_ignores_truncation_and_padding_saved_in_the_tokenizer(model, data, oracle, tmp_path):
    """The forecast tokenizes through the Rust backend where that equals the HF call. A tokenizer.json saved
    with truncation or padding on makes the backend truncate or pad; the HF call turns both off, and so
    must the forecast (or every long sample is forecast short)."""
    tok, _, spec = model
    root, samples = data
    saved = copy.deepcopy(tok)
    saved.backend_tokenizer.enable_truncation(max_length=8)
    saved.backend_tokenizer.enable_padding(length=4096)
    table = forecast_sources(_write_source("parquet", root, samples, tmp_path), tokenizer=saved, spec=spec, progress=False)
    np.testing.assert_array_equal(table.lengths, oracle[0])


@pytest.mark.slow
def test_forecast_in_two_processes_equals_one(model, data, oracle, tmp_path):
    tok, _, spec = model
    root, samples = data
    many = samples * 5  # 20 rows, chunks of 3 rows over 2 processes: order must survive
    ds = _hf_dataset(many)
    path = root / "many.jsonl"
    path.write_text("".join(json.dumps(_sharegpt(s)) + "\n" for s in many))
    for source in (ds, [str(path)]):
        one = forecast_sources(source, tokenizer=tok, spec=spec, progress=False, chunk_rows=3)
        two = forecast_sources(source, tokenizer=tok, spec=spec, progress=False, chunk_rows=3, num_proc=2)
        np.testing.assert_array_equal(two.lengths, np.tile(oracle[0], 5))
        np.testing.assert_array_equal(two.lengths, one.lengths)
        assert two.keys == one.keys and two.sources == one.sources


def test_record_formats_are_detected_and_normalised(data):
    root, samples = data
    s = samples[1]  # two images
    expected = [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": s["q"]}]},
        {"role": "assistant", "content": [{"type": "text", "text": s["a"]}]},
    ]
    cases = {
        "llava": _llava(s),
        "sharegpt": _sharegpt(s),
        "messages": {"images": s["blobs"], "messages": _messages_parts(s)},
        "caption": {"image": s["names"], "caption": "two noise images"},
    }
    for record_format, record in cases.items():
        assert detect_record_format(record) == record_format
        sample = normalise_record(record, key="k", where="here", image_root=root)
        if record_format == "caption":
            assert sample.conversation == "two noise images"
        elif record_format == "sharegpt":
            assert sample.conversation == s["conversation"]
        elif record_format == "llava":  # role/content turns, the text as written (newlines after <image> kept)
            assert sample.conversation == [
                {"role": "user", "content": "<image>\n<image>\n" + s["q"]},
                {"role": "assistant", "content": s["a"]},
            ]
        else:
            assert sample.conversation == expected
        assert len(sample.images) == 2
    # paths resolve against image_root; stored bytes stay bytes
    assert normalise_record(_llava(s), image_root=root).images == tuple(str(root / n) for n in s["names"])
    assert normalise_record(cases["messages"]).images == tuple(s["blobs"])
    # the key comes from the record (LLaVA's "id") before the default
    assert normalise_record(_llava(s), key="x", image_root=root).key == s["key"]
    # LLaMA-Factory's system column is the first turn
    with_system = normalise_record({**_sharegpt(s), "system": "Be brief."}, image_root=root).conversation
    assert with_system == [{"role": "system", "content": "Be brief."}, *s["conversation"]]
    # an override picks the fields: this record has both a caption and messages
    both = {"caption": "short", "messages": _messages_parts(samples[2])}
    assert normalise_record(both).conversation[0]["role"] == "user"
    assert normalise_record(both, record_format="caption").conversation == "short"


def test_a_record_fitting_no_format_lists_its_keys_and_the_formats(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text(json.dumps({"prompt": "hi", "response": "yo", "picture": "a.jpg"}) + "\n")
    with pytest.raises(SampleError) as err:
        list(iter_samples(str(path), on_error="raise"))
    message = str(err.value)
    assert f"{path}:1" in message and "['picture', 'prompt', 'response']" in message
    assert "fits no record format" in message and "record_format= / --format" in message
    for name in RECORD_FORMATS:
        assert f"{name}:" in message
    # skipped (the default): comes as its error, for the caller to count with its reason; nothing lost
    ((where, key, item),) = iter_samples(str(path))
    assert isinstance(item, SampleError) and where == f"{path}:1" and key == "odd-1"


def test_missing_image_names_the_record_and_the_fix(model, data, tmp_path):
    tok, _, spec = model
    _, samples = data
    path = tmp_path / "llava.json"  # image paths relative to a folder that is not the JSON's
    path.write_text(json.dumps([_llava(s) for s in samples]))
    with pytest.raises(
        SampleError,
        match=r"llava.json\[0\] \(key 's0'\): image 0 'images/s0_0.png' not found"
        r".*image_root \(--image-root\)",
    ):
        forecast_sources(str(path), tokenizer=tok, spec=spec, progress=False, on_error="raise")
    table = forecast_sources(str(path), tokenizer=tok, spec=spec, progress=False)  # on_error="skip"
    assert table.keys == ["s2"] and [k for k, _, _ in table.invalid] == ["s0", "s1", "s3"]
    np.testing.assert_array_equal(table.index, [2])


def test_sources_accept_folders_globs_and_reject_others(model, data, tmp_path):
    tok, _, spec = model
    root, samples = data
    folder = tmp_path / "parts"
    folder.mkdir()
    for i, s in enumerate(samples):
        (folder / f"part-{i}.jsonl").write_text(json.dumps(_own(s)) + "\n")
    glob_table = forecast_sources(
        str(folder / "part-*.jsonl"), tokenizer=tok, spec=spec, progress=False, image_root=root
    )
    dir_table = forecast_sources(str(folder), tokenizer=tok, spec=spec, progress=False, image_root=root)
    assert glob_table.keys == dir_table.keys == [s["key"] for s in samples]
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"notes\.txt' is not a source"):
        forecast_sources(str(tmp_path / "notes.txt"), tokenizer=tok, spec=spec)
    with pytest.raises(ValueError, match="does not exist"):
        forecast_sources(str(tmp_path / "absent.parquet"), tokenizer=tok, spec=spec)


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk", "llava", "sharegpt-jsonl", "own-jsonl"])
@pytest.mark.slow
def test_cli_analyze_and_pack_read_every_source(kind, data, oracle, llava_oracle, tmp_path, capsys):
    from vlm_pack.cli.main import main

    root, samples = data
    source = str(_write_source(kind, root, samples, tmp_path))
    lengths, vision = llava_oracle if kind == "llava" else oracle
    extra = ["--workers", "2"] if kind == "parquet" else []
    if kind == "llava":
        extra = ["--format", "llava", "--image-root", str(root)]
    out = tmp_path / "report"
    argv = ["analyze", source, "--capacity", "512", "--no-plots", "--no-progress", "--out", str(out), *extra]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())["dataset"]
    assert report["samples"] == len(SAMPLES) and not report["invalid"]
    assert report["vision_tokens"] == int(vision.sum())
    assert report["text_tokens"] + report["vision_tokens"] == int(lengths.sum())

    plan = tmp_path / "plan.jsonl"
    argv = ["pack", source, "--capacity", "512", "--no-progress", "--out", str(plan), *extra]
    assert main(argv) == 0, capsys.readouterr().err
    packs = [json.loads(line) for line in plan.read_text().splitlines()]
    keys = [k for p in packs for k in p["keys"]]
    assert len(keys) == len(set(keys)) == len(SAMPLES)  # every sample once
    assert sorted(n for p in packs for n in p["lengths"]) == sorted(lengths.tolist())


def test_parquet_row_groups_are_read_by_the_workers_not_shipped(model, data, oracle, tmp_path):
    """Small row groups are chunks a worker reads itself (no Arrow batch read here and pickled over), in
    order, whatever the number of processes; a file of one large group is still streamed in batches."""
    import pyarrow.parquet as pq

    from vlm_pack.data.sources import chunks, open_sources

    tok, _, spec = model
    _, samples = data
    path = tmp_path / "groups.parquet"
    pq.write_table(_hf_dataset(samples * 3).data.table, path, row_group_size=2)
    pieces = list(chunks(open_sources(str(path))))
    assert [(c.start, c.stop, c.group, c.batch) for c in pieces] == [(i, i + 2, i // 2, None) for i in range(0, 12, 2)]
    one = forecast_sources(str(path), tokenizer=tok, spec=spec, progress=False)
    two = forecast_sources(str(path), tokenizer=tok, spec=spec, progress=False, num_proc=2)
    np.testing.assert_array_equal(one.lengths, np.tile(oracle[0], 3))
    np.testing.assert_array_equal(two.lengths, one.lengths)
    assert two.keys == one.keys and two.sources == one.sources
    pq.write_table(_hf_dataset(samples * 3).data.table, path)  # one group of 12 rows, chunks of 2
    assert [c.batch.num_rows for c in chunks(open_sources(str(path)), chunk_rows=2)] == [2] * 6


def test_an_engine_stops_at_the_failure_budget_not_at_the_end_of_the_map(model, data, tmp_path):
    """``assemble_table`` (what ``forecast_ray`` feeds the cluster's results through, in source order) takes
    the chunk results as they come, so a source whose samples all fail stops the map after the first
    ``max_consecutive_failures`` of them, as the local processes stop, instead of after all of it: the
    results after that point are never asked for (here asking raises)."""
    from vlm_pack.data.forecast import assemble_table, forecast_chunk, make_forecaster
    from vlm_pack.failures import FailureBudgetError

    tok, _, spec = model
    root, samples = data
    path = tmp_path / "missing.jsonl"  # every record names an image that is not there: bad data, counted
    path.write_text("".join(json.dumps({**_sharegpt(s), "images": ["images/gone.png"]}) + "\n" for s in samples * 3))
    forecaster = make_forecaster([str(path)], tokenizer=tok, spec=spec, image_root=root)
    pieces = list(chunks(forecaster.sources, 2))
    assert len(pieces) >= 4

    def results():
        for piece in pieces[:3]:
            yield forecast_chunk(forecaster, piece)
        raise AssertionError("asked for chunk results past the failure budget")

    with pytest.raises(FailureBudgetError, match="4 bad samples in a row"):
        assemble_table(results(), 3, "forecast_ray")
    with pytest.raises(SampleError, match=r"gone\.png"):  # on_error="raise": the first bad sample, at once
        assemble_table(results(), None, "forecast_ray", on_error="raise")
