"""Reading failure logs as streams: compressed or not, in chunks, with a literal prefilter.

- **Input.** Plain text, gzip, zstd, bzip2 or xz, recognised by their magic bytes (not the file
  name). An empty file, or one that is binary after decompression (NUL bytes, or mostly bytes
  that are not text), is bad input: :class:`SpecError` naming the file and why.
- **Chunks.** The decompressed bytes are decoded as UTF-8 (invalid bytes replaced) in chunks of
  ``CHUNK_BYTES`` that end at a line break, so memory stays bounded whatever the log's size.
- **Prefilter.** Most lines of a training log match no failure pattern. Each pattern yields
  literal "triggers" (:func:`triggers_of`: for every way the regex can match, a literal string
  the match must contain), and one Aho-Corasick pass over the lower-cased chunk (the
  ``ahocorasick_rs`` package; ``re`` where it is missing) finds the lines holding a trigger; only
  those lines are matched against the patterns. A short trigger (4 characters or fewer) counts
  only on word boundaries, so "efa" does not fire inside "default".
"""

from __future__ import annotations

import bz2
import io
import lzma
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Protocol

import numpy as np

from trainpilot.specs.errors import SpecError

if TYPE_CHECKING:
    from ahocorasick_rs import BytesAhoCorasick

CHUNK_BYTES = 8 << 20
COUNT_BLOCK_BYTES = 1 << 18  # numpy counts line breaks in blocks this size (a cache-sized temp)
SNIFF_BYTES = 8192
PIECE_BYTES = 1 << 20  # the most a broken compressed stream can lose (``_Prefixed.read``)
MIN_TRIGGER = 3
SHORT_TRIGGER = 4  # triggers this short must sit on word boundaries
MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"),
         (b"\xfd7zXZ\x00", "xz"))


class ByteStream(Protocol):
    """What a log is read through: a file, a decompressor's reader, ``io.BytesIO``."""

    def read(self, size: int = -1, /) -> bytes: ...

    def close(self) -> None: ...


def _open_compressed(raw: BinaryIO, kind: str) -> ByteStream:
    if kind == "gzip":
        # ISA-L's inflate (python-isal, the gzip module's interface): about twice zlib's speed
        # on text, so a gzip'd log streams as fast as a plain one (benchmarks/diagnose_speed.py).
        from isal import igzip

        return igzip.GzipFile(fileobj=raw)
    if kind == "bzip2":
        return bz2.BZ2File(raw)
    if kind == "xz":
        return lzma.LZMAFile(raw)
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(raw)


def open_log(path: str | os.PathLike) -> tuple[ByteStream, str]:
    """(decompressed byte stream, format name) of a log file; SpecError for a missing, empty,
    unreadable, corrupt-compressed or binary file."""
    path = Path(path)
    if not path.is_file():
        raise SpecError("LOGFILE", str(path), "valid: a readable log file")
    try:
        raw = open(path, "rb")
    except OSError as err:
        raise SpecError("LOGFILE", str(path), f"cannot be read ({err.strerror})") from None
    head = raw.read(8)
    raw.seek(0)
    kind = next((name for magic, name in MAGIC if head.startswith(magic)), "text")
    stream: ByteStream = raw if kind == "text" else _open_compressed(raw, kind)
    try:
        first = stream.read(SNIFF_BYTES)
    except (OSError, EOFError, lzma.LZMAError, ValueError) as err:
        raw.close()
        raise SpecError("LOGFILE", str(path), f"valid: a readable {kind} file ({err})") from None
    except Exception as err:  # zstandard.ZstdError is not an OSError
        raw.close()
        raise SpecError("LOGFILE", str(path), f"valid: a readable {kind} file ({err})") from None
    if not first.strip():
        raw.close()
        raise SpecError("LOGFILE", str(path), "the file is empty" + (
            f" (after {kind} decompression)" if kind != "text" else "") +
            "; valid: a log file with text")
    if _binary(first):
        raw.close()
        raise SpecError("LOGFILE", str(path), "looks binary, not a text log" + (
            f" (after {kind} decompression)" if kind != "text" else "") +
            "; valid: a text log, plain or gzip/zstd/bzip2/xz compressed")
    return _Prefixed(first, stream, raw, kind), kind


def _binary(sample: bytes) -> bool:
    """NUL bytes, or more than 30 % of bytes that are neither printable ASCII, whitespace, nor
    part of valid UTF-8."""
    if b"\x00" in sample:
        return True
    text = sample.decode("utf-8", errors="replace")
    bad = sum(1 for ch in text if ch == "\ufffd" or (ord(ch) < 32 and ch not in "\t\n\r\f\v\x1b"))
    return bad > 0.3 * max(1, len(text))


class _Prefixed(io.RawIOBase):
    """The sniffed first bytes, then the rest of the stream; closes the file under it. A
    compressed stream that breaks off or turns corrupt past the sniffed bytes (a log compressed
    while the job was dying, a partial copy) ends there: what was read is still diagnosed, and
    ``damage`` says where and why."""

    def __init__(self, first: bytes, stream: ByteStream, raw: BinaryIO, kind: str = "text"):
        self._first, self._stream, self._raw, self._kind = first, stream, raw, kind
        self._read = 0
        self.damage: str | None = None

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        out = b""
        if self._first:
            out, self._first = self._first, b""
            if 0 <= size <= len(out):
                self._read += len(out)
                return out
        # A decompressor that fails drops what it inflated in that call, so it is asked for
        # at most PIECE_BYTES at a time: a broken stream loses no more than that.
        pieces = [out] if out else []
        want = size - len(out) if size >= 0 else -1
        while self.damage is None and want != 0:
            ask = want if self._kind == "text" else (
                PIECE_BYTES if want < 0 else min(want, PIECE_BYTES))
            try:
                piece = self._stream.read(ask)
            except Exception as err:  # EOFError, OSError, LZMAError, zstandard.ZstdError
                self.damage = (f"the {self._kind} stream ends early or is corrupt after "
                               f"{self._read + sum(map(len, pieces)):,} bytes ({err}); "
                               f"diagnosed what was read")
                break
            if not piece:
                break
            pieces.append(piece)
            if want > 0:
                want -= len(piece)
            elif self._kind == "text":
                break  # read(-1) returned the whole rest
        out = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # one piece: no copy
        self._read += len(out)
        return out

    def close(self) -> None:
        for f in (self._stream, self._raw):
            try:
                f.close()
            except Exception:
                pass
        super().close()


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """Whole lines of a log as bytes: ``data`` starts at line ``first_line`` (1-based);
    ``low`` is ``data.lower()`` (ASCII case folding: what the triggers are matched against).
    A line is decoded (UTF-8, invalid bytes replaced) only when it is looked at."""

    data: bytes
    low: bytes
    first_line: int
    num_lines: int

    def line(self, start: int, end: int) -> str:
        return self.data[start:end].decode("utf-8", errors="replace")


def count_newlines(data: bytes, start: int = 0, end: int | None = None) -> int:
    """Line breaks in ``data[start:end]`` (``0 <= start``; ``end`` None: to the end), as
    ``data.count(b"\\n", start, end)``. numpy's vectorised compare counts a long range about four
    times faster than the byte loop of ``bytes.count`` (benchmarks/diagnose_speed.py)."""
    end = len(data) if end is None else min(end, len(data))
    if end - start < COUNT_BLOCK_BYTES // 8:  # a short range: numpy's call costs more
        return data.count(b"\n", start, end)
    view = np.frombuffer(data, dtype=np.uint8)
    return sum(int(np.count_nonzero(view[i:min(i + COUNT_BLOCK_BYTES, end)] == 10))
               for i in range(start, end, COUNT_BLOCK_BYTES))


def _chunk(data: bytes, first_line: int) -> Chunk:
    return Chunk(data=data, low=data.lower(), first_line=first_line,
                 num_lines=count_newlines(data))


def iter_chunks(stream: ByteStream, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """Chunks ending at a line break (the last may not)."""
    carry, line = b"", 1
    while True:
        data = stream.read(chunk_bytes)
        if not data:
            if carry:
                yield _chunk(carry, line)
            return
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            carry += data
            continue
        # The carried partial line and this read's whole lines, copied once.
        body = data if not carry and cut == len(data) else b"".join(
            (carry, memoryview(data)[:cut]))
        carry = data[cut:]
        chunk = _chunk(body, line)
        yield chunk
        line += chunk.num_lines


def text_chunks(text: str, *, chunk_bytes: int = CHUNK_BYTES) -> Iterator[Chunk]:
    """The same chunks for a text already in memory."""
    return iter_chunks(io.BytesIO(text.encode("utf-8", errors="replace")),
                       chunk_bytes=chunk_bytes)


# --------------------------------------------------------------------------------- triggers
def _parser():
    try:
        import re._parser as parser  # Python >= 3.11
    except ImportError:  # pragma: no cover
        import sre_parse as parser
    return parser


def triggers_of(regex: str) -> list[str] | None:
    """Lower-case literals such that every match of ``regex`` contains one of them, or None when
    the regex has no such literal of at least ``MIN_TRIGGER`` characters."""
    parser = _parser()
    return _required(list(parser.parse(regex)), parser)


def _required(seq, parser) -> list[str] | None:
    c = parser._constants if hasattr(parser, "_constants") else parser
    LITERAL, SUBPATTERN, BRANCH = c.LITERAL, c.SUBPATTERN, c.BRANCH
    REPEATS = (c.MAX_REPEAT, c.MIN_REPEAT)
    options: list[list[str]] = []
    run: list[str] = []

    def close_run():
        if len(run) >= MIN_TRIGGER:
            options.append(["".join(run).lower()])
        run.clear()

    for op, av in seq:
        if op is LITERAL:
            run.append(chr(av))
            continue
        close_run()
        if op is SUBPATTERN:
            found = _required(list(av[-1]), parser)
            if found:
                options.append(found)
        elif op is BRANCH:
            found = _branches(av[1], parser)
            if found:
                options.append(found)
        elif op in REPEATS and av[0] >= 1:
            found = _required(list(av[2]), parser)
            if found:
                options.append(found)
    close_run()
    if not options:
        return None
    # The best set: its shortest literal longest (fewest lines match), then fewest literals.
    return max(options, key=lambda o: (min(len(s) for s in o), -len(o)))


def _branches(branches, parser) -> list[str] | None:
    out: list[str] = []
    for branch in branches:
        found = _required(list(branch), parser)
        if not found:
            return None
        out += found
    return sorted(set(out))


class Prefilter:
    """Finds the lines of a lower-cased text (bytes) that hold one of the triggers."""

    def __init__(self, triggers: Iterable[str]):
        self.triggers = sorted(set(triggers))
        self._short = {t.encode() for t in self.triggers
                       if len(t) <= SHORT_TRIGGER and t.isalnum()}
        encoded = [t.encode() for t in self.triggers]
        self._ac: BytesAhoCorasick | None
        self._re: re.Pattern[bytes] | None
        try:
            import ahocorasick_rs

            # Leftmost-longest, non-overlapping: enough to find the lines (the diagnoser then
            # checks which patterns' triggers each candidate line holds). A DFA, built once per
            # command (a few ms for ~400 triggers): it scans a healthy log's chunk in about half
            # the time of the default contiguous NFA (benchmarks/diagnose_speed.py).
            self._ac = ahocorasick_rs.BytesAhoCorasick(
                encoded, matchkind=ahocorasick_rs.MATCHKIND_LEFTMOST_LONGEST,
                implementation=ahocorasick_rs.Implementation.DFA)
            self._re = None
        except ImportError:  # pragma: no cover - the dependency is declared
            self._ac = None
            self._re = re.compile(b"|".join(re.escape(t) for t in
                                            sorted(encoded, key=len, reverse=True)))
            self._index = {t: i for i, t in enumerate(encoded)}

    def _hits(self, low: bytes) -> Iterator[tuple[int, int, int]]:
        if self._ac is not None:
            yield from self._ac.find_matches_as_indexes(low)
        else:
            assert self._re is not None  # __init__ sets one of the two matchers
            for m in self._re.finditer(low):
                yield self._index[m.group(0)], m.start(), m.end()

    def line_hits(self, low: bytes | str, *, dropped: list[tuple[int, int]] | None = None,
                  ) -> list[tuple[int, int, set[int]]]:
        """Sorted (start, end, trigger indices) of the candidate lines (byte offsets; end
        excludes the line break); indices into ``self.triggers``. ``dropped`` collects the
        (start, end) of the lines of short-trigger hits dropped for want of a word boundary:
        the automaton's matches do not overlap, so such a hit can hide another trigger there."""
        if isinstance(low, str):
            low = low.encode()
        lines: dict[int, list] = {}
        current: list | None = None
        for index, start, end in self._hits(low):
            if self._short and (end - start) <= SHORT_TRIGGER and low[start:end] in self._short:
                before = low[start - 1:start] if start else b" "
                after = low[end:end + 1] or b" "
                if before.isalnum() or before == b"_" or after.isalnum() or after == b"_":
                    if dropped is not None:
                        dropped.append(_line_of(low, start, end))
                    continue
            if current is not None and current[0] <= start < current[1]:
                current[2].add(index)  # on the candidate line just found
                continue
            line_start, line_end = _line_of(low, start, end)
            current = lines.get(line_start)
            if current is None:
                current = lines[line_start] = [line_start, line_end, set()]
            current[2].add(index)
        return sorted((a, b, hits) for a, b, hits in lines.values())

    def line_spans(self, low: bytes | str, *, dropped: list[tuple[int, int]] | None = None,
                   ) -> list[tuple[int, int]]:
        """Sorted (start, end) byte spans of the candidate lines (``dropped``: as
        :meth:`line_hits`)."""
        return [(a, b) for a, b, _ in self.line_hits(low, dropped=dropped)]

    @staticmethod
    def held(low: bytes, literals: Iterable[bytes], lines: Iterable[tuple[int, int]],
             ) -> set[bytes]:
        """Which of ``literals`` (each one of the triggers) ``low`` holds, looking only in
        ``lines``: its candidate lines and the dropped hits' lines, which between them hold
        every occurrence of a trigger."""
        lines = list(lines)
        return {lit for lit in literals if any(lit in low[a:b] for a, b in lines)}


def _line_of(low: bytes, start: int, end: int) -> tuple[int, int]:
    """(start, end) of the line holding ``low[start:end]`` (end excludes the line break)."""
    line_end = low.find(b"\n", end)
    return low.rfind(b"\n", 0, start) + 1, len(low) if line_end < 0 else line_end
