"""One family registry (``vlm_pack.families``): every rule of a family is its record, and nothing else keeps one.

- a record's rules hold where they are used: its vision rule builds a spec of its own family; for one family
  of each ``wraps`` kind, the forecast (``Preprocessor.forecast`` and ``forecast_sources``) is the processed
  length on the real processor, the family spelled oddly; ``collapsed=False`` refuses the collapsed layout
  when the Preprocessor is built; a family with mRoPE marks a text-only sample's tokens as its processor does;
- no module keeps a table of its own: outside ``families.py``, ``vision/`` (the rules) and ``offline/`` (the
  stand-ins) no family name is written as a string (docstrings aside) and no family is tested against one.
(Every spelling through every entry point: ``test_family_names.py``.)
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import get_args

import pytest
from PIL import Image

from vlm_pack import Preprocessor, forecast_sources, offline
from vlm_pack.families import FAMILIES, WRAPS, Wraps, canonical, family, lookup, names
from vlm_pack.processing import _embedding_token_id

PACKAGE = Path(__file__).parents[1] / "vlm_pack"
TEMPLATES = Path(__file__).parent / "templates"
IMAGES = [Image.new("RGB", (300, 200), (200, 30, 30)), Image.new("RGB", (90, 160), (0, 90, 0))]
CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is the dog?"}]},
    {"role": "assistant", "content": "the dog is left"},
    {"role": "user", "content": [{"type": "text", "text": "and this one"}, {"type": "image"}]},
    {"role": "assistant", "content": [{"type": "text", "text": "three cats"}]},
]
# One family of each ``wraps`` kind, spelled as a user might.
BY_WRAPS = {
    "none": ("llava", "LLaVA-1.5"),
    "template": ("qwen2_vl", "Qwen2-VL"),
    "processor": ("internvl", "InternVL2.5"),
    "processor_markers": ("idefics3", "Idefics-3"),
    "processor_text": ("gemma3", "Gemma 3"),
}
_PROCESSORS: dict[str, object] = {}


def _processor(name: str):
    """The family's real transformers processor around its offline tokenizer, with its released template."""
    if name not in _PROCESSORS:
        path = TEMPLATES / f"{name}.jinja"
        template = path.read_text() if path.exists() else None
        small = {"size": {"shortest_edge": 3136, "longest_edge": 200704}} if name.startswith("qwen") else {}
        _PROCESSORS[name] = offline.processor(
            name, offline.build_tokenizer(name), chat_template=template, **small
        )
    return _PROCESSORS[name]


def test_names_lookups_and_refusals():
    assert family("InternVL2.5") is family("internvl") is FAMILIES["internvl"]
    assert lookup("GOT-OCR2") is None  # its own model (GotOcr2ForConditionalGeneration): the generic route
    assert family("llava-1.6").name == "llava_next" and canonical("qwen2.5-vl") == "qwen2_5_vl"
    assert canonical(None) is None and canonical("") is None and lookup(None) is None
    assert canonical("llama", strict=False) == "llama" and lookup("llama") is None  # a config's model_type
    with pytest.raises(
        ValueError, match=r"unknown VLM family 'blip2'; known families: qwen2_vl, qwen2_5_vl, "
    ):
        family("blip2")
    with pytest.raises(ValueError, match="no family name given; known families: qwen2_vl"):
        family("")
    with pytest.raises(TypeError, match="must be a string"):
        canonical(3)  # type: ignore[arg-type]
    assert names("mrope") == (
        "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm4v_moe",
        "glm46v",
    )
    assert names("experts") == ("qwen3_5_moe",)
    assert names("two_way_images") == ("gemma3", "gemma4") and names() == tuple(FAMILIES)
    with pytest.raises(ValueError, match="Family has no field 'colour'"):
        names("colour")


def test_the_old_tables_are_gone():
    """Each answered by the registry now (CHANGELOG): nothing still answers to the old name."""
    from vlm_pack import _checks, vision
    from vlm_pack.collate import batch, positions

    assert not hasattr(vision, "FAMILIES")  # names("vision")
    assert not hasattr(positions, "MROPE_FAMILIES")  # family(name).mrope
    assert not hasattr(batch, "TWO_WAY_IMAGE_FAMILIES")  # family(name).two_way_images
    assert not hasattr(_checks, "KNOWN_FAMILIES") and not hasattr(_checks, "canonical_family")  # canonical()


@pytest.mark.parametrize("name", names("vision"))
def test_each_vision_rule_builds_a_spec_of_its_own_family(name):
    spec = FAMILIES[name].vision()
    assert spec.family == name and spec.num_tokens(640, 480) > 0


def test_one_case_per_wraps_kind():
    assert set(BY_WRAPS) == set(WRAPS) == set(get_args(Wraps))
    assert all(FAMILIES[name].wraps == kind for kind, (name, _) in BY_WRAPS.items())


@pytest.mark.parametrize("kind", list(BY_WRAPS))
def test_the_forecast_is_the_processed_length_for_each_wraps_kind(kind, tmp_path):
    """Whoever writes the tokens around an image (nobody, the template, the processor: special tokens, tile
    markers, text that merges with the prompt), the header-only forecast is what the processor makes."""
    name, spelling = BY_WRAPS[kind]
    pre = Preprocessor(processor=_processor(name), family=spelling)
    assert pre.family == name
    sizes = [im.size for im in IMAGES]
    out = pre.process(IMAGES, CONVERSATION, key="k0")
    length, per_image = pre.forecast(CONVERSATION, sizes, key="k0")
    assert (length, per_image) == (len(out["input_ids"]), out["tokens_per_image"].tolist())
    for i, im in enumerate(IMAGES):
        im.save(tmp_path / f"{i}.png")
    record = {"key": "k0", "images": ["0.png", "1.png"], "conversation": CONVERSATION}
    (tmp_path / "data.jsonl").write_text(json.dumps(record) + "\n")
    table = forecast_sources(str(tmp_path / "data.jsonl"), preprocessor=pre, progress=False)
    assert table.lengths.tolist() == [length] and table.image_tokens.tolist() == per_image


@pytest.mark.parametrize("name", ["idefics3", "smolvlm", "mistral3", "internvl", "gemma3"])
def test_the_collapsed_layout_is_refused_when_the_preprocessor_is_built(name):
    """A processor that writes markers between an image's tokens cannot collapse them to one placeholder:
    refused up front (before: every sample with images failed), the others keep one token per image."""
    proc = _processor(name)
    spec_family = Preprocessor(processor=proc).spec.family  # mistral3's processor gives a Pixtral spec
    if not FAMILIES[spec_family].collapsed:
        with pytest.raises(ValueError, match=rf"layout='collapsed'.*the {spec_family} processor.*'expanded'"):
            Preprocessor(processor=proc, layout="collapsed")
        with pytest.raises(ValueError, match="layout='expanded'"):  # tokenizer + image processor alike
            Preprocessor(proc.tokenizer, proc.image_processor, layout="collapsed")
        return
    out = Preprocessor(processor=proc, layout="collapsed").process(IMAGES, CONVERSATION)
    embedding = _embedding_token_id(proc)  # Gemma 3's is not its placeholder
    assert int((out["input_ids"] == embedding).sum()) == len(IMAGES)


@pytest.mark.parametrize("name", [n for n in names("mrope") if n in offline.FAMILIES])
def test_a_text_only_sample_of_an_mrope_family_carries_its_token_types_as_the_processor_gives_them(name):
    """Qwen-VL and GLM-4.1V processors write ``mm_token_type_ids`` for every sample; the tokenizer + image
    processor path does too (GLM-4.1V's text-only samples lacked them)."""
    proc = _processor(name)
    text_only = [{"role": "user", "content": "What is the dog?"}, CONVERSATION[1]]  # a user turn: Qwen3.5 needs one
    theirs = Preprocessor(processor=proc).process([], text_only)
    ours = Preprocessor(proc.tokenizer, proc.image_processor, family=name, template=proc.chat_template)
    ours = ours.process([], text_only)
    assert "mm_token_type_ids" in theirs and "mm_token_type_ids" in ours
    assert not ours["mm_token_type_ids"].any() and len(ours["mm_token_type_ids"]) == len(ours["input_ids"])


# ------------------------------------------------------------------------------ no family table elsewhere

#: String literals spelling a family name that mean something else, where they are written.
NOT_A_FAMILY = {
    ("collate/batch.py", "megatron"): "the Megatron-Core input style of model_inputs()",
    ("processing/chat.py", "llava"): "the name of vlm-pack's LLaVA chat format (a record's chat_format)",
    ("cli/parser.py", "llava"): "the LLaVA-Instruct record format (--format)",
    ("data/records.py", "llava"): "the LLaVA-Instruct record format",
    ("collate/positions.py", "qwen2_5_vl"): "a get_rope_index variant positions.py implements (a record's mrope)",
    ("collate/positions.py", "qwen3_vl"): "a get_rope_index variant positions.py implements (a record's mrope)",
    ("testing/reference.py", "llava_next"): "the default model of the LLaVA reference model",
}
_ALLOWED_DIRS = ("vision/", "offline/")  # the vision rules (each spec names its family) and the stand-ins


def _family_literals(source: str, spellings: set[str]) -> list[tuple[int, str]]:
    """``(line, what)`` of each family-specific rule in ``source``: a string spelling a family (not a
    docstring or other bare string), a comparison of a name holding ``family`` with string literals, and a
    ``.startswith`` / ``.endswith`` test of one."""
    tree = ast.parse(source)
    bare = {
        id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }

    def mentions_family(node: ast.AST) -> bool:
        return any(
            "family" in (getattr(n, "id", "") or getattr(n, "attr", "")).lower() for n in ast.walk(node)
        )

    def literal(node: ast.AST) -> bool:
        items = node.elts if isinstance(node, ast.Tuple | ast.List | ast.Set) else [node]
        return all(isinstance(i, ast.Constant) and isinstance(i.value, str) for i in items)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in bare:
            if node.value.lower() in spellings:
                found.append((node.lineno, node.value))
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(mentions_family(s) and not literal(s) for s in sides) and any(literal(s) for s in sides):
                found.append((node.lineno, ast.unparse(node)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and mentions_family(node.func.value)
        ):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _spellings() -> set[str]:
    return set(FAMILIES) | {alias.lower() for record in FAMILIES.values() for alias in record.aliases}


def test_no_module_keeps_a_family_table_of_its_own():
    spellings, seen, offenders = _spellings(), set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "families.py" or where.startswith(_ALLOWED_DIRS):
            continue
        for line, what in _family_literals(path.read_text(encoding="utf-8"), spellings):
            if (where, what) in NOT_A_FAMILY:
                seen.add((where, what))
            else:
                offenders.append(f"vlm_pack/{where}:{line}: {what}")
    assert not offenders, (
        "family-specific rules outside the registry: make them a field of vlm_pack.families.Family (or, where "
        "the string means something else, list it in NOT_A_FAMILY):\n" + "\n".join(offenders)
    )
    assert seen == set(NOT_A_FAMILY), (
        f"NOT_A_FAMILY lists strings no longer written: {set(NOT_A_FAMILY) - seen}"
    )


def test_the_table_check_finds_tables_and_tests_but_not_docstrings():
    source = '''
"""A module about gemma3 and qwen2_vl."""
TABLE = {"qwen2_vl": 1, "llava": 2}
def f(family, spec, style):
    """Works for gemma3."""
    "a bare string: llava"
    if family == "Gemma-3" or spec.family in ("x", "y") or family.startswith("qwen"):
        return f"{family} and pixtral are named in a message"
    return style == "sdpa" or family in names("mrope")
'''
    found = _family_literals(source, _spellings())
    assert [line for line, _ in found] == [3, 3, 7, 7, 7]
    assert [what for _, what in found][:2] == ["qwen2_vl", "llava"]


# ------------------------------------------------------------------------------ no processor-class table elsewhere

#: Strings naming a transformers processor class outside the registry that are still to move onto the records
#: (issue 38 item 5), by file: none left (the last, processing's bare LLaVA counts and one-call image processors,
#: are ``Family.bare_processor`` / ``one_call_image_processors``). A new entry needs a reason it cannot be a field.
CLASS_TABLES_PENDING: dict[str, set[str]] = {}
_CLASS_NAME = re.compile(r"^(?!(Image|Video)Processor)[A-Z][A-Za-z0-9_]*Processor(Pil|Fast)?$")  # not a suffix


def _class_literals(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of each string literal (docstrings and other bare strings aside) that is a processor
    class name (``...Processor``, ``...ImageProcessorPil``, ``...VideoProcessor``)."""
    tree = ast.parse(source)
    bare = {
        id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in bare and _CLASS_NAME.match(n.value)
    ]


def test_no_module_keeps_a_processor_class_table_of_its_own():
    """Which rule a processor gets is its record's (``Family.processors``): a class name written elsewhere is a
    rule applied by a name the registry does not know of (the old ``_READERS`` picked Qwen's rule for every
    processor holding a ``Qwen2VLImageProcessor``)."""
    seen: dict[str, set[str]] = {}
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        where = path.relative_to(PACKAGE).as_posix()
        if where == "families.py" or where.startswith("offline/"):  # the registry and the stand-ins
            continue
        for line, name in _class_literals(path.read_text(encoding="utf-8")):
            if name in CLASS_TABLES_PENDING.get(where, ()):
                seen.setdefault(where, set()).add(name)
            else:
                offenders.append(f"vlm_pack/{where}:{line}: {name}")
    assert not offenders, (
        "processor class names outside the registry: make them a field of vlm_pack.families.Family:\n"
        + "\n".join(offenders)
    )
    assert seen == CLASS_TABLES_PENDING, f"CLASS_TABLES_PENDING lists names no longer written: {CLASS_TABLES_PENDING}"


def test_the_class_table_check_finds_names_but_not_docstrings():
    source = '''
"""Reads Qwen2VLProcessor."""
READERS = {"Qwen2VLImageProcessor": 1, "LlavaProcessor": 2}
def f(p):
    """For Gemma3ImageProcessorPil."""
    return type(p).__name__ in ("Glm4vImageProcessorPil", "a Processor", "ProcessorSpec", "ImageProcessorPil")
'''
    assert [name for _, name in _class_literals(source)] == [
        "Qwen2VLImageProcessor", "LlavaProcessor", "Glm4vImageProcessorPil",
    ]  # fmt: skip
