"""The embedded demo dataset: image-text samples with realistic image sizes and conversation lengths.

``vlm-pack demo``, the notebook, the examples and the tests need data that looks like a VLM SFT mix without
shipping binaries or reaching the network. This module draws it in a few seconds, deterministically: one
seed gives the same samples, conversations and image sizes on every machine (the encoded bytes can differ
between Pillow builds; the analysis reads only sizes)::

    kind        share  format        pixel sizes (width x height)               what is drawn
    ----------  -----  ------------  -----------------------------------------  ---------------------------
    photo        40%   JPEG          640..4032, 4:3 / 3:2 / 16:9, some portrait  sky, ground, objects
                                     (phone shots stored landscape + EXIF 6)
    document     20%   PNG (gray)    1240x1754 (A4 150 dpi), 1275x1650, 2480x3508 title, text lines, table
                                     (A4 300 dpi), 600x1800 receipts
    screenshot   20%   PNG / WebP    1280x720 .. 2560x1440, 2880x1800, phones    windows, sidebar, labels
    chart        12%   PNG           640x480 .. 1600x900                         axes, bars or a line
    icon          8%   PNG (RGBA)    32 .. 256 squares                           a glyph on a disc

    images per sample: 0 (text only) 12%, 1 image 63%, 2 images 15%, 3 images 10%
    text per sample:   a user prompt + an assistant answer, log-normal: about 70 .. 2,200 tokens,
                       median ~360 (Qwen2-VL chat template, offline tokenizer)

Images are low-detail (flat colours, quality-30 JPEG) so that files stay small, but their pixel sizes are the
realistic part: the packer forecasts vision tokens from the header size only. In the shards a sample is::

    demo-000042.jpg      one image: field "jpg"         (several: "0.jpg", "1.png", ... in placeholder order)
    demo-000042.json     {"messages": [{"role": "user", "content": [{"type": "image"},
                                                                    {"type": "text", "text": "..."}]},
                                       {"role": "assistant", "content": "..."}],
                          "kinds": ["photo"], "source": "vlm-pack demo v1"}

:func:`demo_shards` writes the records as WebDataset shards (with :func:`vlm_pack.data.write_shards`) in a
cache folder, once; later calls reuse them. :func:`demo_jsonl` writes image files plus a JSONL manifest. These
are the two inputs ``vlm-pack analyze`` reads.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "DEMO_NUM_SAMPLES",
    "DEMO_SEED",
    "DEMO_VERSION",
    "DemoImage",
    "demo_cache_dir",
    "demo_jsonl",
    "demo_plan",
    "demo_records",
    "demo_shards",
    "draw_image",
]

#: Bump when the generator changes: cached shards of another version are rebuilt.
DEMO_VERSION = 1
DEMO_SEED = 0
DEMO_NUM_SAMPLES = 320

_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


@dataclass(frozen=True)
class DemoImage:
    """One image to draw: its kind, file format, stored pixel size and EXIF orientation (1 = none).

    ``width`` x ``height`` is the size stored in the file; with orientation 6 or 8 the displayed (and
    processed, after ``exif_transpose``) image is ``height`` x ``width``.
    """

    kind: str
    fmt: str
    width: int
    height: int
    orientation: int = 1
    seed: int = 0

    @property
    def ext(self) -> str:
        return _EXT[self.fmt]

    @property
    def display_size(self) -> tuple[int, int]:
        """``(width, height)`` after EXIF orientation, the size an image processor sees."""
        return (self.height, self.width) if self.orientation in (5, 6, 7, 8) else (self.width, self.height)


# ------------------------------------------------------------------------------------------------------
# Image sizes
# ------------------------------------------------------------------------------------------------------

_DOCUMENT_SIZES = [((1240, 1754), 0.55), ((1275, 1650), 0.2), ((2480, 3508), 0.1), ((600, 1800), 0.15)]
_SCREEN_SIZES = [
    ((1280, 720), 0.2),
    ((1366, 768), 0.1),
    ((1920, 1080), 0.3),
    ((2560, 1440), 0.15),
    ((2880, 1800), 0.1),
    ((1170, 2532), 0.1),
    ((1080, 2400), 0.05),
]
_CHART_SIZES = [((640, 480), 0.25), ((800, 600), 0.3), ((1200, 800), 0.3), ((1600, 900), 0.15)]
_ICON_SIZES = [((32, 32), 0.15), ((64, 64), 0.3), ((128, 128), 0.35), ((256, 256), 0.2)]
_KINDS = [("photo", 0.40), ("document", 0.20), ("screenshot", 0.20), ("chart", 0.12), ("icon", 0.08)]


def _weighted(rng: random.Random, table: Sequence[tuple[Any, float]]) -> Any:
    return rng.choices([v for v, _ in table], weights=[w for _, w in table])[0]


def _photo_size(rng: random.Random, small: bool) -> tuple[tuple[int, int], int]:
    # Long side: web-sized photos dominate, a sixth are full-resolution phone or camera shots.
    if small:
        long_side = rng.choice([640, 640, 800, 1024])
    else:
        long_side = _weighted(
            rng, [(640, 0.3), (800, 0.1), (1024, 0.15), (1280, 0.1), (1600, 0.1), (2048, 0.1), (4032, 0.15)]
        )
    aspect = _weighted(rng, [((4, 3), 0.55), ((3, 2), 0.3), ((16, 9), 0.15)])
    short_side = round(long_side * aspect[1] / aspect[0])
    if long_side == 640 and rng.random() < 0.5:
        short_side = rng.randint(360, 480)  # COCO-like web photos of arbitrary height
    portrait = rng.random() < 0.25
    if portrait and long_side >= 3000:
        # A phone's portrait shot: stored landscape, rotated for display by EXIF orientation 6.
        return (long_side, short_side), 6
    return ((short_side, long_side) if portrait else (long_side, short_side)), 1


def _image_spec(rng: random.Random, kind: str, small: bool) -> DemoImage:
    orientation = 1
    if kind == "photo":
        (w, h), orientation = _photo_size(rng, small)
        fmt = "JPEG"
    elif kind == "document":
        w, h = _weighted(rng, _DOCUMENT_SIZES if not small else _DOCUMENT_SIZES[:2])
        fmt = "PNG"
    elif kind == "screenshot":
        w, h = _weighted(rng, _SCREEN_SIZES if not small else _SCREEN_SIZES[:3])
        fmt = "WEBP" if rng.random() < 0.3 else "PNG"
    elif kind == "chart":
        w, h = _weighted(rng, _CHART_SIZES)
        fmt = "PNG"
    else:
        w, h = _weighted(rng, _ICON_SIZES)
        fmt = "PNG"
    return DemoImage(kind, fmt, int(w), int(h), orientation, rng.randrange(2**31))


# ------------------------------------------------------------------------------------------------------
# Drawing
# ------------------------------------------------------------------------------------------------------


def _color(rng: random.Random, lo: int = 0, hi: int = 255) -> tuple[int, int, int]:
    return (rng.randint(lo, hi), rng.randint(lo, hi), rng.randint(lo, hi))


def _font(size: int) -> Any:
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=max(6, size))
    except (TypeError, OSError):  # Pillow built without FreeType: fixed bitmap font
        return ImageFont.load_default()


def _draw_photo(im: Any, rng: random.Random) -> None:
    from PIL import ImageDraw

    w, h = im.size
    d = ImageDraw.Draw(im)
    horizon = int(h * rng.uniform(0.35, 0.65))
    d.rectangle([0, 0, w, horizon], fill=_color(rng, 90, 230))
    d.rectangle([0, horizon, w, h], fill=_color(rng, 30, 160))
    r = int(min(w, h) * rng.uniform(0.04, 0.1))
    cx, cy = rng.randint(r, w - r), rng.randint(r, max(r, horizon - r))
    d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=(250, 220, 120))
    for _ in range(rng.randint(3, 8)):
        bw, bh = int(w * rng.uniform(0.05, 0.3)), int(h * rng.uniform(0.05, 0.4))
        x, y = rng.randint(0, w - bw), rng.randint(max(0, horizon - bh), h - bh)
        if rng.random() < 0.5:
            d.rectangle([x, y, x + bw, y + bh], fill=_color(rng))
        else:
            d.ellipse([x, y, x + bw, y + bh], fill=_color(rng))


def _draw_document(im: Any, rng: random.Random) -> None:
    from PIL import ImageDraw

    w, h = im.size
    d = ImageDraw.Draw(im)
    margin = w // 12
    line_h = max(8, w // 55)
    font = _font(int(line_h * 0.8))
    d.text((margin, margin), _sentence(rng, 4, 7).upper(), fill=0, font=_font(line_h * 2))
    y = margin + line_h * 4
    table_at = rng.randint(8, 20)
    row = 0
    while y < h - margin - line_h:
        if row == table_at:
            cols, rows = rng.randint(3, 5), rng.randint(3, 8)
            tw, th = w - 2 * margin, rows * line_h * 2
            for i in range(cols + 1):
                x = margin + i * tw // cols
                d.line([x, y, x, y + th], fill=60, width=2)
            for j in range(rows + 1):
                d.line([margin, y + j * line_h * 2, margin + tw, y + j * line_h * 2], fill=60, width=2)
            y += th + line_h
        elif rng.random() < 0.9:
            d.text((margin, y), _sentence(rng, 8, 14), fill=30, font=font)
        y += int(line_h * 1.6)
        row += 1


def _draw_screenshot(im: Any, rng: random.Random) -> None:
    from PIL import ImageDraw

    w, h = im.size
    d = ImageDraw.Draw(im)
    bar = max(16, h // 30)
    d.rectangle([0, 0, w, bar], fill=(40, 40, 48))
    side = w // rng.randint(5, 8)
    d.rectangle([0, bar, side, h], fill=(235, 236, 240))
    font = _font(int(bar * 0.6))
    for i in range(rng.randint(6, 14)):
        d.text((bar // 2, bar * (2 + 1.5 * i)), _sentence(rng, 1, 3), fill=(60, 60, 60), font=font)
    for _ in range(rng.randint(2, 5)):
        x0, y0 = rng.randint(side, w * 3 // 4), rng.randint(bar, h * 3 // 4)
        x1, y1 = min(w - 4, x0 + w // rng.randint(3, 5)), min(h - 4, y0 + h // rng.randint(3, 5))
        d.rectangle([x0, y0, x1, y1], fill=(255, 255, 255), outline=_color(rng, 60, 200), width=3)
        d.rectangle([x0, y0, x1, y0 + bar], fill=_color(rng, 120, 220))
        d.text((x0 + bar // 2, y0 + bar * 1.5), _sentence(rng, 2, 5), fill=(20, 20, 20), font=font)


def _draw_chart(im: Any, rng: random.Random) -> None:
    from PIL import ImageDraw

    w, h = im.size
    d = ImageDraw.Draw(im)
    x0, y0, x1, y1 = w // 10, h // 10, w - w // 20, h - h // 8
    d.line([x0, y0, x0, y1, x1, y1], fill=(0, 0, 0), width=2)
    n = rng.randint(4, 12)
    values = [rng.uniform(0.1, 1.0) for _ in range(n)]
    step = (x1 - x0) / n
    if rng.random() < 0.6:
        for i, v in enumerate(values):
            top = y1 - int(v * (y1 - y0))
            d.rectangle(
                [x0 + int(i * step + step * 0.15), top, x0 + int((i + 0.85) * step), y1], fill=_color(rng)
            )
    else:
        pts = [(x0 + int((i + 0.5) * step), y1 - int(v * (y1 - y0))) for i, v in enumerate(values)]
        d.line(pts, fill=(30, 90, 200), width=max(2, w // 300))
    d.text((x0, y0 // 3), _sentence(rng, 2, 5).title(), fill=(0, 0, 0), font=_font(max(10, h // 25)))


def _draw_icon(im: Any, rng: random.Random) -> None:
    from PIL import ImageDraw

    w, h = im.size
    d = ImageDraw.Draw(im)
    d.ellipse([1, 1, w - 2, h - 2], fill=(*_color(rng, 40, 220), 255))
    m = w // 4
    if rng.random() < 0.5:
        d.polygon([(w // 2, m), (w - m, h - m), (m, h - m)], fill=(255, 255, 255, 255))
    else:
        d.rectangle([m, m, w - m, h - m], fill=(255, 255, 255, 255))


_DRAW = {
    "photo": ("RGB", (128, 128, 128), _draw_photo),
    "document": ("L", 255, _draw_document),
    "screenshot": ("RGB", (250, 250, 252), _draw_screenshot),
    "chart": ("RGB", (255, 255, 255), _draw_chart),
    "icon": ("RGBA", (0, 0, 0, 0), _draw_icon),
}


def draw_image(spec: DemoImage) -> bytes:
    """The encoded file of ``spec``: drawn with Pillow, deterministic in ``spec.seed``."""
    from PIL import Image

    mode, background, draw = _DRAW[spec.kind]
    rng = random.Random(spec.seed)
    # Drawn as displayed, then stored rotated back when the EXIF orientation says the viewer rotates it.
    dw, dh = spec.display_size
    im = Image.new(mode, (dw, dh), background)
    draw(im, rng)
    buf = io.BytesIO()
    if spec.fmt == "JPEG":
        kwargs: dict[str, Any] = {"quality": 30}
        if spec.orientation != 1:
            im = im.transpose(Image.Transpose.ROTATE_90)  # undone by exif_transpose (orientation 6)
            exif = Image.Exif()
            exif[0x0112] = spec.orientation
            kwargs["exif"] = exif.tobytes()
        im.save(buf, "JPEG", **kwargs)
    elif spec.fmt == "WEBP":
        im.save(buf, "WEBP", quality=30, method=0)
    else:
        im.save(buf, "PNG", compress_level=1)
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------------
# Text
# ------------------------------------------------------------------------------------------------------

_NOUNS = (
    "dog cat car tree house street sky water building sign person people table chair window door road bridge "
    "river mountain field flower bird bicycle bus train boat phone laptop screen button menu chart bar line "
    "value total invoice page paragraph title column row figure report customer order price item account"
).split()
_ADJECTIVES = (
    "red green blue yellow black white gray large small tall short old new bright dark empty busy quiet "
    "left right upper lower main first second last total average"
).split()
_VERBS = (
    "shows contains appears holds stands sits walks runs reads writes lists compares increases decreases "
    "covers points opens closes displays follows leads"
).split()
_PREPS = "on in near behind under above next to beside across along".split()

_PROMPTS = {
    "photo": [
        "Describe this photo in detail.",
        "What is happening in this picture?",
        "How many {noun}s can you see?",
        "Write a short caption for the image.",
        "What color is the {noun} on the {side}?",
    ],
    "document": [
        "Transcribe the text of this page.",
        "What is the total amount on this {noun}?",
        "Summarize the main points of the document.",
        "Extract the table as markdown.",
    ],
    "screenshot": [
        "What does this screen show?",
        "Which button opens the {noun} menu?",
        "Describe the user interface and its main elements.",
    ],
    "chart": [
        "What trend does this chart show?",
        "Which category has the highest value?",
        "Convert the chart into a table.",
    ],
    "icon": ["What does this icon represent?", "Describe the symbol."],
    "multi": ["Compare these images.", "What changed between the images?", "Describe each image in turn."],
    "text": [
        "Explain how {noun}s and {noun}s differ.",
        "Write a short story about a {adj} {noun}.",
        "Summarize the following notes.",
        "Answer the question about the {noun}.",
    ],
}


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    words = []
    for i in range(rng.randint(lo, hi)):
        pick = i % 4
        bank = (_ADJECTIVES, _NOUNS, _VERBS, _PREPS)[pick] if i else ("The", "A", "This", "Each")
        words.append(rng.choice(bank))
    return " ".join(words)


def _paragraph(rng: random.Random, approx_words: int) -> str:
    out: list[str] = []
    n = 0
    while n < approx_words:
        s = _sentence(rng, 6, 16)
        if rng.random() < 0.15:
            s += f", {rng.randint(2, 999)} {rng.choice(_NOUNS)}s"
        out.append(s + ".")
        n += s.count(" ") + 1
    return " ".join(out)


def _fill(template: str, rng: random.Random) -> str:
    out = template
    while "{" in out:
        out = (
            out.replace("{noun}", rng.choice(_NOUNS), 1)
            .replace("{adj}", rng.choice(_ADJECTIVES), 1)
            .replace("{side}", rng.choice(["left", "right"]), 1)
        )
    return out


def _log_normal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(rng.gauss(0.0, sigma))))))


def _conversation(rng: random.Random, kinds: list[str]) -> list[dict[str, Any]]:
    key = "text" if not kinds else ("multi" if len(kinds) > 1 else kinds[0])
    prompt = _fill(rng.choice(_PROMPTS[key]), rng)
    # Words, not tokens: the offline tokenizers make about 1.5 tokens per word of this vocabulary.
    if key == "text" or (kinds and kinds[0] == "document" and rng.random() < 0.3):
        prompt += " " + _paragraph(rng, _log_normal_int(rng, 100, 0.7, 10, 300))
    long_answer = key == "document" and prompt.startswith(("Transcribe", "Extract"))
    answer_words = _log_normal_int(rng, 300 if long_answer else 80, 0.7, 12, 600)
    answer = _paragraph(rng, answer_words)
    content: list[dict[str, Any]] = [{"type": "image"} for _ in kinds]
    content.append({"type": "text", "text": prompt})
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


# ------------------------------------------------------------------------------------------------------
# Records, shards, manifest
# ------------------------------------------------------------------------------------------------------


def demo_plan(num_samples: int = DEMO_NUM_SAMPLES, seed: int = DEMO_SEED) -> list[dict[str, Any]]:
    """The demo samples without image bytes: key, conversation and :class:`DemoImage` specs (fast)."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    rng = random.Random(f"vlm-pack-demo-{seed}")
    plan = []
    for i in range(num_samples):
        n_images = _weighted(rng, [(0, 0.12), (1, 0.63), (2, 0.15), (3, 0.10)])
        kinds = [_weighted(rng, _KINDS) for _ in range(n_images)]
        # Several images in one sample are smaller, as in multi-image instruction data.
        images = [_image_spec(rng, kind, small=n_images > 1) for kind in kinds]
        plan.append({"key": f"demo-{i:06d}", "conversation": _conversation(rng, kinds), "images": images})
    return plan


def demo_records(num_samples: int = DEMO_NUM_SAMPLES, seed: int = DEMO_SEED) -> list[dict[str, Any]]:
    """The demo samples as :func:`vlm_pack.data.write_shards` records, images encoded.

    ``{"key": "demo-000042", "images": [(bytes, "jpg"), ...], "conversation": [...], "meta": {"kinds": [...]}}``.
    Deterministic in ``(num_samples, seed)``; the first ``n`` records do not depend on ``num_samples``.
    """
    return [_record(item) for item in demo_plan(num_samples, seed)]


def _record(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "key": item["key"],
        "images": [(draw_image(im), im.ext) for im in item["images"]],
        "conversation": item["conversation"],
        "meta": {"kinds": [im.kind for im in item["images"]], "source": f"vlm-pack demo v{DEMO_VERSION}"},
    }


def demo_cache_dir() -> Path:
    """``$VLM_PACK_CACHE`` or ``$XDG_CACHE_HOME/vlm-pack`` (``~/.cache/vlm-pack``)."""
    root = os.environ.get("VLM_PACK_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vlm-pack"


def _signature(num_samples: int, seed: int, samples_per_shard: int) -> str:
    text = f"v{DEMO_VERSION}-n{num_samples}-s{seed}-p{samples_per_shard}"
    return text + "-" + hashlib.sha1(text.encode()).hexdigest()[:8]


def demo_shards(
    directory: str | os.PathLike[str] | None = None,
    *,
    num_samples: int = DEMO_NUM_SAMPLES,
    seed: int = DEMO_SEED,
    samples_per_shard: int = 64,
    progress: bool | None = False,
) -> list[Path]:
    """Write the demo records as WebDataset ``.tar`` shards (once) and return their paths.

    ``directory`` defaults to ``demo_cache_dir() / "demo-<signature>"``; a folder already holding a complete
    set for the same parameters is reused, so the first call takes seconds and later ones nothing.
    ``progress`` shows a tqdm bar while drawing (``None``: only on a terminal).
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
    sig = _signature(num_samples, seed, samples_per_shard)
    out = Path(directory) if directory is not None else demo_cache_dir() / f"demo-{sig}"
    n_shards = -(-num_samples // samples_per_shard)
    paths = [out / f"demo-{i:05d}.tar" for i in range(n_shards)]
    done = out / "COMPLETE"
    if done.exists() and done.read_text().strip() == sig and all(p.exists() for p in paths):
        return paths
    from vlm_pack.data import write_shards

    out.mkdir(parents=True, exist_ok=True)
    done.unlink(missing_ok=True)
    from tqdm import tqdm

    # Drawn lazily, one record at a time, as write_shards consumes them.
    plan = tqdm(
        demo_plan(num_samples, seed),
        desc=f"drawing demo data into {out}",
        unit=" samples",
        disable=(not progress) if progress is not None else None,
    )
    written = write_shards(
        (_record(item) for item in plan), str(out / "demo-%05d.tar"), maxcount=samples_per_shard
    )
    if [Path(p) for p in written] != paths:
        raise RuntimeError(f"demo_shards: expected {[str(p) for p in paths]}, write_shards wrote {written}")
    done.write_text(sig + "\n")
    return paths


def demo_jsonl(
    directory: str | os.PathLike[str], *, num_samples: int = DEMO_NUM_SAMPLES, seed: int = DEMO_SEED
) -> Path:
    """Write the demo as image files plus ``manifest.jsonl`` (paths relative to it); return the manifest.

    One line per sample: ``{"key": ..., "images": ["images/demo-000001-0.jpg", ...], "conversation": [...]}``,
    the JSONL input format of ``vlm-pack analyze``.
    """
    out = Path(directory)
    (out / "images").mkdir(parents=True, exist_ok=True)
    manifest = out / "manifest.jsonl"
    with open(manifest, "w") as f:
        for rec in demo_records(num_samples, seed):
            paths = []
            for j, (data, ext) in enumerate(rec["images"]):
                rel = f"images/{rec['key']}-{j}.{ext}"
                (out / rel).write_bytes(data)
                paths.append(rel)
            f.write(
                json.dumps({"key": rec["key"], "images": paths, "conversation": rec["conversation"]}) + "\n"
            )
    return manifest
