"""Stable 64-bit keys for string ids: :func:`hash_keys`.

The algorithm, fixed for good (saved tables depend on it): a string is encoded as UTF-8 (``bytes`` are taken
as they are, so ``"alice"`` and ``b"alice"`` are the same id), hashed with BLAKE2b (RFC 7693) with an 8-byte
digest (``digest_size = 8`` in BLAKE2b's parameter block, no key, salt or personalization: what
``hashlib.blake2b(data, digest_size=8)`` computes), and the digest read as a little-endian int64. It does
not depend on the process, the platform, the Python version or ``PYTHONHASHSEED`` (unlike ``hash()``).

Two equal results for different strings are possible (any 64-bit hash collides), but rare: among ``n``
distinct ids, about ``n**2 / 2**65`` pairs collide (10**8 ids: about 3e-4 collisions expected).

Speed: hashing many short ids one ``hashlib`` call at a time costs about a microsecond each in Python; for
lists and arrays :func:`hash_keys` instead packs the UTF-8 bytes into one buffer and runs BLAKE2b compiled
with Numba over it, in parallel (same digests, checked against ``hashlib`` in the tests). Measured on the
development machine (2 cores shared, so indicative): see ``tests/test_dynamic_policies.py`` for the check and
the module's ``__main__`` for the measurement (``python -m embedcore.keys``).
"""

from __future__ import annotations

import hashlib

import numpy as np
from numba import njit, prange

__all__ = ["hash_keys", "hash_key"]

_IV = np.array([0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B, 0xA54FF53A5F1D36F1,
                0x510E527FADE682D1, 0x9B05688C2B3E6C1F, 0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179], np.uint64)
_SIGMA = np.array([
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15],
    [14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3],
    [11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4],
    [7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8],
    [9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13],
    [2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9],
    [12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11],
    [13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10],
    [6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5],
    [10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0],
], np.int64)
_DIGEST_BYTES = 8
_BLOCK = 128


@njit(cache=True, inline="always")
def _rotr(x, n):
    return (x >> np.uint64(n)) | (x << np.uint64(64 - n))


@njit(cache=True, inline="always")
def _g(v, a, b, c, d, x, y):
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 32)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 24)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 63)


@njit(cache=True)
def _compress(h, block, counter, last, iv, sigma, v):
    """BLAKE2b's compression of one 128-byte ``block`` (16 little-endian words) into ``h``."""
    for i in range(8):
        v[i] = h[i]
        v[i + 8] = iv[i]
    v[12] ^= counter
    if last:
        v[14] = ~v[14]
    for r in range(12):
        s = sigma[r % 10]
        _g(v, 0, 4, 8, 12, block[s[0]], block[s[1]])
        _g(v, 1, 5, 9, 13, block[s[2]], block[s[3]])
        _g(v, 2, 6, 10, 14, block[s[4]], block[s[5]])
        _g(v, 3, 7, 11, 15, block[s[6]], block[s[7]])
        _g(v, 0, 5, 10, 15, block[s[8]], block[s[9]])
        _g(v, 1, 6, 11, 12, block[s[10]], block[s[11]])
        _g(v, 2, 7, 8, 13, block[s[12]], block[s[13]])
        _g(v, 3, 4, 9, 14, block[s[14]], block[s[15]])
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


_CHUNK = 1024  # ids per parallel task (each task allocates its scratch once)


@njit(cache=True, parallel=True)
def _blake2b_8(data, offsets, iv, sigma, out):
    """``out[i]`` = the 8-byte BLAKE2b digest (as a little-endian uint64) of ``data[offsets[i]:offsets[i + 1]]``."""
    n = out.shape[0]
    for chunk in prange((n + _CHUNK - 1) // _CHUNK):
        h = np.empty(8, np.uint64)
        v = np.empty(16, np.uint64)
        block = np.empty(16, np.uint64)
        for i in range(chunk * _CHUNK, min(n, (chunk + 1) * _CHUNK)):
            h[:] = iv
            h[0] ^= np.uint64(0x01010000 | _DIGEST_BYTES)
            pos, end = offsets[i], offsets[i + 1]
            while True:
                take = min(_BLOCK, end - pos)
                last = end - pos <= _BLOCK
                block[:] = 0
                for j in range(take):
                    block[j >> 3] |= np.uint64(data[pos + j]) << np.uint64(8 * (j & 7))
                pos += take
                _compress(h, block, np.uint64(pos - offsets[i]), last, iv, sigma, v)
                if last:
                    break
            out[i] = h[0]


def _as_bytes(item, position) -> bytes:
    if isinstance(item, (bytes, bytearray, memoryview, np.bytes_)):
        return bytes(item)
    if isinstance(item, (str, np.str_)):
        return str(item).encode("utf-8")
    raise ValueError(f"hash_keys: item {position} is a {type(item).__name__} ({item!r:.60}), expected str or bytes")


def _packed(strings):
    """``(data uint8, offsets int64)``: the UTF-8 bytes of every string, end to end."""
    if isinstance(strings, np.ndarray) and strings.dtype.kind in "SU":
        packed = _packed_fixed_width(strings.ravel())
        if packed is not None:
            return packed
    flat = strings.ravel().tolist() if isinstance(strings, np.ndarray) else list(strings)
    if all(type(s) is str for s in flat):
        text = "".join(flat)
        if text.isascii():  # one UTF-8 byte per character: no per-item encoding
            return np.frombuffer(text.encode("ascii"), np.uint8), _offsets(np.fromiter(map(len, flat), np.int64,
                                                                                       len(flat)))
    items = [_as_bytes(s, k) for k, s in enumerate(flat)]
    return np.frombuffer(b"".join(items), np.uint8), _offsets(np.fromiter(map(len, items), np.int64, len(items)))


def _offsets(lengths):
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return offsets


def _packed_fixed_width(array):
    """The packing of a 1-D ``S`` array, or of a ``U`` array of ASCII text, without a Python loop (each item
    ends at its last non-NUL character, as NumPy reads it); None for other ``U`` arrays."""
    width = array.dtype.itemsize // (4 if array.dtype.kind == "U" else 1)
    if array.shape[0] == 0 or width == 0:
        return np.zeros(0, np.uint8), np.zeros(array.shape[0] + 1, np.int64)
    codes = np.ascontiguousarray(array).view(np.uint32 if array.dtype.kind == "U" else np.uint8)
    codes = codes.reshape(array.shape[0], width)
    if array.dtype.kind == "U" and codes.max() >= 128:
        return None
    nonzero = codes != 0
    lengths = np.where(nonzero.any(axis=1), width - np.argmax(nonzero[:, ::-1], axis=1), 0).astype(np.int64)
    keep = np.arange(width)[None, :] < lengths[:, None]
    return codes[keep].astype(np.uint8), _offsets(lengths)


def hash_key(string) -> int:
    """One id's key (a Python int in the int64 range), computed with ``hashlib``: the reference."""
    return int.from_bytes(hashlib.blake2b(_as_bytes(string, 0), digest_size=_DIGEST_BYTES).digest(), "little",
                          signed=True)


def hash_keys(strings) -> np.ndarray:
    """Stable 64-bit keys (int64) of string ids; see the module docstring for the algorithm.

    Args:
        strings: a ``str`` or ``bytes`` (gives a 0-d array), a list or tuple of them, or a NumPy array of
            dtype ``U``, ``S`` or ``object`` holding them (any shape; the result has the same shape).

    Raises:
        ValueError: an item that is neither ``str`` nor ``bytes``, naming its position.
    """
    if isinstance(strings, (str, bytes, np.str_, np.bytes_)):
        return np.array(hash_key(strings), np.int64)
    shape = strings.shape if isinstance(strings, np.ndarray) else (len(strings),)
    if isinstance(strings, np.ndarray) and strings.dtype.kind not in "USO":
        raise ValueError(f"hash_keys: expected strings or bytes, got an array of dtype {strings.dtype}")
    data, offsets = _packed(strings)
    out = np.empty(offsets.shape[0] - 1, np.uint64)
    if out.shape[0]:
        _blake2b_8(data if data.shape[0] else np.zeros(1, np.uint8), offsets, _IV, _SIGMA, out)
    return out.view(np.int64).reshape(shape)


def _measure(n: int = 1_000_000) -> None:
    import time
    ids = [f"user-{i * 7919}" for i in range(n)]
    hash_keys(ids[:10])
    t0 = time.perf_counter()
    hash_keys(ids)
    t1 = time.perf_counter()
    [hash_key(s) for s in ids]
    t2 = time.perf_counter()
    print(f"hash_keys: {n / (t1 - t0) / 1e6:.2f} M ids/s vectorised, {n / (t2 - t1) / 1e6:.2f} M ids/s hashlib")


if __name__ == "__main__":
    _measure()
