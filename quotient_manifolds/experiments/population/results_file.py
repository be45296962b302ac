r"""The results file of a population run: append-only JSON lines that several processes share.

[`ResultsFile`][quotient_manifolds.experiments.population.results_file.ResultsFile] writes one
line with a single `write` + `fsync` under an exclusive file lock, so several processes can
append to one file, a crash or Ctrl-C loses no finished line, and a torn trailing line (a
writer killed inside `write`, power loss) is cut off by the next writer. Lines are keyed (the
`"key"` field): a line whose key another process has written meanwhile is not written twice.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from ...errors import PopulationInputError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks; one writer per file
    fcntl = None  # type: ignore[assignment]

__all__ = ["ResultsFile", "append_jsonl", "read_jsonl"]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def append_jsonl(path: str | os.PathLike, record: Mapping) -> None:
    """Append one JSON line with a single `write`, then `fsync`, under an exclusive lock."""
    ResultsFile(path).append(record, once=False)


def _parse_line(line: bytes, path: Path, lineno: int) -> dict:
    try:
        rec = json.loads(line)
    except ValueError:
        rec = None
    if not isinstance(rec, dict):
        raise PopulationInputError(
            f"{path} line {lineno} is not a JSON object; delete that line (the other lines are "
            "kept) and run again"
        )
    return rec


def read_jsonl(path: str | os.PathLike, *, repair: bool = False) -> list[dict]:
    """The records of a results file.

    A torn trailing line (no newline at the end: the writer died inside `write`) is ignored,
    and with `repair=True` cut off the file (under the writers' lock). Any other line that is
    not a JSON object is an error that names the line.
    """
    p = Path(path)
    if not p.exists():
        return []
    if repair:
        rf = ResultsFile(p)
        return rf.refresh()
    raw = p.read_bytes()
    end = raw.rfind(b"\n") + 1
    return [_parse_line(line, p, i) for i, line in enumerate(raw[:end].splitlines(), 1)
            if line.strip()]


class ResultsFile:
    """An append-only JSON-lines file that several processes may write at once.

    Every operation takes an exclusive `flock` on the file for its duration: reading the
    lines appended since the last look, cutting off a torn trailing line (only a writer that
    died inside `write` leaves one, since writers hold the lock), and appending one line with
    a single `write` + `fsync`. The keys (the `"key"` field) of every line seen are kept in
    `keys`, so that
    [`append`][quotient_manifolds.experiments.population.results_file.ResultsFile.append]
    can refuse a line whose key another process has written in the meantime.

    Parameters
    ----------
    path : path
        The results file; created by the first append.

    Notes
    -----
    `flock` is advisory and local to one kernel, except on NFS, where Linux maps it to POSIX
    record locks held by the NFS lock manager. On a file system without locks, give every
    process its own file.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.keys: set[str] = set()
        self.records: list[dict] = []
        self._offset = 0
        self._lineno = 0

    @contextlib.contextmanager
    def _locked(self, create: bool) -> Iterator[int | None]:
        flags = os.O_RDWR | os.O_APPEND | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except FileNotFoundError:
            yield None
            return
        try:
            if fcntl is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def _scan(self, fd: int) -> list[dict]:
        """Read the complete lines after the offset; cut off a torn tail (we hold the lock)."""
        size = os.fstat(fd).st_size
        if size < self._offset:  # the file was replaced or shortened by hand: read it again
            self._offset, self._lineno, self.keys, self.records = 0, 0, set(), []
        chunks = []
        pos = self._offset
        while pos < size:
            chunk = os.pread(fd, min(size - pos, 1 << 24), pos)
            if not chunk:
                break
            chunks.append(chunk)
            pos += len(chunk)
        raw = b"".join(chunks)
        end = raw.rfind(b"\n") + 1
        if end < len(raw):  # a torn line: its writer died inside write()
            os.ftruncate(fd, self._offset + end)
            os.fsync(fd)
        lines = raw[:end].split(b"\n")[:-1]
        new = [_parse_line(line, self.path, self._lineno + i)
               for i, line in enumerate(lines, 1) if line.strip()]
        self._lineno += len(lines)
        self._offset += end
        self.records.extend(new)
        self.keys.update(str(r["key"]) for r in new if "key" in r)
        return new

    def refresh(self) -> list[dict]:
        """Every record of the file (reading only what was appended since the last look)."""
        with self._locked(create=False) as fd:
            if fd is not None:
                self._scan(fd)
        return list(self.records)

    def append(self, record: Mapping, *, once: bool = True) -> bool:
        """Append `record` as one line; return False (and write nothing) when `once` and a
        line with the same `"key"` is already in the file."""
        data = (json.dumps(dict(record), sort_keys=True, allow_nan=True) + "\n").encode()
        with self._locked(create=True) as fd:
            assert fd is not None
            self._scan(fd)
            key = record.get("key")
            if once and key is not None and str(key) in self.keys:
                return False
            _write_all(fd, data)
            os.fsync(fd)
            self._offset += len(data)
            self._lineno += 1
            self.records.append(dict(record))
            if key is not None:
                self.keys.add(str(key))
        return True
