// Options of the host-memory delta syncs in test_delta_sync.cpp and
// test_shared_consumer.cpp (the GPU tier's delta tests keep their own).
#pragma once

#include <chrono>

#include "shmcast/shmcast.hpp"
#include "support.hpp"

namespace delta_host {

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;

inline ProducerOptions delta_opts() {
  ProducerOptions o;
  o.slot_bytes = 2ull << 20;
  o.slots = 2;
  o.pin = Pin::kNo;
  o.engine = CopyEngine::kHost;
  o.delta = true;
  o.consumer_timeout = 30s * kSlowdown;
  return o;
}

inline ConsumerOptions copts() {
  ConsumerOptions o;
  o.pin = Pin::kNo;
  o.open_timeout = 20s;
  o.chunk_timeout = 30s * kSlowdown;
  return o;
}

}  // namespace delta_host
