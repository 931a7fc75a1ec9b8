"""Megatron-Energon: header forecasts, best-fit packs, PackedBatch samples, exactly-once save/restore."""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.energon", reason="needs the [energon] extra")

from megatron.energon import WorkerConfig, get_savable_loader
from megatron.energon.errors import FatalSampleError, reraise_exception

from vlm_pack import PackingConfig, Preprocessor, pad_multiple_for
from vlm_pack.data import stream_tar_samples, write_shards
from vlm_pack.demo import demo_records
from vlm_pack.integrations.energon import FatalPackingError, VLMPackingTaskEncoder, packed_train_dataset
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.processing import process_sample

NUM = 16
CAPACITY = 2048
# Text-only samples at the padding edge: 30 + 33 + 36 = 99 tokens fit a pack of 100, but padded to multiples of
# 4 (pad_multiple_for(cp=2)) they are 32 + 36 + 36 = 104 and do not; 130 is longer than the pack on its own.
EDGE_CAPACITY = 100
EDGE_LENGTHS = [30, 33, 36, 130] * 3


def energon_prepare(path: Path) -> None:
    # the `energon` command of this interpreter's environment, run by it (an overlay venv has no script of its own)
    energon = "import sys; from megatron.energon.cli.main import main; sys.argv[0] = 'energon'; sys.exit(main())"
    cmd = [sys.executable, "-c", energon, "prepare", str(path), "--non-interactive", "--split-ratio", "1,0,0",
           "--sample-type", "CrudeWebdataset"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("energon")
    records = demo_records(NUM)
    write_shards(records, str(path / "part-%05d.tar"), maxcount=4)
    energon_prepare(path)
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size={"shortest_edge": 3136, "longest_edge": 50176})
    return path, tok, ip, {r["key"]: r for r in records}


def _encoder(setup, capacity=CAPACITY, layout="expanded", **kw):
    _, tok, ip, _ = setup
    return VLMPackingTaskEncoder(Preprocessor(tok, ip, family="qwen2_vl", layout=layout), capacity, **kw)


def _loader(setup, rank, world, workers, encoder=None, repeat=False):
    wc = WorkerConfig(rank=rank, world_size=world, num_workers=workers, global_error_handler=reraise_exception)
    # A buffer smaller than a worker's share (16 samples / 2 ranks / 2 workers): with repeat=True a larger one
    # would hold the same sample twice.
    ds = packed_train_dataset(str(setup[0]), encoder or _encoder(setup), worker_config=wc, packing_buffer_size=3,
                              repeat=repeat)
    return get_savable_loader(ds, watchdog_timeout_seconds=None)


def _take(loader, n, what=lambda pack: pack.keys):
    """``what`` (the keys) of the next ``n`` packs; then stop the loader's worker processes now (an abandoned persistent
    iterator is otherwise shut down by a later garbage collection, stalling whatever runs then)."""
    keys = [what(p) for p in itertools.islice(loader, n)]
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None:
        iterator._shutdown_workers()
    return keys


@pytest.mark.slow
def test_packs_hold_the_processed_samples_within_capacity(setup):
    _, tok, ip, records = setup
    packs = list(_loader(setup, 0, 1, 0))
    keys = [k for p in packs for k in p.keys]
    assert sorted(keys) == sorted(records)
    for p in packs[:3]:
        batch = p.batch
        assert batch.num_rows == 1 and batch.row_length == CAPACITY and batch.num_real_tokens <= CAPACITY
        # Oracle: the real processor on the same record, outside Energon.
        want = [len(process_sample([d for d, _ in records[k]["images"]], records[k]["conversation"],
                                   tokenizer=tok, image_processor=ip)["input_ids"]) for k in p.keys]
        assert batch.seq_lens.tolist() == want
        assert batch.position_ids.shape == (4, 1, CAPACITY)  # Qwen mRoPE rows
    assert sum(len(p.keys) for p in packs) / len(packs) > 1.4  # packing, not one sample per item


@pytest.mark.parametrize(("workers", "multiple"), [(0, 1), (2, 1), (1, pad_multiple_for(cp=2))])
@pytest.mark.slow
def test_one_epoch_over_two_ranks_gives_every_sample_once(setup, workers, multiple):
    packs = [p for rank in range(2) for p in _loader(setup, rank, 2, workers, _encoder(setup, pad_to_multiple_of=multiple))]
    keys = [k for p in packs for k in p.keys]
    assert sorted(keys) == sorted(setup[3]) and all(p.left_out == [] for p in packs)
    assert all(p.batch.num_rows == 1 and p.batch.metadata["__key__"] == p.keys for p in packs)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_restart_mid_epoch_resumes_the_same_packs(setup, workers):
    """Saved after 2 packs and restored in a new loader, each rank yields exactly the packs (hence samples) of
    the uninterrupted run: none repeated, none lost."""
    for rank in range(2):
        full = _take(_loader(setup, rank, 2, workers, repeat=True), 5)
        loader = _loader(setup, rank, 2, workers, repeat=True)
        head = [p.keys for p in itertools.islice(loader, 2)]
        state = loader.save_state_rank()
        _take(loader, 0)
        restored = _loader(setup, rank, 2, workers, repeat=True)
        restored.restore_state_rank(state)
        tail = _take(restored, 3)
        assert head + tail == full, f"rank {rank}, {workers} workers: the restart changed the packs"


@pytest.mark.slow
def test_oversized_samples_are_reported_not_lost(setup, caplog):
    encoder = _encoder(setup, capacity=512, oversized="skip")
    with caplog.at_level(logging.WARNING, logger="vlm_pack.integrations.energon"):
        packed = [k for p in _loader(setup, 0, 1, 0, encoder) for k in p.keys]
    left = [key for key, _ in encoder.left_out]
    assert left and sorted(packed + left) == sorted(setup[3])
    assert all(f"left out sample {key!r}" in caplog.text for key in left)
    assert all(reason.endswith("> capacity 512") for _, reason in encoder.left_out)


@pytest.mark.slow
def test_oversized_raise_names_the_sample(setup):
    """oversized="raise" is the default here as everywhere; "truncate" is refused (no sample is ever cut)."""
    with pytest.raises(ValueError, match=r"sample 'demo-\d+': \d+ tokens > capacity 512.*oversized='skip'"):
        list(_loader(setup, 0, 1, 0, _encoder(setup, capacity=512)))
    with pytest.raises(ValueError, match="VLMPackingTaskEncoder cannot do oversized='truncate'"):
        _encoder(setup, capacity=512, oversized="truncate")
    with pytest.raises(ValueError, match=r"oversized must be one of .*got 'report'"):
        _encoder(setup, capacity=512, oversized="report")


@pytest.mark.slow
def test_collapsed_layout_gives_megatron_packed_seq_params(setup):
    encoder = _encoder(setup, layout="collapsed", pad_to_multiple_of=4)
    pack = next(iter(_loader(setup, 0, 1, 0, encoder)))
    batch = pack.batch
    params = batch.model_inputs("megatron")["packed_seq_params"]
    assert batch.layout == "collapsed" and params.qkv_format == "thd"
    # Expanded boundaries: each sample's real length is its processed (expanded) length.
    assert params.cu_seqlens_q.diff().tolist() == batch.seq_lens_expanded.tolist()
    assert (params.cu_seqlens_q_padded.diff() % 4 == 0).all()
    assert batch.input_ids.shape[1] < CAPACITY  # one placeholder per image


@pytest.mark.slow
def test_a_processor_of_any_family_packs_every_sample_at_its_processed_length(setup):
    """InternVL through its processor (released template, <img>...</img> around each image's tiles): the
    cooker's header forecasts are the processed lengths, so every sample is packed and none is refused."""
    from vlm_pack.offline import processor as make_processor

    template = (Path(__file__).parent / "templates" / "internvl.jinja").read_text()
    proc = make_processor("internvl", build_tokenizer("internvl"), chat_template=template, max_patches=2)
    encoder = VLMPackingTaskEncoder(Preprocessor(processor=proc), 8192)
    packs = list(_loader(setup, 0, 1, 0, encoder))
    assert sorted(k for p in packs for k in p.keys) == sorted(setup[3]) and encoder.left_out == []
    records = setup[3]
    for p in packs[:2]:
        want = [len(process_sample([d for d, _ in records[k]["images"]], records[k]["conversation"],
                                   processor=proc)["input_ids"]) for k in p.keys]
        assert p.batch.seq_lens.tolist() == want


def _text_conversation(pre: Preprocessor, tokens: int) -> list[dict]:
    """A text-only conversation that is exactly ``tokens`` tokens long once rendered (searched, not assumed)."""
    for n in range(tokens):
        conv = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": [{"type": "text", "text": " ".join(["a"] * n)}]}]
        if pre.forecast(conv, [])[0] == tokens:
            return conv
    raise AssertionError(f"no text of {tokens} tokens")


@pytest.fixture(scope="module")
def edge(tmp_path_factory, setup):
    """An Energon dataset of text-only samples of ``EDGE_LENGTHS`` tokens, 4 per shard."""
    path = tmp_path_factory.mktemp("energon-edge")
    pre = Preprocessor(setup[1], setup[2], family="qwen2_vl")
    records = [{"key": f"edge-{i:03d}", "images": [], "conversation": _text_conversation(pre, n)}
               for i, n in enumerate(EDGE_LENGTHS)]
    write_shards(records, str(path / "part-%05d.tar"), maxcount=4)
    energon_prepare(path)
    return path, {r["key"]: n for r, n in zip(records, EDGE_LENGTHS)}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.slow
def test_padded_packs_keep_every_sample_and_report_the_left_out_ones_on_the_packs(setup, edge, workers):
    """pad_to_multiple_of=pad_multiple_for(cp=2): every sample is in exactly one pack (each one row, its keys in
    batch.metadata in packed order) or, longer than capacity, in the ``left_out`` of a pack, which reaches the main
    process also from worker processes."""
    path, lengths = edge
    encoder = _encoder(setup, capacity=EDGE_CAPACITY, pad_to_multiple_of=pad_multiple_for(cp=2), oversized="skip")
    wc = WorkerConfig(rank=0, world_size=1, num_workers=workers, global_error_handler=reraise_exception)
    loader = get_savable_loader(packed_train_dataset(str(path), encoder, worker_config=wc, packing_buffer_size=16,
                                                     repeat=False), watchdog_timeout_seconds=None)
    packs = list(loader)
    packed = [k for p in packs for k in p.keys]
    left = [key for p in packs for key, _ in p.left_out]
    assert sorted(packed + left) == sorted(lengths), "a sample was lost or repeated"
    assert sorted(left) == sorted(k for k, n in lengths.items() if n > EDGE_CAPACITY)
    assert all(reason == "too_long: 130 tokens (padded to 132) > capacity 100" for p in packs for _, reason in p.left_out)
    for p in packs:
        batch = p.batch
        assert batch.num_rows == 1 and batch.row_length == EDGE_CAPACITY
        assert batch.metadata["__key__"] == batch.sample_keys == p.keys
        assert batch.seq_lens.tolist() == [lengths[k] for k in p.keys]
        assert (batch.cu_seqlens_padded.diff() % 4 == 0).all(), batch.cu_seqlens_padded
    if workers == 0:  # the encoder's own list is the packing process's: here the main process
        assert sorted(k for k, _ in encoder.left_out) == sorted(left)


@pytest.mark.slow
def test_three_samples_that_fit_only_unpadded_make_two_packs(setup, tmp_path):
    """The issue's repro: 30, 33 and 36 tokens, capacity 100, pad_to_multiple_of=4, no worker."""
    pre = Preprocessor(setup[1], setup[2], family="qwen2_vl")
    records = [{"key": f"t{n}", "images": [], "conversation": _text_conversation(pre, n)} for n in (30, 33, 36)]
    write_shards(records, str(tmp_path / "part-%05d.tar"))
    energon_prepare(tmp_path)
    encoder = _encoder(setup, capacity=EDGE_CAPACITY, pad_to_multiple_of=4)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)  # Energon's default handler: logs and skips a failure
    packs = list(get_savable_loader(packed_train_dataset(str(tmp_path), encoder, worker_config=wc,
                                                         packing_buffer_size=8, repeat=False),
                                    watchdog_timeout_seconds=None))
    assert sorted(k for p in packs for k in p.keys) == ["t30", "t33", "t36"] and len(packs) == 2
    assert encoder.left_out == [] and all(p.left_out == [] for p in packs)


def _truncated_image_record(key: str) -> dict:
    """A small PNG cut in half: its header reads (the cooker forecasts it), its pixels do not decode."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, format="PNG")
    data = buf.getvalue()
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]}]
    return {"key": key, "images": [(data[: len(data) // 2], "png")], "conversation": conv}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, setup):
    """An Energon dataset of 16 samples in 4 shards: 12 good text samples of 30, 33, 36 tokens, two of 130
    (longer than ``EDGE_CAPACITY``), one whose image does not decode and one whose image header does not read,
    the bad ones spread over the shards."""
    path = tmp_path_factory.mktemp("energon-mixed")
    pre = Preprocessor(setup[1], setup[2], family="qwen2_vl")
    records = [{"key": f"good-{i:02d}", "images": [], "conversation": _text_conversation(pre, n)}
               for i, n in enumerate([30, 33, 36] * 4)]
    for at, n in ((1, 130), (9, 130)):
        records.insert(at, {"key": f"long-{at:02d}", "images": [], "conversation": _text_conversation(pre, n)})
    records.insert(6, _truncated_image_record("undecodable"))
    unreadable = _truncated_image_record("unreadable")
    unreadable["images"] = [(b"\x89PNG\r\n\x1a\n-not-a-png", "png")]  # no header: the cooker's forecast fails
    records.insert(13, unreadable)
    write_shards(records, str(path / "part-%05d.tar"), maxcount=4)
    energon_prepare(path)
    return path, sorted(r["key"] for r in records if r["key"].startswith("good"))


def _mixed_loader(path, encoder, rank, repeat=False, buffer=8):
    """A savable loader of rank ``rank`` of 2, 2 workers, Energon's default error handler (log and drop)."""
    wc = WorkerConfig(rank=rank, world_size=2, num_workers=2)
    ds = packed_train_dataset(str(path), encoder, worker_config=wc, packing_buffer_size=buffer, repeat=repeat)
    return get_savable_loader(ds, watchdog_timeout_seconds=None)


@pytest.mark.slow
def test_default_oversized_stops_the_run_through_energons_default_handler(setup, mixed):
    """The README's encoder (default oversized="raise", padded for cp=2), 2 ranks x 2 workers, Energon's default
    ``global_error_handler`` (which logs and drops what a hook raises): the run stops, naming the sample."""
    with pytest.raises(FatalSampleError, match=r"sample 'long-\d\d': 130 tokens \(padded to 132\) > capacity 100; "
                       r"raise capacity or use oversized='skip'"):
        for rank in range(2):
            encoder = _encoder(setup, capacity=EDGE_CAPACITY, pad_to_multiple_of=pad_multiple_for(cp=2))
            list(_mixed_loader(mixed[0], encoder, rank))
    assert issubclass(FatalPackingError, FatalSampleError)


@pytest.mark.slow
def test_skip_keeps_every_good_sample_once_through_energons_default_handler(setup, mixed):
    """oversized="skip", 2 ranks x 2 workers, Energon's default handler: the two long samples and the two with a
    bad image are left out, each reported once on a pack with its reason, and every good sample arrives exactly
    once (on main a decode error dropped its whole pack, good samples included)."""
    packs = [p for rank in range(2) for p in _mixed_loader(
        mixed[0], _encoder(setup, capacity=EDGE_CAPACITY, pad_to_multiple_of=4, oversized="skip"), rank)]
    assert sorted(k for p in packs for k in p.keys) == mixed[1]
    left = dict(item for p in packs for item in p.left_out)
    assert sorted(left) == ["long-01", "long-09", "undecodable", "unreadable"]
    assert sum(len(p.left_out) for p in packs) == 4
    assert left["long-01"] == "too_long: 130 tokens (padded to 132) > capacity 100"
    assert left["undecodable"].startswith("decode_error: sample 'undecodable', image 0 does not decode")
    assert left["unreadable"].startswith("corrupt_image: ")


@pytest.mark.slow
def test_an_error_of_code_stops_the_run_through_energons_default_handler(setup):
    """A check of vlm-pack's own processing that fails (a tokenizer that splits the image placeholder): every
    sample would fail it, so the packer stops the run naming the sample, whatever Energon's handler."""
    tok = build_tokenizer("qwen2_vl")
    tok.split_special_tokens = True
    encoder = VLMPackingTaskEncoder(Preprocessor(tok, setup[2], family="qwen2_vl"), CAPACITY)
    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)  # Energon's default handler: logs and drops
    loader = get_savable_loader(packed_train_dataset(str(setup[0]), encoder, worker_config=wc, repeat=False),
                                watchdog_timeout_seconds=None)
    with pytest.raises(FatalSampleError, match=r"sample 'demo-\d+': InternalCheckError: .*image token"):
        next(iter(loader))


@pytest.mark.slow
def test_skip_restored_mid_epoch_gives_the_same_packs_and_reports(setup, mixed):
    """Saved after one pack of each worker and restored in a new loader (2 workers, default handler), each rank
    yields the packs and left-out reports of the uninterrupted run, across the bad samples.

    Saved only once both workers have yielded: Energon 7.4.1 answers a save that reaches a worker before its first
    sample (its command thread can take the lock first) with "the initial state, skip 1", which drops that worker's
    first pack on restore (seen once in CI under load); a training job saves many steps in, past that window."""
    def loader(rank):  # a buffer smaller than a worker's share (4): with repeat=True a larger one repeats samples
        encoder = _encoder(setup, capacity=EDGE_CAPACITY, pad_to_multiple_of=4, oversized="skip")
        return _mixed_loader(mixed[0], encoder, rank, repeat=True, buffer=3)

    def both(pack):
        return pack.keys, pack.left_out

    reports = set()
    for rank in range(2):
        full = _take(loader(rank), 4, both)
        first = loader(rank)
        head = [both(p) for p in itertools.islice(first, 2)]
        state = first.save_state_rank()
        _take(first, 0)
        restored = loader(rank)
        restored.restore_state_rank(state)
        tail = _take(restored, 2, both)
        assert head + tail == full, f"rank {rank}: the restart changed the packs or reports"
        reports.update(key for _, left_out in tail for key, _ in left_out)
    assert reports == {"long-01", "unreadable"}  # the restored packs cross a too-long and an unreadable sample


def test_the_old_argument_order_still_builds_the_same_encoder_with_a_deprecation_warning(setup):
    """(capacity, preprocessor), the order before 0.9, warns naming the new one; capacity= as a keyword is a
    PackingConfig knob like every dataset's, so it does not warn."""
    import warnings

    pre = Preprocessor(setup[1], setup[2], family="qwen2_vl")
    with pytest.warns(DeprecationWarning, match=r"VLMPackingTaskEncoder\(preprocessor, PackingConfig\(capacity=\.\.\.\)\)"):
        old = VLMPackingTaskEncoder(EDGE_CAPACITY, pre, oversized="skip", pad_to_multiple_of=4)
    new = VLMPackingTaskEncoder(pre, PackingConfig(capacity=EDGE_CAPACITY, oversized="skip", pad_to_multiple_of=4))
    assert old.config == new.config and (old.capacity, old.pad_to_multiple_of, old.oversized) == (100, 4, "skip")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert VLMPackingTaskEncoder(capacity=EDGE_CAPACITY, preprocessor=pre).config.capacity == EDGE_CAPACITY
    with pytest.raises(ValueError, match=r"no vision budget \(vision_capacity=4\)"):
        VLMPackingTaskEncoder(pre, EDGE_CAPACITY, vision_capacity=4)


def _crude(record: dict, tmp_path: Path) -> dict:
    """``record`` as Energon's CrudeWebdataset hands it to the cooker: the raw fields of its shard."""
    write_shards([record], str(tmp_path / "one-%05d.tar"), maxcount=1)
    return next(iter(stream_tar_samples(str(tmp_path / "one-00000.tar"))))


def test_the_cooker_runs_bad_data_through_the_one_failure_policy(setup, tmp_path):
    """A sample whose image header does not read: counted under its reason by the forecast stage's budget and
    carried to a pack's report (on_error="skip"); on_error="raise" and a spent budget stop the run naming it, as a
    FatalSampleError (Energon's handler re-raises it)."""
    bad = _truncated_image_record("unreadable")
    bad["images"] = [(b"\x89PNG\r\n\x1a\n-not-a-png", "png")]
    crude = _crude(bad, tmp_path)
    pre = Preprocessor(setup[1], setup[2], family="qwen2_vl")
    encoder = VLMPackingTaskEncoder(pre, CAPACITY)
    cooked = encoder.cook_sample(crude)
    assert cooked.failure.startswith("corrupt_image: ") and "unreadable" in cooked.failure
    assert encoder.forecasting.budget.counts == {"corrupt_image": 1}
    with pytest.raises(FatalPackingError, match=r"bad sample: corrupt_image: sample 'unreadable'"):
        VLMPackingTaskEncoder(pre, CAPACITY, on_error="raise").cook_sample(crude)
    budget = VLMPackingTaskEncoder(pre, CAPACITY, max_consecutive_failures=1)
    budget.cook_sample(crude)
    with pytest.raises(FatalPackingError, match=r"2 bad samples in a row, more than .*max_consecutive_failures=1"):
        budget.cook_sample(crude)


@pytest.mark.slow
def test_on_error_raise_stops_the_run_through_energons_default_handler(setup, mixed):
    """on_error="raise" (2 ranks x 2 workers, Energon's default handler, which logs and drops what a hook raises):
    the first bad sample stops the run, named with its reason."""
    with pytest.raises(FatalSampleError, match=r"bad sample: (too_long|decode_error|corrupt_image): "
                       r"sample '(long-\d\d|undecodable|unreadable)'"):
        for rank in range(2):
            encoder = _encoder(setup, capacity=EDGE_CAPACITY, pad_to_multiple_of=4, oversized="skip", on_error="raise")
            list(_mixed_loader(mixed[0], encoder, rank))
