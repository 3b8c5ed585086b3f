// The sync record of a live region, read by the read-only probe (probe/,
// shmcast-inspect's thread that probes) under the SIGBUS guard: the seqlock
// when it settles, an unlocked copy when it does not, and a dead store
// producer's record rebuilt from its banks.
#pragma once

#include "base/checks.hpp"
#include "base/layout.hpp"

namespace shmcast::detail::probe_impl {

// The sync record. read_record() fails while the seqlock word is odd; the
// word is also a futex bell, and some library paths ring it outside a write
// (ProducerRing::evict, Producer close), which leaves it odd until the next
// announce, or for good after a close. So: try the seqlock for about 2 ms,
// then settle for an unlocked copy and say so (*stable = false). Callers
// that use the record to locate bytes re-validate what they read.
// False when the page faulted (the file shrank).
bool read_record_any(const Header* live, RecordSnapshot* out, bool* stable);

// The record as read_record_any() gives it; for a store region whose
// producer is dead and whose seqlock word stays odd (it died inside the
// record flip), the record a consumer rebuilds from the banks
// (recover_store_record, docs/protocol.md §11), *recovered set.
bool read_record_or_recover(const Header* live, const Geometry& g, bool producer_dead, RecordSnapshot* out,
                            bool* stable, bool* recovered);

}  // namespace shmcast::detail::probe_impl
