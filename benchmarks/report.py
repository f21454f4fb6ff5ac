"""What every result file records about its run, and the one way results are written.

A result opens with its run's metadata: the command, the commit (`git rev-parse HEAD`, with
"+dirty" when the checkout differs from it outside benchmarks/results/), the date, the
torch and Python versions, the CPU model and its cores. A Markdown file carries it as a
list before its first blank line, a JSON file under "meta" (the figures under "result"), a
PNG file in a tEXt chunk. Every benchmark writes through `write_markdown`, `write_json` and
`stamp_png`, so that no result goes without it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import struct
import subprocess
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Final

ROOT: Final = Path(__file__).resolve().parent.parent
RESULTS: Final = ROOT / "benchmarks" / "results"
GIT_S: Final = 120  # a local git command; past this, something is wrong (a lock held, say)
NOT_RECORDED: Final = "not recorded"


@dataclass(frozen=True, kw_only=True)
class Meta:
    """A run's metadata, each field a line of text."""

    command: str
    commit: str
    date: str
    torch: str
    python: str
    cpu: str
    cores: str

    @classmethod
    def collect(cls, command: str) -> Meta:
        """This machine's and this checkout's, now (the start of a run: the code measured)."""
        import torch

        return cls(command=command, commit=commit(), torch=torch.__version__,
                   date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                   python=platform.python_version(), cpu=cpu_model(), cores=cores())

    def markdown(self) -> str:
        """The list that opens a Markdown result, with the blank line that ends it."""
        return "".join(f"- {f.name}: {getattr(self, f.name)}\n" for f in fields(self)) + "\n"


def commit(root: Path = ROOT) -> str:
    """HEAD's full hash, "+dirty" when files differ from it (results/ left out: a run that
    wrote one does not make the next run's code dirty)."""
    try:
        head = _git(root, "rev-parse", "HEAD").strip()
        changed = _git(root, "status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError) as e:
        return f"unknown ({root} is not a git checkout: {e})"
    return head + ("+dirty" if changed.strip() else "")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True,
                          timeout=GIT_S).stdout


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name: /proc/cpuinfo's on Linux (x86's "model name", ARM's "Model" or
    "CPU part"), else what Python's platform module says."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for key in ("model name", "Model", "Hardware", "CPU part"):
        for line in text.splitlines():
            name, _, value = line.partition(":")
            if name.strip() == key and value.strip():
                return value.strip()
    return platform.processor() or platform.machine() or "unknown"


def cores() -> str:
    """The machine's logical cores and those this process may run on."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{os.cpu_count()} logical cores, {usable} usable by this run"


def write_markdown(path: Path, body: str, meta: Meta) -> Path:
    """`body` under the metadata list, at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(meta.markdown() + body.rstrip("\n") + "\n")
    return path


def write_json(path: Path, result: Any, meta: Meta) -> Path:
    """{"meta": ..., "result": result} at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": asdict(meta), "result": result}, indent=1) + "\n")
    return path


def read_markdown_meta(text: str) -> dict[str, str]:
    """The metadata list that opens a Markdown result (empty: it has none)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("- ") or ": " not in line:
            break
        key, value = line[2:].split(": ", 1)
        found[key] = value
    return found


# PNG: a signature, then chunks of (length, type, data, CRC of type and data).
_PNG: Final = b"\x89PNG\r\n\x1a\n"
_KEYWORD: Final = b"tensorbus benchmark"


def _chunks(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    at = len(_PNG)
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        yield data[at + 4 : at + 8], data[at + 8 : at + 8 + length]
        at += 12 + length


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def stamp_png(path: Path, meta: Meta) -> Path:
    """Put the metadata into the PNG at `path` (a tEXt chunk after its header; one stamped
    before is replaced)."""
    data = path.read_bytes()
    if not data.startswith(_PNG):
        raise ValueError(f"{path} is not a PNG file")
    text = meta.markdown().strip().encode("latin-1", errors="replace")
    out = [_PNG]
    for kind, body in _chunks(data):
        if kind == b"tEXt" and body.startswith(_KEYWORD + b"\0"):
            continue
        out.append(_chunk(kind, body))
        if kind == b"IHDR":
            out.append(_chunk(b"tEXt", _KEYWORD + b"\0" + text))
    path.write_bytes(b"".join(out))
    return path


def read_png_meta(path: Path) -> dict[str, str]:
    """The metadata stamped into a PNG by `stamp_png` (empty: none)."""
    for kind, body in _chunks(path.read_bytes()):
        if kind == b"tEXt" and body.startswith(_KEYWORD + b"\0"):
            return read_markdown_meta(body[len(_KEYWORD) + 1 :].decode("latin-1"))
    return {}
