"""The failure policy end to end: bad data is counted and skipped, a bug raises naming its sample, and a
systematic failure (no good sample, too many bad ones in a row) stops the epoch instead of emptying it.

Through the paths a user takes: a ``PackedDataLoader`` epoch over tar shards written here, and a
``PackedMapDataset`` over a ``datasets.Dataset``; real images (Pillow), real offline tokenizer and image
processor.
"""

from __future__ import annotations

import io
import warnings

import datasets
import pytest
import torch
from PIL import Image

from vlm_pack.config import PackingConfig
from vlm_pack.data import PackedDataLoader, PackedWebDataset, write_shards
from vlm_pack.data.map_style import PackedMapDataset, PackedSampler, plan_info
from vlm_pack.data.stats import BadSampleWarning
from vlm_pack.failures import FailureBudgetError, InternalCheckError, SampleCodeError
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.preprocessor import Preprocessor
from vlm_pack.vision import vision_spec_from_processor

CAPACITY = 512


@pytest.fixture(scope="module")
def qwen():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


def _png(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 30 + seed).convert("RGB").save(buf, format="PNG")
    return buf.getvalue()


def _truncated(seed: int) -> bytes:
    """A PNG whose header reads (the forecast plans it) but whose pixels do not decode."""
    data = _png(seed)
    return data[: len(data) // 2]


_GARBAGE = b"\x89PNG\r\n\x1a\n-not-a-png"  # a header that does not read


def _record(key: str, image: bytes | None, text: str = "a noisy square") -> dict:
    images = [] if image is None else [(image, "png")]
    return {"key": key, "images": images, "caption": text}


def _shards(tmp_path, records: list[dict], maxcount: int = 1000) -> list[str]:
    return write_shards(records, tmp_path / "shards", maxcount=maxcount)


def _stream(urls, qwen, template=None, **knobs) -> PackedWebDataset:
    tok, ip = qwen
    return PackedWebDataset(urls, Preprocessor(tok, ip, template=template), **{"capacity": CAPACITY, **knobs})


def _epoch(ds: PackedWebDataset, num_workers: int = 0) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        warnings.simplefilter("ignore", UserWarning)  # DataLoader: more workers than cores
        return list(PackedDataLoader(ds, num_workers=num_workers))


def _keys(batches) -> list[str]:
    return sorted(k for b in batches for k in b.metadata["__key__"])


# -- (a) an error of code in a template callable raises, naming the sample ---------------------------


@pytest.mark.parametrize("error", [AttributeError, TypeError, NameError])
def test_stream_template_callable_that_raises_is_raised_with_the_sample_named(tmp_path, qwen, error):
    def template(conversation, num_images):
        raise error("the template's own bug")

    urls = _shards(tmp_path, [_record(f"s{i}", _png(i)) for i in range(4)])
    ds = _stream(urls, qwen, template=template)
    with pytest.raises(SampleCodeError, match=r"key 's0' in .*shard-000000\.tar") as caught:
        _epoch(ds)
    assert isinstance(caught.value.__cause__, error)  # chained: the traceback shows the template's line
    assert f"{error.__name__}: the template's own bug" in str(caught.value)


def test_stream_template_bug_crosses_the_dataloader_worker_with_the_sample_named(tmp_path, qwen):
    def template(conversation, num_images):
        return conversation.lower()  # a caption is a str; a conversation has no .lower(): AttributeError

    records = [_record("cap", _png(0))]
    records.append(
        {"key": "chat", "images": [(_png(1), "png")], "conversation": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what?"}]},
            {"role": "assistant", "content": "noise"},
        ]}
    )  # fmt: skip
    ds = _stream(_shards(tmp_path, records), qwen, template=lambda c, n: [(str(template(c, n)), True)])
    with pytest.raises(SampleCodeError, match=r"key 'chat' in .*shard-000000\.tar.*AttributeError"):
        _epoch(ds, num_workers=1)


def test_stream_an_image_processor_bug_is_raised_and_its_refusals_counted(tmp_path, qwen):
    tok, ip = qwen

    class Buggy(type(ip)):  # a subclass: processed sample by sample, each failure named
        def __call__(self, *args, **kwargs):
            raise AttributeError("the processor's own bug")

    class Refusing(type(ip)):
        def __call__(self, *args, **kwargs):
            raise ValueError("this processor refuses every image")

    urls = _shards(tmp_path, [_record(f"s{i}", _png(i)) for i in range(3)])
    for cls in (Buggy, Refusing):
        cls.__name__ = type(ip).__name__  # read as the processor it extends
        processor = type(ip).from_dict(ip.to_dict())
        processor.__class__ = cls
        # a subclass that rewrites __call__ gets no record's rule by resemblance: the spec is given
        pre = Preprocessor(tok, processor, spec=vision_spec_from_processor(ip))
        ds = PackedWebDataset(urls, pre, capacity=CAPACITY)
        if cls is Buggy:
            with pytest.raises(SampleCodeError, match=r"shard .*shard-000000\.tar, sample 's0'.*AttributeError"):
                _epoch(ds)
        else:
            with pytest.raises(FailureBudgetError, match=r"decode_error \(3 of 3\).*refuses every image"):
                _epoch(ds)


@pytest.fixture(scope="module")
def splitting_tokenizer():
    """A tokenizer that splits special tokens in text (``split_special_tokens=True``, an HF option), so a
    rendered ``<|image_pad|>`` is no longer one token: vlm-pack's own check in processing refuses it."""
    tok = build_tokenizer("qwen2_vl")
    tok.split_special_tokens = True
    return tok


def test_stream_a_check_of_vlm_packs_own_processing_raises_naming_the_sample(tmp_path, qwen, splitting_tokenizer):
    """A ValueError of vlm-pack's own processing is an error of code: SampleCodeError naming the sample at once,
    not a decode_error counted on every sample until a failure budget trips."""
    urls = _shards(tmp_path, [_record(f"s{i}", _png(i)) for i in range(3)])
    ds = PackedWebDataset(urls, Preprocessor(splitting_tokenizer, qwen[1]), capacity=CAPACITY)
    # the one forecast checks the placeholders too: the stream's forecast stage (naming the record by its key
    # and shard) raises before processing would
    with pytest.raises(SampleCodeError, match=r"'s0'.*InternalCheckError: sample 's0': 1 image\(s\) became 0 image "
                       r"token\(s\) '<\|image_pad\|>'") as caught:
        _epoch(ds)
    causes = [caught.value]
    while causes[-1].__cause__ is not None:
        causes.append(causes[-1].__cause__)
    assert isinstance(causes[-1], InternalCheckError)  # raised from vlm-pack's own check
    assert isinstance(causes[-1], ValueError)  # `except ValueError` still catches the check


@pytest.mark.slow
def test_stream_a_turn_whose_content_is_no_text_is_bad_data_not_a_bug(tmp_path, qwen):
    turns = [{"role": "user", "content": 5}, {"role": "assistant", "content": "five"}]
    records = [_record("a", _png(0)), {"key": "odd", "conversation": turns}, _record("b", _png(1))]
    ds = _stream(_shards(tmp_path, records), qwen)
    assert _keys(_epoch(ds)) == ["a", "b"]
    assert ds.stats.reasons == {"bad_text": 1} and "'content' must be a string or a list" in ds.stats.bad[0].detail


_JINJA = (
    "{%- for m in messages -%}<|im_start|>{{ m['role'] }}\n"
    "{%- for p in m['content'] -%}"
    "{%- if p['type'] == 'image' -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- else -%}{%- if 'REFUSE' in p['text'] -%}{{ raise_exception('this sample is refused') }}{%- endif -%}"
    "{%- if 'BUG' in p['text'] -%}{{ p['text'] + 1 }}{%- endif -%}{{ p['text'] }}{%- endif -%}"
    "{%- endfor -%}<|im_end|>\n{%- endfor -%}"
)


def test_stream_template_refusals_are_bad_data_and_template_bugs_raise(tmp_path, qwen):
    """A Jinja template's raise_exception() refuses its sample (bad_text); a Python error in it is code."""
    records = [_record(f"s{i}", _png(i)) for i in range(3)]
    records.insert(1, _record("refused", _png(7), "REFUSE this one"))
    ds = _stream(_shards(tmp_path, records), qwen, template=_JINJA)
    batches = _epoch(ds)
    assert _keys(batches) == ["s0", "s1", "s2"]
    assert ds.stats.reasons == {"bad_text": 1} and ds.stats.bad[0].key == "refused"
    assert "this sample is refused" in ds.stats.bad[0].detail

    records.insert(2, _record("buggy", _png(8), "BUG here"))  # 'BUG here' + 1: a TypeError in the template
    ds = _stream(_shards(tmp_path / "b", records), qwen, template=_JINJA)
    with pytest.raises(SampleCodeError, match=r"key 'buggy'.*TypeError"):
        _epoch(ds)


def test_stream_a_callable_that_refuses_a_sample_with_value_error_skips_it(tmp_path, qwen):
    def template(conversation, num_images):
        if "refuse" in conversation:
            raise ValueError("captions saying 'refuse' are not trained on")
        return [("<|vision_start|><image><|vision_end|>" * num_images, False), (conversation, True)]

    records = [_record("a", _png(0)), _record("b", _png(1), "refuse"), _record("c", _png(2))]
    ds = _stream(_shards(tmp_path, records), qwen, template=template)
    assert _keys(_epoch(ds)) == ["a", "c"]
    assert ds.stats.reasons == {"bad_text": 1}


# -- (b) an epoch with no good sample raises, with the reason and the samples -------------------------


def test_stream_all_images_corrupt_raises_instead_of_an_empty_epoch(tmp_path, qwen):
    # header fine, pixels cut: the forecast plans every sample, processing fails every one
    records = [_record(f"cut{i}", _truncated(i)) for i in range(4)]
    records += [_record(f"bad{i}", _GARBAGE) for i in range(2)]  # headers that do not read
    urls = _shards(tmp_path, records, maxcount=3)  # two shards, one per worker
    for workers in (0, 2):
        ds = _stream(urls, qwen)
        with pytest.raises(FailureBudgetError, match="no sample was good") as caught:
            _epoch(ds, num_workers=workers)
        message = str(caught.value)
        assert "most common reason: decode_error (4 of 6)" in message, message
        assert "key 'cut0'" in message and "image file is truncated" in message
        assert "corrupt_image (2)" in message and "key 'bad0'" in message
        assert ds.stats.samples_packed == 0 and ds.stats.reasons == {"decode_error": 4, "corrupt_image": 2}


# -- (c) some corrupt images among good ones: skipped, counted with the reason, the epoch completes -------


def test_stream_some_corrupt_images_are_counted_and_the_rest_packed(tmp_path, qwen):
    records = [_record(f"s{i}", _png(i)) for i in range(8)]
    records[2] = _record("cut", _truncated(2))
    records[5] = _record("garbage", _GARBAGE)
    ds = _stream(_shards(tmp_path, records, maxcount=4), qwen)
    with pytest.warns(BadSampleWarning) as caught:
        batches = list(PackedDataLoader(ds))
    assert _keys(batches) == ["s0", "s1", "s3", "s4", "s6", "s7"]
    stats = ds.stats
    assert stats.reasons == {"decode_error": 1, "corrupt_image": 1}
    assert stats.samples_bad == 2 and stats.samples_packed == 6 and stats.samples_read == 8
    assert {(bad.key, bad.reason) for bad in stats.bad} == {("cut", "decode_error"), ("garbage", "corrupt_image")}
    assert any("key 'cut'" in str(w.message) and "decode_error" in str(w.message) for w in caught)


# -- (d) a failure budget: more bad samples in a row than the limit raise --------------------------------


@pytest.mark.slow
def test_stream_more_consecutive_bad_samples_than_the_limit_raise(tmp_path, qwen):
    good = [_record(f"g{i}", None, f"caption {i}") for i in range(3)]
    records = [_record(f"bad{i:03d}", _GARBAGE) for i in range(101)] + good
    urls = _shards(tmp_path / "101", records)
    share = {"max_bad_fraction": None}  # the run alone (97% bad: the share would stop it first, tests/test_bad_share.py)
    with pytest.raises(FailureBudgetError, match=r"101 bad samples in a row.*max_consecutive_failures=100") as err:
        _epoch(_stream(urls, qwen, **share))  # default limit: 100
    assert "corrupt_image (101)" in str(err.value) and "key 'bad000'" in str(err.value)

    ds = _stream(urls, qwen, max_consecutive_failures=101, **share)  # the limit is a knob
    assert _keys(_epoch(ds)) == ["g0", "g1", "g2"] and ds.stats.reasons == {"corrupt_image": 101}
    ds = _stream(_shards(tmp_path / "100", records[1:]), qwen, **share)  # 100 in a row: within the default
    assert _keys(_epoch(ds)) == ["g0", "g1", "g2"] and ds.stats.reasons == {"corrupt_image": 100}
    ds = _stream(urls, qwen, config=PackingConfig(capacity=CAPACITY, max_consecutive_failures=None, **share))
    assert _keys(_epoch(ds)) == ["g0", "g1", "g2"]


def test_stream_failure_budget_counts_samples_that_fail_after_the_forecast(tmp_path, qwen):
    # every truncated image passes the header-only forecast; processing then fails 4 in a row
    records = [_record(f"cut{i}", _truncated(i)) for i in range(4)] + [_record("g", None, "fine")]
    urls = _shards(tmp_path, records)
    with pytest.raises(FailureBudgetError, match=r"4 bad samples in a row.*=3.*decode_error \(4\)"):
        _epoch(_stream(urls, qwen, max_consecutive_failures=3))
    ds = _stream(urls, qwen, max_consecutive_failures=4)
    assert _keys(_epoch(ds)) == ["g"] and ds.stats.reasons == {"decode_error": 4}


def test_max_consecutive_failures_is_validated_in_the_config():
    assert PackingConfig(capacity=8).max_consecutive_failures == 100
    assert PackingConfig(capacity=8, max_consecutive_failures=None).max_consecutive_failures is None
    for bad in (0, -1, 2.5, True, "100"):
        with pytest.raises(ValueError, match="max_consecutive_failures must be a positive integer or None"):
            PackingConfig(capacity=8, max_consecutive_failures=bad)


# -- the same through PackedMapDataset ------------------------------------------------------------------


def _messages(text: str, images: int) -> list[dict]:
    user = [{"type": "image", "text": None}] * images + [{"type": "text", "text": text}]
    return [{"role": "user", "content": user}, {"role": "assistant", "content": [{"type": "text", "text": "ok"}]}]


def _dataset(images: list[bytes | None], texts: list[str] | None = None) -> datasets.Dataset:
    texts = texts or [f"question {i}" for i in range(len(images))]
    columns = {
        "images": [[] if im is None else [im] for im in images],
        "messages": [_messages(t, im is not None) for t, im in zip(texts, images)],
    }
    ds = datasets.Dataset.from_dict(columns)
    return ds.cast_column("images", datasets.List(datasets.Image(decode=False)))


def _map(dataset, qwen, template=None, **kwargs) -> PackedMapDataset:
    tok, ip = qwen
    config = kwargs.pop("config", PackingConfig(capacity=CAPACITY))
    return PackedMapDataset(dataset, Preprocessor(tok, ip, template=template), config, cache=None, **kwargs)


def _map_epoch(ds: PackedMapDataset) -> list:
    loader = torch.utils.data.DataLoader(ds, batch_size=None, sampler=PackedSampler(ds))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BadSampleWarning)
        return list(loader)


@pytest.mark.parametrize("error", [AttributeError, TypeError])
def test_map_template_callable_that_raises_is_raised_with_the_sample_named(qwen, error):
    def template(conversation, num_images):
        raise error("the template's own bug")

    data = _dataset([_png(i) for i in range(3)])
    with pytest.raises(SampleCodeError, match=r"dataset\[0\].*the template's own bug") as caught:
        _map(data, qwen, template=template)
    assert isinstance(caught.value.__cause__, error)


def test_map_all_images_corrupt_raises_with_the_reason_and_the_samples(qwen):
    with pytest.raises(FailureBudgetError, match="no sample was good") as caught:
        _map(_dataset([_GARBAGE] * 3), qwen)  # no header reads: nothing to plan
    assert "corrupt_image (3)" in str(caught.value) and "dataset[0]" in str(caught.value)

    packed = _map(_dataset([_truncated(i) for i in range(3)]), qwen)  # headers read: planned, pixels fail
    with pytest.raises(FailureBudgetError, match=r"no sample was good.*decode_error \(3\)") as caught:
        _map_epoch(packed)
    assert "dataset row 0" in str(caught.value) and "image file is truncated" in str(caught.value)


def test_map_some_corrupt_images_are_left_out_with_the_reason_and_the_rest_trained(qwen):
    images = [_png(i) for i in range(6)]
    images[1], images[4] = _truncated(1), _GARBAGE
    packed = _map(_dataset(images), qwen)
    batches = _map_epoch(packed)
    rows = sorted(r for b in batches for r in plan_info(b)["rows"])
    left_out = [tuple(x) for b in batches for x in plan_info(b)["left_out"]]
    assert rows == [0, 2, 3, 5]
    assert left_out == [(1, "decode_error")]  # the one the plan had: its pixels failed
    # the unreadable header, left out of the plan, then the row whose pixels failed at load: both reported
    assert [(key, reason) for key, _, reason in packed.skipped][1:] == [("1", "decode_error")]
    assert packed.skipped[0][0] == "4"


def test_map_more_consecutive_bad_records_than_the_limit_raise(qwen):
    data = _dataset([_GARBAGE] * 101 + [None, None], texts=[f"q {i}" for i in range(103)])
    with pytest.raises(FailureBudgetError, match=r"101 bad samples in a row.*max_consecutive_failures=100"):
        _map(data, qwen, max_bad_fraction=None)  # the run alone: 98% bad, the share would stop it first
    packed = _map(data, qwen, config=PackingConfig(capacity=CAPACITY, max_consecutive_failures=101,
                                                   max_bad_fraction=None))
    assert len(packed.skipped) == 101 and packed.num_samples == 2

    # loading: the good (longest) sample first, then 2 truncated ones in a row: over a limit of 1
    images = [None, _truncated(1), _truncated(2)]
    texts = ["a long question " * 8, "q", "q"]
    strict = _map(_dataset(images, texts), qwen, config=PackingConfig(capacity=CAPACITY, max_consecutive_failures=1))
    with pytest.raises(FailureBudgetError, match=r"2 bad samples in a row.*decode_error \(2\)"):
        _map_epoch(strict)
    lenient = _map(_dataset(images, texts), qwen, config=PackingConfig(capacity=CAPACITY, max_consecutive_failures=2))
    assert [r for b in _map_epoch(lenient) for r in plan_info(b)["rows"]] == [0]


# -- one failure loop: the guarded stage every pipeline uses ------------------------------------------------


def test_a_guarded_stage_skips_data_raises_code_and_spends_its_budget():
    """``FailurePolicy`` declared once per run, a ``Guard`` per stage: a data error is reported and skipped
    (a ``Skip``), an error of code raises ``SampleCodeError`` naming the sample, a run of bad samples longer
    than the limit raises ``FailureBudgetError``, a good sample resets the run; ``on_error="raise"`` raises the
    data error naming the sample, its class kept (an undecodable image is still an ``OSError``)."""
    from vlm_pack.failures import FailurePolicy, ImageDecodeError, SampleError, Skip, forecast_mismatch

    reported = []
    guard = FailurePolicy("run", "skip", 2, reported.append).stage("processing", "decode_error")

    def fails(exc):
        raise exc

    out = guard.call(fails, ValueError("the processor refuses it"), sample="row 3", key="3")
    assert isinstance(out, Skip) and out.reason == "decode_error" and "row 3" in out.example
    assert [(f.reason, f.sample, f.key) for f in reported] == [("decode_error", "row 3", "3")]
    assert guard.call(lambda: 7, sample="row 4") == 7
    guard.good()  # the run of bad samples ends
    with pytest.raises(SampleCodeError, match=r"row 5: AttributeError: a bug") as caught:
        guard.call(fails, AttributeError("a bug"), sample="row 5", key="5")
    assert caught.value.key == "5"
    guard.bad(forecast_mismatch(10, 12, "row 6"), "row 6")
    guard.call(fails, ImageDecodeError("decode_error", "truncated"), sample="row 7")
    with pytest.raises(FailureBudgetError, match=r"run, processing: 3 bad samples in a row.*forecast_mismatch"):
        guard.call(fails, ValueError("again"), sample="row 8")
    assert [f.reason for f in reported] == ["decode_error", "forecast_mismatch", "decode_error", "decode_error"]

    strict = FailurePolicy("run", "raise", None).stage("processing", "decode_error")
    with pytest.raises(OSError, match=r"bad sample: decode_error: row 9: truncated") as caught:
        strict.call(fails, ImageDecodeError("decode_error", "truncated"), sample="row 9")
    assert isinstance(caught.value, ImageDecodeError) and caught.value.reason == "decode_error"
    with pytest.raises(SampleError, match=r"forecast 10 != processed length 12 for row 10"):
        strict.bad(forecast_mismatch(10, 12, "row 10"), "row 10")
