// protocol/ (sharded producers): the rounds in which R producer ranks agree on
// one sync, as single steps on the shared words (docs/protocol.md §9,
// "Rounds"). api/producer_ranks.cpp drives these steps with its waits, deadlines and
// liveness checks; the model check (tests/unit/test_rounds.cpp) drives the
// same steps in every interleaving of 2 and 3 ranks with failures injected.
// Each function here is one step: a few loads and at most one store or CAS
// per rank seat, never a wait.
//
// A round has an identity, its round id, which is also the version of the
// sync it makes. Rank 0 opens round n; a rank takes part by posting its list
// for round n; rank 0 takes each post for n with a CAS (a post for another
// round is never used), and ends the round by answering every rank (go, or
// the failure). A rank that gives up waiting withdraws its post with a CAS,
// so rank 0 can never take it afterwards. Everything a failure leaves
// behind is tagged with its round, so it cannot touch the next one.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "base/layout.hpp"

namespace shmcast::detail::rounds {

// RankSeat::post = round << 3 | state.
enum class PostState : std::uint32_t {
  kNone = 0,       // nothing posted for this round (a rank that just attached)
  kList = 1,       // the rank's list for the round is in its list area
  kDropped = 2,    // the rank failed the round before listing; its list area holds why
  kTaken = 3,      // rank 0 took the list (it will answer the round)
  kWithdrawn = 4,  // the rank gave up waiting for rank 0's answer
  // 5..7 are never written: a post that holds one is corrupt.
};
inline constexpr std::uint64_t kMaxRound = (1ull << 61) - 1;
constexpr std::uint64_t post_word(std::uint64_t round, PostState s) {
  return round << 3 | static_cast<std::uint64_t>(s);
}
constexpr std::uint64_t post_round(std::uint64_t w) { return w >> 3; }
constexpr PostState post_state(std::uint64_t w) { return static_cast<PostState>(w & 7u); }

// The shared words of the rounds: a region's, or a test's own memory.
struct Words {
  std::atomic<std::uint64_t>* opened;  // Header::round_open: the round rank 0 has begun
  std::atomic<std::uint64_t>* ended;   // Header::round: the last round rank 0 ended
  std::atomic<std::uint64_t>* done;    // Header::round_done: the fate of the last sync that ended (fate word)
  RankSeat* seats;                     // [world]
  std::uint32_t world;
  RankSeat& seat(std::uint32_t r) const { return seats[r]; }
};

// The id of a rank's next round after `last`: last + 1, or `want` when the
// caller names it (the ranks then name every round alike, e.g. the training
// step). Empty, or why `want` cannot be a round.
std::string next_round(std::uint64_t last, std::uint64_t want, std::uint64_t* out);

// ---------------------------------------------------------------- ranks 1..

// The rank's list of round n is in its list area: `bytes` of it, hashing to
// `hash`. Publishes the post (release).
void post(RankSeat& rs, std::uint64_t n, std::uint64_t bytes, std::uint64_t hash);
// The rank failed round n before it could list (`code`; its list area holds
// `text_bytes` of why): rank 0 fails the round for everyone when it sees it.
void drop(RankSeat& rs, std::uint64_t n, Errc code, std::uint64_t text_bytes);

struct Answer {
  std::uint64_t round = 0;
  Errc status{};  // Errc{} (0): go
  std::uint64_t version = 0, first_seq = 0, rank_chunks = 0;
  // Delta regions: the kind of the sync rank 0 agreed (RankSeat::reply_base):
  // 0 full, else a delta sync against this version.
  std::uint64_t base_version = 0;
  std::string why;  // a failure's reason (the seat's error_text)
};
// RankSeat::reply_round while rank 0 rewrites the answer: the round it is
// answering, with this bit (a seqlock: readers retry or wait).
inline constexpr std::uint64_t kReplyBusy = 1ull << 63;
enum class Heard {
  kNothing,  // no answer to round n yet
  kGo,       // rank 0 answered round n: write the sync (*out)
  kFailed,   // rank 0 failed round n (out->status; the text is in the seat's error_text)
  kOver,     // rank 0 has ended a later round: round n is over without this rank
};
Heard hear(const RankSeat& rs, std::uint64_t n, Answer* out);

enum class GiveUp {
  kWithdrawn,  // the post is withdrawn: rank 0 cannot use it any more (it fails round n)
  kBegun,      // rank 0 has begun round n (or a later one): its answer is coming, wait for it
};
// The rank's deadline for round n passed without an answer. Unless rank 0
// has begun round n (and `force` is false), withdraws the post, so rank 0
// will never take it. With `force` (rank 0 began the round but still did
// not answer), withdraws even a post rank 0 took: rank 0 notices before it
// answers, or at the end of the sync.
GiveUp give_up(const Words& w, std::uint32_t k, std::uint64_t n, bool force);

// The fate of round n's sync (after go), decided once in Words::done:
// round << 1 when rank 0 completed it (every rank's chunks are in), round
// << 1 | 1 when a rank abandoned it first (its write failed, it gave up
// waiting, it closed). So no rank reports a sync complete that another
// reports failed.
bool completed(const Words& w, std::uint64_t n);
bool abandoned(const Words& w, std::uint64_t n);
// Any rank: abandons round n's sync. False when rank 0 completed it first
// (then nothing is to be aborted: the sync is the consumers').
bool abandon(const Words& w, std::uint64_t n);

// What deciding round n's fate found (abandon_round, complete_round).
enum class Decision {
  kWon,       // this call decided it: only this caller writes the reason (Header::error_text)
  kSame,      // another call decided the same fate first
  kOpposite,  // the other fate was decided first (abandon: rank 0 completed it; complete: a rank abandoned it)
  kCorrupt,   // the fate word names round n or a later round, but neither fate of n: the region is corrupt
};
Decision abandon_round(const Words& w, std::uint64_t n);
Decision complete_round(const Words& w, std::uint64_t n);
// The fate word holds round n or a later one, but neither fate of round n
// (nobody writes that: a corrupt region).
bool fate_corrupt(const Words& w, std::uint64_t n);

// ---------------------------------------------------------------- rank 0

// Rank 0 begins round n.
void open(const Words& w, std::uint64_t n);

enum class Seen {
  kTaken,    // rank k's list for round n is rank 0's now
  kMissing,  // nothing for round n yet
  kStale,    // a list for an older round that rank 0 never answered to rank k: refuse it
  kGaveUp,   // rank k withdrew its post of round n (it waited too long for rank 0)
  kDropped,  // rank k failed round n before listing (code; its list area holds why)
  kAhead,    // rank k has posted a later round: it left round n (code), or skipped it
  kCorrupt,  // rank k's post for round n or later holds a state nobody writes (5..7): corrupt
};
struct Look {
  Seen seen;
  std::uint64_t round = 0;  // the round rank k posted for
  Errc code{};              // kDropped, kAhead: why rank k left round n
  bool skipped = false;     // kAhead: rank k never took part in round n at all
};
// Rank 0 with round n open looks at rank k's post, and takes it (CAS
// kList -> kTaken) when it is rank k's list for round n. Nothing else is
// ever taken: not a post of another round, not a withdrawn one.
Look look(RankSeat& rs, std::uint64_t n);
// The post of rank k is still rank 0's for round n (not withdrawn since).
bool still_taken(const RankSeat& rs, std::uint64_t n);
// Answers rank k's stale list of round m (< the round open) with `code`:
// the rank stops waiting for a round that will never come.
void refuse(RankSeat& rs, std::uint64_t m, Errc code, std::string_view why);
// Ends round n with go: every rank's answer (reply fields, then reply_round,
// release), then `ended`.
void go(const Words& w, const Answer& a);
// Ends round n with a failure: every rank k >= 1 gets `code` and `why`
// (also ranks that have not posted yet: they hear it when they do).
void fail(const Words& w, std::uint64_t n, Errc code, std::string_view why);
// Rank 0: the sync of round n is complete (every rank published every
// chunk). False when a rank abandoned it first.
bool complete(const Words& w, std::uint64_t n);

// A process that attaches to rank seat k (attach_rank) while rank 0 may be
// in the middle of a round: returns the last round this process counts as
// over (its next numbered round is that + 1). Rank 0's open round n is
// joined only when the seat's previous process never posted for it; else
// (its list may be taken, or answered, for round n: a round already in
// flight) the seat's post says the rank dropped round n (PeerDied, with
// `why` in its list area), so rank 0 fails round n, and the new process
// starts at round n + 1. Never leaves a post of round n that rank 0 took.
std::uint64_t rejoin(const Words& w, std::uint32_t k, std::byte* list_area, std::uint64_t list_bytes,
                     std::string_view why);

}  // namespace shmcast::detail::rounds

namespace shmcast::detail {

// Tests only: the places where a test process may pause or tamper with the
// round words, to hit a narrow window deterministically. Unset (the
// default) in every real process; the producer calls it at each point
// (api/producer_ranks.cpp, and api/producer_write.cpp for kAbandonWon).
enum class TestPoint {
  kAwaitDoneUndecided,  // rank k, await_done: completed(n) just read false
  kBeforeComplete,      // rank 0, end_sync: every chunk is in, before complete(n)
  kAfterComplete,       // rank 0, end_sync: complete(n) succeeded
  kBeforeGo,            // rank 0, lead_round: every list taken and merged, before go(n)
  kPosted,              // rank k, join_round: its list of round n is posted
  kJoined,              // rank k, begin_sharded: rank 0's go for round n heard (answer: rounds::Answer*)
  kAbandonWon,          // any rank, abort: it won abandon(n), before it writes the reason
  kAwaitReason,         // any rank: round n is abandoned by another rank, waiting for its reason
  kDeltaPlanned,        // a delta producer, end_staged: its GPU tensors planned, before their encodes (round: version)
  kDeltaOutOfSync,      // a delta producer, end_staged: out of the sync (bases final, blobs packed), before begin_ring
};
struct TestPointArgs {
  TestPoint at;
  std::uint64_t round;
  const rounds::Words* words;
  void* answer;  // kJoined: the rounds::Answer the rank heard (the test may change it)
};
extern std::function<void(const TestPointArgs&)> test_point;

// Restart (api/producer_create.cpp): a new rank 0 that finds the name taken by a region
// whose rank 0 is dead removes it (holding kTakeoverLockByte, then byte 0,
// until the name is gone), so that ranks attaching meanwhile never join the
// old file. `before_unlink` runs with both locks held (tests pause there).
// False when the name vanished; kExists, kPermission as Producer::create.
bool take_over_stale(const std::string& dir, std::string_view name, bool replace_stale, bool group_access,
                     const std::function<void()>& before_unlink = {});

}  // namespace shmcast::detail
