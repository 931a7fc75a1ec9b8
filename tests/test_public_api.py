"""The public API: one name per concept, every name importable, and ``import vlm_pack`` loads nothing heavy."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys

import pytest

_PROBE = """
import json, sys
import vlm_pack
before = sorted(sys.modules)
names = {n: type(getattr(vlm_pack, n)).__name__ for n in vlm_pack.__all__}
print(json.dumps({"before": before, "names": names, "dir": dir(vlm_pack)}))
"""

#: What a user calls, stage by stage (README.md and docs/).
TOP_LEVEL = {
    "__version__",
    # configure, forecast, process
    "PackingConfig", "Preprocessor", "image_size", "vision_spec",
    # plan
    "pack", "StreamPacker", "balance_bins",
    # collate
    "PackingCollator", "PackedBatch", "pad_multiple_for", "roll_packed",
    # load
    "PackedDataLoader", "PackedMapDataset", "PackedSampler", "PackedWebDataset", "forecast_sources",
    "stream_info", "write_shards", "write_shards_from_folder",
    # attend
    "varlen_attention", "use_varlen_attention", "isolate_token_mixers",
    # scale out
    "shard_for_context_parallel", "roll_packed_context_parallel", "check_parallel_config", "PerTokenLoss",
    "token_cross_entropy",
    # failures
    "SampleError", "SampleCodeError", "FailureBudgetError",
}  # fmt: skip

#: Names that left the top level, and the module a user imports them from now.
MOVED = {
    "process_sample": "vlm_pack.processing",
    "forecast_length": "vlm_pack.processing",
    "tokenize_conversation": "vlm_pack.processing",
    "remap_cu_seqlens": "vlm_pack.collate.remap",
    "remap_cu_seqlens_padded": "vlm_pack.collate.remap",
    "gather_from_context_parallel": "vlm_pack.forward.context_parallel",
    "all_gather_from_context_parallel": "vlm_pack.forward.context_parallel",
    "context_parallel_index": "vlm_pack.forward.context_parallel",
    "ContextParallelShard": "vlm_pack.forward.context_parallel",
    "reduce_token_loss": "vlm_pack.forward.loss",
    "mrope_position_ids": "vlm_pack.collate.positions",
    "packed_position_ids": "vlm_pack.collate.positions",
    "PackedBin": "vlm_pack.packing",
    "PackResult": "vlm_pack.packing",
    "PackedSeqParams": "vlm_pack.collate.batch",
    "PipelineStats": "vlm_pack.data",
    "VisionSpec": "vlm_pack.vision",
    "vision_spec_from_processor": "vlm_pack.vision",
    "available_backends": "vlm_pack.forward.attention",
    "register_hf_attention": "vlm_pack.forward.attention",
    "resolve_backend": "vlm_pack.forward.attention",
    "pad_samples": "vlm_pack.collate.padded",
}


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.slow
def test_import_is_lazy_and_every_public_name_resolves():
    probe = _run(_PROBE)
    loaded = set(probe["before"])
    heavy = ("vlm_pack.testing", "vlm_pack.offline", "vlm_pack.demo", "vlm_pack.forward.attention",
             "vlm_pack.forward.context_parallel", "vlm_pack.forward.loss", "vlm_pack.data", "megatron", "matplotlib",
             "webdataset", "torch", "transformers")  # fmt: skip
    assert not loaded & set(heavy), sorted(loaded & set(heavy))
    # Every advertised name resolves (to a class, function or string), and dir() lists them all.
    import vlm_pack

    assert set(probe["names"]) == set(vlm_pack.__all__)
    assert "module" not in probe["names"].values(), probe["names"]
    assert set(vlm_pack.__all__) <= set(probe["dir"])


def test_top_level_is_what_a_user_calls():
    import vlm_pack

    assert set(vlm_pack.__all__) == TOP_LEVEL
    assert len(vlm_pack.__all__) <= 32


@pytest.mark.parametrize("name", sorted(MOVED))
def test_moved_names_live_in_their_module_only(name):
    import vlm_pack as vp

    assert name not in vp.__all__
    with pytest.raises(AttributeError, match=name):
        getattr(vp, name)
    assert getattr(importlib.import_module(MOVED[name]), name) is not None


def test_removed_names_are_gone():
    """Shims and duplicates with one replacement each (CHANGELOG): nothing still answers to the old name."""
    from vlm_pack import preprocessor, processing, report
    from vlm_pack.collate import remap

    assert not hasattr(remap, "collapse_cu_seqlens")  # remap_cu_seqlens(..., inverse=True)
    assert not hasattr(remap, "roll_packed")  # vlm_pack.collate.labels.roll_packed (vlm_pack.roll_packed)
    assert not hasattr(processing, "forecast_prompt")  # Preprocessor.forecast_prompt
    assert not hasattr(processing, "_image_token_id")
    assert not hasattr(report, "expand_sources")  # vlm_pack.data.sources.open_sources
    assert not hasattr(preprocessor, "checked_preprocessor")  # Preprocessor.check
    assert importlib.util.find_spec("vlm_pack.parallel") is None  # vlm_pack.forward.context_parallel, vlm_pack.forward.loss


@pytest.mark.slow
def test_scaffolding_is_opt_in():
    """``vlm_pack.testing`` / ``offline`` / ``demo`` are modules a user imports, not top-level names."""
    probe = _run(
        "import json, sys, vlm_pack\n"
        "missing = [n for n in ('testing', 'offline', 'demo') if not hasattr(vlm_pack, n)]\n"
        "from vlm_pack.testing import check_packed_equivalence\n"
        "from vlm_pack.offline import build_tokenizer\n"
        "print(json.dumps({'missing': missing}))\n"
    )
    assert probe["missing"] == ["testing", "offline", "demo"]


@pytest.mark.slow
def test_trl_adapter_does_not_load_the_test_harness():
    pytest.importorskip("trl")
    probe = _run("import json, sys\nimport vlm_pack.integrations.trl\nprint(json.dumps(sorted(sys.modules)))")
    assert not {m for m in probe if m.startswith("vlm_pack.testing")}, "the TRL adapter imports vlm_pack.testing"


def test_one_name_per_concept():
    import vlm_pack as vp
    from vlm_pack.config import PackingConfig

    assert vp.PackingConfig is PackingConfig
    for alias in ("build_packed_pipeline", "select_backend"):
        assert alias not in vp.__all__ and not hasattr(vp, alias)
    # A typo is an AttributeError that names it, not a silent None.
    try:
        vp.PackingConfg  # noqa: B018
    except AttributeError as e:
        assert "PackingConfg" in str(e)
    else:
        raise AssertionError("vp.PackingConfg resolved")


def test_one_label_shift_and_one_ignore_index():
    """The per-sample shift has one definition (``labels.roll_packed``); every caller uses it."""
    import inspect

    from vlm_pack.collate import batch, labels
    from vlm_pack.collate import collator as collate
    from vlm_pack.forward import context_parallel, loss

    assert labels.IGNORE_INDEX == -100
    for module in (batch, collate, context_parallel, loss):
        assert getattr(module, "IGNORE_INDEX", labels.IGNORE_INDEX) is labels.IGNORE_INDEX
        source = inspect.getsource(module)
        assert "IGNORE_INDEX = " not in source, module.__name__
    source = inspect.getsource(context_parallel)
    assert "torch.cat([x[..., 1:]" not in source and "_roll_labels_full" not in source
