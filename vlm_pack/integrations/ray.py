"""Forecast on a Ray cluster with Ray Data (issue 25): the lengths table and the plan that
``forecast_sources`` makes in one process, bit for bit, for any number of Ray workers.

    driver    open_sources ─ chunks ─> ray.data.from_items(one row per chunk: its sequence number + descriptor)
    cluster     .map_batches(_ChunkForecast, concurrency=N)      each actor: data.forecast.forecast_chunk
    driver    results sorted by sequence ─> assemble_table ─> LengthTable ─> write_lengths / make_plan

A chunk is a descriptor of where its records live (a parquet row group, a JSON Lines byte range, a
WebDataset shard, a ``datasets.Dataset`` row range; JSON arrays, streamed hub datasets and parquet row groups
larger than 4 chunks ship their records, read by the driver):
the worker reads the bytes itself, as ``forecast_sources``' processes do, because the forecast reads only each
image's header and seeks past the rest, where Ray's ``read_parquet`` / ``read_webdataset`` would move every
image byte through the object store. The per-sample code is ``forecast_chunk``, the same function the local
process pool runs; the order is restored from the chunk sequence after the map, so neither the number of
workers nor the order Ray finishes them in changes a bit of the result.

On a multi-machine cluster every node must reach the sources at the same paths (shared storage) and have
vlm-pack installed (or ship it with ``ray.init(runtime_env=...)`` before calling). Needs
``pip install 'vlm-pack[ray]'``.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Generator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import (
    DEFAULT_MAX_BAD_FRACTION,
    DEFAULT_MAX_CONSECUTIVE_FAILURES,
    DEFAULT_MAX_IMAGE_PIXELS,
    PackingConfig,
)
from ..data.forecast import LengthTable, assemble_table, forecast_chunk, make_forecaster
from ..data.sources import Chunk, Source, chunks

if TYPE_CHECKING:
    from ..data.plan import Plan
    from ..packing.steps import EpochBalance, StepBalance
    from ..preprocessor import Preprocessor

__all__ = ["build_plan_ray", "forecast_ray", "ray_chunks"]

_INSTALL = "pip install 'vlm-pack[ray]'"


def _require_ray() -> Any:
    try:
        import ray
        import ray.data
    except ImportError as e:
        raise ImportError(
            f"vlm_pack.integrations.ray needs Ray Data ({e}): {_INSTALL} (or pip install 'ray[data]')."
        ) from None
    return ray


def ray_chunks(sources: Sequence[Source], chunk_rows: int = 1024) -> list[Chunk]:
    """The chunks of ``sources`` in source order (``data.sources.chunks``: a parquet row group, a JSONL byte
    range, a shard... are descriptors the worker reads; JSON records and large row groups travel inside)."""
    return list(chunks(sources, chunk_rows))


def _shippable(source: Source) -> Source:
    # JSON arrays and streamed datasets travel inside their chunks: the actors need only the name
    ref = None if source.kind in ("json", "iterable") else source.ref
    return replace(source, ref=ref, handle=None)


def forecast_parts(pre: Preprocessor) -> Preprocessor:
    """The parts of ``pre`` a forecast reads, for a worker: its tokenizer, chat template (the processor's,
    resolved here), placeholder, family, layout and vision spec, without the image processor or processor.

    A forecast reads image headers and the spec, never the image processor; unpickling one imports its
    transformers module, which imports torch (``transformers/image_utils.py``: ``if is_torch_available():
    import torch``), seconds of a worker's start for nothing. A family whose processor writes tile markers
    named on the processor (``families`` ``wraps="processor_markers"``: Idefics3, SmolVLM, LFM2-VL) keeps it.
    """
    from ..preprocessor import Preprocessor
    from ..processing.chat import _checkpoint_template
    from ..processing.markers import _wraps

    if pre.image_processor is None and pre.processor is None:
        return pre
    if pre.processor is not None and _wraps(pre.spec) == "processor_markers":  # marker names read on it
        return Preprocessor(pre.tokenizer, None, pre.processor, pre.family, pre.template, pre.layout, pre.spec)
    template = pre.template
    if template is None:  # the processor's template first, as a rendering with the processor reads it
        template = _checkpoint_template(pre.tokenizer, pre.processor)
    lean = Preprocessor(pre.tokenizer, family=pre.family, template=template, layout=pre.layout, spec=pre.spec)
    vars(lean)["_placeholder"] = pre._placeholder  # the processor's image token, asked here once
    return lean


class _ChunkForecast:
    """A Ray Data actor: the checkpoint's parts are unpickled once, then each batch of chunk descriptors is
    read and forecast with ``forecast_chunk``."""

    def __init__(self, forecaster: Any) -> None:
        # one CPU per actor: the tokenizer's own thread pool would oversubscribe the cores Ray counted
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        self.forecaster = forecaster

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        results = []
        for blob in batch["chunk"]:
            results.append(pickle.dumps(forecast_chunk(self.forecaster, pickle.loads(blob))))
        return {"seq": np.asarray(batch["seq"], dtype=np.int64), "result": results}


def _worker_error(exc: BaseException) -> BaseException | None:
    """The exception a worker raised, out of Ray's wrappers (``RayTaskError``, ``UserCodeException``)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if not type(e).__module__.startswith("ray"):
            return e
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


def _connect(address: str | None) -> tuple[Any, bool]:
    """Ray, and whether this call started it (a local cluster, or a connection to ``address``)."""
    ray = _require_ray()
    if ray.is_initialized():
        return ray, False
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    return ray, True


def forecast_ray(
    sources: Any | Sequence[Any],
    *,
    tokenizer: Any = None,
    spec: Any = None,
    family: str | None = None,
    template: Callable[..., Any] | None = None,
    preprocessor: Preprocessor | None = None,
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    exif_transpose: bool = True,
    verify: bool = False,
    on_error: str = "skip",
    num_proc: int | None = None,
    chunk_rows: int = 1024,
    max_consecutive_failures: int | None = DEFAULT_MAX_CONSECUTIVE_FAILURES,
    address: str | None = None,
    progress: bool | None = None,
    max_bad_fraction: float | None = DEFAULT_MAX_BAD_FRACTION,
    max_image_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
) -> LengthTable:
    """:func:`vlm_pack.data.forecast_sources` of ``sources`` (parquet, JSON / JSONL, WebDataset shards, a
    ``datasets`` dataset from the hub or ``save_to_disk``...) run as a Ray Data ``map_batches`` over
    ``num_proc`` actors of one CPU (default: every CPU of the cluster): the same :class:`LengthTable`.

    Uses the Ray session already started (``ray.init``), else starts one (``address``: a cluster to join,
    e.g. ``"auto"`` or ``"ray://head:10001"``; None: a local cluster on this machine) and shuts it down after.
    ``progress``: Ray Data's progress bars (None: Ray's default). Other arguments: ``forecast_sources``'.
    Records with bad data are skipped or raised as there: the results are taken in source order as the
    workers finish them, the failure budget spent and the first bad sample raised in that order, so a broken
    source stops the map after its first bad chunks, not at its end (the first failure in source order is the
    one raised, whichever worker found it).
    """
    _require_ray()  # before loading anything: a missing install is the first thing to say
    if num_proc is not None and (
        isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1
    ):
        raise ValueError(f"num_proc must be a positive int or None (every CPU), got {num_proc!r}")
    forecaster = make_forecaster(
        sources,
        tokenizer=tokenizer,
        spec=spec,
        family=family,
        template=template,
        preprocessor=preprocessor,
        record_format=record_format,
        image_root=image_root,
        exif_transpose=exif_transpose,
        verify=verify,
        on_error=on_error,
        who="forecast_ray",
        max_image_pixels=max_image_pixels,
    )
    pieces = ray_chunks(forecaster.sources, chunk_rows)
    # workers skip and report; the driver raises the first failure in source order, whichever worker found it,
    # and spends the failure budget as the results arrive in source order: a broken source stops the cluster
    # after its first bad chunks, as the local processes stop, not after the whole map
    shipped = replace(
        forecaster,
        sources=[_shippable(s) for s in forecaster.sources],
        pre=forecast_parts(forecaster.pre),
        on_error="skip",
    )
    ray, started = _connect(address)
    results = _map(ray, shipped, pieces, num_proc, progress)
    try:
        # "forecast_ray": the guard adds its stage ("header-only forecast"), as forecast_sources' does
        return assemble_table(results, max_consecutive_failures, "forecast_ray", on_error, max_bad_fraction)
    finally:
        results.close()  # a map stopped early shuts its executor down now, while Ray is still up
        if started:
            ray.shutdown()


def _map(
    ray: Any, forecaster: Any, pieces: list[Any], num_proc: int | None, progress: bool | None
) -> Generator[Any, None, None]:
    """The chunk results of ``pieces``, in their order, as a Ray Data ``map_batches`` makes them: each is
    yielded once it and all before it are done (the consumer may stop early; the map stops with it)."""
    if not pieces:
        return
    context = ray.data.DataContext.get_current()
    if progress is not None:
        context.enable_progress_bars = progress
    workers = num_proc or max(1, int(ray.cluster_resources().get("CPU", 1)))
    rows = [{"seq": i, "chunk": pickle.dumps(piece)} for i, piece in enumerate(pieces)]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))  # a block per chunk: the unit a worker takes
    mapped = ds.map_batches(
        _ChunkForecast,
        fn_constructor_args=(forecaster,),
        batch_size=1,
        concurrency=min(workers, len(rows)),
        num_cpus=1,
    )
    waiting: dict[int, bytes] = {}  # done out of order, held until the chunks before them are done
    nxt = 0
    rows_done = iter(mapped.iter_rows())
    try:
        for row in rows_done:
            waiting[int(row["seq"])] = row["result"]
            while nxt in waiting:
                yield pickle.loads(waiting.pop(nxt))
                nxt += 1
    except Exception as e:
        cause = _worker_error(e)
        if cause is None or cause is e:
            raise
        raise cause from None
    finally:  # stopped early (the failure budget) or done: end Ray Data's iteration here, not at garbage collection
        close = getattr(rows_done, "close", None)
        if close is not None:
            close()
    if nxt != len(rows):
        raise RuntimeError(f"forecast_ray: Ray Data returned {nxt} of {len(rows)} chunks in order; report this bug")


def build_plan_ray(
    sources: Any | Sequence[Any],
    preprocessor: Preprocessor,
    config: PackingConfig | None = None,
    *,
    world_size: int = 1,
    strategy: str = "bfd",
    record_format: str | None = None,
    image_root: str | os.PathLike[str] | None = None,
    lengths: str | os.PathLike[str] | None = None,
    num_proc: int | None = None,
    address: str | None = None,
    progress: bool | None = None,
    balance: StepBalance | EpochBalance | None = None,
    **knobs: Any,
) -> Plan:
    """:func:`forecast_ray` of ``sources``, the table written to ``lengths`` (a parquet file; None: not
    written), then planned as :func:`vlm_pack.data.build_plan` plans: the same :class:`~vlm_pack.data.Plan`
    as the single-process forecast planned with ``config`` (and ``capacity=``... over it) for ``world_size``
    ranks (``balance``: how packs are dealt to (step, rank), as there, or ``StepBalance``'s fields as
    keywords: ``grad_accum=``, ``cost=``...). Keyed by :func:`~vlm_pack.data.plan_key` when ``sources`` is one ``datasets.Dataset`` (so
    ``PackedMapDataset(plan=)`` takes it), else by its own content."""
    from ..data.lengths import write_lengths
    from ..data.plan import _check_world_size, forecast_settings, plan_dataset, resolve_settings
    from ..preprocessor import Preprocessor

    pre = Preprocessor.check(preprocessor)
    config, balance = resolve_settings("build_plan_ray", config, balance, knobs)
    _check_world_size(world_size)
    table = forecast_ray(
        sources, preprocessor=pre, record_format=record_format, image_root=image_root, num_proc=num_proc,
        address=address, progress=progress, **forecast_settings(config),
    )  # fmt: skip
    if lengths is not None:
        write_lengths(table, Path(lengths))
    ds, root = _one_dataset(sources, image_root)
    return plan_dataset(ds, pre, config, world_size, strategy, record_format, root, balance, 1, False, table)


def _one_dataset(sources: Any, image_root: Any) -> tuple[Any, Path | None]:
    """``(datasets.Dataset, image_root)`` when ``sources`` is one dataset, else ``(None, image_root)``."""
    from ..data.sources import open_sources

    single = isinstance(sources, (str, os.PathLike)) or not isinstance(sources, Sequence)
    items = [sources] if single else list(sources)
    # only a dataset object or a folder can be one: opening files again would re-read a JSON array
    if len(items) == 1 and (not isinstance(items[0], (str, os.PathLike)) or Path(items[0]).is_dir()):
        opened = open_sources(items, image_root=image_root)
        if len(opened) == 1 and opened[0].kind == "dataset":
            return opened[0].ref, opened[0].image_root
    return None, Path(image_root) if image_root is not None else None
