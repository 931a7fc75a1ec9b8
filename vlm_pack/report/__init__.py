"""How much does packing save on a dataset? Forecast lengths from headers, pack, compare with padding.

The analysis behind ``vlm-pack analyze`` (and the notebook), in four steps::

    sources ------------------------------> LengthTable ---------------> Report ------> table / JSON / PNG
    (shards, parquet,   text + image headers  per sample: text tokens,     per capacity:
     JSON(L), datasets) (nothing decoded)     vision tokens, images,       padded baseline vs packed,
                                              where each image sits        grad-accum equivalent
             vlm_pack.forecast_sources()                    analyze()        format_report() / write_report()

Lengths are *expanded* lengths, the positions a sample occupies in the language model: its text tokens
(chat template included) plus the placeholders its images become (``vision.VisionSpec.sample_tokens``).
No pixel is decoded; the forecast equals ``len(process_sample(...)["input_ids"])``.

The padded baseline is what a plain ``DataLoader`` does: micro-batches of ``batch_size`` samples, each
padded to its longest sample, in random order and length-grouped (Hugging Face ``group_by_length``:
mega-batches of ``50 * batch_size`` sorted by length). A padded run has no capacity, so the baseline batches
every sample at its full length and is the same at every capacity::

    padded, B = 3                                 packed, capacity C
    |s0 ......|###########|   waste = #           |s0 ......|s4 ..|s7 ....|s2 .|##|   waste = 1 - efficiency
    |s1 .................|                        |s1 .................|s3 ....|#|
    |s2 ..|###############|

Packing changes how many samples one micro step sees (``per_step = mean_samples_per_pack * world_size *
packs_per_device``), so the gradient accumulation changes too. Two are reported: the recommended one, whose
``per_step * grad_accum`` is closest to ``target_samples_per_update``, and the smallest that reaches it
(``ceil(target / per_step)``). ``target_samples_per_update`` defaults to the padded run's ``batch_size *
world_size * grad_accum``.

Modules: ``analysis`` (metrics), ``plots``, ``output``; the forecast is ``vlm_pack.data.forecast``.
"""

from ..data.forecast import LengthTable
from .analysis import Baseline, analyze, analyze_capacity, padded_batches
from .output import format_report, write_report
from .plots import plot_efficiency, plot_lengths, plot_packs

__all__ = [
    "Baseline",
    "LengthTable",
    "analyze",
    "analyze_capacity",
    "format_report",
    "padded_batches",
    "plot_efficiency",
    "plot_lengths",
    "plot_packs",
    "write_report",
]
