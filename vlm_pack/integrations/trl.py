"""TRL ``SFTTrainer`` on packed VLM rows: the configuration, a dataset TRL accepts, a collator, the token count.

TRL 1.16 refuses ``packing=True`` and ``padding_free=True`` for vision datasets, but trains on packed rows when
it is set up by hand. Four pieces do that::

    a datasets.Dataset, parquet, --packed_dataset--> datasets.Dataset, a row per pack (plan: PackedMapDataset's
    JSON / JSONL (LLaVA), shards                     {"keys", "conversations",      over header forecasts, no
    (anything forecast_sources reads)                 "image_bytes", "video_bytes", decode; read by row)
                                                      "lengths"}
                                                     (streaming=True: an IterableDataset; .left_out: samples
                                                      left out, with their reasons)
        --TRLPackingCollator--> input_ids, labels [R, T]; position_ids [4, R, T] (Qwen mRoPE) or [R, T];
                                pixel_values, image_grid_thw, mm_token_type_ids; NO attention_mask
                                (transformers then masks per sample from the position restarts; Gemma 3
                                gets its packed mask mapping {"full_attention", "sliding_attention"})
        --PackedSFTTrainer(args=packed_sft_config(...))--> TRL's own loss, entropy, mean_token_accuracy

- **config** (:func:`packed_sft_config`, checked by :func:`check_sft_config`): ``remove_unused_columns=False``
  (else only ``input_ids``/``labels``/``seq_lengths`` reach the collator), ``dataset_kwargs={"skip_prepare_dataset":
  True}`` (else TRL tokenizes and truncates), ``max_length=None``, ``packing=False`` and ``padding_free=False``
  (TRL's own packing refuses a custom collator and vision data).
- **loss, entropy, token accuracy**: TRL shifts labels inside each row; every packed sample's first label is
  -100, so no token is scored against the next sample's first token and all three are exact per token.
- **token mixers** (Qwen3.5's gated delta-net, LFM2's short convolutions): :class:`PackedSFTTrainer` calls
  ``vp.isolate_token_mixers`` on its model, so they run per sample (``vlm_pack.forward.mixers``).
- **num_tokens**: TRL logs ``position_ids.size(1)`` when there is no ``attention_mask``: for ``[4, R, T]`` mRoPE
  ids that is ``R`` (rows), for ``[R, T]`` ids ``T`` (padding included). The collator adds the real (expanded,
  unpadded) token count as ``num_real_tokens``; :class:`PackedSFTTrainer` pops it before the forward and replaces
  TRL's increment of ``num_tokens`` with it (gathered over processes like TRL's own count). The logged value is
  then the count a padded run logs from its ``attention_mask``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import datasets
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("vlm_pack.integrations.trl needs TRL and datasets: pip install 'vlm-pack[trl]'") from exc

import numpy as np
import torch

from .._compat import dataset_fingerprint, set_sft_train_tokens, sft_train_tokens
from ..collate.labels import IGNORE_INDEX
from ..collate.padded import pad_samples
from ..config import PackingConfig
from ..data import BadSampleWarning, PackedMapDataset, Plan, Sample, SampleError, normalise_record
from ..data.job import SampleJob
from ..data.sources import chunk_samples, chunks, open_sources
from ..forward.mixers import isolate_token_mixers
from ..preprocessor import Preprocessor

__all__ = [
    "NUM_TOKENS_KEY",
    "PackedSFTTrainer",
    "TRLPackingCollator",
    "check_sft_config",
    "packed_dataset",
    "packed_sft_config",
]

#: The batch key carrying the real token count of a packed micro-batch (popped by PackedSFTTrainer).
NUM_TOKENS_KEY = "num_real_tokens"

# What the packed path needs from SFTConfig: name -> (required value, why).
_REQUIRED = {
    "remove_unused_columns": (False, "otherwise TRL drops every column but input_ids/labels/seq_lengths"),
    "packing": (False, "TRL's packing refuses vision data and a custom collator; the rows are packed already"),
    "padding_free": (False, "TRL's padding-free mode refuses vision data and a custom collator"),
    "max_length": (None, "with dataset preparation skipped TRL truncates nothing; packs respect capacity"),
}

_FEATURES = datasets.Features(
    {
        "keys": datasets.List(datasets.Value("string")),
        "conversations": datasets.List(datasets.Value("string")),
        "image_bytes": datasets.List(datasets.List(datasets.Value("binary"))),
        "video_bytes": datasets.List(datasets.List(datasets.Value("binary"))),
        "lengths": datasets.List(datasets.Value("int64")),
    }
)


def check_sft_config(args: Any) -> None:
    """Raise ``ValueError`` listing every ``SFTConfig`` setting that breaks training on packed VLM rows."""
    problems = [
        f"{name}={getattr(args, name)!r} (set {name}={value!r}: {why})"
        for name, (value, why) in _REQUIRED.items()
        if getattr(args, name, value) != value
    ]
    kwargs = args.dataset_kwargs or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if not kwargs.get("skip_prepare_dataset", False):
        problems.append(
            'dataset_kwargs lacks skip_prepare_dataset=True (set dataset_kwargs={"skip_prepare_dataset": True}: '
            "rows are plans of raw samples that the collator processes; TRL must not tokenize them)"
        )
    if problems:
        raise ValueError(
            "SFTConfig is not set up for packed VLM rows; use vlm_pack.integrations.trl.packed_sft_config(...) "
            "or fix: " + "; ".join(problems)
        )


def packed_sft_config(output_dir: str, **kwargs: Any) -> SFTConfig:
    """An ``SFTConfig`` with the settings packed VLM rows need; other ``SFTConfig`` arguments pass through.

    A conflicting value (e.g. ``packing=True``) raises ``ValueError`` naming it, rather than being overridden.
    """
    dataset_kwargs = {"skip_prepare_dataset": True, **(kwargs.pop("dataset_kwargs", None) or {})}
    for name, (value, _) in _REQUIRED.items():
        kwargs.setdefault(name, value)
    args = SFTConfig(output_dir=output_dir, dataset_kwargs=dataset_kwargs, **kwargs)
    check_sft_config(args)
    return args


# ---------------------------------------------------------------------------------------------- dataset

_ROWS_FORMAT = 3  # in the fingerprints of the Arrow files below: bump when what a row holds changes
# PackedMapDataset warns about the samples its plan leaves out only when it builds the plan (not when it reads
# it from its cache); packed_dataset reports them itself, every time, with those the reading left out.
_PLAN_WARNING = r"vlm-pack: \d+ sample\(s\) left out of the plan"
_IMAGE_COLUMN = "{}.png"  # a name the WebDataset record format reads as image {}; the bytes keep their own format
_VIDEO_COLUMN = "{}.mp4"  # ... and as video {}: PyAV reads the container from the bytes, whatever the name


def packed_dataset(
    sources: Any,
    preprocessor: Preprocessor,
    config: PackingConfig | None = None,
    *,
    streaming: bool = False,
    cache_dir: str | None = None,
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    num_proc: int = 1,
    plan: Plan | str | os.PathLike[str] | None = None,
    **knobs: Any,
) -> datasets.Dataset | datasets.IterableDataset:
    """A ``datasets.Dataset`` (``streaming=True``: ``IterableDataset``) of packs of ``sources``, one row each.

    ``sources`` is anything :func:`vlm_pack.data.forecast_sources` reads: a ``datasets.Dataset`` (or a
    ``save_to_disk`` folder, or an ``IterableDataset``), parquet files, JSON (LLaVA-Instruct, ShareGPT) or
    JSONL files, WebDataset shards, folders or globs of them, or a list mixing these; records in any format of
    ``vlm_pack.data.RECORD_FORMATS`` (``record_format=`` forces one; ``image_root`` resolves relative image
    paths).

    ``config`` (a :class:`~vlm_pack.PackingConfig`) and keywords over it (``capacity=``, ``oversized=``,
    ``pad_to_multiple_of=``, ``shuffle_seed=``, ``on_error=``, ``max_samples_per_bin=`` ...: its settings, with
    its defaults) say how to plan, as for :class:`~vlm_pack.PackedMapDataset`. A plan never cuts a sample:
    ``oversized="truncate"`` is refused.

    The plan is :class:`vlm_pack.PackedMapDataset`'s, over a ``datasets.Dataset``: given one, that dataset;
    otherwise the records copied once into one (Arrow, in ``cache_dir``: each record's conversation and
    its images' bytes, reused while the files are unchanged; an ``IterableDataset`` is copied on every call,
    having nothing to tell an unchanged stream by). Every sample's expanded length is forecast from
    its image headers by ``preprocessor`` (give the same one to :class:`TRLPackingCollator`, so that plan and
    rows agree; no decode), the samples are packed into bins of ``capacity`` tokens (each sample counted
    padded to ``pad_to_multiple_of``, as the collator lays it out), and ``shuffle_seed`` shuffles the order
    of the bins (``None``, the default, keeps the plan's order: the Trainer's sampler shuffles the rows of a
    ``Dataset``; give ``streaming=True`` a seed, or it sees a length curriculum). The plan is cached in
    ``cache_dir/vlm_pack_plans`` (default: vlm-pack's plan cache). ``plan=`` (a :class:`vlm_pack.data.Plan` or
    the folder ``Plan.save`` / ``vlm-pack plan`` wrote for the same dataset, parts and settings) is used as it
    is, without forecasting; one made with another template, processor or capacity is refused, naming what
    changed.

    Each bin becomes one row ``{"keys", "conversations" (JSON), "image_bytes", "video_bytes", "lengths"}``,
    samples in data order, read row by row from the dataset (images and videos undecoded, videos forecast from
    their container headers; :class:`TRLPackingCollator` decodes them).

    Samples left out are reported, never dropped silently: under ``on_error="skip"`` (default) a record that
    cannot be read or forecast (a corrupt image, a record in no format) and, with ``oversized="skip"``, a
    sample longer than ``capacity`` are listed as ``(key, where, reason)`` in the returned dataset's
    ``left_out`` attribute, with one warning naming the first. ``oversized="raise"`` (default) stops at the
    first sample longer than ``capacity``, ``on_error="raise"`` at the first record that cannot be read.
    """
    Preprocessor.refuse_parts("packed_dataset", knobs)
    config = PackingConfig.resolve("packed_dataset", config, refuse=("truncate",), **knobs)
    pre = Preprocessor.check(preprocessor)
    if pre.layout != "expanded":
        raise ValueError(
            f"packed_dataset plans rows for Hugging Face models: give a Preprocessor with layout='expanded', "
            f"not {pre.layout!r}"
        )
    table, left_out, row_format, root = _as_dataset(sources, record_format, image_root, cache_dir)
    if left_out and config.on_error == "raise":
        raise SampleError("bad_text", f"{left_out[0][2]} (on_error='skip' leaves such records out, listed)")
    plan = _plan(table, pre, config, row_format, root, cache_dir, num_proc, plan)
    left_out += _where_read(table, [tuple(s) for s in plan.skipped])
    if left_out:
        key, where, reason = left_out[0]
        warnings.warn(
            f"packed_dataset: {len(left_out)} sample(s) left out (listed in the dataset's left_out), the "
            f"first {key!r} ({where}): {reason}",
            BadSampleWarning,
            stacklevel=2,
        )
    ds = _rows_dataset(table, plan, row_format, root, cache_dir)
    out = ds.to_iterable_dataset() if streaming else ds
    out.left_out = left_out
    return out


def _bins_in_order(plan: PackedMapDataset) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The dataset rows and forecast lengths of every pack of ``plan``, packs in the order of its epoch 0
    (shuffled by its seed), samples in data order inside each."""
    bins, lengths = [], []
    for b in plan.bins_in_order().tolist():  # the epoch's order computed once: O(1) per pack
        rows, forecast = plan.rows_of(b), plan.lengths_of(b)
        order = np.argsort(rows, kind="stable")
        bins.append(tuple(rows[order].tolist()))
        lengths.append(tuple(forecast[order].tolist()))
    return bins, lengths


def _rows_dataset(
    table: datasets.Dataset,
    plan: PackedMapDataset,
    record_format: str | None,
    root: Path | None,
    cache_dir: str | None,
) -> datasets.Dataset:
    """One row per pack of ``plan`` (:func:`pack_rows`), cached under a digest of what the rows hold."""
    bins, lengths = _bins_in_order(plan)
    digest = hashlib.sha256(
        json.dumps([_ROWS_FORMAT, dataset_fingerprint(table), plan.plan_digest, record_format, str(root)]).encode()
    )
    digest.update(json.dumps([bins, lengths]).encode())
    return datasets.Dataset.from_generator(
        pack_rows,
        gen_kwargs={
            # tuples: datasets reads lists in gen_kwargs as data shards to split between jobs
            "dataset": table,
            "bins": tuple(bins),
            "lengths": tuple(lengths),
            "record_format": record_format,
            "image_root": None if root is None else str(root),
        },
        features=_FEATURES,
        cache_dir=cache_dir,
        fingerprint=digest.hexdigest()[:32],
    )


def _as_dataset(
    sources: Any, record_format: str | None, image_root: str | os.PathLike[str] | None, cache_dir: str | None
) -> tuple[datasets.Dataset, list[tuple[str, str, str]], str | None, Path | None]:
    """``sources`` as one ``datasets.Dataset``: ``(dataset, records left out, record format, image root)``.

    One ``datasets.Dataset`` is used as it is. Other sources are copied into one, in the WebDataset record format
    (``__key__``, ``json`` holding the normalised conversation, image ``i`` in column ``"{i}.png"``, video
    ``i`` in ``"{i}.mp4"``, None past a record's last one), so that the conversation reaches the chat template exactly as read; a
    record that cannot be read is kept out of it and returned as ``(key, where, reason)``.
    """
    opened = open_sources(sources, image_root=image_root)
    if len(opened) == 1 and opened[0].kind == "dataset":
        return opened[0].ref, [], record_format, opened[0].image_root
    (most, most_videos), fingerprint = _survey(opened, record_format)
    names = tuple(_IMAGE_COLUMN.format(i) for i in range(most))
    video_names = tuple(_VIDEO_COLUMN.format(i) for i in range(most_videos))
    string, binary = datasets.Value("string"), datasets.Value("binary")
    columns = {"__key__": string, "__where__": string, "__error__": string, "json": binary}
    features = datasets.Features({**columns, **dict.fromkeys(names + video_names, binary)})
    table = datasets.Dataset.from_generator(
        copied_records,
        gen_kwargs={
            "sources": tuple(opened), "record_format": record_format, "names": names, "video_names": video_names
        },
        features=features,
        cache_dir=cache_dir,
        fingerprint=fingerprint,
    )
    errors = table.data.column("__error__").is_valid().to_numpy(zero_copy_only=False)
    if not errors.any():
        return table, [], None, None
    bad = table.select(np.flatnonzero(errors)).select_columns(["__key__", "__where__", "__error__"])
    left_out = [(r["__key__"], r["__where__"], r["__error__"]) for r in bad.to_list()]
    return table.select(np.flatnonzero(~errors)), left_out, None, None


def _where_read(table: datasets.Dataset, skipped: list[Any]) -> list[tuple[str, str, str]]:
    """``(key, where, reason)`` of samples the plan left out, ``where`` the record's file (a shard, a JSON
    file's record) rather than its row in the copy, when ``table`` is a copy."""
    if not skipped or "__where__" not in table.column_names:
        return skipped
    import pyarrow as pa
    import pyarrow.compute as pc

    keys, wheres = table.data.column("__key__"), table.data.column("__where__")
    found = pc.is_in(keys, value_set=pa.array(sorted({key for key, _, _ in skipped})))
    where_of = dict(zip(keys.filter(found).to_pylist(), wheres.filter(found).to_pylist()))
    return [(key, where_of.get(key, where), reason) for key, where, reason in skipped]


def _samples(
    opened: Sequence[Any], record_format: str | None
) -> Iterator[tuple[str, str, Sample | SampleError]]:
    for chunk in chunks(opened):
        yield from chunk_samples(opened, chunk, record_format=record_format)


def _survey(opened: Sequence[Any], record_format: str | None) -> tuple[tuple[int, int], str]:
    """The most images and the most videos one record of ``opened`` has, and a fingerprint of what the copy
    is made from (the files' sizes and times, a dataset's fingerprint, every image and video file's; unique
    for an IterableDataset)."""
    from .._version import __version__

    stamp = hashlib.sha256(json.dumps([_ROWS_FORMAT, __version__, record_format]).encode())
    for src in opened:
        if src.kind == "iterable":
            stamp.update(uuid.uuid4().bytes)  # nothing to tell an unchanged stream by: copied every time
        elif src.kind == "dataset":
            stamp.update(dataset_fingerprint(src.ref).encode())
        else:
            stat = os.stat(src.name)
            stamp.update(f"{src.kind}:{src.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    most = most_videos = 0
    for _, _, sample in _samples(opened, record_format):
        if isinstance(sample, Sample):
            most, most_videos = max(most, len(sample.images)), max(most_videos, len(sample.videos))
            for item in (*sample.images, *sample.videos):
                if isinstance(item, str):  # a file a JSON record names: changing it changes the copy
                    stat = os.stat(item)
                    stamp.update(f"{item}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return (most, most_videos), stamp.hexdigest()[:32]


def copied_records(
    sources: Sequence[Any], record_format: str | None, names: Sequence[str], video_names: Sequence[str] = ()
) -> Iterator[dict[str, Any]]:
    """The rows :func:`_as_dataset` copies ``sources`` into (module level, for ``datasets``' generator)."""
    for where, key, sample in _samples(list(sources), record_format):
        row: dict[str, Any] = {"__key__": key, "__where__": where, "__error__": None, "json": None}
        row.update(dict.fromkeys((*names, *video_names)))
        if isinstance(sample, SampleError):
            row["__error__"] = str(sample)
            yield row
            continue
        conversation = sample.conversation
        payload = {"caption": conversation} if isinstance(conversation, str) else {"messages": conversation}
        row["__key__"], row["json"] = sample.key, json.dumps(payload, ensure_ascii=False).encode("utf-8")
        try:
            row.update(zip(names, (_image_bytes(image) for image in sample.images)))
            row.update(zip(video_names, (_image_bytes(video) for video in sample.videos)))
        except OSError as e:
            row["__error__"] = f"{sample.label}: an image or a video could not be read ({e})"
        yield row


def _image_bytes(image: Any) -> bytes:
    """One image or video of a ``vlm_pack.data.Sample`` (bytes, a path, a binary file, a PIL image) as bytes."""
    if isinstance(image, bytes):
        return image
    if isinstance(image, str):
        return Path(image).read_bytes()
    if hasattr(image, "read"):
        return image.read()
    buf = io.BytesIO()  # a decoded PIL image: PNG keeps its pixels exactly
    image.save(buf, format="PNG")
    return buf.getvalue()


def _plan(
    table: datasets.Dataset,
    pre: Preprocessor,
    config: PackingConfig,
    record_format: str | None,
    image_root: Path | None,
    cache_dir: str | None,
    num_proc: int,
    given: Plan | str | os.PathLike[str] | None = None,
) -> PackedMapDataset:
    """The map-style dataset's plan of ``table``: ``given``, else its forecast, bins and plan cache."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_PLAN_WARNING)
        plan = PackedMapDataset(
            table,
            pre,
            config,
            record_format=record_format,
            image_root=image_root,
            cache=True if cache_dir is None else Path(cache_dir) / "vlm_pack_plans",
            num_proc=num_proc,
            plan=given,
            # Only the plan is used: TRLPackingCollator collates the rows, with the model's config. Gemma 3's
            # collator wants a sliding window up front: one as long as a row stands in for the model's here.
            collator_kwargs={"sliding_window": config.capacity},
        )
    return plan


def pack_rows(
    dataset: datasets.Dataset,
    bins: Sequence[Sequence[int]],
    lengths: Sequence[Sequence[int]],
    record_format: str | None,
    image_root: str | None,
) -> Iterator[dict[str, Any]]:
    """The rows of :func:`packed_dataset`, one per bin of ``dataset`` rows, each record read by its row
    (module level, for ``datasets``' generator)."""
    arrow = dataset.with_format("arrow")  # image bytes stay encoded
    for rows, bin_lengths in zip(bins, lengths):
        samples = []
        for row in rows:
            (record,) = arrow[row : row + 1].to_pylist()
            where = f"dataset[{row}]"
            sample = normalise_record(
                record, record_format=record_format, key=str(row), where=where, image_root=image_root
            )
            samples.append(sample)
        yield {
            "keys": [s.key for s in samples],
            "conversations": [json.dumps(s.conversation, ensure_ascii=False) for s in samples],
            "image_bytes": [[_image_bytes(image) for image in s.images] for s in samples],
            "video_bytes": [[_image_bytes(video) for video in s.videos] for s in samples],
            "lengths": list(bin_lengths),
        }


# ---------------------------------------------------------------------------------------------- collator


class TRLPackingCollator:
    """``data_collator`` for ``SFTTrainer``: rows of :func:`packed_dataset` -> model inputs of packed rows.

    Each row's samples are decoded and processed by ``preprocessor`` (the same :class:`~vlm_pack.Preprocessor`
    as :func:`packed_dataset`'s: the checkpoint's chat template and image processor) and collated by
    :class:`~vlm_pack.PackingCollator` into rows of ``capacity`` tokens
    (one row per pack for ``per_device_train_batch_size=1``; with more packs per micro-batch the collator
    regroups their samples by best fit, never over ``capacity``). Returns ``input_ids``, ``labels``
    ``[R, T]``, ``position_ids`` ``[4, R, T]`` (Qwen-VL) or ``[R, T]``, the vision tensors,
    ``mm_token_type_ids`` (Qwen-VL), and ``num_real_tokens`` (a scalar, for :class:`PackedSFTTrainer`); no
    ``attention_mask`` (Gemma 3: its mask mapping). ``pad_to_multiple_of``: as :func:`packed_dataset`'s.

    ``packed=False`` gives the unpacked reference instead: one sample per row, right padding, an
    ``attention_mask`` and labels padded with -100 (for a padded run to compare losses with).
    """

    def __init__(
        self,
        capacity: int,
        preprocessor: Preprocessor,
        *,
        model_config: Any = None,
        packed: bool = True,
        pad_to_multiple_of: int = 1,
    ) -> None:
        self.preprocessor = Preprocessor.check(preprocessor)
        # max_rows=None: a micro-batch holds per_device_train_batch_size packs, regrouped into rows here
        self.collator = self.preprocessor.collator(
            capacity, model_config=model_config, pad_to_multiple_of=pad_to_multiple_of, max_rows=None
        )
        self.packed = packed

    def samples(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """The processed samples of ``rows`` (``process_sample`` output), row by row, each checked against the
        forecast its pack was planned on (``Preprocessor.checked_length``; a mismatch raises ``SampleError``
        ``forecast_mismatch`` naming the sample: a collator cannot leave a sample out of a planned row)."""
        out = []
        for row in rows:
            n = len(row["keys"])
            videos_of = row.get("video_bytes") or [[]] * n  # rows written before videos: none
            lengths = row.get("lengths") or [None] * n
            for key, conv, images, videos, forecast in zip(
                row["keys"], row["conversations"], row["image_bytes"], videos_of, lengths
            ):
                label = f"sample {key!r} of a packed_dataset row"
                job = SampleJob(key, label, images, json.loads(conv), forecast, list(videos or ()))
                out.append(job.process(self.preprocessor))
        return out

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        samples = self.samples(rows)
        if not self.packed:
            return _padded_inputs(samples, self.collator.pad_token_id)
        batch = self.collator.collate(samples)
        inputs = batch.model_inputs("sdpa")
        inputs.pop("use_cache")  # SFTTrainer.compute_loss sets it
        inputs[NUM_TOKENS_KEY] = torch.tensor(batch.num_real_tokens)
        return inputs


def _padded_inputs(samples: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, Any]:
    """One sample per row, right-padded, with an attention mask; labels padded with -100."""
    inputs = pad_samples(samples, pad_token_id=pad_token_id)
    inputs["labels"] = torch.nn.utils.rnn.pad_sequence(
        [s["labels"] for s in samples], batch_first=True, padding_value=IGNORE_INDEX
    )
    return inputs


# ---------------------------------------------------------------------------------------------- trainer


class PackedSFTTrainer(SFTTrainer):
    """``SFTTrainer`` for packed VLM rows: checks the config, and logs the real ``num_tokens``.

    ``compute_loss`` pops the collator's ``num_real_tokens`` before the forward (the model must not see it),
    lets TRL compute loss, entropy and accuracy unchanged, then replaces TRL's token increment
    (``position_ids.size(1)``, wrong for packed rows) with the gathered real count.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        train_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if train_args is None:
            raise ValueError("PackedSFTTrainer needs args=packed_sft_config(output_dir, ...)")
        check_sft_config(train_args)
        super().__init__(*args, **kwargs)
        # where vlm-pack meets the model: its token mixers run per sample (a no-op for attention-only models;
        # raises, naming the layer, on a mixer vlm-pack does not know)
        isolate_token_mixers(self.model)

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        real = inputs.pop(NUM_TOKENS_KEY, None)
        before = sft_train_tokens(self)
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if real is not None and self.model.training:
            local = torch.as_tensor(real, device=self.accelerator.device).reshape(1)
            total = int(self.accelerator.gather_for_metrics(local).sum().item())
            set_sft_train_tokens(self, before + total // self.get_tp_size())
        return result
