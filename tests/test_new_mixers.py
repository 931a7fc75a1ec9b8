"""The token mixers transformers 5.21-5.25 brought, isolated per sample: packed = each sample alone.

Tiny genuine text models built from the 5.25 configs (fp32 CPU, sdpa and eager): LFM3's short convolutions
(``Lfm3ShortConv``), Nemotron-H's Mamba2 (``NemotronHMamba2Mixer``, the text model of ``nemotron_h_omni``),
Qwen4-Exp's gated delta-net (``Qwen4ExpTextGatedDeltaNet``), GLM-5-Next's Kimi delta attention
(``Glm5NextTextLinearAttention``), MiniCPM-V 4.6's text model (``qwen3_5_text``: Qwen3.5's delta-net). Inkling2's
short convolutions inside attention blocks and GLM-5-Next's indexed attention are refused by name. Oracle: each
sample run alone through the same model; control: the same row without isolation leaks.
"""

from __future__ import annotations

import pytest
import torch

import vlm_pack as vp
from vlm_pack.forward.mixers import find_token_mixers
from vlm_pack.forward.packed_calls import guard_packed_calls
from vlm_pack.testing import unguarded

transformers = pytest.importorskip("transformers")
T = transformers

LENGTHS = (37, 53, 29, 45)
_DIMS = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, initializer_range=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=2)  # fmt: skip
_DELTA = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)


def _config(name: str):
    if name == "lfm3":
        return T.Lfm3Config(**_DIMS, num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"])
    if name == "nemotron_h" and "linear_attention" not in str(getattr(T.NemotronHConfig, "__init__", "")):
        try:
            T.NemotronHConfig(layers_block_type=["linear_attention"], num_hidden_layers=1)
        except Exception:  # an earlier release names its layer kinds otherwise (mamba, attention)
            pytest.skip(f"transformers {T.__version__}'s NemotronHConfig has other layer kinds than 5.25's")
    if name == "nemotron_h":
        return T.NemotronHConfig(**_DIMS, num_hidden_layers=4, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16,
                                 n_groups=2, chunk_size=16,
                                 layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention"])  # fmt: skip
    if name == "qwen4_exp":
        return T.Qwen4ExpTextConfig(**_DIMS, **_DELTA, num_hidden_layers=2, moe_intermediate_size=32,
                                    layer_types=["linear_attention", "full_attention"],
                                    shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                    hc_count=2, hc_lowrank=8, indexer_n_heads=2, indexer_kv_heads=1,
                                    indexer_head_dim=16, indexer_budget=64, indexer_compress_ratio=4)  # fmt: skip
    if name == "glm5_next":  # its linear-attention layers (the indexed attention layer is refused: below)
        return T.Glm5NextTextConfig(**(_DIMS | dict(num_key_value_heads=4)), num_hidden_layers=2,
                                    layer_types=["linear_attention"] * 2, linear_head_dim=16, linear_num_heads=4,
                                    hc_mult=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)  # fmt: skip
    if name == "minicpmv4_6":  # the VLM's text model, as its config builds it
        try:
            cfg = T.MiniCPMV4_6Config(text_config=dict(**_DIMS, **_DELTA, num_hidden_layers=4,
                                                       layer_types=["linear_attention"] * 3 + ["full_attention"]))  # fmt: skip
        except KeyError:  # an earlier release's config names its text model otherwise
            pytest.skip(f"transformers {T.__version__}'s MiniCPMV4_6Config takes no qwen3_5_text text config")
        assert cfg.text_config.model_type == "qwen3_5_text"
        return cfg.text_config
    raise AssertionError(name)


_CLASSES = {"lfm3": "Lfm3Config", "nemotron_h": "NemotronHConfig", "qwen4_exp": "Qwen4ExpTextConfig",
            "glm5_next": "Glm5NextTextConfig", "minicpmv4_6": "MiniCPMV4_6Config", "inkling2": "Inkling2TextConfig"}


def _needs(name: str) -> None:
    if not hasattr(T, _CLASSES[name]):
        pytest.skip(f"transformers {T.__version__} has no {_CLASSES[name]} (5.21-5.25 added it)")


def _model(name: str, attn: str):
    _needs(name)
    torch.manual_seed(0)
    config = _config(name)
    config._attn_implementation = attn
    model = T.Glm5NextTextModel(config) if name == "glm5_next" else T.AutoModelForCausalLM.from_config(config)
    return model.eval()


def _out(output) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output.last_hidden_state


def _row() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Four samples in one row with what ``PackedBatch.model_inputs("sdpa")`` gives a family with mixers:
    restarted positions and ``seq_idx``."""
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(3, 128, (n,), generator=g) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    seq_idx = torch.cat([torch.full((n,), k, dtype=torch.int32) for k, n in enumerate(LENGTHS)])[None]
    return samples, {"input_ids": torch.cat(samples)[None], "position_ids": positions, "seq_idx": seq_idx}


def _gap(model, samples, inputs) -> float:
    with torch.no_grad():
        packed = _out(model(**inputs, use_cache=False))[0]
        alone = torch.cat([_out(model(input_ids=s[None], use_cache=False))[0] for s in samples])
    return float((packed - alone).abs().max())


# Qwen4-Exp's tiny model takes ~20 s to build and run on a loaded 2-core machine (its indexer and hyper-connections)
NAMES = ["lfm3", "nemotron_h", pytest.param("qwen4_exp", marks=pytest.mark.slow), "glm5_next", "minicpmv4_6"]
KINDS = {"lfm3": "short_conv", "nemotron_h": "mamba2", "qwen4_exp": "gated_delta_net",
         "glm5_next": "kimi_delta_attention", "minicpmv4_6": "gated_delta_net"}  # fmt: skip


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_each_sample_alone(name, attn):
    model = _model(name, attn)
    mixers = find_token_mixers(model)
    assert mixers and {(m.kind, m.isolation) for m in mixers} == {(KINDS[name], "none")}
    samples, inputs = _row()
    plain = {k: v for k, v in inputs.items() if k != "seq_idx"}
    with unguarded():  # the control: transformers' layers carry one sample into the next
        assert _gap(model, samples, plain) > 1e-2
    vp.isolate_token_mixers(model)
    assert {m.isolation for m in find_token_mixers(model)} == {"per_sample"}
    assert _gap(model, samples, inputs) < 1e-4
    assert _gap(model, samples, plain) < 1e-4  # boundaries from the restarted positions alone


@pytest.mark.parametrize("name", NAMES)
def test_unisolated_layers_called_with_the_rows_marker_are_isolated_first(name):
    """No manual call: the packed-call guard (armed by vlm-pack's collators; here by hand) isolates the model at
    its first call with ``seq_idx``, where transformers' own layers would refuse the marker (5.24 on) or leak."""
    assert guard_packed_calls()
    samples, inputs = _row()
    model = _model(name, "sdpa")
    assert _gap(model, samples, inputs) < 1e-4
    assert {m.isolation for m in find_token_mixers(model)} == {"per_sample"}


def test_mixers_vlm_pack_cannot_split_are_refused_by_name():
    _needs("inkling2")
    _needs("glm5_next")
    inkling = T.Inkling2ForCausalLM(T.Inkling2TextConfig(**_DIMS, num_hidden_layers=1))
    names = [m.name for m in find_token_mixers(inkling)]
    assert "model.layers.0.self_attn.k_proj.sconv" in names
    with pytest.raises(ValueError, match=r"layer model\.layers\.0\.self_attn\.k_proj\.sconv .*conv_mask"):
        vp.isolate_token_mixers(inkling)
    config = _config("glm5_next")
    config.layer_types, config.num_hidden_layers = ["linear_attention", "full_attention"], 2
    config = T.Glm5NextTextConfig(**config.to_dict())
    glm = T.Glm5NextTextModel(config)
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.indexer .*indexed attention"):
        vp.isolate_token_mixers(glm)
    assert glm.layers[0].self_attn.__dict__.get("forward") is None  # refused before touching anything
