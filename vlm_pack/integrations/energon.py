"""Megatron-Energon: a task encoder that packs VLM samples with vlm-pack's exact forecasts and best fit.

Energon's packing hooks get no lengths, and a sample its selector leaves out of every group is lost without a
word (the buffer is cleared). :class:`VLMPackingTaskEncoder` fills both gaps::

    CrudeWebdataset  ->  cooker (@stateless)           ->  select_samples_to_pack      ->  pack_selected_samples
    (decoder=None:       image sizes from the headers,      vlm_pack.pack (best fit         (@stateless) decode, process,
     raw bytes)          forecast_length: exact tokens      decreasing) over the buffer     PackingCollator -> PackedBatch
                         (no pixel decoded)                 every fitting sample packed     in a PackedVLMSample
                                                            oversized: counted + warned     (restore keys by Energon)

Policy for samples left out: best fit over the whole buffer places every sample that fits ``capacity``, so the
only samples left out are those longer than ``capacity`` on their own. Each is logged as a warning naming its
key, length and the capacity, and recorded as ``(key, reason)`` in :attr:`VLMPackingTaskEncoder.left_out` (of
the process that packed it: with ``num_workers > 0`` the worker's copy, so read the warnings). ``oversized="raise"``
stops at the first one instead.
Nothing is carried between buffers: a carry list would live outside Energon's saved state, and a restore
would then repeat or lose those samples.

Images are decoded inside ``pack_selected_samples`` (not in ``postencode_sample``): Energon 7.4.1 cannot
restore a pack when ``postencode_sample`` is overridden. Both the cooker and the packer are ``@stateless``
and deterministic, so ``save_state_rank`` / ``restore_state_rank`` resume mid-epoch with every sample exactly
once. Set up a dataset folder of WebDataset shards with::

    energon prepare DIR --non-interactive --split-ratio 1,0,0 --sample-type CrudeWebdataset

and load it with :func:`packed_train_dataset` (``batch_size=None``: every item is one pack).
"""

from __future__ import annotations

import logging
from typing import Any

try:
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        WorkerConfig,
        edataclass,
        get_train_dataset,
        stateless,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "vlm_pack.integrations.energon needs Megatron-Energon: pip install 'vlm-pack[energon]'"
    ) from exc

from .. import PackedBatch, Preprocessor, pack
from ..data import read_header
from ..preprocessor import checked_preprocessor

__all__ = ["PackedVLMSample", "VLMPackingTaskEncoder", "VLMSample", "packed_train_dataset"]

logger = logging.getLogger(__name__)


@edataclass
class VLMSample(Sample):
    """A cooked sample: raw image bytes (not decoded), the conversation and its exact forecast length."""

    images: list
    conversation: Any
    length: int


@edataclass
class PackedVLMSample(Sample):
    """One pack: the collated :class:`~vlm_pack.PackedBatch` and the keys of its samples in packed order."""

    batch: PackedBatch
    keys: list


class VLMPackingTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder: exact length forecasts, best-fit packs of ``capacity`` tokens, ``PackedBatch`` out.

    Args:
        capacity: tokens per pack (expanded length, what the language model runs on).
        preprocessor: the checkpoint's parts (:class:`~vlm_pack.Preprocessor`: ``processor=`` for any family,
            or ``tokenizer=`` + ``image_processor=``); its ``layout``: ``"expanded"`` (HF models) or
            ``"collapsed"`` (Megatron: one placeholder per image).
        config: the model config (family, token ids, merge size; see :class:`~vlm_pack.PackingCollator`).
        pad_to_multiple_of: per-sample padding for context/sequence parallelism (``pad_multiple_for``).
        oversized: ``"report"`` (warn, record in :attr:`left_out`, leave the sample out) or ``"raise"``
            (pair it with ``WorkerConfig(global_error_handler=megatron.energon.errors.reraise_exception)``:
            Energon's default handler logs a failed selection and skips its whole buffer).

    Use with ``get_train_dataset(..., batch_size=None, packing_buffer_size=N, task_encoder=encoder)`` or
    :func:`packed_train_dataset`.
    """

    # Raw bytes reach the cooker: image sizes come from the headers, pixels are decoded only when packed.
    decoder = None

    def __init__(
        self,
        capacity: int,
        preprocessor: Preprocessor,
        *,
        config: Any = None,
        pad_to_multiple_of: int = 1,
        oversized: str = "report",
    ) -> None:
        super().__init__()
        if oversized not in ("report", "raise"):
            raise ValueError(f"oversized must be 'report' or 'raise', got {oversized!r}")
        self.preprocessor = checked_preprocessor(preprocessor)
        self.collator = preprocessor.collator(
            capacity, config=config, layout=preprocessor.layout, pad_to_multiple_of=pad_to_multiple_of
        )
        self.capacity = capacity
        self.oversized = oversized
        self.left_out: list[tuple[str, str]] = []
        self.cookers = [Cooker(self.cook_sample)]

    @stateless
    def cook_sample(self, crude: dict) -> VLMSample:
        """Crude WebDataset sample (raw bytes) -> :class:`VLMSample` with its exact expanded length."""
        key = crude["__key__"]
        header = read_header(crude, image_name=lambda name: f"{key}.{name}")
        length, _ = self.preprocessor.forecast(header.conversation, header.image_sizes, key)
        return VLMSample(
            __key__=key,
            __restore_key__=crude.get("__restore_key__", ()),
            __subflavors__=crude.get("__subflavors__"),
            __sources__=crude.get("__sources__"),
            images=[crude[name] for name in header.image_names],
            conversation=header.conversation,
            length=int(length),
        )

    def select_samples_to_pack(self, samples: list[VLMSample]) -> list[list[VLMSample]]:
        """Best-fit decreasing over the whole buffer; samples keep their buffer order inside a pack."""
        plan = pack([s.length for s in samples], self.capacity, oversized="skip")
        left = []
        for miss in plan.unpacked:
            sample = samples[miss.index]
            reason = f"{sample.length} tokens > capacity {self.capacity}"
            if self.oversized == "raise":
                raise ValueError(
                    f"sample {sample.__key__!r}: {reason}; raise capacity or use oversized='report'"
                )
            logger.warning("vlm-pack/energon: left out sample %r: %s", sample.__key__, reason)
            left.append((sample.__key__, reason))
        self.left_out.extend(left)
        return [[samples[i] for i in sorted(b)] for b in plan.bins]

    @stateless
    def pack_selected_samples(self, samples: list[VLMSample]) -> PackedVLMSample:
        """Decode and process the pack's samples and collate them into one :class:`PackedBatch` row."""
        processed = [self.preprocessor.process(s.images, s.conversation, s.__key__) for s in samples]
        for s, p in zip(samples, processed):
            tpi = p.get("tokens_per_image")
            n = len(p["input_ids"])
            if self.preprocessor.layout == "collapsed" and tpi is not None:  # one placeholder per image
                n += int(tpi.sum()) - len(tpi)
            if n != s.length:
                raise RuntimeError(
                    f"sample {s.__key__!r}: forecast {s.length} tokens, processed {n}: the vision spec does "
                    "not match the image processor (build both from the same checkpoint)"
                )
        batch = self.collator.collate(processed)
        if batch.num_rows != 1:
            raise RuntimeError(f"pack of {[s.__key__ for s in samples]} did not fit one row of {self.capacity}")
        sources = tuple(src for s in samples for src in (s.__sources__ or ()))
        return PackedVLMSample(
            __key__="+".join(s.__key__ for s in samples),
            __restore_key__=(),
            __subflavors__=samples[0].__subflavors__,
            __sources__=sources or None,
            batch=batch,
            keys=[samples[i].__key__ for i in batch.sample_index.tolist()],
        )

    def batch(self, samples: list[PackedVLMSample]) -> list[PackedVLMSample]:
        # batch_size=None never calls this; with a batch size, a batch is the list of its packs (a row each).
        return samples

    def encode_batch(self, batch: Any) -> Any:
        return batch


def packed_train_dataset(
    path: str,
    task_encoder: VLMPackingTaskEncoder,
    *,
    rank: int = 0,
    world_size: int = 1,
    num_workers: int = 0,
    packing_buffer_size: int = 32,
    shuffle_buffer_size: int | None = None,
    repeat: bool = True,
    worker_config: WorkerConfig | None = None,
    **kwargs: Any,
) -> Any:
    """``get_train_dataset`` for packs: one item per pack (``batch_size=None``); ``repeat=False`` is one epoch.

    Wrap it with ``megatron.energon.get_savable_loader`` to save (``save_state_rank``) and restore
    (``restore_state_rank``, before iterating) mid-run: with ``repeat=True`` (Energon's training default) the
    restored loader yields exactly the packs of an uninterrupted run. With ``repeat=False``, Energon 7.4.1
    resets a worker's epoch state as soon as its last sample has entered the packing buffer, so a state saved
    during the last ``packing_buffer_size`` samples of a worker's share restores into a fresh pass (samples
    repeat): restore one-epoch runs only from states saved before that point.
    """
    if worker_config is None:
        worker_config = WorkerConfig(rank=rank, world_size=world_size, num_workers=num_workers)
    return get_train_dataset(
        path,
        worker_config=worker_config,
        batch_size=None,
        packing_buffer_size=packing_buffer_size,
        shuffle_buffer_size=shuffle_buffer_size,
        max_samples_per_sequence=None,
        task_encoder=task_encoder,
        repeat=repeat,
        **kwargs,
    )

