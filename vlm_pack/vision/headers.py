"""``image_size``: an image's ``(width, height)`` from its header, without decoding pixels.

JPEG, PNG (APNG included), GIF and WebP headers are parsed by hand (several times faster than Pillow's lazy
open, see ``benchmarks/bench_image_size.py``); other formats go through Pillow's lazy ``Image.open``.

EXIF: transformers' ``load_image`` (used when a processor or chat template is given a path, URL or base64
string) applies ``PIL.ImageOps.exif_transpose``, so a JPEG stored as 4000x3000 with orientation 6 reaches
the processor as 3000x4000. :func:`image_size` therefore honours orientations 5-8 by default; pass
``exif_transpose=False`` when your pipeline hands ``PIL.Image.open(...)`` results to the processor without
transposing them (WebDataset's PIL decoder, Megatron-Energon), because then the stored size is what the
processor sees. The rule is the same for every family: it belongs to the loader, not to the processor.
TIFF is the exception: Pillow's TIFF reader applies the orientation itself (``Image.open(...).size`` is
already the displayed size and ``load()`` transposes the pixels), so a TIFF reaches the processor in its
displayed size either way.
"""

from __future__ import annotations

import functools
import io
import os
import re
import struct
import zlib
from typing import Any, BinaryIO, Union

ImageSource = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]

_PREFIX = 64 * 1024  # bytes read up front from files: enough for nearly every header


class _Reader:
    """Random access over bytes or a seekable binary file; ``get`` returns fewer bytes at the end."""

    __slots__ = ("base", "buf", "complete", "fp")

    def __init__(self, buf: Any, fp: BinaryIO | None = None, base: int = 0) -> None:
        self.buf = buf
        self.fp = fp
        self.base = base
        self.complete = fp is None or len(buf) < _PREFIX

    def get(self, offset: int, n: int) -> bytes:
        end = offset + n
        if end <= len(self.buf) or self.complete:
            return bytes(self.buf[offset:end])
        assert self.fp is not None
        self.fp.seek(self.base + offset)
        return self.fp.read(n)


class _Corrupt(ValueError):
    pass


def _u16be(b: bytes, o: int = 0) -> int:
    return (b[o] << 8) | b[o + 1]


def _exif_orientation(data: bytes) -> int | None:
    """The Orientation tag (0x0112) of IFD0 of a TIFF-structured EXIF block, or None if absent."""
    for _ in range(2):  # Pillow strips up to two "Exif\0\0" prefixes (PNG eXIf chunks often carry one)
        if data[:6] == b"Exif\x00\x00":
            data = data[6:]
    # Pillow's TIFF prefixes (42 either way round); anything else, BigTIFF included, yields no EXIF tags.
    if data[:4] in (b"II*\x00", b"II\x00*"):
        bo = "<"
    elif data[:4] in (b"MM\x00*", b"MM*\x00"):
        bo = ">"
    else:
        return None
    (ifd,) = struct.unpack_from(bo + "I", data, 4)
    if ifd + 2 > len(data):
        return None
    (count,) = struct.unpack_from(bo + "H", data, ifd)
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(data):
            return None
        tag, typ, n = struct.unpack_from(bo + "HHI", data, entry)
        if tag != 0x0112:
            continue
        if n != 1:
            return -1  # present but not a single value: no transposition
        fmt = {1: "B", 3: "H", 4: "I", 6: "b", 8: "h", 9: "i"}.get(typ)
        return struct.unpack_from(bo + fmt, data, entry + 8)[0] if fmt else -1
    return None


_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')


def _orientation(exif: bytes | None, xmp: bytes | None) -> int:
    """Pillow's ``getexif()`` Orientation: EXIF's tag, else XMP's ``tiff:Orientation``, else 1."""
    if exif is not None:
        value = _exif_orientation(exif)
        if value is not None:
            return value
    if xmp:
        match = _XMP_ORIENTATION.search(xmp)
        if match:
            return int(match[2])
    return 1


def _jpeg(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    pos = 2
    size = None
    exif = xmp = None
    while True:
        head = r.get(pos, 4)
        if len(head) < 2:
            raise _Corrupt("JPEG ends before its start-of-scan marker (truncated header)")
        if head[0] != 0xFF:  # Pillow skips junk between segments
            pos += 1
            continue
        marker = head[1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x00 or marker == 0x01 or 0xD0 <= marker <= 0xD8:  # no length field
            pos += 2
            continue
        if marker == 0xD9:
            break
        if len(head) < 4:
            raise _Corrupt("JPEG segment header is truncated")
        seglen = _u16be(head, 2)
        if seglen < 2:
            raise _Corrupt(f"JPEG segment 0xFF{marker:02X} has invalid length {seglen}")
        if marker == 0xDA:  # start of scan: the header is over
            break
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):
            sof = r.get(pos + 4, 6)
            if len(sof) < 6:
                raise _Corrupt("JPEG start-of-frame segment is truncated")
            if sof[0] != 8:
                raise _Corrupt(f"{sof[0]}-bit JPEG: Pillow (hence the processor) cannot decode it")
            if sof[5] not in (1, 3, 4):
                raise _Corrupt(f"JPEG with {sof[5]} components: Pillow cannot decode it")
            size = (_u16be(sof, 3), _u16be(sof, 1))  # Pillow keeps the last SOF
        elif marker == 0xE1 and want_exif:
            body = r.get(pos + 4, seglen - 2)
            if len(body) < seglen - 2:
                raise _Corrupt("JPEG APP1 segment is truncated")
            # As Pillow: Exif APP1s are concatenated (one TIFF structure), the last XMP packet wins.
            if body[:6] == b"Exif\x00\x00":
                exif = body if exif is None else exif + body[6:]
            elif body[:29] == b"http://ns.adobe.com/xap/1.0/\x00":
                xmp = body[29:]
        pos += 2 + seglen
    if size is None:
        raise _Corrupt("JPEG has no start-of-frame segment before its image data")
    return size[0], size[1], _orientation(exif, xmp) if want_exif else 1


_PNG_SIG = b"\x89PNG\r\n\x1a\n"
_PNG_CHUNK = struct.Struct(">I4s")


def _png_text(cid: bytes, body: bytes) -> tuple[bytes, bytes] | None:
    """``(keyword, text)`` of a tEXt / zTXt / iTXt chunk, decompressed as Pillow does; None if unreadable."""
    key, _, value = body.partition(b"\x00")
    if cid == b"zTXt":
        try:
            value = zlib.decompress(value[1:]) if value[:1] == b"\x00" else b""
        except zlib.error:
            value = b""
    elif cid == b"iTXt":
        parts = value[2:].split(b"\x00", 2)
        if len(value) < 2 or len(parts) < 3:
            return None
        text = parts[2]
        if value[0]:
            try:
                text = zlib.decompress(text) if value[1] == 0 else b""
            except zlib.error:
                text = b""
        value = text
    return key, value


def _png(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    head = r.get(8, 25)
    if len(head) < 25:
        raise _Corrupt("PNG ends inside its IHDR chunk (truncated header)")
    if head[4:8] != b"IHDR":
        raise _Corrupt(f"PNG's first chunk is {head[4:8]!r}, not IHDR")
    width, height = struct.unpack_from(">II", head, 8)
    if not want_exif:
        return width, height, 1
    # Pillow reads eXIf / text chunks before and (when the image is loaded) after the image data.
    exif = raw_profile = xmp_str = xmp = None
    pos = 8
    seen_idat = animated = False
    mem = r.buf if r.complete else None  # in memory: unpack chunk headers in place (hot loop over IDATs)
    end = len(r.buf)
    while True:
        if mem is not None:
            if pos + 8 > end:
                break
            length, cid = _PNG_CHUNK.unpack_from(mem, pos)
        else:
            chunk = r.get(pos, 8)
            if len(chunk) < 8:
                break  # a truncated tail loses only metadata, as with Pillow's tolerant chunk reader
            length, cid = _PNG_CHUNK.unpack(chunk)
        if cid == b"IEND" or (animated and seen_idat and cid == b"fcTL"):
            break
        if cid == b"acTL":
            animated = True
        elif cid == b"IDAT":
            seen_idat = True
        elif cid == b"eXIf":
            exif = b"Exif\x00\x00" + r.get(pos + 8, length)
        elif cid in (b"tEXt", b"zTXt", b"iTXt"):
            text = _png_text(cid, r.get(pos + 8, length))
            if text is not None:
                key, value = text
                if key == b"exif" and cid == b"tEXt":
                    exif = value
                elif key == b"Raw profile type exif":
                    raw_profile = value
                elif key == b"XML:com.adobe.xmp":
                    xmp_str = value
                    if cid == b"iTXt":
                        xmp = value
        pos += 12 + length
    if exif is None and raw_profile is not None:
        try:
            exif = bytes.fromhex("".join(raw_profile.decode("latin-1").split("\n")[3:]))
        except ValueError:
            exif = None
    return width, height, _orientation(exif, xmp_str if xmp_str is not None else xmp)


def _gif(r: _Reader) -> tuple[int, int, int]:
    head = r.get(0, 13)
    if len(head) < 13:
        raise _Corrupt("GIF ends inside its logical screen descriptor")
    width, height = struct.unpack_from("<HH", head, 6)
    flags = head[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    # Pillow enlarges the canvas to the first frame's extent when that frame spills over it.
    while True:
        block = r.get(pos, 1)
        if not block:
            raise _Corrupt("GIF ends before its first image descriptor")
        if block == b"!":
            pos += 2
            while True:
                n = r.get(pos, 1)
                if not n:
                    raise _Corrupt("GIF extension block is truncated")
                pos += 1 + n[0]
                if n[0] == 0:
                    break
        elif block == b",":
            desc = r.get(pos + 1, 8)
            if len(desc) < 8:
                raise _Corrupt("GIF image descriptor is truncated")
            x0, y0, w, h = struct.unpack("<HHHH", desc)
            return max(width, x0 + w), max(height, y0 + h), 1
        elif block == b";":
            raise _Corrupt("GIF ends (trailer) before its first image descriptor")
        else:
            pos += 1  # Pillow skips stray bytes between blocks


def _webp(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    head = r.get(12, 18)
    if len(head) < 8:
        raise _Corrupt("WebP ends before its first chunk")
    fourcc = head[:4]
    if fourcc == b"VP8 ":
        if len(head) < 18 or head[11:14] != b"\x9d\x01\x2a":
            raise _Corrupt("WebP VP8 frame header is truncated or invalid")
        w, h = struct.unpack_from("<HH", head, 14)
        return w & 0x3FFF, h & 0x3FFF, 1
    if fourcc == b"VP8L":
        if len(head) < 13 or head[8] != 0x2F:
            raise _Corrupt("WebP VP8L header is truncated or invalid")
        bits = int.from_bytes(head[9:13], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, 1
    if fourcc == b"VP8X":
        if len(head) < 18:
            raise _Corrupt("WebP VP8X header is truncated")
        width = 1 + int.from_bytes(head[12:15], "little")
        height = 1 + int.from_bytes(head[15:18], "little")
        orientation = 1
        if want_exif and head[8] & 0x0C:  # EXIF (0x08) or XMP (0x04) flag
            exif = xmp = None
            pos = 12
            while True:
                chunk = r.get(pos, 8)
                if len(chunk) < 8:
                    break
                cid, length = chunk[:4], int.from_bytes(chunk[4:], "little")
                if cid == b"EXIF" and exif is None:
                    exif = r.get(pos + 8, length)
                elif cid == b"XMP " and xmp is None:
                    xmp = r.get(pos + 8, length)
                pos += 8 + length + (length & 1)
            orientation = _orientation(exif, xmp)
        return width, height, orientation
    raise _Corrupt(f"WebP has an unknown first chunk {fourcc!r}")


@functools.cache
def _tiff_reader_orients() -> bool:
    """Whether this Pillow's TIFF reader reports (and loads) the displayed size itself.

    Recent Pillow releases apply a TIFF's Orientation tag when opening it; older ones leave it to
    ``ImageOps.exif_transpose``. Probed once on a 2x1 TIFF tagged orientation 6 (90 degrees).
    """
    from PIL import Image

    buf = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.new("L", (2, 1)).save(buf, format="TIFF", exif=exif)
    buf.seek(0)
    with Image.open(buf) as im:
        return im.size == (1, 2)


def _pillow(r: _Reader, want_exif: bool) -> tuple[int, int, int]:
    from PIL import Image, TiffImagePlugin, UnidentifiedImageError

    fp: Any
    if r.fp is not None and r.base == 0:
        fp = r.fp  # Pillow's plugins seek to absolute offsets: only a stream starting at 0 works as is
        fp.seek(0)
    elif r.complete:
        fp = io.BytesIO(bytes(r.buf))
    else:
        assert r.fp is not None
        r.fp.seek(r.base + len(r.buf))
        fp = io.BytesIO(bytes(r.buf) + r.fp.read())
    try:
        with Image.open(fp) as im:
            width, height = im.size
            # Pillow's TIFF reader already reports the displayed size (and transposes the pixels on load,
            # whether or not the caller asks for exif_transpose): swapping again would undo it.
            oriented_by_reader = isinstance(im, TiffImagePlugin.TiffImageFile) and _tiff_reader_orients()
            orientation = im.getexif().get(0x0112, 1) if want_exif and not oriented_by_reader else 1
    except UnidentifiedImageError:
        raise _Corrupt("not an image format Pillow can identify") from None
    except Image.DecompressionBombError as e:
        raise _Corrupt(f"Pillow refuses to open it ({e})") from None
    except Exception as e:  # Pillow's plugins raise anything on garbage
        raise _Corrupt(f"Pillow cannot read its header ({type(e).__name__}: {e})") from None
    return width, height, orientation if isinstance(orientation, int) else -1


def _parse(r: _Reader, want_exif: bool) -> tuple[int, int]:
    sig = r.get(0, 16)
    if sig[:3] == b"\xff\xd8\xff":
        w, h, orientation = _jpeg(r, want_exif)
    elif sig[:8] == _PNG_SIG:
        w, h, orientation = _png(r, want_exif)
    elif sig[:6] in (b"GIF87a", b"GIF89a"):
        w, h, orientation = _gif(r)
    elif sig[:4] == b"RIFF" and sig[8:12] == b"WEBP":
        w, h, orientation = _webp(r, want_exif)
    elif not sig:
        raise _Corrupt("empty input")
    else:
        w, h, orientation = _pillow(r, want_exif)
    if w <= 0 or h <= 0:
        raise _Corrupt(f"header declares a {w}x{h} image")
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def _describe(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{type(source).__name__} of {len(source)} bytes>"
    name = getattr(source, "name", None)
    return repr(name) if isinstance(name, str) else f"<{type(source).__name__}>"


def image_size(
    source: ImageSource, *, exif_transpose: bool = True, name: str | None = None
) -> tuple[int, int]:
    """``(width, height)`` of an image, read from its header only (pixels are never decoded).

    Args:
        source: a path (``str`` / ``PathLike``), in-memory bytes (``bytes`` / ``bytearray`` /
            ``memoryview``), or a binary file object (read from its current position, which is restored).
        exif_transpose: honour the EXIF / XMP Orientation as ``PIL.ImageOps.exif_transpose`` (hence
            transformers' ``load_image``) does: orientations 5-8 swap width and height. Pass ``False`` when
            the processor receives ``PIL.Image.open`` results untransposed. TIFF is always its displayed
            size: Pillow's TIFF reader applies the orientation itself, so no flag changes what the
            processor sees.
        name: how to call the image in error messages (e.g. a WebDataset key); defaults to the path or type.

    JPEG, PNG (incl. APNG), GIF and WebP (VP8, VP8L, VP8X) are parsed by hand; other formats fall back to
    Pillow's lazy ``Image.open(...).size``. Corrupt or truncated headers raise ``ValueError`` naming the
    source.
    """
    label = name if name is not None else _describe(source)
    try:
        if isinstance(source, (bytes, bytearray, memoryview)):
            buf = source if not isinstance(source, memoryview) else source.cast("B")
            return _parse(_Reader(buf), exif_transpose)
        if isinstance(source, (str, os.PathLike)):
            with open(source, "rb") as fp:
                return _parse(_Reader(fp.read(_PREFIX), fp, 0), exif_transpose)
        if hasattr(source, "read"):
            start = source.tell() if source.seekable() else None
            if start is None:  # unseekable stream: take it whole
                return _parse(_Reader(source.read()), exif_transpose)
            try:
                return _parse(_Reader(source.read(_PREFIX), source, start), exif_transpose)
            finally:
                source.seek(start)
    except _Corrupt as e:
        raise ValueError(f"image_size({label}): {e}.") from None
    except (struct.error, IndexError) as e:
        raise ValueError(f"image_size({label}): corrupt or truncated header ({e}).") from None
    except OSError as e:
        raise ValueError(f"image_size({label}): cannot read it ({e}).") from None
    raise TypeError(
        f"image_size: expected a path, bytes-like object or binary file object, got {type(source).__name__}."
    )
