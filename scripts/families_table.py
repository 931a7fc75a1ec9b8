"""Regenerate the model-type table of docs/families.md for the installed transformers.

Every model type ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`` maps gets one row: a named record of
``vlm_pack.families`` (its figures are the table above it), or the route for types without a record
(``vlm_pack.model_types``) certified on a tiny genuine model (``vlm_pack.testing.certify_model_type``: packed
vs each sample alone, sdpa and eager), or why not: refused (packing measured not exact: listed in
``vlm_pack.model_types.REFUSED``, which collators refuse by name) or not certified here (what could not be built
offline). Each type runs in its own process (a time and memory limit each), so one type cannot stop the sweep.

    PYTHONPATH=. .venv/bin/python scripts/families_table.py            # all types, rewrites docs/families.md
    PYTHONPATH=. .venv/bin/python scripts/families_table.py --only paddleocr_vl exaone4_5   # print rows only

Run it in the venv with torchvision to certify the types whose image processor exists only as a torchvision
class. The "forecast exact" column compares, for each type whose processor builds offline (a record's through
``vlm_pack.offline.processor``, any other through ``processor_for_type``), the forecast from image sizes alone
(``Preprocessor.forecast``: a record's fast rule, or the exact route of ``vlm_pack.vision.oracle``) with the
length of the processor's own ``__call__`` on Pillow images of those sizes (:data:`FORECAST_SIZES`).

    PYTHONPATH=. .venv-tv/bin/python scripts/families_table.py --forecast-only   # refill that column only

``--videos`` (torchvision and PyAV) fills the "notes" column of each type without a record whose processor has
a video processor (``VIDEO_PROCESSOR_MAPPING_NAMES``) with its video certificate
(``certify_model_type(..., videos=True)``: a video sample, forecast by the processor's own video step and
processed by vlm-pack, packed with image and text samples against each alone), or why its videos are refused;
``--videos-only`` refills that column of the committed table alone.

    PYTHONPATH=. .venv-tv/bin/python scripts/families_table.py --videos-only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "families.md"
BEGIN, END = "<!-- model-types:begin (scripts/families_table.py) -->", "<!-- model-types:end -->"
_ONE = """
import json, logging, warnings
warnings.filterwarnings("ignore"); logging.disable(logging.WARNING)
from vlm_pack.testing.model_types import certify_model_type
c = certify_model_type({model_type!r})
print("CERT" + json.dumps(dict(exact=c.exact, errors=c.errors, positions=c.positions, mixers=c.mixers,
                               reason=c.reason, built=c.built, tokens=c.tokens, notes=c.notes)))
"""


#: Samples of real image sizes (width, height): a photo, a tall document page, a screenshot, two images.
FORECAST_SIZES = (((640, 480),), ((333, 1000),), ((1280, 720),), ((500, 375), (300, 400)))


def forecast_check(model_type: str) -> str:
    """The forecast-exact cell: ``exact on N samples`` where ``Preprocessor.forecast`` from sizes alone equals
    the length of the processor's own ``__call__`` on Pillow images of those sizes for every sample of
    :data:`FORECAST_SIZES`, else the first difference or why it could not be checked."""
    from PIL import Image

    from vlm_pack import Preprocessor
    from vlm_pack.families import lookup
    from vlm_pack.offline import processor as record_processor
    from vlm_pack.offline.model_types import placeholder_for_type, processor_for_type

    record = lookup(model_type)
    saved = ROOT / "tests" / "templates" / f"{record.name if record else model_type}.jinja"  # released templates
    try:
        if record is not None:
            proc = record_processor(record.name, chat_template=saved.read_text() if saved.exists() else None)
        else:
            proc = processor_for_type(model_type)
    except Exception as e:  # the processor does not build offline: nothing to compare
        return f"not checked: {type(e).__name__}: {str(e)[:80]}".replace("|", "/")

    def template(conversation: object, num_images: int) -> list[tuple[str, bool]]:  # a type without a record
        # the form its processor insists on, with vlm-pack's marker where the image token goes
        images = placeholder_for_type(model_type, proc).replace(str(proc.image_token), "<image>") * num_images
        return [(f"User: {images}Describe it.\n", False), ("Assistant: A test card.", True)]

    try:
        pre = Preprocessor(processor=proc, template=None if record is not None else template)
    except ValueError as e:  # refused by name at start-up (or the stand-in prompt does not suit it)
        return f"refused: {type(e).__name__}: {str(e)[:100]}".replace("|", "/")
    except Exception as e:
        return f"not checked: {type(e).__name__}: {str(e)[:100]}".replace("|", "/")
    try:
        for sizes in FORECAST_SIZES:
            images = [Image.new("RGB", size, (40 * i, 120, 200)) for i, size in enumerate(sizes)]
            turns = [{"role": "user", "content": "<image>" * len(sizes) + "Describe it."},
                     {"role": "assistant", "content": "A test card."}]  # fmt: skip
            length, _ = pre.forecast(turns, list(sizes))
            text = pre.render(turns, len(sizes))  # a BOS the tokenizer adds written out
            try:
                own = len(proc(text=[text], images=[images], add_special_tokens=False, return_tensors="pt")["input_ids"][0])
            except ValueError:  # a processor that takes no nested images (GOT-OCR2's): the sample's, flat
                own = len(proc(text=[text], images=images, add_special_tokens=False, return_tensors="pt")["input_ids"][0])
            if length != own:
                shown = "+".join(f"{w}x{h}" for w, h in sizes)
                return f"OFF: forecast {length}, processor {own} at {shown}"
    except Exception as e:
        return f"not checked: {type(e).__name__}: {str(e)[:80]}".replace("|", "/")
    return f"exact on {len(FORECAST_SIZES)} samples"


def video_check(model_type: str) -> str:
    """The notes cell's video part for a type without a record whose processor has a video processor: ``video:
    packed = alone`` with the errors and the forecast against the processed length, or why not; "" for the
    others (a record's videos are its family's: docs/video.md)."""
    from transformers.models.auto.video_processing_auto import VIDEO_PROCESSOR_MAPPING_NAMES

    from vlm_pack.families import lookup
    from vlm_pack.model_types import refused_on
    from vlm_pack.offline.type_overrides import override as _override
    from vlm_pack.testing.model_types import certify_model_type

    if lookup(model_type) is not None or refused_on(model_type) is not None or model_type not in VIDEO_PROCESSOR_MAPPING_NAMES:
        return ""
    try:
        c = certify_model_type(model_type, videos=True)
    except Exception as e:  # the harness reports the type's failures itself: this is its own
        return f"video: not checked: {type(e).__name__}: {str(e)[:100]}".replace("|", "/")
    if c.exact:
        measured = " / ".join(f"{c.errors[k]:.7f} ({k})" for k in ("sdpa", "eager") if k in c.errors)
        given = _override(model_type, "video_processor")  # settings the released defaults differ by
        settings = f" (video processor {', '.join(f'{k}={v}' for k, v in given.items())})" if given else ""
        return f"video: packed = alone {measured}{settings}; {c.video}".replace("|", "/")
    return f"video: not packed: {(c.reason or '')[:240]}".replace("|", "/")


def refill_videos() -> int:
    """Rewrite the "notes" cell of every row of the committed table whose type has a video certificate."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END)
    lines = text[start:end].splitlines()
    for i, line in enumerate(lines):
        if line.startswith("| `"):
            cells = line.split("|")
            cell = video_check(cells[1].strip().strip("`"))
            if cell:
                cells[6] = f" {cell} "
                lines[i] = "|".join(cells)
                print(lines[i], flush=True)
    DOC.write_text(text[:start] + "\n".join(lines) + "\n" + text[end:])
    return 0


class _TimeUp(BaseException):  # not caught by the check's own "except Exception"
    pass


def certify_here(model_type: str, timeout: int) -> dict:
    """One type certified in this process (an alarm after ``timeout`` s; the address-space limit set in main
    turns a type that needs more memory into its reason)."""
    import gc
    import signal

    from vlm_pack.testing.model_types import certify_model_type

    def time_up(*_: object) -> None:
        raise _TimeUp

    signal.signal(signal.SIGALRM, time_up)
    signal.alarm(timeout)
    try:
        c = certify_model_type(model_type)
        return dict(exact=c.exact, errors=c.errors, positions=c.positions, mixers=c.mixers, reason=c.reason,
                    built=c.built, tokens=c.tokens, notes=c.notes)
    except _TimeUp:
        return dict(exact=False, reason=f"not certified: the check ran past {timeout} s", built=False)
    except MemoryError:
        return dict(exact=False, reason="not certified: the tiny model needs more memory than the limit", built=False)
    finally:
        signal.alarm(0)
        gc.collect()


def certify(model_type: str, timeout: int, memory_kb: int) -> dict:
    """One type certified in a child process; a crash, a timeout or the memory limit is its reason."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    limit = f"ulimit -v {memory_kb}; " if memory_kb else ""
    command = f'{limit}exec "{sys.executable}" -c "$CODE"'
    try:
        done = subprocess.run(["bash", "-c", command], env=dict(env, CODE=_ONE.format(model_type=model_type)),
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(exact=False, reason=f"not certified: the check ran past {timeout} s", built=False)
    for line in done.stdout.splitlines():
        if line.startswith("CERT"):
            return json.loads(line[4:])
    tail = " ".join((done.stderr or "").strip().splitlines()[-1:])[:160]
    return dict(exact=False, reason=f"not certified: the check crashed ({tail or 'rc ' + str(done.returncode)})",
                built=False)


def row(model_type: str, cls: str, cert: dict | None, refused: dict[str, str]) -> str:
    from vlm_pack.families import lookup

    record = lookup(model_type)
    if record is not None:
        alias = f" (`{record.name}`'s record, by alias)" if record.name != model_type else ""
        return f"| `{model_type}` | {cls} | named record{alias} | see the families table above | | |"
    if model_type in refused:
        return f"| `{model_type}` | {cls} | refused | {refused[model_type]} | | |"
    assert cert is not None
    errors = cert.get("errors") or {}
    measured = " / ".join(f"{errors[s]:.7f}" for s in ("sdpa", "eager") if s in errors)
    if cert.get("exact"):
        mixers = f"; mixers isolated: {', '.join(cert['mixers'])}" if cert.get("mixers") else ""
        styles = " / ".join(s for s in ("sdpa", "eager") if s in errors)
        notes = "".join(f"; {note}" for note in cert.get("notes") or [])
        return f"| `{model_type}` | {cls} | generic, certified | packed = alone {measured} ({styles}); " \
               f"positions: {cert.get('positions')}{mixers}{notes} | | |"
    reason = (cert.get("reason") or "").replace("|", "/")
    if errors or reason.startswith("a token mixer vlm-pack cannot isolate"):  # must be in REFUSED
        return f"| `{model_type}` | {cls} | refused (add to REFUSED) | {reason} | | |"
    return f"| `{model_type}` | {cls} | not certified here | {reason} | | |"


def refill_forecasts() -> int:
    """Rewrite the "forecast exact" cell of every row of the committed table (:func:`forecast_check`), and the
    count of exact forecasts in its summary line."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END)
    lines, exact = text[start:end].splitlines(), 0
    for i, line in enumerate(lines):
        if line.startswith("| `"):
            cells = line.split("|")
            cell = forecast_check(cells[1].strip().strip("`"))
            exact += cell.startswith("exact")
            cells[5] = f" {cell} "
            lines[i] = "|".join(cells)
            print(lines[i], flush=True)
    lines = [line for line in lines if not line.startswith("Forecast exact (")]
    lines.insert(2, _forecast_summary(exact) + "\n")
    DOC.write_text(text[:start] + "\n".join(lines) + "\n" + text[end:])
    print(_forecast_summary(exact))
    return 0


def _forecast_summary(exact: int) -> str:
    return f"Forecast exact (from sizes alone = the processor's own call on {len(FORECAST_SIZES)} samples of real " \
           f"sizes): {exact} types."


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "absent"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=None, help="certify these types and print their rows")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per type")
    parser.add_argument("--memory-gb", type=float, default=8.0, help="address-space limit per type (0: none)")
    parser.add_argument("--isolate", action="store_true", help="each type in a process of its own (slower)")
    parser.add_argument("--forecast-only", action="store_true", help="refill the forecast exact column only")
    parser.add_argument("--videos", action="store_true", help="certify videos too, into the notes column")
    parser.add_argument("--videos-only", action="store_true", help="refill the notes column's videos only")
    args = parser.parse_args(argv)
    if args.forecast_only:
        return refill_forecasts()
    if args.videos_only:
        return refill_videos()
    if not args.isolate and args.memory_gb:
        import resource

        limit = int(args.memory_gb * 1024**3)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        import logging
        import warnings

        warnings.filterwarnings("ignore")
        logging.disable(logging.WARNING)

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as TYPES

    from vlm_pack.families import lookup
    from vlm_pack.model_types import refused_on

    types = args.only if args.only else list(TYPES)
    rows = []
    counts: dict[str, int] = {}
    for model_type in types:
        refusal = refused_on(model_type)
        needs_run = lookup(model_type) is None and refusal is None
        if not needs_run:
            cert = None
        elif args.isolate:
            cert = certify(model_type, args.timeout, int(args.memory_gb * 1024 * 1024))
        else:
            cert = certify_here(model_type, args.timeout)
        cells = row(model_type, TYPES[model_type], cert, {model_type: refusal} if refusal else {}).split("|")
        cells[5] = f" {forecast_check(model_type)} "
        if args.videos:
            cells[6] = f" {video_check(model_type)} "
        line = "|".join(cells)
        kind = line.split("|")[3].strip()
        counts[kind] = counts.get(kind, 0) + 1
        rows.append(line)
        print(line, flush=True)
    if args.only:
        return 0
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    table = "\n".join([
        BEGIN,
        f"Every image-text-to-text model type of transformers {transformers.__version__} "
        f"(`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, {len(types)} types): {summary}. Generated by "
        f"`scripts/families_table.py` (torch {_version('torch')}, torchvision {_version('torchvision')}; tiny "
        "genuine models on CPU, fp32, its real processor on Pillow images; token_mult_prob_error, 1.0 = exact).",
        _forecast_summary(sum(line.split("|")[5].strip().startswith("exact") for line in rows)),
        "",
        "| model type | model class | route | packed vs alone, or the reason | forecast exact | notes |",
        "|---|---|---|---|---|---|",
        *rows,
        END,
    ])
    text = DOC.read_text()
    if BEGIN in text:
        text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: table, text, flags=re.S)
    else:
        text = text.rstrip("\n") + "\n\n## Every image-text-to-text model type\n\n" + table + "\n"
    DOC.write_text(text)
    print(f"wrote {DOC}: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
