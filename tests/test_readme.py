"""The README's code runs as written: its snippets are executed against real shards, images and a tiny model."""

import io
import re
from pathlib import Path

import pytest
from PIL import Image

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _jpeg(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (90, 140, 200)).save(buf, format="JPEG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def namespace():
    from vlm_pack.offline import build_tokenizer, tiny_model

    tok = build_tokenizer("qwen2_vl")
    conv = [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A sky."}]
    return {
        "conversation": conv,
        "jpeg_bytes": [_jpeg(200, 150)],
        "lengths": [300, 1200, 5000, 16000, 40],
        "data": [([_jpeg(120, 90)], conv), ([], [{"role": "user", "content": "Hi"}, conv[1]])],
        "model": tiny_model("qwen2_vl", tok, initializer_range=0.2),
    }


def test_api_tour_runs(namespace, capsys):
    exec(_python_blocks()[0], namespace)
    assert namespace["length"] == len(
        namespace["vp"].process_sample(
            [namespace["jpeg_bytes"][0]],
            namespace["conversation"],
            tokenizer=namespace["tok"],
            image_processor=namespace["ip"],
        )["input_ids"]
    )
    assert sorted(i for b in namespace["plan"].bins for i in b) == list(range(5))
    assert namespace["batch"].input_ids.shape == (1, 16384)
    assert namespace["report"].passed
    assert "1.0000" in capsys.readouterr().out


def test_streaming_snippet_runs(tmp_path, namespace, monkeypatch):
    import vlm_pack as vp

    records = [
        {"key": f"s{i:03d}", "images": [_jpeg(64 + 16 * i, 64)], "conversation": namespace["conversation"]}
        for i in range(6)
    ]
    (tmp_path / "shards").mkdir()
    vp.write_shards(records, str(tmp_path / "shards" / "%03d.tar"), maxcount=3)
    monkeypatch.chdir(tmp_path)
    code = _python_blocks()[1].replace("num_workers=4", "num_workers=0").replace("{000..099}", "{000..001}")
    code = code.replace("    ...", "    packs.append(batch)")
    namespace["packs"] = []
    exec(code, namespace)
    assert sum(len(b.sample_index) for b in namespace["packs"]) == 6
    assert namespace["state"]


def test_token_counts_quoted_in_the_readme_are_the_forecasts():
    import vlm_pack as vp

    text = README.read_text()
    for family, n in (("qwen2_vl", 2691), ("qwen3_vl", 2040), ("llava_next", 1948)):
        assert f"{n}" in text
        assert vp.vision_spec(family).num_tokens(1920, 1080) == n


def test_megatron_snippet_runs():
    import vlm_pack as vp
    from vlm_pack.offline import build_tokenizer, processor

    tok = build_tokenizer("llava_next")
    proc = processor("llava_next", tok)
    conv = [{"role": "user", "content": "<image>What is this?"}, {"role": "assistant", "content": "A sky."}]
    samples = [
        vp.process_sample([_jpeg(300 + 100 * i, 200)], conv, processor=proc, layout="collapsed")
        for i in range(3)
    ]
    ns = {"vp": vp, "tok": tok, "samples": samples}
    code = _python_blocks()[2]
    exec(code.split("vp.remap_cu_seqlens")[0], ns)  # the collator part, then the remap with real inputs
    batch = ns["batch"]
    # A Megatron-style cu_seqlens partitions the collapsed row: the padded offsets.
    ns.update(
        cu_seqlens=batch.cu_seqlens_padded,
        input_ids=batch.input_ids[0],
        image_token_id=tok.image_token_id,
        tokens_per_image=batch.tokens_per_image,
    )
    exec(code, ns)
    expanded = vp.remap_cu_seqlens(
        batch.cu_seqlens_padded, batch.input_ids[0], tok.image_token_id, batch.tokens_per_image
    )
    assert expanded.tolist() == batch.cu_seqlens_padded_expanded.tolist()
    assert ns["params"].qkv_format == "thd"
    assert ns["params"].cu_seqlens_q_padded.tolist() == expanded.tolist()
