// The relay's checksum thread for chunks received straight into this node's
// slots: Relay::Impl's network thread submits, a thread of its own hashes,
// the network thread takes the results (receive.cpp).
#pragma once

#include <xxhash.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace shmcast::relay {

// Checks chunks received straight into slots (XXH3 against the sum the
// upstream sent) on a thread of its own, so that neither the network thread
// nor the region writer, which may wait for this node's consumers, holds
// the next chunk up. Results are collected with take().
class Verifier {
 public:
  struct Job {
    std::uint64_t serial = 0;
    std::size_t pos = 0;
    const std::byte* p = nullptr;
    std::uint64_t n = 0, sum = 0;
    int buf = -1;  // the relay's reference to the slot, held until take()
    bool ok = false;
  };
  explicit Verifier(std::function<void()> done) : done_(std::move(done)), t_([this] { run(); }) {}
  Verifier(const Verifier&) = delete;
  Verifier& operator=(const Verifier&) = delete;
  // Returns once no job is running: the slots may go.
  ~Verifier() {
    {
      std::lock_guard<std::mutex> g(mu_);
      exit_ = true;
    }
    cv_.notify_all();
    t_.join();
  }
  void submit(const Job& j) {
    {
      std::lock_guard<std::mutex> g(mu_);
      q_.push_back(j);
    }
    cv_.notify_all();
  }
  std::vector<Job> take() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<Job> out;
    out.swap(out_);
    return out;
  }

 private:
  void run() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [this] { return !q_.empty() || exit_; });
      if (exit_) return;
      Job j = q_.front();
      q_.pop_front();
      g.unlock();
      j.ok = XXH3_64bits(j.p, j.n) == j.sum;
      g.lock();
      out_.push_back(j);
      done_();
    }
  }
  std::function<void()> done_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> q_;
  std::vector<Job> out_;
  bool exit_ = false;
  std::thread t_;
};

}  // namespace shmcast::relay
