// relay/: a file's owner in a message, "uid 65534 (nobody)" (the key file,
// the status file). The core library's own helper is private to it.
#pragma once

#include <pwd.h>
#include <sys/types.h>

#include <string>

namespace shmcast::relay {

inline std::string owner_text(uid_t uid) {
  std::string s = "uid " + std::to_string(uid);
  struct passwd pw {};
  struct passwd* res = nullptr;
  char buf[1024];
  if (::getpwuid_r(uid, &pw, buf, sizeof buf, &res) == 0 && res && res->pw_name) s += std::string(" (") + res->pw_name + ")";
  return s;
}

}  // namespace shmcast::relay
