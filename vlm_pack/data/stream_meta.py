"""Where a streamed batch carries its stream metadata (the state after it, its samples' shards and keys), and
what a stream that yields no batch yields instead: :func:`stream_info`, :class:`StreamEnd`."""

from __future__ import annotations

from typing import Any

__all__ = ["StreamEnd", "attach_meta", "stream_info"]

_META = "__stream__"  # where a yielded batch carries its stream metadata (see stream_info)


class StreamEnd:
    """Yielded by a stream that yields no batch at all, to carry its final state (see the module doc).

    :class:`~vlm_pack.data.PackedDataLoader` and single-process iteration consume it; with a plain
    ``DataLoader``, ``dataset.observe(item)`` records it and returns None: skip such items.
    """

    def __init__(self, meta: dict[str, Any]) -> None:
        self.metadata = {_META: meta}

    def __repr__(self) -> str:
        return f"StreamEnd(stream={self.metadata[_META]['snapshot'].stream})"


def attach_meta(batch: Any, meta: dict[str, Any]) -> None:
    # In PackedBatch.metadata: a dataclass field, so it survives .to(device) and pin_memory().
    metadata = getattr(batch, "metadata", None)
    if isinstance(metadata, dict):
        metadata[_META] = meta
    elif isinstance(batch, dict):
        batch[_META] = meta
    else:
        try:
            setattr(batch, _META, meta)
        except AttributeError:
            raise TypeError(
                f"the collator returned a {type(batch).__name__}, which cannot carry the stream metadata: "
                "return a PackedBatch, a dict, or an object with a 'metadata' dict."
            ) from None


def stream_info(batch: Any) -> dict[str, Any] | None:
    """The stream metadata a batch of :class:`PackedWebDataset` carries (None for other batches).

    Keys: ``epoch``, ``generation`` (re-deals after a layout change), ``layout`` ([world, workers]),
    ``samples`` ([shard URL, key] per sample, in the order given to the collator), ``lengths`` (processed
    lengths), ``forecast`` (forecast lengths, equal unless reported), ``snapshot`` (a
    :class:`~vlm_pack.data.state.StreamSnapshot`: the stream's state after this batch, ``.stream``,
    ``.seq``, ``.done``, ``.cursor``, buffers, packer and RNG states, ``.stats``). The per-sample keys in
    packed order are ``batch.metadata["__key__"]`` / ``["__url__"]``.
    """
    metadata = getattr(batch, "metadata", None)
    if isinstance(metadata, dict) and _META in metadata:
        return metadata[_META]
    if isinstance(batch, dict):
        return batch.get(_META)
    return getattr(batch, _META, None)
