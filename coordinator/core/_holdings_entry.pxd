# The compiled holdings' table entry, shared by the module that owns the table
# (_holdings_accel.pyx) and the one that indexes it by worker slot (_slot_positions_accel.pyx).
# Declarations and inline accessors only: no module of its own, nothing called through a
# function pointer.

from libc.stdint cimport uint16_t, uint64_t
from libc.string cimport memcpy

cdef enum:
    INLINE = 6       # holder slots kept in the entry itself
    KEY_BYTES = 16
    TOMBSTONE = 1    # ``cap`` of a deleted entry (n == 0): probes go on past it, inserts reuse it

cdef struct Entry:
    uint64_t k0
    uint64_t k1
    # Holders; 0: no key here, and then ``cap`` says why: 0 an empty entry, which ends a probe
    # run, TOMBSTONE a deleted one, which does not.
    uint16_t n
    uint16_t cap      # capacity of the out-of-line array (0: the holders are inline)
    # The holders, sorted: inline when cap == 0; else the first 8 bytes hold a pointer to a
    # heap array of cap slots (n used). 16 + 4 + 12 = 32 bytes an entry.
    uint16_t inl[INLINE]


cdef inline uint16_t *_ext(Entry *e) noexcept:
    cdef uint16_t *p
    memcpy(&p, e.inl, sizeof(p))
    return p


cdef inline void _set_ext(Entry *e, uint16_t *p) noexcept:
    memcpy(e.inl, &p, sizeof(p))


cdef inline uint16_t *_slots(Entry *e) noexcept:
    return _ext(e) if e.cap else e.inl


cdef inline int _find_slot(const uint16_t *arr, int n, uint16_t slot) noexcept:
    """Index of ``slot`` in sorted ``arr``, or -(insertion point) - 1."""
    cdef int lo = 0, hi = n - 1, mid
    while lo <= hi:
        mid = (lo + hi) >> 1
        if arr[mid] < slot:
            lo = mid + 1
        elif arr[mid] > slot:
            hi = mid - 1
        else:
            return mid
    return -lo - 1


cdef inline bint _holds(Entry *e, uint16_t slot) noexcept:
    """Whether the entry is a key's and ``slot`` is among its holders."""
    return e.n != 0 and _find_slot(_slots(e), e.n, slot) >= 0
