"""Packing engine: group samples into fixed-capacity bins (packs) without losing any.

A *bin* is one row of a packed batch: the samples in it are laid end to end and
separated by ``cu_seqlens``, so nothing attends across a sample boundary. Every
sample is fitted on its **expanded length**, the number of positions it really
occupies in the language model: text tokens plus the vision tokens its images
expand into (``vision.py`` forecasts those from the image header, e.g. Qwen2-VL's
``(H/14) * (W/14) / 4`` for an image resized to H x W). Fitting on text alone
would overflow every bin that holds an image.

Samples are placed longest first, each into the open bin with the least free
space that still holds it (best-fit decreasing)::

    pack([900, 700, 500, 400, 300, 120, 60], capacity=1024)

             0                                                     1024
    bin 0   |s0 900 .....................................|s6 60 |    |   960 used
    bin 1   |s1 700 ..............................|s4 300 .........| |  1000 used
    bin 2   |s2 500 ................|s3 400 ...............|s5 120 | |  1020 used

    PackResult (flat arrays, no per-sample Python objects):
    order       = [0, 6, 1, 4, 2, 3, 5]     sample indices, bin by bin
    bin_offsets = [0, 2, 4, 7]              bin i = order[bin_offsets[i]:bin_offsets[i+1]]
    bin_lengths = [960, 1000, 1020]         tokens used per bin
    efficiency  = 2980 / (3 * 1024) = 0.970, lower_bound = ceil(2980 / 1024) = 3

Where things live (each file one concept):

- ``bins.py``: what packing returns (``PackResult``, ``PackedBin``, ``Unpacked``) and the shared input
  validation.
- ``offline.py``: :func:`pack`, which validates, sorts and hands the lengths to a core.
- ``histogram.py``: the fast whole-length cores (exact BFD / FFD on a length histogram).
- ``per_item.py``: one-item-at-a-time cores (budgets, samples-per-bin cap, first fit, next fit).
- ``online.py``: :class:`StreamPacker` (packs a stream as it arrives) and its ``StreamStats``; ``offline.py``'s
  :func:`pack` is its whole-dataset counterpart.
- ``ranks.py``: :func:`balance_bins` (fixed bins dealt to ranks) and the per-bin cost model.
- ``cost.py``: :class:`PackCost`, a pack's compute cost from the model's widths and depths (LM + vision tower).
- ``steps.py``: :func:`step_plan`, packs dealt to (step, rank) so each step costs the same on every rank
  (``StepBalance``), or by epoch totals (``EpochBalance``).
- ``balanced.py``: :func:`~vlm_pack.packing.balanced.balanced_packs`, packs made for a step plan (each rank's
  share of a step about the same cost) where dealing fixed packs cannot balance; ``step_lower_bound``.
- ``window.py``: :class:`StreamBalance`, the same for streaming without moving packs between ranks: a look-ahead
  window per rank emitted in a cost-quantile order every rank shares.

Three entry points:

- :func:`pack` packs a whole dataset offline (``"bfd"`` best-fit decreasing,
  ``"ffd"`` first-fit decreasing, ``"ff"`` first-fit in data order, ``"nf"``
  next-fit), with an optional second per-bin budget (``vision``: ViT patches
  before merge, or images per bin) and a cap on samples per bin.
- :class:`StreamPacker` packs an iterable stream with a bounded buffer of open
  bins, and its ``state_dict`` resumes mid-epoch to the exact same bins.
- :func:`balance_bins` deals bins to data-parallel ranks (Karmarkar-Karp) so each
  rank's attention + MLP + vision-tower work is balanced, not just its tokens.

Padding: a collator with ``pad_to_multiple_of=m`` (context parallelism, ``pad_multiple_for``) gives every
sample a span of its length rounded up to ``m``; plan on those spans (``pack(..., pad_to_multiple_of=m)``,
``StreamPacker(..., pad_to_multiple_of=m)``, ``PackingConfig(pad_to_multiple_of=m)``, all through
:func:`padded_lengths`) and each bin is exactly one row: ``[4093, 4097]`` at capacity 8192 is one bin raw
but ``[4096, 4100]``, two bins, at ``m = 4``.

Tie-breaking is part of the contract, so the bins are reproducible anywhere:
samples are visited longest first (then larger vision cost, then lower index);
best fit picks the bin with the least free token space among those the sample
fits, and among equal free space the bin modified most recently; first fit
picks the lowest-numbered bin it fits. Bins are numbered in the order they were
opened (``seed`` optionally shuffles that order afterwards). Nothing is lost:
every sample is in exactly one bin or in ``PackResult.unpacked`` with a reason.
"""

from .bins import PackedBin, PackResult, Unpacked, padded_lengths
from .cost import PackCost, pack_costs
from .offline import STRATEGIES, pack
from .online import StreamPacker, StreamStats
from .ranks import balance_bins, bin_costs, partition_imbalance
from .steps import EpochBalance, StepBalance, step_imbalance, step_plan
from .window import StreamBalance

__all__ = [
    "STRATEGIES",
    "EpochBalance",
    "PackCost",
    "PackResult",
    "PackedBin",
    "StepBalance",
    "StreamBalance",
    "StreamPacker",
    "StreamStats",
    "Unpacked",
    "balance_bins",
    "bin_costs",
    "pack",
    "pack_costs",
    "padded_lengths",
    "partition_imbalance",
    "step_imbalance",
    "step_plan",
]
