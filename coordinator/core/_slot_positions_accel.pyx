# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Where each worker slot's keys lie in the compiled holdings' table (``_holdings_accel.pyx``):
what makes ``count`` O(1), and ``keys_by_slot`` and ``drop_slot`` O(the slot's keys) rather
than O(the table).

Per slot: how many keys it holds, and an array of their table positions (uint32: the table has
at most 2**32 entries). The table moves live entries only when it rehashes (a deletion leaves a
tombstone), and then calls ``rebuild``, which reads every slot's positions afresh. A new
holding appends its position. A discard leaves its position behind: the slot is then *stale*,
its array possibly naming positions it no longer holds, or one twice (a key discarded and added
back). Reads of a stale slot filter its array into a scratch one (the positions whose entry
holds the slot, sorted, once each) and leave it as it is; a write compacts it the same way in
place when it passes twice its count on filling up, or four times after a discard, so an array
costs 4 bytes a holding plus its slack. Not thread-safe.
"""

from cpython.mem cimport PyMem_Calloc, PyMem_Free, PyMem_Realloc
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.stdlib cimport qsort
from libc.string cimport memset

from coordinator.core._holdings_entry cimport Entry, _holds, _slots

# When a full array is compacted rather than grown (past twice its count) and when a discard
# compacts it (past four times): amortised, a compaction's O(n log n) is paid for by the n/2
# appends or 3n/4 discards that made it that long. The 16 keeps tiny slots from churning.
DEF SLACK = 16


cdef class SlotPositions:
    def __cinit__(self):
        self.slot_cap = 64
        self.slots = <SlotHoldings *>PyMem_Calloc(self.slot_cap, sizeof(SlotHoldings))
        self.scratch = NULL
        self.scratch_cap = 0
        if self.slots is NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef int s
        if self.slots is not NULL:
            for s in range(self.slot_cap):
                PyMem_Free(self.slots[s].at)
            PyMem_Free(self.slots)
        PyMem_Free(self.scratch)

    cdef SlotHoldings *of(self, uint16_t slot) except NULL:
        """The slot's record (the records grown, zeroed: holding nothing, to reach it)."""
        cdef SlotHoldings *grown
        cdef int cap = self.slot_cap
        if slot >= cap:
            while cap <= slot:
                cap *= 2
            grown = <SlotHoldings *>PyMem_Realloc(self.slots, cap * sizeof(SlotHoldings))
            if grown is NULL:
                raise MemoryError()
            memset(grown + self.slot_cap, 0, (cap - self.slot_cap) * sizeof(SlotHoldings))
            self.slots = grown
            self.slot_cap = cap
        return &self.slots[slot]

    cdef uint64_t count(self, int slot) noexcept:
        """How many keys ``slot`` holds (0 for a slot never seen)."""
        return self.slots[slot].count if 0 <= slot < self.slot_cap else 0

    cdef int added(self, uint16_t slot, uint64_t at, Entry *table) except -1:
        """``slot`` holds the key at position ``at`` now, and did not before this call."""
        cdef SlotHoldings *sh = self.of(slot)
        sh.count += 1
        if sh.n == sh.cap:
            if sh.n >= 2 * sh.count + SLACK:
                _compact(sh, slot, table)
                # The key may have been here before and left its position stale: compacting
                # kept it (the slot holds it now), so it is in the array already.
                if _sorted_has(sh.at, sh.n, <uint32_t>at):
                    return 0
            if sh.n == sh.cap:
                _resize(sh, sh.cap + sh.cap // 2 + SLACK)
        # Not stale stays not stale: the slot did not hold this position, so it was not listed.
        sh.at[sh.n] = <uint32_t>at
        sh.n += 1
        return 0

    cdef int removed(self, uint16_t slot, uint64_t count, Entry *table) except -1:
        """``slot`` stopped holding ``count`` keys (their entries updated already)."""
        cdef SlotHoldings *sh
        if not count:
            return 0
        sh = &self.slots[slot]  # it held them: it has a record
        sh.count -= count
        sh.stale = True
        if sh.n > 4 * sh.count + SLACK:
            _compact(sh, slot, table)
        return 0

    cdef void dropped(self, uint16_t slot) noexcept:
        """``slot`` holds nothing now (its entries updated already)."""
        if slot < self.slot_cap:
            PyMem_Free(self.slots[slot].at)
            memset(&self.slots[slot], 0, sizeof(SlotHoldings))

    cdef int rebuild(self, Entry *table, uint64_t capacity) except -1:
        """Every slot's positions read afresh from ``table`` (just rehashed; every count
        right), in table order: none stale, room for a quarter more."""
        cdef int s, j
        cdef uint64_t i
        cdef SlotHoldings *sh
        cdef uint16_t *holders
        for s in range(self.slot_cap):
            sh = &self.slots[s]
            sh.n = 0
            sh.stale = False
            _resize(sh, sh.count + sh.count // 4 + SLACK if sh.count else 0)
        for i in range(capacity):
            if table[i].n:
                holders = _slots(&table[i])
                for j in range(table[i].n):
                    sh = &self.slots[holders[j]]
                    sh.at[sh.n] = <uint32_t>i
                    sh.n += 1
        return 0

    cdef Py_ssize_t held(self, uint16_t slot, Entry *table, uint32_t **out) except -1:
        """How many keys ``slot`` holds; ``out`` set to their positions, once each, valid until
        the next call: the slot's own array, or where it is stale the scratch one."""
        cdef SlotHoldings *sh
        cdef uint32_t *grown
        if slot >= self.slot_cap or not self.slots[slot].count:
            return 0
        sh = &self.slots[slot]
        if not sh.stale:
            out[0] = sh.at
            return sh.n
        if self.scratch_cap < sh.n:
            grown = <uint32_t *>PyMem_Realloc(self.scratch, sh.n * sizeof(uint32_t))
            if grown is NULL:
                raise MemoryError()
            self.scratch, self.scratch_cap = grown, sh.n
        out[0] = self.scratch
        return _held_sorted(sh, slot, table, self.scratch)

    cdef int check(self, Entry *table, uint64_t capacity, dict counts) except -1:
        """AssertionError unless each slot's count is ``counts``' (slot -> how many entries of
        the table it holds) and its positions name each of those entries: once each and
        nothing else unless it is stale, and never more than the compaction bound."""
        cdef int s
        cdef uint64_t i
        cdef SlotHoldings *sh
        cdef uint32_t *positions
        if counts and max(counts) >= self.slot_cap:
            raise AssertionError("a slot holds keys but has no record")
        for s in range(self.slot_cap):
            sh = &self.slots[s]
            if sh.count != counts.get(s, 0):
                raise AssertionError(f"slot {s}'s holdings count is wrong")
            if sh.n > sh.cap or sh.n > 4 * sh.count + SLACK:
                raise AssertionError(f"slot {s}'s positions outgrew their bound")
            for i in range(sh.n):
                if sh.at[i] >= capacity:
                    raise AssertionError(f"slot {s} names a position past the table")
            positions = <uint32_t *>PyMem_Calloc(sh.n + 1, sizeof(uint32_t))
            if positions is NULL:
                raise MemoryError()
            try:
                if _held_sorted(sh, s, table, positions) != sh.count:
                    raise AssertionError(f"slot {s}'s positions miss a key it holds")
                if not sh.stale and sh.n != sh.count:
                    raise AssertionError(f"slot {s}'s positions are stale but not marked so")
            finally:
                PyMem_Free(positions)
        return 0


cdef uint64_t _held_sorted(SlotHoldings *sh, uint16_t slot, Entry *table,
                           uint32_t *dest) noexcept:
    """The positions in ``sh.at`` whose entry ``slot`` holds, sorted and distinct, written to
    ``dest`` (room for ``sh.n``; ``sh.at`` itself will do); returns how many."""
    cdef uint64_t i, kept = 0, distinct = 0
    for i in range(sh.n):
        if _holds(&table[sh.at[i]], slot):
            dest[kept] = sh.at[i]
            kept += 1
    qsort(dest, kept, sizeof(uint32_t), _ascending)
    for i in range(kept):
        if distinct == 0 or dest[i] != dest[distinct - 1]:
            dest[distinct] = dest[i]
            distinct += 1
    return distinct


cdef int _compact(SlotHoldings *sh, uint16_t slot, Entry *table) except -1:
    """``sh.at`` filtered in place as ``_held_sorted`` does (not stale after), trimmed when it
    has more than twice the room it needs."""
    sh.n = _held_sorted(sh, slot, table, sh.at)
    sh.stale = False
    if sh.cap > 2 * sh.n + SLACK:
        _resize(sh, sh.n + sh.n // 2 + SLACK)
    return 0


cdef int _resize(SlotHoldings *sh, uint64_t cap) except -1:
    """Room for ``cap`` positions (0: none, the array freed); ``sh.n <= cap``."""
    cdef uint32_t *grown
    if cap == 0:
        PyMem_Free(sh.at)
        sh.at, sh.cap = NULL, 0
        return 0
    grown = <uint32_t *>PyMem_Realloc(sh.at, cap * sizeof(uint32_t))
    if grown is NULL:
        raise MemoryError()
    sh.at, sh.cap = grown, cap
    return 0


cdef bint _sorted_has(const uint32_t *at, uint64_t n, uint32_t position) noexcept:
    cdef uint64_t lo = 0, hi = n, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if at[mid] < position:
            lo = mid + 1
        else:
            hi = mid
    return lo < n and at[lo] == position


cdef int _ascending(const void *a, const void *b) noexcept nogil:
    cdef uint32_t x = (<const uint32_t *>a)[0], y = (<const uint32_t *>b)[0]
    return (x > y) - (x < y)
