# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled page-key chain: keyed BLAKE2b-128 (RFC 7693) of ``parent key || page bytes``,
page after page, in C (``coordinator.core.hashing.PageHasher`` uses it for the blake2b-128
algorithm where it was built; the tests check every key against ``hashlib.blake2b``).

The key block is compressed once per hasher (``KeyedChain``); each page then costs the
compressions of its message (one for 16-token pages: 80 bytes), as ``hashlib``'s copied keyed
state does, without the interpreter's per-page calls. Little-endian hosts only (the import fails elsewhere, and the
pure-Python path serves).
"""

import sys

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uint8_t, uint64_t
from libc.string cimport memcpy, memset

if sys.byteorder != "little":
    raise ImportError("the compiled page-key chain assumes a little-endian host")

DEF BLOCK = 128
DEF OUT = 16
DEF PARENT = 16

cdef uint64_t IV[8]
IV[:] = [0x6a09e667f3bcc908, 0xbb67ae8584caa73b, 0x3c6ef372fe94f82b, 0xa54ff53a5f1d36f1,
         0x510e527fade682d1, 0x9b05688c2b3e6c1f, 0x1f83d9abfb41bd6b, 0x5be0cd19137e2179]

cdef uint8_t SIGMA[10][16]  # round i uses SIGMA[i % 10]
SIGMA[:] = [
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
]


cdef inline uint64_t _rotr(uint64_t x, int n) noexcept:
    return (x >> n) | (x << (64 - n))


cdef inline void _g(uint64_t *v, int a, int b, int c, int d, uint64_t x, uint64_t y) noexcept:
    v[a] = v[a] + v[b] + x
    v[d] = _rotr(v[d] ^ v[a], 32)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 24)
    v[a] = v[a] + v[b] + y
    v[d] = _rotr(v[d] ^ v[a], 16)
    v[c] = v[c] + v[d]
    v[b] = _rotr(v[b] ^ v[c], 63)


cdef void _compress(uint64_t *h, const uint8_t *block, uint64_t counter, bint last) noexcept:
    cdef uint64_t v[16]
    cdef uint64_t m[16]
    cdef int i
    cdef const uint8_t *s
    memcpy(m, block, BLOCK)  # little-endian words
    for i in range(8):
        v[i] = h[i]
        v[i + 8] = IV[i]
    v[12] ^= counter  # the counter's high word stays 0: messages here are short
    if last:
        v[14] = ~v[14]
    for i in range(12):
        s = SIGMA[i % 10]
        _g(v, 0, 4, 8, 12, m[s[0]], m[s[1]])
        _g(v, 1, 5, 9, 13, m[s[2]], m[s[3]])
        _g(v, 2, 6, 10, 14, m[s[4]], m[s[5]])
        _g(v, 3, 7, 11, 15, m[s[6]], m[s[7]])
        _g(v, 0, 5, 10, 15, m[s[8]], m[s[9]])
        _g(v, 1, 6, 11, 12, m[s[10]], m[s[11]])
        _g(v, 2, 7, 8, 13, m[s[12]], m[s[13]])
        _g(v, 3, 4, 9, 14, m[s[14]], m[s[15]])
    for i in range(8):
        h[i] ^= v[i] ^ v[i + 8]


cdef class KeyedChain:
    """Keyed BLAKE2b with a 16-byte digest: ``hashlib.blake2b(m, key=key, digest_size=16)``
    for any non-empty message (the chain's are 16 bytes plus a page)."""

    cdef uint64_t keyed[8]  # the state after the key block

    def __cinit__(self, bytes key):
        cdef uint8_t block[BLOCK]
        cdef int i
        if not 1 <= len(key) <= 64:
            raise ValueError("a BLAKE2b key is 1 to 64 bytes")
        for i in range(8):
            self.keyed[i] = IV[i]
        self.keyed[0] ^= 0x01010000 ^ (<uint64_t>len(key) << 8) ^ OUT
        memset(block, 0, BLOCK)
        memcpy(block, PyBytes_AS_STRING(key), len(key))
        _compress(self.keyed, block, BLOCK, False)

    cdef void _digest(self, const uint8_t *message, Py_ssize_t length, uint8_t *out) noexcept:
        """Digest of a non-empty ``message``: whole blocks, then the last one padded."""
        cdef uint64_t h[8]
        cdef uint8_t block[BLOCK]
        cdef uint64_t counter = BLOCK  # the key block
        memcpy(h, self.keyed, sizeof(h))
        while length > BLOCK:
            counter += BLOCK
            _compress(h, message, counter, False)
            message += BLOCK
            length -= BLOCK
        memset(block, 0, BLOCK)
        memcpy(block, message, length)
        _compress(h, block, counter + length, True)
        memcpy(out, h, OUT)

    def digest(self, bytes message):
        """The 16-byte keyed digest of a non-empty ``message``."""
        cdef uint8_t out[OUT]
        if not PyBytes_GET_SIZE(message):
            raise ValueError("an empty message")
        self._digest(<const uint8_t *>PyBytes_AS_STRING(message), PyBytes_GET_SIZE(message),
                     out)
        return PyBytes_FromStringAndSize(<char *>out, OUT)

    def chain(self, bytes parent, bytes data, Py_ssize_t start, Py_ssize_t end,
              Py_ssize_t page_bytes, dict remember=None):
        """Keys of the pages ``data[start:end]`` (``page_bytes`` each), chained from
        ``parent``: key_i = H(key_{i-1} || page_i). With ``remember``, each ``parent || page``
        message is stored there with its key (the chain cache)."""
        cdef Py_ssize_t length = PARENT + page_bytes
        cdef const uint8_t *src = <const uint8_t *>PyBytes_AS_STRING(data)
        cdef Py_ssize_t pos
        cdef list keys = []
        cdef uint8_t *message
        if PyBytes_GET_SIZE(parent) != PARENT or page_bytes <= 0:
            raise ValueError("a 16-byte parent and pages of at least 1 byte")
        if start < 0 or end > PyBytes_GET_SIZE(data) or (end - start) % page_bytes:
            raise ValueError("the pages must lie whole inside data")
        buffer = PyBytes_FromStringAndSize(NULL, length)  # the message, rewritten per page
        message = <uint8_t *>PyBytes_AS_STRING(buffer)
        memcpy(message, PyBytes_AS_STRING(parent), PARENT)
        pos = start
        while pos < end:
            memcpy(message + PARENT, src + pos, page_bytes)
            key = PyBytes_FromStringAndSize(NULL, OUT)
            self._digest(message, length, <uint8_t *>PyBytes_AS_STRING(key))
            if remember is not None:
                remember[PyBytes_FromStringAndSize(<char *>message, length)] = key
            keys.append(key)
            memcpy(message, PyBytes_AS_STRING(key), PARENT)
            pos += page_bytes
        return keys
