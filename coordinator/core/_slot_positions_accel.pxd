# Declarations of _slot_positions_accel.pyx (its docstring states the contract), for the
# compiled holdings (_holdings_accel.pyx) to cimport.

from libc.stdint cimport uint16_t, uint32_t, uint64_t

from coordinator.core._holdings_entry cimport Entry

cdef struct SlotHoldings:
    uint64_t count    # keys the slot holds
    uint32_t *at      # table positions: each of those keys' at least once
    uint64_t n        # positions in ``at``
    uint64_t cap      # room in ``at``
    # ``at`` may name positions the slot no longer holds, or one twice (since a discard);
    # when false it names each of the slot's positions exactly once.
    bint stale


cdef class SlotPositions:
    cdef SlotHoldings *slots
    cdef int slot_cap
    cdef uint32_t *scratch    # the positions a read of a stale slot returns
    cdef uint64_t scratch_cap

    cdef SlotHoldings *of(self, uint16_t slot) except NULL
    cdef uint64_t count(self, int slot) noexcept
    cdef int added(self, uint16_t slot, uint64_t at, Entry *table) except -1
    cdef int removed(self, uint16_t slot, uint64_t count, Entry *table) except -1
    cdef void dropped(self, uint16_t slot) noexcept
    cdef int rebuild(self, Entry *table, uint64_t capacity) except -1
    cdef Py_ssize_t held(self, uint16_t slot, Entry *table, uint32_t **out) except -1
    cdef int check(self, Entry *table, uint64_t capacity, dict counts) except -1
