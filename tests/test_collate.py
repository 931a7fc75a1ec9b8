"""collate.py: PackingCollator on real processors, tokenizers and tiny real HF models."""

from __future__ import annotations

import inspect
import itertools
import pickle
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from vlm_pack.collate import collator as collate_module
from vlm_pack.collate.collator import PackedBatch, PackingCollator, pad_multiple_for
from vlm_pack.collate.rows import one_row, repack
from vlm_pack.collate.settings import SOURCES, CollatorSettings
from vlm_pack.config import PackingConfig
from vlm_pack.offline import build_tokenizer, image_processor, processor, tiny_model
from vlm_pack.packing import pack, padded_lengths
from vlm_pack.processing import process_sample

QWEN_SMALL = {"shortest_edge": 3136, "longest_edge": 112 * 112}  # at most 16 vision tokens per image


def img(w: int, h: int, seed: int) -> Image.Image:
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())


CONVERSATIONS = [
    (
        [img(56, 56, 0)],
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it"}]},
            {"role": "assistant", "content": "a red square"},
        ],
    ),
    ([], "the dog is large and the cat is small"),
    (
        [img(112, 56, 1), img(56, 84, 2)],
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "compare"}],
            },
            {"role": "assistant", "content": "green and blue"},
        ],
    ),
    ([img(70, 90, 3)], "a photo of a tree near a house"),
    ([], [{"role": "user", "content": "count to three"}, {"role": "assistant", "content": "one two three"}]),
]


@pytest.fixture(scope="module")
def qwen():
    tok = build_tokenizer("qwen2_vl")
    ip = image_processor("qwen2_vl", size=QWEN_SMALL)
    model = tiny_model("qwen2_vl", tok, initializer_range=0.2)
    samples = [
        process_sample(ims, c, tokenizer=tok, image_processor=ip, family="qwen2_vl")
        for ims, c in CONVERSATIONS
    ]
    collapsed = [
        process_sample(ims, c, tokenizer=tok, image_processor=ip, family="qwen2_vl", layout="collapsed")
        for ims, c in CONVERSATIONS
    ]
    return tok, model, samples, collapsed


def sample_span(batch: PackedBatch, k: int) -> tuple[int, int, int]:
    """(row, start in row, real length) of packed sample k."""
    r = int(batch.row_of_sample[k])
    return r, int(batch.cu_seqlens_padded[k]) - r * batch.row_length, int(batch.seq_lens[k])


def hf_rope(model, s):
    pos, _ = model.model.get_rope_index(
        s["input_ids"][None],
        mm_token_type_ids=s["mm_token_type_ids"][None],
        image_grid_thw=s.get("image_grid_thw"),
    )
    return pos[:, 0]


# ------------------------------------------------------------------------------------ expanded layout


def test_qwen_layout_labels_positions_padding(qwen):
    tok, model, samples, _ = qwen
    m = 8
    collator = PackingCollator(
        64, tokenizer=tok, model_config=model.config, pad_to_multiple_of=m, max_rows=None
    )
    b = collator(samples)
    n = len(samples)
    R, T = b.input_ids.shape
    assert b.num_rows == R and T == 64 and b.position_ids.shape == (4, R, T)
    assert sorted(b.sample_index.tolist()) == list(range(n))  # nothing dropped, nothing twice
    lens = [samples[i]["input_ids"].numel() for i in b.sample_index.tolist()]
    assert b.seq_lens.tolist() == lens and b.seq_lens.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [sum(lens[:k]) for k in range(n + 1)]
    assert b.cu_seqlens.dtype == b.cu_seqlens_padded.dtype == torch.int32
    spans = b.cu_seqlens_padded.diff()
    assert bool((spans % m == 0).all()) and int(b.cu_seqlens_padded[-1]) == R * T
    assert {r * T for r in range(R + 1)} <= set(b.cu_seqlens_padded.tolist())  # rows end on boundaries
    assert b.max_seqlen == max(lens) and b.num_real_tokens == sum(lens)
    assert b.row_of_sample.tolist() == sorted(b.row_of_sample.tolist())

    text_pos = b.position_ids[0]
    for k, i in enumerate(b.sample_index.tolist()):
        s = samples[i]
        r, st, L = sample_span(b, k)
        end = int(b.cu_seqlens_padded[k + 1]) - r * T
        assert torch.equal(b.input_ids[r, st : st + L], s["input_ids"])
        assert bool((b.input_ids[r, st + L : end] == tok.pad_token_id).all())
        # labels: the first token never a target, the rest as processed, padding ignored
        assert int(b.labels[r, st]) == -100
        assert torch.equal(b.labels[r, st + 1 : st + L], s["labels"][1:])
        assert bool((b.labels[r, st + L : end] == -100).all())
        # positions: restart per sample, padding continues the arange; mRoPE = the model's own per sample
        assert text_pos[r, st:end].tolist() == list(range(end - st))
        assert torch.equal(b.position_ids[1:, r, st : st + L], hf_rope(model, s))
        assert torch.equal(b.mm_token_type_ids[r, st : st + L], s["mm_token_type_ids"])
    order = b.sample_index.tolist()
    with_images = [samples[i] for i in order if "image_grid_thw" in samples[i]]
    assert torch.equal(b.image_grid_thw, torch.cat([s["image_grid_thw"] for s in with_images]))
    assert torch.equal(b.pixel_values, torch.cat([s["pixel_values"] for s in with_images]))
    assert torch.equal(b.tokens_per_image, torch.cat([s["tokens_per_image"] for s in with_images]))


@pytest.mark.slow
def test_packed_forward_matches_each_sample_alone(qwen):
    tok, model, samples, _ = qwen
    b = PackingCollator(
        64, tokenizer=tok, model_config=model.config, pad_to_multiple_of=4, max_rows=None
    )(samples)
    with torch.no_grad():
        out = model(**b.model_inputs("sdpa"))
        logp = out.logits.log_softmax(-1)
        loss_sum, n_targets = 0.0, 0
        for k, i in enumerate(b.sample_index.tolist()):
            s = samples[i]
            single = model(
                input_ids=s["input_ids"][None],
                labels=s["labels"][None],
                pixel_values=s.get("pixel_values"),
                image_grid_thw=s.get("image_grid_thw"),
                mm_token_type_ids=s["mm_token_type_ids"][None],
            )
            r, st, L = sample_span(b, k)
            assert torch.allclose(logp[r, st : st + L], single.logits[0].log_softmax(-1), atol=1e-4, rtol=0)
            n = int((s["labels"][1:] != -100).sum())
            loss_sum += float(single.loss) * n
            n_targets += n
    # The packed loss is the token-weighted mean of the samples' own losses: no target crosses a sample.
    assert abs(float(out.loss) - loss_sum / n_targets) < 1e-4
    assert b.num_label_tokens == n_targets
    eager = tiny_model("qwen2_vl", tok, initializer_range=0.2, attn_implementation="eager")
    with torch.no_grad():
        assert torch.allclose(eager(**b.model_inputs("eager")).logits, out.logits, atol=1e-4, rtol=0)


def test_padding_multiples_and_unpadded_rows(qwen):
    tok, _, samples, _ = qwen
    b = PackingCollator(
        96,
        tokenizer=tok,
        family="qwen2_vl",
        pad_to_multiple_of=pad_multiple_for(cp=4),
        pad_to_capacity=False,
        max_rows=None,
    )(samples)
    assert b.pad_to_multiple_of == 8
    assert bool((b.cu_seqlens_padded.diff() % 8 == 0).all())
    assert b.row_length == int(b.cu_seqlens_padded[-1]) // b.num_rows <= 96
    assert b.row_length % 8 == 0


def _text(n: int, key: object) -> dict:
    return {"input_ids": torch.arange(1, n + 1), "__key__": key}


def test_a_planned_bin_is_one_row_or_an_error_naming_its_samples():
    samples = [_text(n, f"s{n}") for n in (30, 33, 36)]  # 99 tokens; padded to multiples of 4: 104
    # in-batch packing is an opt-in (max_rows=None): it re-packs the list into the rows it needs
    assert PackingCollator(100, pad_to_multiple_of=4, max_rows=None)(samples).num_rows == 2
    assert PackingCollator(100, pad_to_multiple_of=4, max_rows=2)(samples).num_rows == 2
    one_row = PackingCollator(100, pad_to_multiple_of=4)  # the default: one bin, one row
    assert one_row.max_rows == 1
    with pytest.raises(
        ValueError,
        match=r"sample 0 \(key 's30'\), sample 1 \(key 's33'\), sample 2 \(key 's36'\) need 2 rows of capacity "
        r"100 \(expanded lengths \[30, 33, 36\], padded to multiples of 4: \[32, 36, 36\]; 104 tokens\).*"
        r"pad_to_multiple_of=4.*opt in with PackingCollator\(\.\.\., max_rows=None\)",
    ):
        one_row(samples)
    # Lengths near the edge: every bin pack() plans with the collator's multiple is exactly one row ...
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 61, (60,), generator=g).tolist()
    for b in pack(lengths, 100, pad_to_multiple_of=4).bins:
        batch = one_row([_text(lengths[i], i) for i in b])
        assert batch.num_rows == 1 and sorted(batch.sample_keys) == sorted(b)
        assert batch.seq_lens.tolist() == [lengths[i] for i in batch.sample_keys]
    # ... while a plan on the raw lengths has bins that two rows would hold: refused, not split.
    too_big = [b for b in pack(lengths, 100).bins if padded_lengths([lengths[i] for i in b], 4).sum() > 100]
    assert too_big
    with pytest.raises(ValueError, match="need 2 rows"):
        one_row([_text(lengths[i], i) for i in too_big[0]])
    assert pickle.loads(pickle.dumps(one_row)).max_rows == 1
    with pytest.raises(ValueError, match="max_rows must be a positive int or None"):
        PackingCollator(100, max_rows=0)


def test_one_bin_is_one_row_in_its_order_and_the_repacker_is_a_function_of_its_own(monkeypatch):
    # rows of one call: one_row keeps a bin as given, repack groups a list (padded spans 32, 36, 36)
    assert one_row([32, 36, 36], 104, None) == [[0, 1, 2]]
    assert one_row([32, 36, 36], 100, None) is None  # 104 tokens fit no row of 100
    assert one_row([32, 36], 100, 1) is None  # two samples, at most one per row
    assert repack([36, 32, 36], 100, "bfd", None) == [[0, 2], [1]]  # the two 36s fill one row
    assert repack([36, 32, 36], 100, "nf", 1) == [[0], [1], [2]]
    samples = [_text(n, f"s{n}") for n in (36, 9, 21)]

    def refuse(*args, **kwargs):
        raise AssertionError("a bin that fits one row was re-packed")

    monkeypatch.setattr(collate_module, "repack", refuse)
    batch = PackingCollator(72, pad_to_multiple_of=4)(samples)  # the default, max_rows=1
    assert batch.sample_keys == ["s36", "s9", "s21"] and batch.num_rows == 1
    assert batch.cu_seqlens_padded.tolist() == [0, 36, 48, 72]  # 36, 12, 24: the row is the bin's span
    with pytest.raises(AssertionError, match="re-packed"):
        PackingCollator(72, pad_to_multiple_of=4, max_rows=None)(samples)  # opted in: re-packs


def test_the_settings_are_read_once_from_one_table():
    proc = processor("qwen2_vl", size=QWEN_SMALL)
    tok = proc.tokenizer
    config = SimpleNamespace(
        model_type="qwen2_vl",
        image_token_id=tok.image_token_id + 1,  # the config's id wins over the tokenizer's
        pad_token_id=tok.pad_token_id + 1,  # ... but the tokenizer pads
        text_config=SimpleNamespace(sliding_window=None, pad_token_id=None),
        vision_config=SimpleNamespace(spatial_merge_size=None, tokens_per_second=2),
    )
    s = CollatorSettings.resolve(tokenizer=proc, model_config=config)
    assert s.family == "qwen2_vl" and s.mrope and s.two_way_layers == ()
    assert s.image_token_id == tok.image_token_id + 1 and s.pad_token_id == tok.pad_token_id
    assert s.video_token_id == tok.video_token_id and s.vision_start_token_id == tok.vision_start_token_id
    assert s.spatial_merge_size == proc.image_processor.merge_size and s.tokens_per_second == 2
    assert CollatorSettings.resolve(tokenizer=proc, model_config=config, image_token_id=5).image_token_id == 5
    assert CollatorSettings.resolve().to_dict() == {
        **{name: default for name, (_, default) in SOURCES.items()}, "family": None, "two_way_layers": (),
        "mrope": False,
    }
    with pytest.raises(TypeError, match="no such setting"):
        CollatorSettings.resolve(image_token=5)
    collator = PackingCollator(64, tokenizer=proc, model_config=config)
    assert collator.settings == s
    assert (collator.family, collator.image_token_id, collator.spatial_merge_size) == ("qwen2_vl", s.image_token_id, 2)
    # a real model's config gives what its own forward reads
    model = tiny_model("qwen2_vl", tok)
    real = PackingCollator(64, tokenizer=tok, model_config=model.config)
    assert real.image_token_id == model.config.image_token_id
    assert real.spatial_merge_size == model.config.vision_config.spatial_merge_size


def test_from_config_reads_the_packing_config(qwen):
    tok, model, samples, _ = qwen
    config = PackingConfig(capacity=96, pad_to_multiple_of=4, max_samples_per_bin=2)
    collator = PackingCollator.from_config(config, tokenizer=tok, model_config=model.config)
    assert (collator.capacity, collator.pad_to_multiple_of, collator.max_samples_per_bin) == (96, 4, 2)
    assert collator.max_rows == 1 and collator.family == "qwen2_vl"
    by_hand = PackingCollator(96, tokenizer=tok, model_config=model.config, pad_to_multiple_of=4, max_rows=1)
    a, b = collator(samples[:2]), by_hand(samples[:2])
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
    with pytest.raises(ValueError, match="and at most 2 samples"):
        collator([samples[1], samples[4], samples[1]])  # three samples: more than a bin holds


def test_strategies_keep_every_sample(qwen):
    tok, _, samples, _ = qwen
    lens = [s["input_ids"].numel() for s in samples]
    nf = PackingCollator(64, tokenizer=tok, family="qwen2_vl", strategy="nf", max_rows=None)(samples)
    assert nf.sample_index.tolist() == list(range(len(samples)))  # next-fit keeps the data order
    bfd = PackingCollator(64, tokenizer=tok, family="qwen2_vl", max_rows=None)(samples)
    assert bfd.num_rows == -(-sum(lens) // 64)  # as few rows as the lengths allow here
    one = PackingCollator(64, tokenizer=tok, family="qwen2_vl", max_samples_per_bin=1, max_rows=None)(samples)
    assert one.num_rows == len(samples)


def test_sample_keys_follow_the_packed_order(qwen):
    """batch.sample_keys: each packed sample's own key (WebDataset __key__, else key/id), in packed order;
    every other non-tensor field is in batch.metadata; model_input_names() are the model inputs."""
    tok, _, samples, _ = qwen
    names = [f"shard-0/{i:06d}" for i in range(len(samples))]
    keyed = [dict(s, __key__=name, source="demo") for s, name in zip(samples, names)]
    b = PackingCollator(64, tokenizer=tok, family="qwen2_vl", max_rows=None)(keyed)
    order = b.sample_index.tolist()
    assert order != sorted(order)  # bfd reorders these samples: the keys must follow them
    assert b.sample_keys == [names[i] for i in order]
    assert b.metadata["source"] == ["demo"] * len(samples)
    assert "__key__" not in b.model_input_names() and "input_ids" in b.model_input_names()
    by_id = PackingCollator(64, tokenizer=tok, family="qwen2_vl", max_rows=None)(
        [dict(s, id=i * 10) for i, s in enumerate(samples)]
    )
    assert by_id.sample_keys == [i * 10 for i in by_id.sample_index.tolist()]
    assert PackingCollator(64, tokenizer=tok, family="qwen2_vl", max_rows=None)(samples).sample_keys is None


# ----------------------------------------------------------------------------------- collapsed layout


def test_collapsed_layout_matches_expanded(qwen):
    tok, model, expanded, collapsed = qwen
    kw = dict(tokenizer=tok, model_config=model.config, pad_to_multiple_of=8)
    e = PackingCollator(64, **kw, max_rows=None)(expanded)
    c = PackingCollator(64, layout="collapsed", **kw, max_rows=None)(collapsed)
    assert torch.equal(c.sample_index, e.sample_index) and c.num_rows == e.num_rows
    assert c.input_ids.shape[0] == 1  # packs are consecutive segments of one "thd" row
    # Expanded boundaries (what attention needs) agree with the expanded layout's own.
    assert torch.equal(c.cu_seqlens_expanded, e.cu_seqlens)
    assert torch.equal(c.cu_seqlens_padded_expanded, e.cu_seqlens_padded)
    assert torch.equal(c.seq_lens_expanded, e.seq_lens)
    assert bool((c.cu_seqlens_padded_expanded.diff() % 8 == 0).all())
    # Collapsed boundaries count one token per image.
    tpi = [expanded[i]["tokens_per_image"] for i in c.sample_index.tolist()]
    extra = torch.tensor([int(t.sum()) - t.numel() for t in tpi], dtype=torch.int32)
    assert torch.equal(c.seq_lens + extra, e.seq_lens)
    assert c.seq_lens.tolist() == [collapsed[i]["input_ids"].numel() for i in c.sample_index.tolist()]
    # Positions are given in expanded space: identical to the expanded layout's.
    assert torch.equal(c.position_ids, e.position_ids.reshape(4, 1, -1))
    # Expanding the collapsed row reproduces the expanded rows.
    repeats = torch.ones_like(c.input_ids[0])
    repeats[c.input_ids[0] == tok.image_token_id] = c.tokens_per_image
    assert torch.equal(torch.repeat_interleave(c.input_ids[0], repeats), e.input_ids.reshape(-1))
    meg = c.model_inputs("megatron")
    tokens, labels = meg["tokens"][0], meg["labels"][0]
    targets = torch.nonzero(labels != -100).squeeze(1)
    assert targets.numel() == c.num_label_tokens  # shifted in collapsed space, inside each sample
    assert torch.equal(labels[targets], tokens[targets + 1])
    psp = meg["packed_seq_params"]
    assert psp.qkv_format == "thd"
    assert torch.equal(psp.cu_seqlens_q, e.cu_seqlens) and torch.equal(
        psp.cu_seqlens_kv_padded, e.cu_seqlens_padded
    )
    assert psp.max_seqlen_q == int(e.cu_seqlens_padded.diff().max())
    with pytest.raises(ValueError, match="needs the expanded layout"):
        c.model_inputs("sdpa")


def test_collapsed_llava_counts_from_config():
    tok = build_tokenizer("llava")
    ip = image_processor("llava")
    s = process_sample(
        [img(40, 30, 5)],
        "a cat <image> on a mat",
        tokenizer=tok,
        image_processor=ip,
        family="llava",
        layout="collapsed",
    )
    t = process_sample([], "just words here", tokenizer=tok, family="llava", layout="collapsed")
    del s["tokens_per_image"]  # the collator derives 576 from image_seq_length
    c = PackingCollator(
        1024, tokenizer=tok, family="llava", image_seq_length=576, layout="collapsed", pad_to_multiple_of=16
    )([s, t])
    assert c.tokens_per_image.tolist() == [576]
    lens = [s["input_ids"].numel() + 575, t["input_ids"].numel()]
    assert c.seq_lens_expanded.tolist() == lens
    assert c.cu_seqlens_padded_expanded.tolist() == [0, -(-lens[0] // 16) * 16, 1024]
    assert c.position_ids.shape == (1, 1024)
    assert c.position_ids[0, : lens[0]].tolist() == list(range(lens[0]))


# ------------------------------------------------------------------------------------- model inputs


def test_model_input_styles(qwen):
    tok, model, samples, _ = qwen
    b = PackingCollator(
        64, tokenizer=tok, model_config=model.config, pad_to_multiple_of=4, max_rows=None
    )(samples)
    R, T = b.input_ids.shape
    sdpa = b.model_inputs("sdpa")
    assert "attention_mask" not in sdpa and sdpa["use_cache"] is False
    assert b.model_input_names() == list(sdpa) and b["input_ids"] is b.input_ids and "use_cache" in b
    flash = b.model_inputs("flash_attention_2")
    assert "cu_seqlens" not in flash  # would reach the vision tower
    assert flash["input_ids"].shape == (1, R * T) and flash["position_ids"].shape == (4, 1, R * T)
    assert flash["mm_token_type_ids"].shape == (1, R * T)
    assert (
        torch.equal(flash["cu_seq_lens_q"], b.cu_seqlens_padded)
        and flash["cu_seq_lens_k"] is flash["cu_seq_lens_q"]
    )
    assert flash["max_length_q"] == int(b.cu_seqlens_padded.diff().max())
    assert torch.equal(flash["position_ids"][:, 0], b.position_ids.reshape(4, -1))
    meg = b.model_inputs("megatron")
    tokens, labels, mask = meg["tokens"][0], meg["labels"][0], meg["loss_mask"][0]
    cu = b.cu_seqlens_padded.tolist()
    for k in range(b.num_samples):
        a, L = cu[k], int(b.seq_lens[k])
        # labels[t] is the target of token t, only inside the sample; the last real token predicts nothing
        hf = b.labels.reshape(-1)[a : a + L]
        assert torch.equal(labels[a : a + L - 1], hf[1:L])
        assert int(labels[a + L - 1]) == -100
        trained = labels[a : a + L] != -100
        assert torch.equal(tokens[a + 1 : a + L][trained[: L - 1]], labels[a : a + L - 1][trained[: L - 1]])
    assert torch.equal(mask.bool(), labels != -100) and int(mask.sum()) == b.num_label_tokens
    psp = meg["packed_seq_params"]
    assert torch.equal(psp.cu_seqlens_q, b.cu_seqlens) and torch.equal(
        psp.cu_seqlens_q_padded, b.cu_seqlens_padded
    )
    with pytest.raises(ValueError, match="style must be one of"):
        b.model_inputs("xformers")
    moved = b.to("meta")
    assert moved.input_ids.device.type == "meta" and moved.pixel_values.device.type == "meta"
    assert b.input_ids.device.type == "cpu"


@pytest.mark.slow
def test_flash_style_inputs_run_varlen_attention(qwen):
    """The flattened row + cu_seq_lens_q/k through a varlen attention gives the sdpa rows' logits."""
    from vlm_pack.forward.attention import use_varlen_attention

    tok, model, samples, _ = qwen
    varlen = use_varlen_attention(tiny_model("qwen2_vl", tok, initializer_range=0.2))  # same seed, weights
    b = PackingCollator(
        64, tokenizer=tok, model_config=model.config, pad_to_multiple_of=4, max_rows=None
    )(samples)
    with torch.no_grad():
        rows = model(**b.model_inputs("sdpa")).logits
        flat = varlen(**b.model_inputs("flash_attention_2")).logits
    assert flat.shape[:2] == (1, b.num_rows * b.row_length)
    assert torch.allclose(flat[0], rows.reshape(flat.shape[1], -1), atol=1e-4, rtol=0)


# transformers releases whose Qwen-VL models hand the text's flash kwargs (cu_seq_lens_q, ...) to the vision
# tower too, which then gets cu_seq_lens_q twice (5.19 drops them in accepts_precomputed_kwargs).
FLASH_KWARGS_REACH_THE_VISION_TOWER = {"5.18.0"}


@pytest.mark.slow
def test_flash_style_through_transformers_flash_dispatch(qwen):
    """model_inputs("flash_attention_2") under an attention whose name says "flash": transformers then runs
    the vision tower's own varlen branch (cu_seq_lens_q = the images' boundaries) next to the text model's,
    and must keep the packed row's cu_seq_lens_q away from the vision tower. The stand-in kernel is
    flash_attn_varlen_func's contract (block-diagonal over cu_seq_lens_q) computed with sdpa on CPU."""
    import torch.nn.functional as F
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    seen = []

    def varlen_sdpa(module, q, k, v, attention_mask=None, scaling=None, cu_seq_lens_q=None, **kwargs):
        assert attention_mask is None and q.shape[0] == 1 and cu_seq_lens_q is not None
        causal = kwargs.get("is_causal", module.is_causal)
        seen.append((causal, cu_seq_lens_q))
        t = torch.arange(q.shape[2])
        seg = torch.searchsorted(cu_seq_lens_q.long(), t, right=True)
        allowed = (seg[:, None] == seg[None, :]) & (t[None, :] <= t[:, None] if causal else True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=True)
        return out.transpose(1, 2), None

    AttentionInterface.register("test_flash_varlen", varlen_sdpa)
    AttentionMaskInterface.register("test_flash_varlen", flash_attention_mask)
    tok, model, samples, _ = qwen
    flash = tiny_model("qwen2_vl", tok, initializer_range=0.2)  # same seed: the fixture's weights
    for m in flash.modules():
        if hasattr(m, "config"):  # set_attn_implementation would try to import the flash-attn package
            m.config._attn_implementation_internal = "test_flash_varlen"
    b = PackingCollator(
        64, tokenizer=tok, model_config=model.config, pad_to_multiple_of=4, max_rows=None
    )(samples)
    inputs = b.model_inputs("flash_attention_2")
    assert inputs["cu_seq_lens_q"].dtype == torch.int32
    with torch.no_grad():
        rows = model(**b.model_inputs("sdpa")).logits
        try:
            flat = flash(**inputs).logits
        except TypeError as e:  # transformers' bug, on the releases measured to have it (README)
            import transformers

            if "multiple values for keyword argument 'cu_seq_lens_q'" not in str(e):
                raise
            if transformers.__version__ not in FLASH_KWARGS_REACH_THE_VISION_TOWER:
                raise AssertionError(f"transformers {transformers.__version__}: add it to the table") from e
            pytest.xfail(f"transformers {transformers.__version__} passes the text's cu_seq_lens_q to the vision "
                         "tower beside its own: TypeError in a real flash run too")  # fmt: skip
        else:
            import transformers

            assert transformers.__version__ not in FLASH_KWARGS_REACH_THE_VISION_TOWER  # the table is true
    assert torch.allclose(flat[0], rows.reshape(flat.shape[1], -1), atol=1e-4, rtol=0)
    text_calls = [cu for causal, cu in seen if causal]
    assert text_calls and all(cu is inputs["cu_seq_lens_q"] for cu in text_calls)
    vision_cu = F.pad((b.image_grid_thw.prod(-1)).cumsum(0), (1, 0))
    assert all(torch.equal(cu, vision_cu.to(cu.dtype)) for causal, cu in seen if not causal)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.slow
def test_qwen_family_real_processor_forward(family):
    tok = build_tokenizer(family)
    small = {"shortest_edge": 4096, "longest_edge": 128 * 128} if family == "qwen3_vl" else QWEN_SMALL
    ip = image_processor(family, size=small)
    model = tiny_model(family, tok, initializer_range=0.2)
    samples = [
        process_sample(ims, c, tokenizer=tok, image_processor=ip, family=family)
        for ims, c in CONVERSATIONS[:3]
    ]
    b = PackingCollator(96, tokenizer=tok, model_config=model.config, pad_to_multiple_of=4)(samples)
    with torch.no_grad():
        logp = model(**b.model_inputs("sdpa")).logits.log_softmax(-1)
        for k, i in enumerate(b.sample_index.tolist()):
            s = samples[i]
            r, st, L = sample_span(b, k)
            assert torch.equal(b.position_ids[1:, r, st : st + L], hf_rope(model, s))
            ref = (
                model(
                    input_ids=s["input_ids"][None],
                    pixel_values=s.get("pixel_values"),
                    image_grid_thw=s.get("image_grid_thw"),
                    mm_token_type_ids=s["mm_token_type_ids"][None],
                )
                .logits[0]
                .log_softmax(-1)
            )
            assert torch.allclose(logp[r, st : st + L], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", ["llava", "llava_next"])
@pytest.mark.slow
def test_llava_processor_outputs_forward(family):
    """Samples straight from an HF processor ([1, L] tensors with attention_mask) pack and run."""
    proc = processor(family)
    model = tiny_model(family, proc.tokenizer, initializer_range=0.2)
    sizes = [(600, 60), (50, 700)] if family == "llava_next" else [(60, 40), (50, 90)]
    samples = [
        dict(
            proc(
                images=[img(*sizes[0], 7)],
                text="USER: <image>\nwhat is it ASSISTANT: a cat",
                return_tensors="pt",
            )
        ),
        dict(proc(text="USER: hello there ASSISTANT: hi", return_tensors="pt")),
        dict(
            proc(
                images=[img(*sizes[1], 8)],
                text="USER: <image>\nand this ASSISTANT: a dog",
                return_tensors="pt",
            )
        ),
    ]
    lens = [s["input_ids"].shape[1] for s in samples]
    b = PackingCollator(
        sum(_round_up(n, 16) for n in lens), tokenizer=proc, model_config=model.config, pad_to_multiple_of=16
    )(samples)
    assert b.num_rows == 1 and b.position_ids.shape == b.input_ids.shape
    if family == "llava_next":
        # Different patch counts: padded to the most, image_sizes tells the model each one's real count.
        n_patches = [s["pixel_values"].shape[1] for s in samples if "pixel_values" in s]
        assert len(set(n_patches)) == 2 and b.pixel_values.shape[1] == max(n_patches)
        assert b.image_sizes.shape == (2, 2)
    with torch.no_grad():
        logp = model(**b.model_inputs("sdpa")).logits.log_softmax(-1)
        for k, i in enumerate(b.sample_index.tolist()):
            s = samples[i]
            r, st, L = sample_span(b, k)
            assert torch.equal(b.input_ids[r, st : st + L], s["input_ids"][0])
            assert b.position_ids[r, st : st + L].tolist() == list(range(L))
            ref = model(**{k2: v for k2, v in s.items() if k2 != "attention_mask"}).logits[0].log_softmax(-1)
            assert torch.allclose(logp[r, st : st + L], ref, atol=1e-4, rtol=0)
    # No labels given: trained on the text, never on image tokens or a sample's first token.
    assert not bool((b.labels == proc.tokenizer.image_token_id).any())
    assert all(int(b.labels[0, c]) == -100 for c in b.cu_seqlens_padded[:-1].tolist())


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# ------------------------------------------------------------------------------------------- errors


def test_errors_name_the_sample(qwen):
    tok, model, samples, collapsed = qwen
    col = PackingCollator(64, tokenizer=tok, model_config=model.config)
    big = dict(
        samples[0], input_ids=torch.cat([samples[0]["input_ids"]] * 4), labels=None, mm_token_type_ids=None
    )
    del big["tokens_per_image"]
    big["image_grid_thw"] = big["image_grid_thw"].repeat(4, 1)
    with pytest.raises(
        ValueError, match=r"sample 2 is \d+ tokens long but a row holds capacity=64: raise capacity"
    ):
        col([samples[1], samples[3], big])
    wrong = dict(samples[2], image_grid_thw=samples[2]["image_grid_thw"][:1])
    del wrong["tokens_per_image"]
    with pytest.raises(ValueError, match=r"sample 1: input_ids hold \d+ image tokens but its 1 image"):
        col([samples[0], wrong])
    no_place = dict(
        samples[1], pixel_values=samples[0]["pixel_values"], image_grid_thw=samples[0]["image_grid_thw"]
    )
    del no_place["tokens_per_image"]
    with pytest.raises(ValueError, match="sample 0 has 1 image\\(s\\) but no image token"):
        col([no_place])
    orphan = dict(samples[0])
    del orphan["pixel_values"], orphan["image_grid_thw"], orphan["tokens_per_image"]
    with pytest.raises(
        ValueError, match="sample 0: input_ids hold 4 image token\\(s\\) but the sample has no images"
    ):
        col([orphan])
    keyed = dict(wrong, __key__="shard-3/000042")
    with pytest.raises(ValueError, match="sample 0 \\(key 'shard-3/000042'\\)"):
        col([keyed])
    no_counts = dict(collapsed[0])
    del no_counts["tokens_per_image"], no_counts["image_grid_thw"]
    no_counts["image_sizes"] = torch.tensor([[56, 56]])
    with pytest.raises(ValueError, match="collapsed layout needs tokens_per_image"):
        PackingCollator(64, tokenizer=tok, family="qwen2_vl", layout="collapsed")([no_counts])
    broken = dict(samples[0], input_ids=samples[0]["input_ids"].clone())
    broken["input_ids"][broken["input_ids"] == tok.convert_tokens_to_ids("<|vision_start|>")] = 100
    with pytest.raises(
        ValueError, match=r"sample 2: a vision block at offset \d+ does not follow <\|vision_start\|>"
    ):
        col([samples[1], samples[3], broken])  # named by its index in the list, whatever its packed place
    with pytest.raises(ValueError, match="empty list"):
        col([])
    with pytest.raises(ValueError, match="labels has 3 entries but input_ids has"):
        col([dict(samples[1], labels=torch.tensor([1, 2, 3]))])
    with pytest.raises(ValueError, match=r"\[L\] or \[1, L\]"):
        col(
            [
                dict(
                    samples[1],
                    input_ids=samples[1]["input_ids"].reshape(2, -1),
                    labels=None,
                    mm_token_type_ids=None,
                )
            ]
        )
    with pytest.raises(ValueError, match="capacity 100 is not a multiple of pad_to_multiple_of 8"):
        PackingCollator(100, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match="needs layout='expanded'"):
        PackingCollator(64, layout="collapsed", return_style="sdpa")


def test_qwen_samples_without_the_mrope_family_raise(qwen):
    """A hub processor carries no family: Qwen samples must not silently get 1-D position ids (the model
    then finds no text row, builds no packed mask and lets the samples attend to each other)."""
    tok, _, samples, _ = qwen
    no_family = PackingCollator(64, image_token_id=tok.image_token_id)
    with pytest.raises(ValueError, match=r"sample 1 has image_grid_thw.*family is None: pass model_config="):
        no_family([samples[1], samples[0]])
    with pytest.raises(ValueError, match="family is 'llava'"):
        PackingCollator(64, family="llava", image_token_id=tok.image_token_id)([samples[0]])
    with pytest.raises(ValueError, match=r"vision_start_token_id .* but no family"):
        PackingCollator(
            64, image_token_id=tok.image_token_id, vision_start_token_id=tok.vision_start_token_id
        )


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
@pytest.mark.slow
def test_qwen_video_samples(family):
    """Videos (pixel_values_videos, video_grid_thw, Qwen2.5-VL second_per_grid_ts) pack in sample order
    and every sample's logits equal the model's on that sample alone."""
    tok = build_tokenizer(family)
    model = tiny_model(family, tok, initializer_range=0.2)
    cfg = model.config
    g = torch.Generator().manual_seed(0)

    def video(t: int, h: int, w: int, seconds: float) -> dict:
        ids = [30, 31, cfg.vision_start_token_id] + [cfg.video_token_id] * (t * h * w // 4)
        s = {
            "input_ids": torch.tensor([*ids, cfg.vision_end_token_id, 40, 41]),
            "pixel_values_videos": torch.randn(t * h * w, 1176, generator=g),
            "video_grid_thw": torch.tensor([[t, h, w]]),
        }
        if family == "qwen2_5_vl":
            s["second_per_grid_ts"] = torch.tensor([seconds])
        return s

    # transformers < 5.18 truncates seconds per grid to an integer in get_rope_index (tests/test_positions.py)
    truncates = "int(next(second_per_grid_ts))" in inspect.getsource(type(model.model).get_rope_index)
    samples = [video(2, 4, 4, 3.0 if truncates else 0.5), {"input_ids": torch.tensor([50, 51, 52])}, video(3, 2, 6, 2.0)]
    b = PackingCollator(128, tokenizer=tok, model_config=cfg, pad_to_multiple_of=4)(samples)
    order = [i for i in b.sample_index.tolist() if "video_grid_thw" in samples[i]]
    assert torch.equal(b.video_grid_thw, torch.cat([samples[i]["video_grid_thw"] for i in order]))
    assert torch.equal(b.pixel_values_videos, torch.cat([samples[i]["pixel_values_videos"] for i in order]))
    assert int((b.mm_token_type_ids == 2).sum()) == int((b.input_ids == cfg.video_token_id).sum())
    with torch.no_grad():
        logits = model(**b.model_inputs("sdpa")).logits
        for k, i in enumerate(b.sample_index.tolist()):
            s = samples[i]
            types = 2 * (s["input_ids"] == cfg.video_token_id).long()
            alone = model(**{**s, "input_ids": s["input_ids"][None], "mm_token_type_ids": types[None]})
            r, st, L = sample_span(b, k)
            assert torch.allclose(logits[r, st : st + L], alone.logits[0], atol=1e-4, rtol=0)


def test_pad_multiple_for():
    assert pad_multiple_for() == 1
    assert pad_multiple_for(cp=2) == 4
    assert pad_multiple_for(tp=2, sequence_parallel=True) == 2
    assert pad_multiple_for(tp=4, cp=2, sequence_parallel=True) == 16  # 2*CP*TP
    assert pad_multiple_for(tp=2, cp=3, sequence_parallel=True) == 12
    assert pad_multiple_for(tp=4, cp=2) == 4  # TP without SP does not split the sequence
    assert pad_multiple_for(fp8=True) == 16
    assert pad_multiple_for(cp=2, fp8=True) == 32
    with pytest.raises(ValueError, match="cp must be a positive int"):
        pad_multiple_for(cp=0)


# Hand-computed from the rule (Megatron Bridge; Megatron-LM multimodal ``get_padding``): with CP > 1 each
# sample is cut into 2*CP chunks, so its length must divide by 2*CP; sequence parallelism splits every chunk
# again over the TP ranks (times TP); TP without sequence parallelism never splits the sequence. FP8 GEMMs
# also need each rank's share (length / (CP * TP_sp)) divisible by 16.
#   tp, cp, sequence_parallel, fp8 -> multiple
_PAD_RULE_TABLE = [
    (1, 1, False, False, 1),
    (8, 1, False, False, 1),
    (2, 1, True, False, 2),
    (8, 1, True, False, 8),
    (1, 2, False, False, 4),
    (4, 2, False, False, 4),
    (4, 2, True, False, 16),
    (1, 3, False, False, 6),
    (2, 3, True, False, 12),
    (8, 3, True, False, 48),
    (1, 4, False, False, 8),
    (4, 4, True, False, 32),
    (2, 8, False, False, 16),
    (8, 8, True, False, 128),
    (1, 1, False, True, 16),
    (1, 2, False, True, 32),
    (1, 3, False, True, 48),
    (2, 1, True, True, 32),
    (4, 2, True, True, 128),
]


def _smallest_length_that_splits(tp: int, cp: int, sequence_parallel: bool, fp8: bool) -> int:
    """Brute force over lengths: the first that cuts into 2*CP equal chunks (CP > 1), each chunk into TP
    equal parts under sequence parallelism, with (FP8) each rank's share a multiple of 16."""
    chunks = 2 * cp if cp > 1 else 1
    parts = tp if sequence_parallel else 1
    for length in range(1, 10_000):
        if length % chunks or (length // chunks) % parts:
            continue
        if fp8 and (length % (cp * parts) or (length // (cp * parts)) % 16):
            continue
        return length
    raise AssertionError("no length found")


def test_pad_multiple_for_is_the_parallel_padding_rule():
    from vlm_pack.forward.context_parallel import check_parallel_config

    for tp, cp, sp, fp8, want in _PAD_RULE_TABLE:
        case = f"tp={tp} cp={cp} sequence_parallel={sp} fp8={fp8}"
        assert _smallest_length_that_splits(tp, cp, sp, fp8) == want, case  # the table is the rule
        assert pad_multiple_for(tp=tp, cp=cp, sequence_parallel=sp, fp8=fp8) == want, case
        if fp8:
            continue  # the configuration check knows nothing of FP8
        # the configuration check asks for exactly this multiple, accepts it, and rejects half of it
        assert check_parallel_config(cp, tp, sequence_parallel=sp, pad_to_multiple_of=want) == want, case
        if want > 1:
            with pytest.raises(ValueError, match="is not a multiple of"):
                check_parallel_config(cp, tp, sequence_parallel=sp, pad_to_multiple_of=want // 2)
    # beyond the table: every combination is the brute-forced rule and passes the configuration check
    for cp, tp, sp, fp8 in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 8), (False, True), (False, True)):
        multiple = pad_multiple_for(tp=tp, cp=cp, sequence_parallel=sp, fp8=fp8)
        assert multiple == _smallest_length_that_splits(tp, cp, sp, fp8), (tp, cp, sp, fp8)
        assert check_parallel_config(cp, tp, sequence_parallel=sp, pad_to_multiple_of=multiple) >= 1


# ------------------------------------------------------------------------------------ data loaders


def test_dataloader_workers_and_trainer_style(qwen):
    tok, model, samples, _ = qwen
    collator = PackingCollator(
        64, tokenizer=tok, model_config=model.config, pad_to_multiple_of=4, max_rows=None
    )
    assert pickle.loads(pickle.dumps(collator)).image_token_id == tok.image_token_id
    loader = torch.utils.data.DataLoader(samples * 2, batch_size=5, num_workers=2, collate_fn=collator)
    batches = list(loader)
    assert len(batches) == 2 and all(isinstance(x, PackedBatch) for x in batches)
    assert all(sorted(x.sample_index.tolist()) == list(range(5)) for x in batches)
    # As an HF Trainer data_collator: a plain dict of forward kwargs.
    as_dict = PackingCollator(
        64, tokenizer=tok, model_config=model.config, return_style="sdpa", max_rows=None
    )(samples)
    assert isinstance(as_dict, dict) and as_dict["use_cache"] is False
    with torch.no_grad():
        assert torch.isfinite(model(**as_dict).loss)


@pytest.mark.slow
def test_hf_trainer_step(qwen, tmp_path):
    """As an HF Trainer data_collator (return_style="sdpa"): one real optimisation step on packed rows."""
    from transformers import Trainer, TrainingArguments

    tok, _, samples, _ = qwen
    model = tiny_model("qwen2_vl", tok).train()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=len(samples),
        max_steps=1,
        report_to=[],
        remove_unused_columns=False,  # the collator needs every processed field
        use_cpu=True,
        save_strategy="no",
        logging_strategy="no",
    )
    collator = PackingCollator(
        64, tokenizer=tok, model_config=model.config, return_style="sdpa", max_rows=None
    )
    before = model.lm_head.weight.detach().clone()
    result = Trainer(model=model, args=args, train_dataset=samples, data_collator=collator).train()
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.lm_head.weight.detach())


_LAZY_MEGATRON = """
import importlib.abc, pathlib, sys, types
attempts = []

class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "megatron":
            attempts.append(name)
        return None

sys.meta_path.insert(0, Spy())
# vlm_pack without its __init__: what importing the collate module itself pulls in.
package = types.ModuleType("vlm_pack")
package.__path__ = [sys.argv[1]]
sys.modules["vlm_pack"] = package
import vlm_pack.collate.collator as collate
assert not attempts, f"import vlm_pack.collate.collator imported {attempts}"
cls = collate.PackedSeqParams
assert "megatron.core" in attempts or "megatron" in attempts, attempts
params = cls(qkv_format="thd")
assert type(params).__name__ == "PackedSeqParams" and params.qkv_format == "thd"
print("ok")
"""


@pytest.mark.slow
def test_megatron_core_is_imported_only_when_packed_seq_params_are_asked_for():
    import subprocess
    import sys
    from pathlib import Path

    import vlm_pack

    package_dir = str(Path(vlm_pack.__file__).parent)
    out = subprocess.run(
        [sys.executable, "-c", _LAZY_MEGATRON, package_dir], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
