"""What a checkpoint save writes, byte by byte: a CRC-32 per file, and a full disk named.

Why a stream wrapper: the manifest records each file's size and zlib.crc32, so a flipped byte is
refused on load instead of loading silently. Reading every file back after the save would double
the I/O of a 70B checkpoint; here DCP's own writer is given a filesystem (``RecordingFileSystem``)
whose streams pass each write through ``zlib.crc32`` on its way to the file, so the checksum costs
one pass over bytes already in memory (about 1-2 GB/s per writer thread, overlapped with the disk).

Why here too: DCP writes tensors with ``torch.save`` into the stream, and when the disk fills the
C++ zip writer reports only ``inline_container.cc ... unexpected pos``; the wrapper sees the
``OSError(ENOSPC)`` itself and records it, so the save's failure can say "no space left".
"""

from __future__ import annotations

import errno
import os
import shutil
import zlib
from contextlib import contextmanager

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter


class _RecordingStream:
    """A binary file that updates a CRC-32 and a byte count with each write (writes are sequential)."""

    def __init__(self, raw, on_close, on_full):
        self._raw, self._on_close, self._on_full = raw, on_close, on_full
        self.crc, self.size = 0, 0

    def write(self, data) -> int:
        try:
            written = self._raw.write(data)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                self._on_full(e)
            raise
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view if written is None or written == len(view) else view[:written], self.crc)
        self.size += len(view) if written is None else written
        return written

    def flush(self) -> None:
        try:
            self._raw.flush()
        except OSError as e:
            if e.errno == errno.ENOSPC:
                self._on_full(e)
            raise

    def close(self) -> None:
        if not self._raw.closed:
            self.flush()
            self._raw.close()
            self._on_close(self)

    def __getattr__(self, name):  # tell, fileno, seekable, closed, ...: the file's own
        return getattr(self._raw, name)


class RecordingFileSystem(FileSystem):
    """DCP's local filesystem, recording {file name: (crc32, size)} of what this process wrote."""

    def __init__(self):
        super().__init__()
        self.records: dict[str, tuple[int, int]] = {}
        self.full: OSError | None = None  # the ENOSPC error, if a write met one

    def _full(self, error: OSError) -> None:
        self.full = self.full or error

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(str(path))
        with open(path, mode) as raw:
            stream = _RecordingStream(raw, lambda s: self.records.__setitem__(name, (s.crc, s.size)), self._full)
            try:
                yield stream
            finally:
                stream.close()

    def rename(self, path, new_path) -> None:  # .metadata.tmp -> .metadata
        super().rename(path, new_path)
        old, new = os.path.basename(str(path)), os.path.basename(str(new_path))
        if old in self.records:
            self.records[new] = self.records.pop(old)


def recording_writer(path: str) -> tuple[FileSystemWriter, RecordingFileSystem]:
    writer = FileSystemWriter(path)
    fs = RecordingFileSystem()
    writer.fs = fs
    return writer, fs


def file_crc32(path: str, chunk: int = 1 << 24) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ENOSPC is anywhere in ``error``'s chain (or DCP's per-rank failures)."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC or "No space left on device" in str(e):
            return True
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch's CheckpointException: {rank: exception}
        if isinstance(failures, dict):
            stack += [v for v in failures.values() if isinstance(v, BaseException)]
    return False


def no_space_message(root: str, needed: int) -> str:
    free = shutil.disk_usage(root).free
    return f"no space left on {root}: {needed} bytes needed, {free} free"
