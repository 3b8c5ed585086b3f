// Text for messages: byte counts as people read them.
#pragma once

#include <cstdint>
#include <string>

namespace shmcast::detail {

// "1.0 GiB", "64 MiB", "512 B"
std::string human_bytes(std::uint64_t bytes);

}  // namespace shmcast::detail
