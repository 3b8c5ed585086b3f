"""Region bytes no shmcast producer writes, crafted from Python by the
offsets of docs/protocol.md: what a consumer does with a hostile manifest.

edit_sync(path) rewrites the manifest of the sync a producer just announced
(before any consumer has read it) and fixes the sync record to match: stream
size, chunk count and the manifest's XXH3-64 hash, which the consumer checks.
The hash comes from libxxhash, which the shmcast module links, or else from
the xxhash package.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import struct

import pytest

# docs/protocol.md 3.1 (header), 3.3 (sync record), 6 (manifest)
_SLOT_BYTES = 40
_MANIFEST_OFFSET = 64
_REC_CHUNKS = 216
_REC_STREAM_BYTES = 224
_REC_MANIFEST_USED = 232
_REC_MANIFEST_HASH = 240
_MH_TENSOR_COUNT = 16
_MH_NAMES_OFFSET = 24
_MH_STREAM_BYTES = 40
_MH_PAYLOAD_BYTES = 48
_MH_WORLD_SIZE = 56
_MH_PIECE_COUNT = 60
_MH_BYTES = 64
_ENTRY_BYTES = 96
_PIECE_BYTES = 48  # manifest format 2: tensor u32, rank u16, dim u16, start, length, offset, nbytes, reserved
_P_NBYTES = 32
_E_NAME_OFFSET = 0
_E_NAME_BYTES = 4
_E_NBYTES = 16
_E_SHAPE = 32


def _xxh3_function():
    for lib in (ctypes.util.find_library("xxhash"), "libxxhash.so.0"):
        if not lib:
            continue
        try:
            f = ctypes.CDLL(lib).XXH3_64bits
        except (OSError, AttributeError):
            continue
        f.restype = ctypes.c_uint64
        f.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
        return lambda data: f(bytes(data), len(data))
    try:
        import xxhash

        return xxhash.xxh3_64_intdigest
    except ImportError:
        return None


_xxh3 = _xxh3_function()


def xxh3_64(data) -> int:
    if _xxh3 is None:
        pytest.skip("no XXH3-64 here (neither libxxhash nor the xxhash package)")
    return _xxh3(data)


class Manifest:
    """The manifest bytes of one sync (a bytearray) with typed accessors."""

    def __init__(self, data: bytearray):
        self.data = data

    def _u64(self, off, value=None):
        if value is None:
            return struct.unpack_from("<Q", self.data, off)[0]
        struct.pack_into("<Q", self.data, off, value)

    def _u32(self, off):
        return struct.unpack_from("<I", self.data, off)[0]

    def _ranks_at(self):  # format 2: u64 rank_bytes[world_size] after the entries, then the pieces
        return _MH_BYTES + self._u32(_MH_TENSOR_COUNT) * _ENTRY_BYTES

    def _pieces_at(self):
        return self._ranks_at() + 8 * self._u32(_MH_WORLD_SIZE)

    def stream_bytes(self, value=None):
        if value is not None and self._u32(_MH_WORLD_SIZE) == 1:
            self._u64(self._ranks_at(), value)  # one rank: its sub-stream is the stream
        return self._u64(_MH_STREAM_BYTES, value)

    def payload_bytes(self, value=None):
        return self._u64(_MH_PAYLOAD_BYTES, value)

    def _entry(self, i):
        return _MH_BYTES + i * _ENTRY_BYTES

    def set_tensor(self, i, *, nbytes, shape):
        e = self._entry(i)
        self._u64(e + _E_NBYTES, nbytes)
        struct.pack_into("<8q", self.data, e + _E_SHAPE, *(list(shape) + [0] * (8 - len(shape))))
        for k in range(self._u32(_MH_PIECE_COUNT)):  # its (whole) piece says the same size
            at = self._pieces_at() + k * _PIECE_BYTES
            if self._u32(at) == i:
                self._u64(at + _P_NBYTES, nbytes)

    def set_name(self, i, raw: bytes):
        """Replaces tensor i's name bytes (same length)."""
        e = self._entry(i)
        off, n = struct.unpack_from("<II", self.data, e + _E_NAME_OFFSET)
        assert len(raw) == n, "set_name keeps the name's length"
        at = self._u64(_MH_NAMES_OFFSET) + off
        self.data[at:at + n] = raw


@contextlib.contextmanager
def edit_sync(path: str):
    """Yields the Manifest of the sync last announced in region `path`;
    on exit writes it back and fixes the sync record (stream_bytes, chunks,
    manifest hash). Call it after the producer's send() returned and
    before the consumer's wait_sync()."""
    xxh3_64(b"")  # skips the test here, before anything is changed, when there is no XXH3
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        slot_bytes, = struct.unpack_from("<Q", m, _SLOT_BYTES)
        at, = struct.unpack_from("<Q", m, _MANIFEST_OFFSET)
        used, = struct.unpack_from("<Q", m, _REC_MANIFEST_USED)
        man = Manifest(bytearray(m[at:at + used]))
        yield man
        m[at:at + used] = bytes(man.data)
        stream = man.stream_bytes()
        struct.pack_into("<QQ", m, _REC_CHUNKS, -(-stream // slot_bytes), stream)
        struct.pack_into("<Q", m, _REC_MANIFEST_HASH, xxh3_64(man.data))
