"""How much does packing save on a dataset? Forecast lengths from headers, pack, compare with padding.

The analysis behind ``vlm-pack analyze`` (and the notebook), in four steps::

    sources ----------> SampleInfo --------------> LengthTable ---------------> Report ------> table / JSON / PNG
    (shards, parquet,   key, conversation,         per sample: text tokens,     per capacity:
     JSON(L), datasets) image (width, height)      vision tokens, images,       padded baseline vs packed,
                        from headers only          where each image sits        grad-accum equivalent
       scan_samples()                 forecast_lengths()          analyze()        format_report() / write_report()
       '--- vlm_pack.data.forecast_sources(): both steps, in parallel processes ---'

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

Modules: ``sources`` (reading), ``lengths`` (forecast), ``analysis`` (metrics), ``plots``, ``output``.
"""

from .analysis import Baseline, analyze, analyze_capacity, padded_batches
from .lengths import LengthTable, forecast_lengths
from .output import format_report, write_report
from .plots import plot_efficiency, plot_lengths, plot_packs
from .sources import SampleInfo, SampleReadError, expand_sources, scan_samples

__all__ = [
    "Baseline",
    "LengthTable",
    "SampleInfo",
    "SampleReadError",
    "analyze",
    "analyze_capacity",
    "expand_sources",
    "forecast_lengths",
    "format_report",
    "padded_batches",
    "plot_efficiency",
    "plot_lengths",
    "plot_packs",
    "scan_samples",
    "write_report",
]
