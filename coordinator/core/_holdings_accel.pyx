# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled holdings (``coordinator.core.index.holdings`` states the contract; ``PyHoldings`` is
the same in pure Python).

One open-addressing table (linear probing, power-of-two capacity) of 32-byte entries
(``_holdings_entry.pxd``): the 16-byte key, its holder count, and its holder slots as sorted
16-bit ints, up to six inline and past that in a sorted heap array. The slot hash is the key's
first 8 bytes mixed with a per-table random seed (keys are keyed BLAKE2b digests, but callers may
send trusted keys: the seed keeps chosen keys from clustering). A deleted entry becomes a
tombstone, or empty where the next entry is empty, so live entries stay where they are until
the table rehashes: when keys and tombstones pass 3/4 of it, at twice the size if keys pass 21/32,
else at the same size. Staying put is what lets ``_slot_positions_accel`` keep each slot's count
and its keys' positions, so that ``count`` is O(1) and ``keys_by_slot`` and ``drop_slot`` are
O(the slot's keys).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Malloc, PyMem_Realloc
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove, memset

from coordinator.core._holdings_entry cimport (
    INLINE,
    KEY_BYTES,
    TOMBSTONE,
    Entry,
    _ext,
    _find_slot,
    _set_ext,
    _slots,
)
from coordinator.core._slot_positions_accel cimport SlotHoldings, SlotPositions

import os

# The most entries a table may have: _slot_positions_accel keeps positions as uint32.
DEF MAX_CAPACITY = 1 << 32


cdef inline uint64_t _mix(uint64_t x) noexcept:
    # splitmix64's finaliser
    x ^= x >> 30
    x *= <uint64_t>0xbf58476d1ce4e5b9
    x ^= x >> 27
    x *= <uint64_t>0x94d049bb133111eb
    x ^= x >> 31
    return x


cdef class CHoldings:
    cdef Entry *table
    cdef uint64_t mask_bits     # capacity - 1
    cdef uint64_t used          # keys
    cdef uint64_t tombstones
    cdef uint64_t seed
    cdef SlotPositions positions  # each slot's count and where its keys are
    cdef uint16_t *scratch      # running intersection for ``runs``
    cdef int scratch_cap
    cdef uint16_t *merge_buf    # a key's holders with its pending slots, for ``runs``
    cdef int merge_cap
    cdef uint16_t *pend_buf     # the slots of the last pending mask ``runs`` met, sorted
    cdef int pend_cap

    def __cinit__(self):
        self.mask_bits = 63
        self.table = <Entry *>PyMem_Calloc(64, sizeof(Entry))
        self.used = 0
        self.tombstones = 0
        self.seed = int.from_bytes(os.urandom(8), "little")
        self.positions = SlotPositions()
        self.scratch_cap = 64
        self.scratch = <uint16_t *>PyMem_Malloc(self.scratch_cap * sizeof(uint16_t))
        self.merge_cap = 64
        self.merge_buf = <uint16_t *>PyMem_Malloc(self.merge_cap * sizeof(uint16_t))
        self.pend_cap = 64
        self.pend_buf = <uint16_t *>PyMem_Malloc(self.pend_cap * sizeof(uint16_t))
        if (self.table is NULL or self.scratch is NULL or self.merge_buf is NULL
                or self.pend_buf is NULL):
            raise MemoryError()

    def __dealloc__(self):
        cdef uint64_t i
        if self.table is not NULL:
            for i in range(self.mask_bits + 1):
                if self.table[i].n and self.table[i].cap:
                    PyMem_Free(_ext(&self.table[i]))
            PyMem_Free(self.table)
        PyMem_Free(self.scratch)
        PyMem_Free(self.merge_buf)
        PyMem_Free(self.pend_buf)

    def __len__(self):
        return self.used

    # ---- the table --------------------------------------------------------------------

    cdef inline uint64_t _home(self, uint64_t k0, uint64_t k1) noexcept:
        return _mix(k0 ^ self.seed ^ (k1 << 1)) & self.mask_bits

    cdef Entry *_lookup(self, const char *key) noexcept:
        """The entry of ``key``, or NULL."""
        cdef uint64_t k0, k1, i
        memcpy(&k0, key, 8)
        memcpy(&k1, key + 8, 8)
        i = self._home(k0, k1)
        while True:
            if self.table[i].n:
                if self.table[i].k0 == k0 and self.table[i].k1 == k1:
                    return &self.table[i]
            elif not self.table[i].cap:  # empty: the run ends (a tombstone does not end it)
                return NULL
            i = (i + 1) & self.mask_bits

    cdef int _rehash(self) except -1:
        """Every key moved to a new table without tombstones: twice the size if keys fill
        more than 21/32 of this one, else the same size. Slot positions rebuilt."""
        cdef uint64_t old_cap = self.mask_bits + 1, i, j
        cdef uint64_t new_cap = old_cap * 2 if (self.used + 1) * 32 > old_cap * 21 else old_cap
        cdef Entry *old = self.table
        cdef Entry *fresh
        if new_cap > MAX_CAPACITY:
            raise MemoryError("the holdings table would pass 2**32 entries")
        fresh = <Entry *>PyMem_Calloc(new_cap, sizeof(Entry))
        if fresh is NULL:
            raise MemoryError()
        self.table = fresh
        self.mask_bits = new_cap - 1
        for i in range(old_cap):
            if old[i].n:
                j = self._home(old[i].k0, old[i].k1)
                while fresh[j].n:
                    j = (j + 1) & self.mask_bits
                fresh[j] = old[i]
        PyMem_Free(old)
        self.tombstones = 0
        self.positions.rebuild(self.table, new_cap)
        return 0

    cdef Entry *_insert(self, const char *key) except NULL:
        """The entry of ``key``, created empty-handed (n == 0 until a holder is added) if
        absent, in the first tombstone of its probe run if it has one. The caller adds a
        holder before any other table operation."""
        cdef uint64_t k0, k1, i
        cdef Entry *reuse = NULL
        if (self.used + self.tombstones + 1) * 4 > (self.mask_bits + 1) * 3:
            self._rehash()
        memcpy(&k0, key, 8)
        memcpy(&k1, key + 8, 8)
        i = self._home(k0, k1)
        while True:
            if self.table[i].n:
                if self.table[i].k0 == k0 and self.table[i].k1 == k1:
                    return &self.table[i]
            elif not self.table[i].cap:
                break
            elif reuse is NULL:
                reuse = &self.table[i]
            i = (i + 1) & self.mask_bits
        if reuse is NULL:
            reuse = &self.table[i]
        else:
            self.tombstones -= 1
        reuse.k0 = k0
        reuse.k1 = k1
        reuse.cap = 0
        self.used += 1
        return reuse

    cdef void _delete_at(self, uint64_t i) noexcept:
        """Remove the (holder-less) entry at ``i``: a tombstone, so no lookup stops early,
        unless the next entry is empty; then no run passes through ``i``, and the tombstones
        just before it are emptied too. No live entry moves."""
        self.used -= 1
        if self.table[(i + 1) & self.mask_bits].n or self.table[(i + 1) & self.mask_bits].cap:
            self.table[i].cap = TOMBSTONE
            self.tombstones += 1
            return
        memset(&self.table[i], 0, sizeof(Entry))
        i = (i - 1) & self.mask_bits
        while not self.table[i].n and self.table[i].cap:
            memset(&self.table[i], 0, sizeof(Entry))
            self.tombstones -= 1
            i = (i - 1) & self.mask_bits

    # ---- one entry's holders ---------------------------------------------------------

    cdef int _add_holder(self, Entry *e, uint16_t slot) except -1:
        """1 if ``slot`` was added, 0 if it held the key already."""
        cdef uint16_t *arr = _slots(e)
        cdef int at = _find_slot(arr, e.n, slot)
        cdef uint16_t *grown
        cdef int new_cap
        if at >= 0:
            return 0
        at = -at - 1
        if e.cap == 0 and e.n == INLINE:
            grown = <uint16_t *>PyMem_Malloc(2 * INLINE * sizeof(uint16_t))
            if grown is NULL:
                raise MemoryError()
            memcpy(grown, e.inl, INLINE * sizeof(uint16_t))
            _set_ext(e, grown)
            e.cap = 2 * INLINE
        elif e.cap and e.n == e.cap:
            new_cap = min(2 * <int>e.cap, 65535)
            grown = <uint16_t *>PyMem_Realloc(_ext(e), new_cap * sizeof(uint16_t))
            if grown is NULL:
                raise MemoryError()
            _set_ext(e, grown)
            e.cap = new_cap
        arr = _slots(e)
        memmove(arr + at + 1, arr + at, (e.n - at) * sizeof(uint16_t))
        arr[at] = slot
        e.n += 1
        return 1

    cdef int _remove_holder(self, Entry *e, uint16_t slot) noexcept:
        """1 if ``slot`` was removed (the entry may be left with none), 0 if it was absent."""
        cdef uint16_t *arr = _slots(e)
        cdef int at = _find_slot(arr, e.n, slot)
        cdef uint16_t *ext
        if at < 0:
            return 0
        memmove(arr + at, arr + at + 1, (e.n - at - 1) * sizeof(uint16_t))
        e.n -= 1
        if e.cap and e.n <= INLINE:
            ext = _ext(e)
            memcpy(e.inl, ext, e.n * sizeof(uint16_t))
            PyMem_Free(ext)
            e.cap = 0
        return 1

    # ---- the contract ----------------------------------------------------------------

    def add(self, keys, int slot):
        cdef Py_ssize_t added = 0
        cdef Entry *e
        cdef uint16_t s = _checked_slot(slot)
        for key in keys:  # a bad key part-way leaves the keys before it added, and counted
            _check_stored_key(key)
            e = self._insert(PyBytes_AS_STRING(key))
            if self._add_holder(e, s):
                added += 1
                self.positions.added(s, <uint64_t>(e - self.table), self.table)
        return added

    def discard(self, keys, int slot):
        cdef Py_ssize_t removed = 0
        cdef Entry *e
        cdef uint16_t s = _checked_slot(slot)
        try:
            for key in keys:
                _check_stored_key(key)
                e = self._lookup(PyBytes_AS_STRING(key))
                if e is not NULL and self._remove_holder(e, s):
                    removed += 1
                    if not e.n:
                        self._delete_at(<uint64_t>(e - self.table))
        finally:
            self.positions.removed(s, removed, self.table)
        return removed

    def drop_slot(self, int slot):
        """O(the slot's keys): the positions of its keys name every entry to visit."""
        cdef uint16_t s = _checked_slot(slot)
        cdef SlotHoldings *held
        cdef Entry *e
        cdef uint64_t i
        cdef Py_ssize_t dropped = 0
        if not self.positions.count(s):
            return 0
        held = self.positions.of(s)
        for i in range(held.n):  # deletions move no live entry: every position stays right
            e = &self.table[held.at[i]]
            if e.n and self._remove_holder(e, s):  # false for a stale or repeated position
                dropped += 1
                if not e.n:
                    self._delete_at(held.at[i])
        self.positions.dropped(s)
        return dropped

    def holds(self, key, int slot):
        cdef Entry *e
        if type(key) is not bytes or PyBytes_GET_SIZE(key) != KEY_BYTES:
            return False
        e = self._lookup(PyBytes_AS_STRING(key))
        return e is not NULL and _find_slot(_slots(e), e.n, _checked_slot(slot)) >= 0

    def not_held(self, keys, int slot):
        cdef Entry *e
        cdef uint16_t s = _checked_slot(slot)
        out = []
        for key in keys:
            _check_stored_key(key)
            e = self._lookup(PyBytes_AS_STRING(key))
            if e is NULL or _find_slot(_slots(e), e.n, s) < 0:
                out.append(key)
        return out

    def count(self, int slot):
        return self.positions.count(slot)

    def keys_by_slot(self, slots):
        """``{slot: the keys it holds}`` for every slot asked: O(the keys they hold)."""
        cdef uint32_t *at
        cdef Py_ssize_t i, n
        cdef char buf[KEY_BYTES]
        out = {_checked_slot(slot): None for slot in slots}
        for s in out:
            n = self.positions.held(s, self.table, &at)
            keys = out[s] = [None] * n
            for i in range(n):
                memcpy(buf, &self.table[at[i]].k0, 8)
                memcpy(buf + 8, &self.table[at[i]].k1, 8)
                keys[i] = PyBytes_FromStringAndSize(buf, KEY_BYTES)
        return out

    def mask(self, key):
        cdef Entry *e
        if type(key) is not bytes or PyBytes_GET_SIZE(key) != KEY_BYTES:
            return 0
        e = self._lookup(PyBytes_AS_STRING(key))
        if e is NULL:
            return 0
        return _mask_of(_slots(e), e.n)

    def runs(self, keys, pending):
        """``holder_masks.prefix_runs`` over this table (``pending``: ``key -> mask`` or
        None)."""
        cdef list out = []
        cdef Py_ssize_t end = 0
        cdef int r = -1, n, i, j, kept, pn = 0, hn
        cdef Entry *e
        cdef const uint16_t *arr
        cdef const uint16_t *held
        cdef uint16_t *run
        cdef object extra, last_extra = None
        for key in keys:
            if type(key) is not bytes:
                raise ValueError("page keys must be bytes")
            e = NULL
            if PyBytes_GET_SIZE(key) == KEY_BYTES:
                e = self._lookup(PyBytes_AS_STRING(key))
            extra = pending.get(key) if pending else None
            if extra is not None:
                # A pending mask joins the holders. A route marks a whole tail pending, so
                # neighbouring keys share one mask: decode it to sorted slots once per mask,
                # then merge with the key's (sorted, distinct) holders in C.
                if extra is not last_extra and extra != last_extra:
                    slots = _slots_of_mask(extra)
                    pn = len(slots)
                    self.pend_buf = _reserved(self.pend_buf, &self.pend_cap, pn)
                    for i in range(pn):
                        self.pend_buf[i] = slots[i]
                    last_extra = extra
                if e is NULL:
                    arr, n = self.pend_buf, pn
                else:
                    held, hn = _slots(e), e.n
                    self.merge_buf = _reserved(self.merge_buf, &self.merge_cap, pn + hn)
                    n = _merge_sorted(self.pend_buf, pn, held, hn, self.merge_buf)
                    arr = self.merge_buf
            elif e is NULL:
                break
            else:
                arr, n = _slots(e), e.n
            if r < 0:  # the first key: the run starts as its holders
                self.scratch = _reserved(self.scratch, &self.scratch_cap, n)
                memcpy(self.scratch, arr, n * sizeof(uint16_t))
                r = n
                end = 1
                out.append([_mask_of(self.scratch, r), end])
                continue
            run = self.scratch
            if n == r and memcmp(arr, run, r * sizeof(uint16_t)) == 0:
                kept = r  # the same holders as the run: the common, long shared prefix
            else:
                kept = 0  # intersect in place: both sorted
                j = 0
                for i in range(r):
                    while j < n and arr[j] < run[i]:
                        j += 1
                    if j < n and arr[j] == run[i]:
                        run[kept] = run[i]
                        kept += 1
            if not kept:
                break
            end += 1
            if kept == r:
                out[len(out) - 1][1] = end
            else:
                r = kept
                out.append([_mask_of(run, r), end])
        return [(m, d) for m, d in out]

    def check(self):
        """AssertionError unless the table agrees with itself: counts, order, probe runs,
        tombstones, and each slot's positions."""
        cdef uint64_t i, tombstones = 0
        cdef int j
        cdef uint16_t *arr
        counts = {}
        live = 0
        for i in range(self.mask_bits + 1):
            if not self.table[i].n:
                if self.table[i].cap:
                    if self.table[i].cap != TOMBSTONE:
                        raise AssertionError("an entry without holders is neither empty nor "
                                             "a tombstone")
                    tombstones += 1
                continue
            live += 1
            arr = _slots(&self.table[i])
            for j in range(self.table[i].n):
                if j and arr[j - 1] >= arr[j]:
                    raise AssertionError("an entry's holders are not sorted and distinct")
                counts[arr[j]] = counts.get(arr[j], 0) + 1
            if self.table[i].cap and self.table[i].n <= INLINE:
                raise AssertionError("a small holder set is out of line")
            if self._lookup_at(i) != i:
                raise AssertionError("an entry is unreachable from its home")
        if live != self.used:
            raise AssertionError("the key count is wrong")
        if tombstones != self.tombstones:
            raise AssertionError("the tombstone count is wrong")
        if (self.used + self.tombstones) * 4 > (self.mask_bits + 1) * 3:
            raise AssertionError("keys and tombstones fill more than 3/4 of the table")
        self.positions.check(self.table, self.mask_bits + 1, counts)

    cdef uint64_t _lookup_at(self, uint64_t at):
        cdef char buf[KEY_BYTES]
        cdef Entry *e
        memcpy(buf, &self.table[at].k0, 8)
        memcpy(buf + 8, &self.table[at].k1, 8)
        e = self._lookup(buf)
        return <uint64_t>(e - self.table) if e is not NULL else <uint64_t>-1


cdef uint16_t *_reserved(uint16_t *buf, int *cap, int n) except NULL:
    """``buf`` grown to at least ``n`` slots (``cap`` updated)."""
    cdef uint16_t *grown
    if n <= cap[0]:
        return buf
    grown = <uint16_t *>PyMem_Realloc(buf, n * sizeof(uint16_t))
    if grown is NULL:
        raise MemoryError()
    cap[0] = n
    return grown


cdef inline int _checked_slot(int slot) except -1:
    if slot < 0 or slot >= 65535:
        raise ValueError(f"slot {slot} out of range")
    return slot


cdef inline int _check_stored_key(object key) except -1:
    if type(key) is not bytes or PyBytes_GET_SIZE(key) != KEY_BYTES:
        raise ValueError("page keys must be 16-byte bytes")
    return 0


cdef object _mask_of(const uint16_t *arr, int n):
    """The Python int with bit ``arr[i]`` set for each i (``arr`` sorted ascending)."""
    cdef int i, nbytes
    cdef unsigned char *buf
    cdef unsigned long long small = 0
    if n == 0:
        return 0
    if arr[n - 1] < 64:
        for i in range(n):
            small |= (<unsigned long long>1) << arr[i]
        return small
    nbytes = arr[n - 1] // 8 + 1
    buf = <unsigned char *>PyMem_Calloc(nbytes, 1)
    if buf is NULL:
        raise MemoryError()
    try:
        for i in range(n):
            buf[arr[i] >> 3] |= <unsigned char>(1 << (arr[i] & 7))
        return int.from_bytes(PyBytes_FromStringAndSize(<char *>buf, nbytes), "little")
    finally:
        PyMem_Free(buf)


cdef int _merge_sorted(const uint16_t *a, int an, const uint16_t *b, int bn,
                       uint16_t *out) noexcept:
    """The union of two sorted, distinct slot arrays into ``out`` (room for ``an + bn``),
    sorted and distinct; returns its length."""
    cdef int i = 0, j = 0, n = 0
    while i < an and j < bn:
        if a[i] < b[j]:
            out[n] = a[i]
            i += 1
        elif b[j] < a[i]:
            out[n] = b[j]
            j += 1
        else:
            out[n] = a[i]
            i += 1
            j += 1
        n += 1
    while i < an:
        out[n] = a[i]
        i += 1
        n += 1
    while j < bn:
        out[n] = b[j]
        j += 1
        n += 1
    return n


cdef list _slots_of_mask(object mask):
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
