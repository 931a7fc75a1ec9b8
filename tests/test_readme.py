"""README.md and docs/*.md run as pasted: every python block of a page, in order, in one namespace and an empty
folder (each page on its own: a page holds its own set-up); their numbers and formats are real.

Oracles: the Hugging Face image processors' own outputs (grids, expanded placeholders) on real Pillow images,
the keys written into the shards, and a collapsed -> expanded remap computed here by hand.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def _blocks(lang: str, page: Path = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", page.read_text(), flags=re.S)


def _runnable(page: Path = README) -> list[str]:
    return [b for b in _blocks("python", page) if not b.startswith("# not run:")]


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _needs(page: Path) -> list[str]:
    """The modules a page's blocks import beyond the main set-up, from its first line
    (``<!-- needs: av, torchvision -->``): its run is then `torchvision`-marked and skipped without them."""
    first = page.read_text().splitlines()[0]
    found = re.match(r"<!-- needs: (.*) -->", first)
    return [m.strip() for m in found.group(1).split(",")] if found else []


def _skip_without_video_support() -> None:
    from vlm_pack._compat import VIDEOS_SINCE, installed_transformers_version, videos_supported

    if not videos_supported():
        pytest.skip(f"video samples need transformers >= {VIDEOS_SINCE} (installed {installed_transformers_version()})")


def _page_param(page: Path) -> object:
    return pytest.param(page, id=_name(page), marks=[pytest.mark.torchvision] if _needs(page) else [])


def _hf_qwen_tokens(image: Image.Image, patch_size: int, min_pixels: int, max_pixels: int) -> int:
    import transformers

    ip = transformers.Qwen2VLImageProcessorPil(
        patch_size=patch_size, merge_size=2, temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )  # fmt: skip
    return int(ip(images=[image], return_tensors="pt")["image_grid_thw"].prod()) // 4


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_not_run_blocks_say_why(page):
    skipped = [b for b in _blocks("python", page) if "not run" in b.splitlines()[0]]
    assert all(re.match(r"# not run: \w+.{20,}", b.splitlines()[0]) for b in skipped), _name(page)


def test_the_readme_opens_with_the_real_checkpoint_then_runs_it_offline():
    """The first block is the real-checkpoint path (Preprocessor(processor=AutoProcessor...) -> plan -> dataset
    -> trainer); the first runnable one is the same path on the offline stand-ins; the README stays short."""
    first = _blocks("python")[0]
    assert first.startswith("# not run:")
    steps = ["Preprocessor(processor=AutoProcessor.from_pretrained(", "build_plan(", "PackedMapDataset(", "Trainer("]
    assert [first.index(s) for s in steps] == sorted(first.index(s) for s in steps)
    offline = _runnable()[0]
    assert all(s.replace("AutoProcessor.from_pretrained(", "") in offline for s in steps)
    assert len(_runnable()) >= 4 and len(README.read_text().splitlines()) < 300
    text = README.read_text()
    assert "make test" in text and "make demo" in text  # .ci/run and the set-up rely on them
    for page in DOCS.glob("*.md"):  # every reference page is linked from the README
        assert f"(docs/{page.name})" in text, page.name


def _run_page(page: Path, folder: Path) -> tuple[list[dict], list[str]]:
    """Every runnable block of ``page``, in order, in one namespace, with ``folder`` as the working directory."""
    import os

    assert not any(folder.iterdir())
    ns: dict = {"__name__": "__readme__"}
    after, outputs = [], []  # the namespace and the printed text after each block (later blocks reuse names)
    old = os.getcwd()
    os.chdir(folder)
    try:
        for block in _runnable(page):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                exec(compile(block, _name(page), "exec"), ns)
            after.append(dict(ns))
            outputs.append(buf.getvalue())
    finally:
        os.chdir(old)
    return after, outputs


@pytest.fixture(scope="module")
def page_runs(tmp_path_factory):
    """``run(name)``: the page's blocks run once per test module, each page in its own empty folder."""
    done: dict[str, tuple] = {}

    def run(name: str) -> tuple[list[dict], list[str], Path]:
        if name not in done:
            folder = tmp_path_factory.mktemp(name.replace("/", "_").replace(".", "_"))
            done[name] = (*_run_page(ROOT / name, folder), folder)
        return done[name]

    return run


@pytest.fixture(scope="module")
def readme_run(page_runs):
    return page_runs("README.md")


@pytest.fixture(scope="module")
def data_run(page_runs):
    return page_runs("docs/data.md")


@pytest.fixture(scope="module")
def parallel_run(page_runs):
    return page_runs("docs/parallel.md")


@pytest.mark.slow
@pytest.mark.parametrize("page", [_page_param(p) for p in PAGES if _runnable(p)])
def test_every_page_runs_as_pasted(page, page_runs):
    for module in _needs(page):
        pytest.importorskip(module)
    if page.name == "video.md":
        _skip_without_video_support()
    after, outputs, _ = page_runs(_name(page))
    assert len(after) == len(outputs) == len(_runnable(page))


@pytest.mark.slow
def test_the_offline_path_trains_on_packs_of_every_row(readme_run):
    """README's first runnable block: the plan covers each of the 16 rows once, no pack over capacity (lengths:
    the processed samples of the next block), and the HF Trainer ran its step on the packs."""
    after, outputs, _ = readme_run
    ns, lengths = after[0], after[1]["lengths"]
    ds, result = ns["ds"], ns["result"]
    packs = [[int(r) for r in ds.rows_of(ds.bin_of(i)[2])] for i in range(len(ds))]
    assert sorted(r for p in packs for r in p) == list(range(len(ns["records"]))) == list(range(16))
    assert all(sum(lengths[r] for r in p) <= 4096 for p in packs)
    assert result.global_step == 1 and math.isfinite(result.training_loss)
    assert outputs[0].splitlines()[-1].split() == [str(len(ds)), "16", "1"]  # after the Trainer's own log


@pytest.mark.slow
def test_api_tour(readme_run):
    from PIL import ImageOps

    import vlm_pack as vp

    after, outputs, _ = readme_run
    ns = after[1]
    records, samples, lengths, proc = ns["records"], ns["samples"], ns["lengths"], ns["proc"]
    tok = proc.tokenizer
    # Each sample's image placeholders are what the HF processor's grids say (4 patches per token).
    for record, sample in zip(records, samples):
        images = [ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB") for data, _ in record["images"]]
        want = 0
        if images:
            grids = proc.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
            want = int(grids.prod(-1).sum()) // 4
        assert int((sample["input_ids"] == tok.image_token_id).sum()) == want, record["key"]
    assert any(len(r["images"]) > 1 for r in records) and any(not r["images"] for r in records)
    assert outputs[1].splitlines()[0] == "True"  # the forecast equals the processed lengths
    first = vp.pack(lengths, capacity=4096).bins[0]
    batch = ns["batch"]
    assert batch.input_ids.shape == (1, 4096)
    assert batch.cu_seqlens.diff().tolist() == [lengths[i] for i in first]
    assert ns["report"].passed and "PASS" in outputs[1]


@pytest.mark.slow
def test_what_a_batch_carries(readme_run):
    after, outputs, _ = readme_run
    ns = after[2]
    batch, inputs = ns["batch"], ns["inputs"]
    assert {"input_ids", "cu_seq_lens_q", "pixel_values", "image_grid_thw"} <= set(inputs)
    assert inputs["input_ids"].shape == (1, 4096) and inputs["cu_seq_lens_q"][-1] == 4096
    assert outputs[2].splitlines()[1] == str(batch.cu_seqlens.tolist())
    assert batch.sample_index.tolist() == list(range(len(batch.seq_lens)))


@pytest.mark.slow
def test_token_mixers_block_isolates_the_delta_net(readme_run):
    """The mixers block: Qwen3.5's gated delta-net runs per sample, and the packed row equals each sample run
    alone through the model (check_packed_equivalence's oracle)."""
    after, outputs, _ = readme_run
    ns = after[3]
    lines = outputs[3].splitlines()
    assert "gated_delta_net" in lines[0] and "per_sample" in lines[0] and lines[-1] == "True"
    assert len(ns["few"]) == 3 and sum(len(r["images"]) for r in ns["records"][:3]) >= 1


@pytest.mark.slow
def test_streaming_resumes_exactly_once(data_run):
    after, outputs, folder = data_run
    ns = after[1]
    from vlm_pack.demo import demo_records

    written = sorted(r["key"] for r in demo_records(40))
    assert sorted(ns["seen"]) == written  # every sample of the shards, none twice, across the resume
    assert len(sorted((folder / "shards").glob("*.tar"))) == 3
    stats = ns["resumed"].stats
    assert (stats.samples_read, stats.samples_packed, stats.samples_bad) == (40, 40, 0)
    assert outputs[1].splitlines()[0] == "40 40"


@pytest.mark.slow
def test_what_a_streamed_batch_carries(data_run):
    after, outputs, _ = data_run
    ns = after[2]
    batch, inputs, info = ns["batch"], ns["inputs"], ns["info"]
    assert {"input_ids", "cu_seq_lens_q", "pixel_values", "image_grid_thw"} <= set(inputs)
    assert inputs["input_ids"].shape == (1, 4096) and inputs["cu_seq_lens_q"][-1] == 4096
    # The keys name real samples of the shards, one per packed sample, and the stream info agrees.
    keys = batch.metadata["__key__"]
    assert len(keys) == len(batch.seq_lens) == len(set(keys)) and set(keys) <= set(after[1]["seen"])
    assert sorted(key for _, key in info["samples"]) == sorted(keys)
    assert all(url.startswith("shards/") and url.endswith(".tar") for url, _ in info["samples"])
    assert info["epoch"] == 0 and outputs[2].splitlines()[1] == str(keys)


@pytest.mark.slow
def test_megatron_remap_matches_a_hand_count(parallel_run):
    after, outputs, _ = parallel_run
    ns = after[0]
    batch, params, llava = ns["batch"], ns["params"], ns["llava"]
    image_id = llava.tokenizer.image_token_id
    # Expanded offset of a collapsed offset: add (tokens - 1) for every image placeholder before it.
    placeholders = (batch.input_ids[0] == image_id).nonzero().flatten().tolist()
    extra = (batch.tokens_per_image - 1).tolist()
    hand = [c + sum(e for p, e in zip(placeholders, extra) if p < c) for c in batch.cu_seqlens_padded.tolist()]
    assert len(placeholders) == len(extra) >= 3
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == hand
    # tokens per image: what the HF LLaVA-NeXT processor expands each image into.
    for record in ns["records"][:3]:
        for data, _ in record["images"]:
            im = Image.open(io.BytesIO(data))
            out = llava(images=[im.convert("RGB")], text="<image>", return_tensors="pt")["input_ids"][0]
            assert int((out == image_id).sum()) in batch.tokens_per_image.tolist()
    assert outputs[0].splitlines()[-1] == "True"


@pytest.mark.slow
def test_balancing_blocks_print_what_they_say(parallel_run):
    _, outputs, _ = parallel_run
    assert outputs[1].split() == ["True"]
    assert outputs[2].splitlines() == ["True", "[True, True, True, False]"]


@pytest.mark.slow
def test_map_style_dataset_covers_every_row_once(data_run):
    """The map-style block: rank 0's packs plus rank 1's (from the same cached plan) hold every row once."""
    after, outputs, folder = data_run
    ns = after[3]
    ds, hf, batch = ns["ds"], ns["hf"], ns["batch"]
    other = type(ds)(hf, ds.preprocessor, ns["config"], world_size=2,
                     rank=1, cache=str(folder / "plans"), num_proc=1)
    assert other.from_cache  # the plan was forecast once, by the page's block
    rows = [int(r) for d in (ds, other) for i in range(len(d)) for r in d.rows_of(d.bin_of(i)[2])]
    assert sorted(rows) == list(range(len(hf))) == list(range(24))
    assert abs(len(ds) - len(other)) <= 1 and outputs[3].split() == [str(len(ds)), "1"]
    # The pack the loader gave is one of rank 0's, and its samples are real rows of the dataset.
    assert batch.input_ids.shape[0] == 1 and len(batch.seq_lens) >= 1


def test_token_counts_quoted_in_the_readme_are_the_hf_processors():
    """1920x1080: Qwen2-VL 2691, Qwen3-VL 2040, LLaVA-NeXT 1948, as the HF processors expand a real image."""
    import transformers

    from vlm_pack.offline import build_tokenizer

    text = README.read_text()
    image = Image.new("RGB", (1920, 1080), (90, 140, 200))
    quoted = re.search(r"1920x1080 photo is (\d+) tokens for Qwen2-VL,\s+(\d+) for Qwen3-VL, (\d+) for LLaVA-NeXT", text)
    assert quoted, "the README's 1920x1080 sentence moved"
    qwen2, qwen3, llava_next = map(int, quoted.groups())
    # Qwen/Qwen2-VL-7B-Instruct and Qwen/Qwen3-VL preprocessor_config.json
    assert _hf_qwen_tokens(image, 14, 3136, 12845056) == qwen2
    assert _hf_qwen_tokens(image, 16, 65536, 16777216) == qwen3
    # llava-hf/llava-v1.6-mistral-7b-hf preprocessor_config.json + processor_config.json
    ip = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336}, do_center_crop=True, do_pad=True,
        image_grid_pinpoints=[[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    )  # fmt: skip
    tok = build_tokenizer("llava_next")
    proc = transformers.LlavaNextProcessor(
        image_processor=ip, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, image_token="<image>",
    )  # fmt: skip
    ids = proc(images=[image], text="<image>", return_tensors="pt")["input_ids"][0]
    assert int((ids == tok.convert_tokens_to_ids("<image>")).sum()) == llava_next


def _image_file(path: Path, size: tuple[int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (200, 80, 40)).save(path)


def test_data_format_examples_are_accepted(tmp_path, capsys, write_tar):
    from vlm_pack.cli.main import main

    (record,) = _blocks("json", DOCS / "data.md")
    shard = tmp_path / "shard.tar"
    buf = io.BytesIO()
    Image.new("RGB", (640, 480), (1, 2, 3)).save(buf, format="JPEG")
    write_tar(shard, [("k1.json", record.encode()), ("k1.jpg", buf.getvalue())])
    manifests = _blocks("jsonl", DOCS / "data.md")
    assert len(manifests) == 3  # own JSONL, ShareGPT-style, LLaVA
    sources, want_samples, want_images = [str(shard)], 1, 1
    for i, block in enumerate(manifests):
        lines = [json.loads(line) for line in block.splitlines() if line.strip()]
        manifest = tmp_path / f"m{i}" / "data.jsonl"
        for line in lines:
            paths = line.get("images", line.get("image", []))
            for path in [paths] if isinstance(paths, str) else paths:
                _image_file(manifest.parent / path, (640, 480))
        manifest.write_text(block)
        sources.append(str(manifest))
        want_samples += len(lines)
        want_images += sum(len(p) if isinstance(p, list) else 1 for p in (x.get("images", x.get("image", [])) for x in lines))
    for source in sources:  # each on its own: the manifests' image folders differ
        code = main(["analyze", source, "--out", str(tmp_path / "r"), "--no-plots", "--json", "--verify"])
        out = capsys.readouterr().out
        assert code == 0, source
        report = json.loads(out)
        assert report["dataset"]["invalid"] == []
        want_samples -= report["dataset"]["samples"]
        want_images -= report["dataset"]["images"]
        # Each 640x480 image is what the HF Qwen2-VL processor makes of it (the default family).
        per_image = _hf_qwen_tokens(Image.new("RGB", (640, 480)), 14, 3136, 12845056)
        assert report["dataset"]["vision_tokens"] == per_image * report["dataset"]["images"]
    assert want_samples == 0 and want_images == 0


@pytest.mark.slow
def test_plans_block_loads_the_saved_plan_and_refuses_another_capacity(data_run):
    """The Plans block: the saved folder is the plan it built (rank 1 mapped), and another capacity is named."""
    import numpy as np

    after, outputs, folder = data_run
    ns = after[4]
    plan, mine, rank1 = ns["plan"], ns["mine"], ns["rank1"]
    assert isinstance(mine.rows, np.memmap) and mine.rank == 1 and (folder / "train.plan" / "plan.json").is_file()
    rows = [int(r) for i in range(len(rank1)) for r in rank1.rows_of(rank1.bin_of(i)[2])]
    assert sorted(rows) == sorted(int(r) for b in plan.rank_bins_of(1) for r in plan.rows_of(int(b)))
    assert outputs[4].strip() == "stale: packing.capacity changed"


@pytest.mark.slow
@pytest.mark.torchvision
def test_the_video_page_forecasts_what_processing_and_decoding_give(page_runs):
    """docs/video.md: the header's frames and size are what PyAV decodes, the stream packed every sample at
    its header forecast, and the LLaVA-Video row's forecast is the length processing the clip gives."""
    av = pytest.importorskip("av")
    pytest.importorskip("torchvision")
    _skip_without_video_support()
    after, outputs, _ = page_runs("docs/video.md")
    ns = after[0]
    with av.open(io.BytesIO(ns["clip"])) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    assert outputs[0].splitlines()[0].split()[:4] == [str(len(frames)), "6.0", *map(str, frames[0].shape[1::-1])]
    assert outputs[0].splitlines()[-1] == "0" and sorted(ns["batch"].metadata["__key__"]) == ["caption", "clip", "mixed"]
    pre, row = after[1]["pre"], after[1]["rows"][0]
    conversation = [{"role": "user", "content": "<video>\nWhat moves?"}, {"role": "assistant", "content": "A square."}]
    processed = pre.process([], conversation, videos=[ns["clip"]])
    assert outputs[1].split() == [f"[{int(processed['input_ids'].shape[0])}]", f"[{int(processed['tokens_per_video'].sum())}]"]
    assert row["video"] == "clip.mp4"
