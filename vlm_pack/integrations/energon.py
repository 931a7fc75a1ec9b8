"""Megatron-Energon: a task encoder that packs VLM samples with vlm-pack's exact forecasts and best fit.

Energon's packing hooks get no lengths, and a sample its selector leaves out of every group is lost without a
word (the buffer is cleared). :class:`VLMPackingTaskEncoder` fills both gaps::

    CrudeWebdataset  ->  cooker (@stateless)           ->  select_samples_to_pack      ->  pack_selected_samples
    (decoder=None:       image sizes, video container       vlm_pack.pack (best fit         (@stateless) decode, process,
     raw bytes)          headers; forecast_length: exact    decreasing) over the buffer,    PackingCollator -> one row
                         tokens (no pixel or frame          on the padded spans the rows    in a PackedVLMSample
                         decoded)                           will have; oversized: carried   (.keys, .left_out, restore
                                                            by a pack of the same buffer    keys by Energon)

Videos are members beside the images (``KEY.mp4``, ``KEY.0.webm``, ``KEY.1.mkv`` ...; ``vlm_pack.data.video_fields``,
in the order of the ``<video>`` placeholders): the cooker reads each container's header (``read_header``: the MP4
sample table, or a demux-only packet count for MKV / WebM), so a clip's tokens are forecast and a clip longer than
``capacity`` is refused or skipped before any frame is decoded; the packer decodes only the frames the forecast
kept (``Preprocessor.process(..., videos=)``). A container that does not read is ``corrupt_video`` (cooker), one
that reads but does not decode is ``decode_error`` (packer): either is that sample alone, counted and reported.

Every pack is one row: the selection plans on each sample's span once padded to ``pad_to_multiple_of`` (as the
collator lays it out, ``vlm_pack.packing.padded_lengths``), and the collator (``max_rows=1``) refuses a pack
that would need two. ``pack.batch.metadata["__key__"]`` (= ``pack.batch.sample_keys`` = ``pack.keys``) names the
samples in packed order.

Energon hands what a cooker or packer raises to ``WorkerConfig.global_error_handler``; its default logs it
and drops the sample, or the whole packing buffer when the selection raised, and training goes on. So the
encoder decides inside the hooks, and never lets a bad sample take good ones with it::

    oversized="raise" (default)   the cooker raises FatalPackingError naming the sample: a FatalSampleError,
                                  which Energon re-raises whatever the handler, so the run stops
    oversized="skip"              the sample is left out before packing, counted as too_long, reported (below)
    bad data (vlm_pack.failures)  a forecast, decode or processed length that fails: that sample alone is
                                  left out and reported, its pack's good samples are packed (on_error="skip",
                                  the default); on_error="raise": FatalPackingError naming it
    an error of code, or more     FatalPackingError (from the SampleCodeError / FailureBudgetError): stops
    than max_consecutive_failures the run; Energon's handler would otherwise skip it sample after sample
    bad samples in a row

Both hooks run through one ``vlm_pack.failures.FailurePolicy`` declared from the ``PackingConfig``, a guarded
stage each (the cooker's forecast, the packer's decode and process), as ``PackedWebDataset``'s stream does.

A sample left out is reported as ``(key, "reason: detail")`` (``reason`` one of ``vlm_pack.failures.REASONS``:
``too_long``, ``decode_error``, ...) in the :attr:`PackedVLMSample.left_out` of a pack of the same buffer, so
the report travels with the packs from worker processes to the training loop and is restored with them (the
selection puts the left-out samples at the end of the first pack's group, and the stateless packer
recognises them); it is also logged as a warning and recorded in :attr:`VLMPackingTaskEncoder.left_out` of
the process that selected it (with ``num_workers > 0`` a worker's copy, not the main process's). Best fit
over the whole buffer places every sample that fits ``capacity``. A buffer in which no sample fits, or a pack
none of whose samples decodes, has no pack to carry its report: only the warnings and that list tell. "truncate" is refused (the encoder never
cuts a sample).
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

import contextlib
import logging
import numbers
import warnings
from collections.abc import Iterator
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
    from megatron.energon.errors import FatalSampleError, SkipSample
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "vlm_pack.integrations.energon needs Megatron-Energon: pip install 'vlm-pack[energon]'"
    ) from exc

from ..collate.batch import PackedBatch
from ..config import PackingConfig
from ..data import read_header
from ..data.job import SampleJob, forecast_job
from ..failures import (
    FailureBudgetError,
    FailurePolicy,
    SampleCodeError,
    SampleError,
    Skip,
)
from ..packing import pack, padded_lengths
from ..preprocessor import Preprocessor

__all__ = ["FatalPackingError", "PackedVLMSample", "VLMPackingTaskEncoder", "VLMSample", "packed_train_dataset"]

logger = logging.getLogger(__name__)


class FatalPackingError(FatalSampleError):
    """vlm-pack stops the run from inside an Energon hook, naming the sample (message) and the fix.

    Energon catches what a cooker or packer raises and hands it to ``WorkerConfig.global_error_handler``,
    whose default logs it and drops the sample, or the whole packing buffer when it came from the
    selection. A ``FatalSampleError`` is the one kind it re-raises whatever the handler
    (``megatron.energon.errors.SYSTEM_EXCEPTIONS``), so "raise" stops the run there too. Raised from the
    original error: an oversized sample with ``oversized="raise"`` (a ``SampleError`` ``too_long``), an error
    of code (``SampleCodeError``) or too many bad samples in a row (``FailureBudgetError``).
    """


@edataclass
class VLMSample(Sample):
    """A cooked sample: raw image and video bytes (not decoded; ``videos`` in ``<video>`` order), the
    conversation and its exact forecast length, or ``failure``: why its forecast failed (``"reason: detail"``,
    a bad sample carried to a pack's report)."""

    images: list
    conversation: Any
    length: int
    failure: str | None = None
    videos: tuple = ()
    video_forecasts: tuple = ()
    """Each video's ``VideoForecast`` from its container header (read once: processing decodes its kept frames)."""


@edataclass
class PackedVLMSample(Sample):
    """One pack: the collated :class:`~vlm_pack.PackedBatch` (one row), the keys of its samples in packed order
    (also ``batch.metadata["__key__"]``) and ``left_out``: ``(key, "reason: detail")`` of the samples of the
    same packing buffer that no pack holds (``reason`` one of ``vlm_pack.failures.REASONS``: ``too_long``,
    or bad data such as ``decode_error``), reported once, on one pack of that buffer."""

    batch: PackedBatch
    keys: list
    left_out: list


def _why(skip: Skip) -> str:
    """How a pack reports a sample left out: ``"reason: detail"``."""
    return f"{skip.reason}: {skip.detail}"


@contextlib.contextmanager
def _stops_the_run() -> Iterator[None]:
    """What the failure policy raises inside a hook (an error of code, a spent budget, a bad sample under
    ``on_error="raise"``) leaves as :class:`FatalPackingError`: Energon's handler would log and drop anything
    else, and training would go on."""
    try:
        yield
    except (SampleError, SampleCodeError, FailureBudgetError) as stop:
        raise FatalPackingError(str(stop)) from stop


def _old_order(preprocessor: Any, config: Any) -> tuple[Any, Any]:
    """``(capacity, preprocessor)``, the earlier order, as ``(preprocessor, capacity)`` with a warning."""
    if isinstance(preprocessor, numbers.Integral) and isinstance(config, Preprocessor):
        warnings.warn(
            "VLMPackingTaskEncoder(capacity, preprocessor) is deprecated: pass the Preprocessor first, as to every "
            "dataset: VLMPackingTaskEncoder(preprocessor, PackingConfig(capacity=...)) (or the capacity, an int)",
            DeprecationWarning,
            stacklevel=3,
        )
        return config, preprocessor
    return preprocessor, config


class VLMPackingTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder: exact length forecasts, best-fit packs of ``capacity`` tokens, ``PackedBatch`` out.

    Args:
        preprocessor: the checkpoint's parts (:class:`~vlm_pack.Preprocessor`: ``processor=`` for any family,
            or ``tokenizer=`` + ``image_processor=``); its ``layout``: ``"expanded"`` (HF models) or
            ``"collapsed"`` (Megatron: one placeholder per image).
        config: the packing knobs (:class:`~vlm_pack.PackingConfig`, or the capacity, an int), each also a
            keyword alone or over ``config`` (``capacity=8192``), as for every dataset. The encoder reads:
            ``capacity`` (tokens per pack, the expanded length the language model runs on);
            ``pad_to_multiple_of`` (per-sample padding for context/sequence parallelism, ``pad_multiple_for``:
            packs are planned on the padded spans, so each is one row); ``max_samples_per_bin``;
            ``oversized``: ``"raise"`` (default: the cooker raises :class:`FatalPackingError` naming the sample,
            which stops the run whatever Energon's ``global_error_handler``) or ``"skip"`` (the sample is left
            out, reported in a pack's ``left_out``, warned about, recorded in :attr:`left_out` and counted as
            ``too_long``; ``"truncate"`` is refused: the encoder never cuts a sample); ``on_error`` (bad data:
            "skip", alone, never with its pack; "raise" stops the run) and ``max_consecutive_failures`` (bad
            samples in a row, per stage, before the run stops; None: no limit). ``vision_capacity`` is refused
            (no vision budget here); the streaming knobs are Energon's own (``packing_buffer_size``, shuffling).
        model_config: the model's config (family, token ids, merge size; see :class:`~vlm_pack.PackingCollator`).

    ``VLMPackingTaskEncoder(capacity, preprocessor, ...)``, the earlier order, still works with a
    ``DeprecationWarning``. Use with ``get_train_dataset(..., batch_size=None, packing_buffer_size=N,
    task_encoder=encoder)`` or :func:`packed_train_dataset`.
    """

    # Raw bytes reach the cooker: image sizes come from the headers, pixels are decoded only when packed.
    decoder = None

    def __init__(
        self,
        preprocessor: Preprocessor,
        config: PackingConfig | int | None = None,
        *,
        model_config: Any = None,
        **knobs: Any,
    ) -> None:
        super().__init__()
        preprocessor, config = _old_order(preprocessor, config)
        Preprocessor.refuse_parts("VLMPackingTaskEncoder", knobs)
        # PackingConfig validates the settings (names, values, capacity a multiple of pad_to_multiple_of)
        self.config = config = PackingConfig.resolve("VLMPackingTaskEncoder", config, refuse=("truncate",), **knobs)
        if config.vision_capacity is not None:
            raise ValueError(
                f"VLMPackingTaskEncoder has no vision budget (vision_capacity={config.vision_capacity}): leave it "
                "None, or plan with vlm_pack.pack / PackedWebDataset, which budget the vision cost"
            )
        self.preprocessor = Preprocessor.check(preprocessor)
        # max_rows=1: a pack is one row, or the collator raises naming its samples
        self.collator = preprocessor.collator(
            config.capacity,
            model_config=model_config,
            layout=preprocessor.layout,
            pad_to_multiple_of=config.pad_to_multiple_of,
            max_rows=1,
        )
        self.capacity = config.capacity
        self.pad_to_multiple_of = config.pad_to_multiple_of
        self.oversized = config.oversized
        # the selection's plan: every sample that reaches it fits (the cooker sorted out the rest); Energon shuffles
        self._plan = config.replace(oversized="raise", shuffle_seed=None)
        self.left_out: list[tuple[str, str]] = []
        # One policy, a guarded stage (and budget) per hook, as each sees samples in its own order (per process:
        # a worker has its copy). Reports are made where a pack carries them (selection, packing): no callback.
        policy = FailurePolicy.of("VLMPackingTaskEncoder", config)
        self.forecasting = policy.stage("forecast in the cooker", "bad_text")
        self.processing = policy.stage("decode and process in the packer", "decode_error")
        self.cookers = [Cooker(self.cook_sample)]

    @stateless
    def cook_sample(self, crude: dict) -> VLMSample:
        """Crude WebDataset sample (raw bytes) -> :class:`VLMSample` with its exact expanded length; a sample
        that is bad data (its forecast fails, or it is too long under ``oversized="skip"``) carries its
        ``failure`` on to a pack's report.

        Raises:
            FatalPackingError: a sample longer than ``capacity`` with ``oversized="raise"``, an error of code,
                a bad sample under ``on_error="raise"``, or too many bad samples in a row.
        """
        key = crude["__key__"]
        meta = dict(__key__=key, __restore_key__=crude.get("__restore_key__", ()),
                    __subflavors__=crude.get("__subflavors__"), __sources__=crude.get("__sources__"))
        with _stops_the_run():
            job = self.forecasting.call(self._forecast, crude, key, sample=f"sample {key!r}", key=key)
            if isinstance(job, Skip):
                return VLMSample(**meta, images=[], conversation=None, length=0, failure=_why(job))
            length = job.length
            reason = self._too_long(length)
            if reason is not None and self.oversized == "raise":  # the run's policy, not bad data: it stops
                message = f"sample {key!r}: {reason}; raise capacity or use oversized='skip'"
                raise FatalPackingError(message) from SampleError("too_long", message)
            if reason is not None:
                skip = self.forecasting.bad(SampleError("too_long", reason), f"sample {key!r}", key)
                return VLMSample(**meta, images=[], conversation=None, length=length, failure=_why(skip))
            self.forecasting.good()
        return VLMSample(**meta, images=job.images, conversation=job.conversation, length=length,
                         videos=tuple(job.videos), video_forecasts=tuple(job.video_forecasts))

    def _forecast(self, crude: dict, key: str) -> SampleJob:
        """The sample's job from its headers (text, image sizes, video container headers; no pixel or frame
        decoded): its exact expanded length and each video's forecast."""
        header = read_header(crude, exif_transpose=self.config.exif_transpose, image_name=lambda name: f"{key}.{name}")
        images = [crude[name] for name in header.image_names]
        videos = [crude[name] for name in header.video_names]
        return forecast_job(self.preprocessor, header, images, videos, key=key, label=f"sample {key!r}", keep_prompt=False)

    def _too_long(self, length: int) -> str | None:
        """Why a sample of ``length`` tokens fits no pack (its padded span exceeds ``capacity``), or None."""
        span = int(padded_lengths([length], self.pad_to_multiple_of)[0])
        if span <= self.capacity:
            return None
        padding = f" (padded to {span})" if span != length else ""
        return f"{length} tokens{padding} > capacity {self.capacity}"

    def _report(self, key: str, why: str) -> None:
        logger.warning("vlm-pack/energon: left out sample %r: %s", key, why)
        self.left_out.append((key, why))

    def select_samples_to_pack(self, samples: list[VLMSample]) -> list[list[VLMSample]]:
        """Best-fit decreasing over the whole buffer on the padded spans; samples keep their buffer order inside
        a pack. The samples left out (bad, or longer than ``capacity``) go at the end of the first pack's
        group: ``pack_selected_samples`` reports them on that pack, so none is dropped without a word."""
        fits = [i for i, s in enumerate(samples) if s.failure is None]
        left = [s for s in samples if s.failure is not None]
        for sample in left:
            self._report(sample.__key__, sample.failure)
        plan = pack([samples[i].length for i in fits], self._plan)
        groups = [[samples[fits[i]] for i in sorted(b)] for b in plan.bins]
        if groups:
            groups[0] += left
        elif left:
            logger.warning(
                "vlm-pack/energon: no sample of this packing buffer fits a pack: %d sample(s) left out "
                "with no pack to report them on: %s", len(left), [s.__key__ for s in left],
            )
        return groups

    def _process(self, sample: VLMSample) -> dict | str:
        """The processed sample, or ``"reason: detail"`` when its pixels do not decode (bad data, counted)
        or its processed length is not its forecast (``forecast_mismatch``: never packed at another length)."""
        key, label = sample.__key__, f"sample {sample.__key__!r}"
        job = SampleJob(key, label, sample.images, sample.conversation, sample.length, list(sample.videos),
                        list(sample.video_forecasts))
        p = self.processing.call(job.process, self.preprocessor, sample=label, key=key)
        if isinstance(p, Skip):  # bad data, a forecast_mismatch included: left out, counted, reported on its pack
            return _why(p)
        self.processing.good()
        p["__key__"] = key  # batch.metadata["__key__"] in packed order
        return p

    @stateless
    def pack_selected_samples(self, samples: list[VLMSample]) -> PackedVLMSample:
        """Decode and process the pack's samples and collate them into one :class:`PackedBatch` row. The
        samples the selection left out (placed here) and those whose pixels do not decode become the pack's
        ``left_out``: a bad sample never takes its pack's good ones with it.

        Raises:
            FatalPackingError: an error of code, a bad sample under ``on_error="raise"``, or too many bad
                samples in a row.
            SkipSample: no sample of the pack was good (each is logged and in :attr:`left_out`).
        """
        left_out = [(s.__key__, s.failure) for s in samples if s.failure is not None]
        kept, processed = [], []
        for sample in (s for s in samples if s.failure is None):
            with _stops_the_run():
                result = self._process(sample)
            if isinstance(result, str):
                self._report(sample.__key__, result)
                left_out.append((sample.__key__, result))
            else:
                kept.append(sample)
                processed.append(result)
        if not kept:
            raise SkipSample()
        try:
            batch = self.collator.collate(processed)
        except Exception as exc:  # the plan fits one row: a collator that refuses it is code
            keys = [s.__key__ for s in kept]
            raise FatalPackingError(f"pack of samples {keys}: {type(exc).__name__}: {exc}") from exc
        sources = tuple(src for s in kept for src in (s.__sources__ or ()))
        return PackedVLMSample(
            __key__="+".join(s.__key__ for s in kept),
            __restore_key__=(),
            __subflavors__=kept[0].__subflavors__,
            __sources__=sources or None,
            batch=batch,
            keys=list(batch.sample_keys),
            left_out=left_out,
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

