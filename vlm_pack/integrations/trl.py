"""TRL ``SFTTrainer`` on packed VLM rows: the configuration, a dataset TRL accepts, a collator, the token count.

TRL 1.16 refuses ``packing=True`` and ``padding_free=True`` for vision datasets, but trains on packed rows when
it is set up by hand. Four pieces do that::

    WebDataset shards --packed_dataset--> datasets.Dataset, one row per pack      (plan: vlm_pack.pack over
                                          {"keys", "conversations", "image_bytes",   header forecasts, no decode)
                                           "lengths"}  (.to_iterable_dataset() streams it)
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
- **num_tokens**: TRL logs ``position_ids.size(1)`` when there is no ``attention_mask``: for ``[4, R, T]`` mRoPE
  ids that is ``R`` (rows), for ``[R, T]`` ids ``T`` (padding included). The collator adds the real (expanded,
  unpadded) token count as ``num_real_tokens``; :class:`PackedSFTTrainer` pops it before the forward and replaces
  TRL's increment of ``num_tokens`` with it (gathered over processes like TRL's own count). The logged value is
  then the count a padded run logs from its ``attention_mask``.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

try:
    import datasets
    from trl import SFTConfig, SFTTrainer
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("vlm_pack.integrations.trl needs TRL and datasets: pip install 'vlm-pack[trl]'") from exc

import torch

from .. import Preprocessor, pack
from ..data import SampleError, read_header, stream_tar_samples
from ..preprocessor import checked_preprocessor
from ..testing import pad_samples

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


def _read_shards(urls: Sequence[str]) -> Iterator[tuple[str, list[bytes], Any, list[tuple[int, int]]]]:
    """(key, image bytes, conversation, image (width, height) from the headers) of every sample."""
    for url in urls:
        for raw in stream_tar_samples(url):
            try:
                header = read_header(raw)
            except SampleError as exc:
                raise ValueError(f"{url}: sample {raw.get('__key__')!r}: {exc}") from exc
            images = [raw[name] for name in header.image_names]
            yield raw["__key__"], images, header.conversation, header.image_sizes


def pack_rows(
    urls: Sequence[str], bins: Sequence[Sequence[str]], lengths: Sequence[Sequence[int]]
) -> Iterator[dict[str, Any]]:
    """The rows of :func:`packed_dataset`, one per bin of sample keys (module level, so that ``datasets``
    can fingerprint it)."""
    wanted = {key for keys in bins for key in keys}
    found = {key: (images, conv) for key, images, conv, _ in _read_shards(urls) if key in wanted}
    for keys, bin_lengths in zip(bins, lengths):
        yield {
            "keys": list(keys),
            "conversations": [json.dumps(found[key][1]) for key in keys],
            "image_bytes": [found[key][0] for key in keys],
            "lengths": list(bin_lengths),
        }


def packed_dataset(
    urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    preprocessor: Preprocessor,
    *,
    capacity: int,
    oversized: str = "raise",
    seed: int | None = 0,
    streaming: bool = False,
    cache_dir: str | None = None,
) -> datasets.Dataset | datasets.IterableDataset:
    """A ``datasets.Dataset`` (``streaming=True``: ``IterableDataset``) of pack plans over WebDataset shards.

    Every sample's expanded length is forecast from its image headers by ``preprocessor`` (the checkpoint's
    parts: give the same one to :class:`TRLPackingCollator`, so that plan and rows agree; no decode), the
    samples are packed into bins of ``capacity`` tokens (``vlm_pack.pack``, best fit decreasing; ``seed``
    shuffles the bin order so that training sees no length curriculum; ``None`` keeps creation order) and each
    bin becomes one row ``{"keys", "conversations" (JSON), "image_bytes", "lengths"}``, samples in data order.
    Images are decoded only by :class:`TRLPackingCollator`. ``oversized="skip"`` leaves samples longer than
    ``capacity`` out with a warning naming each; ``"raise"`` (default) stops, naming the first.
    """
    url_list = [os.fspath(urls)] if isinstance(urls, (str, os.PathLike)) else [os.fspath(u) for u in urls]
    if oversized not in ("raise", "skip"):
        raise ValueError(f"oversized must be 'raise' or 'skip', got {oversized!r}")
    pre = checked_preprocessor(preprocessor)
    keys, lengths = [], []
    for key, _, conv, sizes in _read_shards(url_list):
        keys.append(key)
        lengths.append(pre.forecast(conv, sizes, key)[0])
    if not keys:
        raise ValueError(f"packed_dataset: no samples in {url_list}")
    too_long = [(k, n) for k, n in zip(keys, lengths) if n > capacity]
    if too_long and oversized == "raise":
        key, n = too_long[0]
        raise ValueError(
            f"sample {key!r}: {n} tokens > capacity {capacity} ({len(too_long)} such samples); raise capacity, "
            "lower the image processor's max_pixels, or pass oversized='skip'"
        )
    for key, n in too_long:
        warnings.warn(f"packed_dataset: left out sample {key!r}: {n} tokens > capacity {capacity}", stacklevel=2)
    plan = pack(lengths, capacity, oversized="skip", seed=seed)
    bins = [sorted(b) for b in plan.bins]
    ds = datasets.Dataset.from_generator(
        pack_rows,
        gen_kwargs={
            # tuples: datasets reads lists in gen_kwargs as data shards to split between jobs
            "urls": tuple(url_list),
            "bins": tuple(tuple(keys[i] for i in b) for b in bins),
            "lengths": tuple(tuple(lengths[i] for i in b) for b in bins),
        },
        features=_FEATURES,
        cache_dir=cache_dir,
    )
    return ds.to_iterable_dataset() if streaming else ds


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
    ``attention_mask``.

    ``packed=False`` gives the unpacked reference instead: one sample per row, right padding, an
    ``attention_mask`` and labels padded with -100 (for a padded run to compare losses with).
    """

    def __init__(self, capacity: int, preprocessor: Preprocessor, *, config: Any = None, packed: bool = True) -> None:
        self.preprocessor = checked_preprocessor(preprocessor)
        self.collator = self.preprocessor.collator(capacity, config=config)
        self.packed = packed

    def samples(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, torch.Tensor]]:
        """The processed samples of ``rows`` (``process_sample`` output), row by row."""
        out = []
        for row in rows:
            for key, conv, images in zip(row["keys"], row["conversations"], row["image_bytes"]):
                out.append(self.preprocessor.process(images, json.loads(conv), key))
        return out

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        samples = self.samples(rows)
        if not self.packed:
            return _padded_inputs(samples, self.collator.pad_token_id)
        batch = self.collator.collate(samples)
        inputs = batch.model_inputs("sdpa")
        inputs.pop("use_cache")  # SFTTrainer.compute_loss sets it
        inputs[NUM_TOKENS_KEY] = torch.tensor(batch.num_real_tokens)
        if isinstance(inputs.get("attention_mask"), dict):  # Gemma 3's packed masks
            inputs["attention_mask"] = _MaskMapping(inputs["attention_mask"], batch.num_real_tokens)
        return inputs


class _MaskMapping(dict):
    """Gemma 3's packed masks ``{"full_attention", "sliding_attention"}`` as SFTTrainer's loop can read them:
    it counts a batch's tokens with ``attention_mask.sum()``, which here gives the real tokens of the row."""

    def __init__(self, masks: Mapping[str, torch.Tensor], num_real_tokens: int) -> None:
        super().__init__(masks)
        self.num_real_tokens = int(num_real_tokens)

    def sum(self) -> torch.Tensor:
        return torch.tensor(self.num_real_tokens)


def _padded_inputs(samples: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, Any]:
    """One sample per row, right-padded, with an attention mask; labels padded with -100."""
    inputs = pad_samples(samples, pad_token_id=pad_token_id)
    inputs["labels"] = torch.nn.utils.rnn.pad_sequence(
        [s["labels"] for s in samples], batch_first=True, padding_value=-100
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

    def compute_loss(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        real = inputs.pop(NUM_TOKENS_KEY, None)
        before = self._total_train_tokens
        result = super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )
        if real is not None and self.model.training:
            local = torch.as_tensor(real, device=self.accelerator.device).reshape(1)
            total = int(self.accelerator.gather_for_metrics(local).sum().item())
            self._total_train_tokens = before + total // self._tp_size
            self._metrics["train"]["num_tokens"] = [self._total_train_tokens]
        return result
