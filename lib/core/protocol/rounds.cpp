#include "protocol/rounds.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "base/checks.hpp"

namespace shmcast::detail::rounds {

namespace {

std::uint64_t answered(const RankSeat& rs) {
  return rs.reply_round.load(std::memory_order_acquire) & ~kReplyBusy;
}

// Rank k's answer to round a.round (never an older round than it has).
// reply_round is a seqlock: busy while the fields change, then the round
// (release), so a reader never pairs one round with another's fields.
void answer_one(RankSeat& rs, const Answer& a, std::string_view why) {
  if (answered(rs) >= a.round) return;
  rs.reply_round.store(a.round | kReplyBusy, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  write_error_text(rs.error_text, why);
  rs.reply_status.store(static_cast<std::uint32_t>(a.status), std::memory_order_relaxed);
  rs.reply_version.store(a.version, std::memory_order_relaxed);
  rs.reply_first_seq.store(a.first_seq, std::memory_order_relaxed);
  rs.reply_rank_chunks.store(a.rank_chunks, std::memory_order_relaxed);
  rs.reply_base.store(a.base_version, std::memory_order_relaxed);
  rs.reply_round.store(a.round, std::memory_order_release);
}

}  // namespace

std::string next_round(std::uint64_t last, std::uint64_t want, std::uint64_t* out) {
  if (want == 0) {
    if (last >= kMaxRound) return "this producer has used every round id (2^61 - 1)";
    *out = last + 1;
    return "";
  }
  if (want <= last)
    return "version " + std::to_string(want) + " is not greater than this rank's last sync round, " +
           std::to_string(last) + ": every rank names each sync's version alike, strictly increasing";
  if (want > kMaxRound) return "version " + std::to_string(want) + " is larger than 2^61 - 1";
  *out = want;
  return "";
}

// ---------------------------------------------------------------- ranks 1..

void post(RankSeat& rs, std::uint64_t n, std::uint64_t bytes, std::uint64_t hash) {
  rs.posted_bytes.store(bytes, std::memory_order_relaxed);
  rs.posted_hash.store(hash, std::memory_order_relaxed);
  rs.post.store(post_word(n, PostState::kList), std::memory_order_release);
}

void drop(RankSeat& rs, std::uint64_t n, Errc code, std::uint64_t text_bytes) {
  rs.left_round.store(n, std::memory_order_relaxed);
  rs.left_code.store(static_cast<std::uint32_t>(code), std::memory_order_relaxed);
  rs.error_code.store(static_cast<std::uint32_t>(code), std::memory_order_relaxed);
  rs.posted_bytes.store(text_bytes, std::memory_order_relaxed);
  rs.posted_hash.store(0, std::memory_order_relaxed);
  rs.post.store(post_word(n, PostState::kDropped), std::memory_order_release);
}

Heard hear(const RankSeat& rs, std::uint64_t n, Answer* out) {
  for (int tries = 0; tries < 8; ++tries) {
    const std::uint64_t r1 = rs.reply_round.load(std::memory_order_acquire);
    const std::uint64_t r = r1 & ~kReplyBusy;
    if (r > n) return Heard::kOver;  // rank 0 answers rounds in order: n is over
    if (r < n || (r1 & kReplyBusy) != 0) return Heard::kNothing;  // none yet, or being written
    Answer a;
    a.round = n;
    a.status = static_cast<Errc>(rs.reply_status.load(std::memory_order_relaxed));
    a.version = rs.reply_version.load(std::memory_order_relaxed);
    a.first_seq = rs.reply_first_seq.load(std::memory_order_relaxed);
    a.rank_chunks = rs.reply_rank_chunks.load(std::memory_order_relaxed);
    a.base_version = rs.reply_base.load(std::memory_order_relaxed);
    if (a.status != Errc{}) a.why = read_error_text(rs.error_text);
    std::atomic_thread_fence(std::memory_order_acquire);
    if (rs.reply_round.load(std::memory_order_relaxed) != r1) continue;  // rewritten meanwhile
    *out = std::move(a);
    return out->status == Errc{} ? Heard::kGo : Heard::kFailed;
  }
  return Heard::kNothing;
}

GiveUp give_up(const Words& w, std::uint32_t k, std::uint64_t n, bool force) {
  RankSeat& rs = w.seat(k);
  // Rank 0 stores `opened` before it takes any post of the round (both
  // seq_cst): a rank that still sees an older round open has not been taken.
  if (!force && w.opened->load(std::memory_order_seq_cst) >= n) return GiveUp::kBegun;
  rs.left_round.store(n, std::memory_order_relaxed);
  rs.left_code.store(static_cast<std::uint32_t>(Errc::kTimeout), std::memory_order_relaxed);
  std::uint64_t cur = rs.post.load(std::memory_order_relaxed);
  for (;;) {
    const PostState s = post_state(cur);
    if (post_round(cur) != n || s == PostState::kWithdrawn) return GiveUp::kWithdrawn;
    if (s == PostState::kTaken && !force) return GiveUp::kBegun;
    if (rs.post.compare_exchange_weak(cur, post_word(n, PostState::kWithdrawn), std::memory_order_acq_rel,
                                      std::memory_order_relaxed)) {
      // The rank's later writes to its list area come after the CAS: rank 0,
      // if it copied the list before, sees the post changed (still_taken).
      std::atomic_thread_fence(std::memory_order_release);
      return GiveUp::kWithdrawn;
    }
  }
}

bool completed(const Words& w, std::uint64_t n) { return w.done->load(std::memory_order_acquire) == n << 1; }
bool abandoned(const Words& w, std::uint64_t n) { return w.done->load(std::memory_order_acquire) == (n << 1 | 1); }

namespace {
// Decides round n's fate (`fate`: n << 1, or n << 1 | 1) unless it is
// decided already, and says who decided it.
Decision decide(const Words& w, std::uint64_t n, std::uint64_t fate) {
  std::uint64_t cur = w.done->load(std::memory_order_acquire);
  while ((cur >> 1) < n)
    if (w.done->compare_exchange_weak(cur, fate, std::memory_order_acq_rel, std::memory_order_acquire))
      return Decision::kWon;
  if (cur == fate) return Decision::kSame;
  if (cur == (fate ^ 1)) return Decision::kOpposite;
  return Decision::kCorrupt;
}
}  // namespace

Decision abandon_round(const Words& w, std::uint64_t n) { return decide(w, n, n << 1 | 1); }
Decision complete_round(const Words& w, std::uint64_t n) { return decide(w, n, n << 1); }
bool abandon(const Words& w, std::uint64_t n) {
  const Decision d = abandon_round(w, n);
  return d == Decision::kWon || d == Decision::kSame;
}
bool fate_corrupt(const Words& w, std::uint64_t n) {
  const std::uint64_t cur = w.done->load(std::memory_order_acquire);
  return (cur >> 1) >= n && cur != n << 1 && cur != (n << 1 | 1);
}

// ---------------------------------------------------------------- rank 0

void open(const Words& w, std::uint64_t n) { w.opened->store(n, std::memory_order_seq_cst); }

Look look(RankSeat& rs, std::uint64_t n) {
  std::uint64_t cur = rs.post.load(std::memory_order_acquire);
  for (;;) {
    const std::uint64_t m = post_round(cur);
    const PostState s = post_state(cur);
    // A state no rank writes, for this round or a later one: corrupt (one
    // for an older round is overwritten when the rank posts round n).
    if (s > PostState::kWithdrawn && m >= n) return {Seen::kCorrupt, m, Errc::kCorrupt};
    if (m == n) {
      switch (s) {
        case PostState::kList:
          if (rs.post.compare_exchange_weak(cur, post_word(n, PostState::kTaken), std::memory_order_acq_rel,
                                            std::memory_order_acquire))
            return {Seen::kTaken, n};
          continue;
        case PostState::kTaken:
          return {Seen::kTaken, n};
        case PostState::kWithdrawn:
          return {Seen::kGaveUp, n, Errc::kTimeout};
        case PostState::kDropped:
          return {Seen::kDropped, n, static_cast<Errc>(rs.left_code.load(std::memory_order_relaxed))};
        case PostState::kNone:
          return {Seen::kMissing, n};
        default:
          return {Seen::kCorrupt, n, Errc::kCorrupt};
      }
    }
    if (m > n) {
      // The rank has gone on past round n: it gave up on round n or failed
      // it (left_round, written before its later post), or never took part.
      const std::uint64_t left = rs.left_round.load(std::memory_order_relaxed);
      if (left >= n) return {Seen::kAhead, m, static_cast<Errc>(rs.left_code.load(std::memory_order_relaxed))};
      return {Seen::kAhead, m, Errc::kInvalidArgument, true};
    }
    // An older round's list that rank 0 never answered to this rank (it
    // skipped that round): the rank would wait for it in vain.
    if (s == PostState::kList && answered(rs) < m) return {Seen::kStale, m};
    return {Seen::kMissing, m};
  }
}

bool still_taken(const RankSeat& rs, std::uint64_t n) {
  std::atomic_thread_fence(std::memory_order_acquire);  // after copying the list: seqlock reader
  return rs.post.load(std::memory_order_relaxed) == post_word(n, PostState::kTaken);
}

void refuse(RankSeat& rs, std::uint64_t m, Errc code, std::string_view why) {
  Answer a;
  a.round = m;
  a.status = code;
  answer_one(rs, a, why);
}

void go(const Words& w, const Answer& a) {
  for (std::uint32_t k = 1; k < w.world; ++k) answer_one(w.seat(k), a, "");
  w.ended->store(a.round, std::memory_order_release);
}

void fail(const Words& w, std::uint64_t n, Errc code, std::string_view why) {
  Answer a;
  a.round = n;
  a.status = code;
  for (std::uint32_t k = 1; k < w.world; ++k) answer_one(w.seat(k), a, why);
  w.ended->store(n, std::memory_order_release);
}

bool complete(const Words& w, std::uint64_t n) { return complete_round(w, n) == Decision::kWon; }

std::uint64_t rejoin(const Words& w, std::uint32_t k, std::byte* list_area, std::uint64_t list_bytes,
                     std::string_view why) {
  RankSeat& rs = w.seat(k);
  // The seat's previous process is gone (the caller holds its lock byte):
  // only rank 0 still changes the post (kList -> kTaken), so each CAS below
  // fails only when rank 0 took the list meanwhile, and is tried again.
  std::uint64_t cur = rs.post.load(std::memory_order_acquire);
  for (;;) {
    const std::uint64_t ended = w.ended->load(std::memory_order_acquire);
    const std::uint64_t p = post_round(cur);
    const PostState s = post_state(cur);
    if (p <= ended) {
      // No post for a round rank 0 has not ended: this process joins the
      // next round rank 0 opens (or the one open now).
      rs.left_round.store(0, std::memory_order_relaxed);
      rs.left_code.store(0, std::memory_order_relaxed);
      if (rs.post.compare_exchange_weak(cur, post_word(ended, PostState::kNone), std::memory_order_acq_rel,
                                        std::memory_order_acquire))
        return ended;
      continue;
    }
    // The previous process posted for round p, not ended (in flight, or
    // ahead of rank 0): rank 0 may have taken that list, or answer it. It
    // is not this process's: the seat drops round p, and this process
    // begins after it.
    if (s == PostState::kDropped || s == PostState::kWithdrawn) return p;  // rank 0 fails p already
    rs.left_round.store(p, std::memory_order_relaxed);
    rs.left_code.store(static_cast<std::uint32_t>(Errc::kPeerDied), std::memory_order_relaxed);
    // First withdrawn (rank 0 can no longer take or use the list), then the
    // reason in the list area, then dropped.
    if (!rs.post.compare_exchange_weak(cur, post_word(p, PostState::kWithdrawn), std::memory_order_acq_rel,
                                       std::memory_order_acquire))
      continue;
    std::atomic_thread_fence(std::memory_order_release);
    const std::uint64_t len = std::min<std::uint64_t>(why.size(), list_bytes);
    std::memcpy(list_area, why.data(), len);
    drop(rs, p, Errc::kPeerDied, len);
    return p;
  }
}

}  // namespace shmcast::detail::rounds

namespace shmcast::detail {
std::function<void(const TestPointArgs&)> test_point;
}  // namespace shmcast::detail
