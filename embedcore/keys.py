"""Stable 64-bit keys for string ids: :func:`hash_keys`.

The algorithm, fixed for good (saved tables depend on it): a string is encoded as UTF-8 (``bytes`` are taken
as they are, so ``"alice"`` and ``b"alice"`` are the same id), hashed with BLAKE2b (RFC 7693) with an 8-byte
digest (``digest_size = 8`` in BLAKE2b's parameter block, no key, salt or personalization: what
``hashlib.blake2b(data, digest_size=8)`` computes), and the digest read as a little-endian int64. It does
not depend on the process, the platform, the Python version or ``PYTHONHASHSEED`` (unlike ``hash()``).

Two equal results for different strings are possible (any 64-bit hash collides), but rare: among ``n``
distinct ids, about ``n**2 / 2**65`` pairs collide (10**8 ids: about 3e-4 collisions expected).

Speed: hashing ids one ``hashlib`` call at a time costs about a microsecond each in Python; for lists and
arrays :func:`hash_keys` instead packs the UTF-8 bytes into one buffer (one ``join`` and one ``encode`` for a
list of ASCII ``str``; no Python loop at all for ``S`` arrays and ASCII ``U`` arrays) and runs BLAKE2b compiled
with Numba over it, in parallel (the same digests: the tests check them against ``hashlib``). Measured with
``python -m embedcore.keys`` (10**6 ids such as ``"user-7919"``) on the shared 2-core development machine
under a load average of about 6, so only indicative: 1.6 M ids/s, against 0.7-1.0 M ids/s for ``hashlib`` one
id at a time; packing took about half of that time, the compiled hash the other half.
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
def _g(a, b, c, d, x, y):
    a = a + b + x
    d = _rotr(d ^ a, 32)
    c = c + d
    b = _rotr(b ^ c, 24)
    a = a + b + y
    d = _rotr(d ^ a, 16)
    c = c + d
    b = _rotr(b ^ c, 63)
    return a, b, c, d


@njit(cache=True)
def _compress(h, m, counter, last, iv, sigma):
    """BLAKE2b's compression of one 128-byte block ``m`` (16 little-endian words) into ``h`` (the working
    vector in local variables, so it stays in registers)."""
    v0, v1, v2, v3, v4, v5, v6, v7 = h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]
    v8, v9, v10, v11 = iv[0], iv[1], iv[2], iv[3]
    v12, v13, v14, v15 = iv[4] ^ counter, iv[5], iv[6], iv[7]
    if last:
        v14 = ~v14
    for r in range(12):
        s = sigma[r % 10]
        v0, v4, v8, v12 = _g(v0, v4, v8, v12, m[s[0]], m[s[1]])
        v1, v5, v9, v13 = _g(v1, v5, v9, v13, m[s[2]], m[s[3]])
        v2, v6, v10, v14 = _g(v2, v6, v10, v14, m[s[4]], m[s[5]])
        v3, v7, v11, v15 = _g(v3, v7, v11, v15, m[s[6]], m[s[7]])
        v0, v5, v10, v15 = _g(v0, v5, v10, v15, m[s[8]], m[s[9]])
        v1, v6, v11, v12 = _g(v1, v6, v11, v12, m[s[10]], m[s[11]])
        v2, v7, v8, v13 = _g(v2, v7, v8, v13, m[s[12]], m[s[13]])
        v3, v4, v9, v14 = _g(v3, v4, v9, v14, m[s[14]], m[s[15]])
    h[0] ^= v0 ^ v8
    h[1] ^= v1 ^ v9
    h[2] ^= v2 ^ v10
    h[3] ^= v3 ^ v11
    h[4] ^= v4 ^ v12
    h[5] ^= v5 ^ v13
    h[6] ^= v6 ^ v14
    h[7] ^= v7 ^ v15


_CHUNK = 1024  # ids per parallel task (each task allocates its scratch once)


@njit(cache=True, parallel=True)
def _blake2b_8(data, offsets, iv, sigma, out):
    """``out[i]`` = the 8-byte BLAKE2b digest (as a little-endian uint64) of ``data[offsets[i]:offsets[i + 1]]``."""
    n = out.shape[0]
    for chunk in prange((n + _CHUNK - 1) // _CHUNK):
        h = np.empty(8, np.uint64)
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
                _compress(h, block, np.uint64(pos - offsets[i]), last, iv, sigma)
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
