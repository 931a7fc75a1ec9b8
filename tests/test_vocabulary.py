"""One vocabulary: each setting has one name, one set of values and one default at every entry point.

``PackingConfig`` names, values and defaults a setting; the datasets (``PackedWebDataset``,
``PackedMapDataset``), the adapters (TRL's ``packed_dataset``, Energon's ``VLMPackingTaskEncoder``), the
forecast (``forecast_sources``) and the CLI flags take exactly its values, with its defaults, whether a
setting comes as a config or as a keyword. A value an entry point cannot do ("truncate" where no sample is ever
cut) is refused naming the values it takes; an old name or value raises naming the new one. ``layout`` is the
token layout only; the format records are stored in is ``record_format`` (``--format``).
"""

from __future__ import annotations

import argparse
import inspect

import datasets
import pytest

from vlm_pack import PackedWebDataset, PackingConfig, Preprocessor
from vlm_pack.cli.main import build_parser
from vlm_pack.config import DEFAULT_MAX_CONSECUTIVE_FAILURES, ON_ERROR, OVERSIZED
from vlm_pack.data import RECORD_FORMATS, normalise_record
from vlm_pack.data.forecast import forecast_sources
from vlm_pack.data.map_style import PackedMapDataset
from vlm_pack.data.sources import iter_samples
from vlm_pack.offline import build_tokenizer, image_processor
from vlm_pack.packing import StreamPacker, pack

DEFAULTS = PackingConfig(capacity=64)


@pytest.fixture(scope="module")
def parts():
    return build_tokenizer("qwen2_vl"), image_processor("qwen2_vl")


@pytest.fixture(scope="module")
def table():
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    return datasets.Dataset.from_list([{"messages": turn}] * 3)


def _stream(parts, config=None, **knobs):
    tok, ip = parts
    return PackedWebDataset("never-read-{0..1}.tar", Preprocessor(tok, ip), config, **knobs)


def _map(parts, table, config=None, **knobs):
    tok, ip = parts
    return PackedMapDataset(table, Preprocessor(tok, ip), config, cache=False, **knobs)


def _cli(command: str, *flags: str) -> argparse.Namespace:
    sources = ["x.tar"] + (["--capacity", "64", "--out", "p.jsonl"] if command == "pack" else [])
    return build_parser().parse_args([command, *sources, *flags])


def _choices(command: str, flag: str) -> tuple[str, ...]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if flag in a.option_strings)
    return tuple(action.choices)


def test_the_defaults_are_packing_configs_everywhere(parts, table):
    assert (DEFAULTS.oversized, DEFAULTS.on_error) == ("raise", "skip")
    assert DEFAULTS.max_consecutive_failures == DEFAULT_MAX_CONSECUTIVE_FAILURES
    # from keywords alone, the datasets build the very config PackingConfig(capacity) is
    assert _stream(parts, capacity=64).config == DEFAULTS
    assert _map(parts, table, capacity=64).config == DEFAULTS
    # and from a config, that config
    config = PackingConfig(capacity=64, oversized="skip", on_error="raise", max_samples_per_bin=2)
    assert _stream(parts, config).config == config == _map(parts, table, config).config
    # the packers read a PackingConfig: the config's defaults are theirs
    assert StreamPacker(64).config == DEFAULTS
    assert pack([1], 64).capacity == DEFAULTS.capacity and pack([1], DEFAULTS).bins == [[0]]
    # the functions' defaults are the config's
    for function, names in (
        (forecast_sources, ("on_error", "max_consecutive_failures", "max_bad_fraction", "exif_transpose")),
        (iter_samples, ("on_error",)),
    ):
        parameters = inspect.signature(function).parameters
        for name in names:
            assert parameters[name].default == getattr(DEFAULTS, name), (function.__name__, name)
    # the CLI's flags: one name each (PackingConfig's, dashed), its values and its defaults
    args = _cli("pack")
    for name in ("oversized", "on_error", "max_samples_per_bin", "vision_capacity", "vision_cost",
                 "pad_to_multiple_of", "shuffle_seed", "max_consecutive_failures", "max_bad_fraction"):  # fmt: skip
        assert getattr(args, name) == getattr(DEFAULTS, name), name
    # ... but an analysis counts too-long samples at each capacity rather than stopping at the first
    assert _cli("analyze").oversized == "skip" and _cli("analyze").on_error == DEFAULTS.on_error
    for command in ("analyze", "pack"):
        assert _choices(command, "--oversized") == OVERSIZED
        assert _choices(command, "--on-error") == ON_ERROR


def test_energon_takes_the_same_values_and_default(parts):
    energon = pytest.importorskip("vlm_pack.integrations.energon", reason="needs the [energon] extra")
    tok, ip = parts
    assert energon.VLMPackingTaskEncoder(Preprocessor(tok, ip), 64).oversized == DEFAULTS.oversized
    for value in ("raise", "skip"):
        assert energon.VLMPackingTaskEncoder(Preprocessor(tok, ip), 64, oversized=value).oversized == value
        config = PackingConfig(capacity=64, oversized=value)
        assert energon.VLMPackingTaskEncoder(Preprocessor(tok, ip), config).oversized == value
    with pytest.raises(ValueError, match=r"VLMPackingTaskEncoder cannot do oversized='truncate'.*'raise' or 'skip'"):
        energon.VLMPackingTaskEncoder(Preprocessor(tok, ip), 64, oversized="truncate")
    with pytest.raises(ValueError, match=r"oversized must be one of .*got 'report'"):  # old value: gone
        energon.VLMPackingTaskEncoder(Preprocessor(tok, ip), 64, oversized="report")
    with pytest.raises(ValueError, match="capacity 66 is not a multiple of pad_to_multiple_of 4"):
        energon.VLMPackingTaskEncoder(Preprocessor(tok, ip), 66, pad_to_multiple_of=4)


def test_a_value_an_entry_point_cannot_do_is_refused_by_name(parts, table, tmp_path):
    trl = pytest.importorskip("vlm_pack.integrations.trl", reason="needs the [trl] extra")
    tok, ip = parts
    for value in ("raise", "skip"):
        assert _stream(parts, capacity=64, oversized=value).config.oversized == value
        assert _map(parts, table, capacity=64, oversized=value).config.oversized == value
    refusals = {
        "PackedWebDataset": lambda **kw: _stream(parts, capacity=64, **kw),
        "PackedMapDataset": lambda **kw: _map(parts, table, capacity=64, **kw),
        "packed_dataset": lambda **kw: trl.packed_dataset(table, Preprocessor(tok, ip), capacity=64, **kw),
    }
    for who, build in refusals.items():
        with pytest.raises(ValueError, match=rf"{who} cannot do oversized='truncate'.*'raise' or 'skip'"):
            build(oversized="truncate")
        with pytest.raises(ValueError, match=r"on_error must be one of \('raise', 'skip'\), got 'warn'"):
            build(on_error="warn")
        with pytest.raises(ValueError, match=r"oversized must be one of \('raise', 'skip', 'truncate'\)"):
            build(oversized="clip")
    with pytest.raises(ValueError, match=r"on_error must be one of \('raise', 'skip'\)"):
        forecast_sources(table, tokenizer=tok, spec=Preprocessor(tok, ip).spec, on_error="warn")
    with pytest.raises(SystemExit):
        _cli("pack", "--on-error", "warn")
    # an offline plan can cut a sample: the CLI's pack takes "truncate"
    assert _cli("pack", "--oversized", "truncate").oversized == "truncate"


def test_old_names_are_gone_and_unknown(parts, table, capsys):
    """The renamed settings (CHANGELOG: max_samples_per_row, max_samples_per_pack -> max_samples_per_bin;
    seed -> shuffle_seed) are unknown names now, refused with the list of valid ones, never translated."""
    trl = pytest.importorskip("vlm_pack.integrations.trl", reason="needs the [trl] extra")
    tok, ip = parts
    builders = {
        "PackedWebDataset": lambda **kw: _stream(parts, capacity=64, **kw),
        "PackedMapDataset": lambda **kw: _map(parts, table, capacity=64, **kw),
        "packed_dataset": lambda **kw: trl.packed_dataset(table, Preprocessor(tok, ip), capacity=64, **kw),
        "PackingConfig.replace": lambda **kw: DEFAULTS.replace(**kw),
        "pack": lambda **kw: pack([1, 2], 4, **kw),
        "StreamPacker": lambda **kw: StreamPacker(4, **kw),
    }
    for who, build in builders.items():
        for old in ("max_samples_per_row", "seed", "max_samples_per_pack"):
            with pytest.raises(TypeError, match=rf"unknown (argument|packing option)\(s\) \['{old}'\]"):
                build(**{old: 1})
        with pytest.raises(TypeError, match=rf"{who}: layout= names the token layout only.*is record_format="):
            build(layout="llava")
    # a packing setting given to the collator alone would disagree with the plan: the dataset's keyword
    with pytest.raises(TypeError, match="pass max_samples_per_bin= to PackedWebDataset itself"):
        _stream(parts, capacity=64, collator_kwargs={"max_samples_per_bin": 2})
    with pytest.raises(TypeError, match="pass pad_to_multiple_of= to PackedMapDataset itself"):
        _map(parts, table, capacity=64, collator_kwargs={"pad_to_multiple_of": 4})
    # functions whose old name is simply gone: Python names the keyword
    for call in (
        lambda: forecast_sources(table, tokenizer=tok, spec=Preprocessor(tok, ip).spec, layout="llava"),
        lambda: normalise_record({"caption": "a"}, layout="caption"),
    ):
        with pytest.raises(TypeError, match="unexpected keyword argument"):
            call()
    for flag in ("--max-samples-per-pack", "--layout", "--seed", "--max-images-per-pack"):
        with pytest.raises(SystemExit):
            _cli("pack", flag, "2")
        assert f"unrecognized arguments: {flag} 2" in capsys.readouterr().err


def test_layout_is_the_token_layout_and_record_format_the_records(parts, table):
    tok, ip = parts
    with pytest.raises(ValueError, match="layout must be 'expanded' or 'collapsed'"):
        Preprocessor(tok, ip, layout="llava")
    assert _map(parts, table, capacity=64, record_format="messages").num_samples == 3
    spec = Preprocessor(tok, ip).spec
    assert len(forecast_sources(table, tokenizer=tok, spec=spec, record_format="messages", progress=False)) == 3
    with pytest.raises(ValueError, match="record_format must be one of"):
        forecast_sources(table, tokenizer=tok, spec=spec, record_format="expanded", progress=False)
    assert _cli("analyze", "--format", "llava").record_format == "llava"
    assert _choices("analyze", "--format") == _choices("pack", "--format") == tuple(RECORD_FORMATS)
    assert normalise_record({"caption": "a dog"}, record_format="caption").conversation == "a dog"
