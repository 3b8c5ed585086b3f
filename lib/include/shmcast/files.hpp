// Files shmcast creates next to its regions: a relay's status file,
// shmcast-inspect's dumps, and the regions themselves. Every one is made the
// way regions are, so that nothing is ever written through a name another
// user could have planted in a shared directory (a volume without the
// sticky bit): a new file, opened O_CREAT|O_EXCL|O_NOFOLLOW|O_CLOEXEC in
// the target directory (a link or anything else at the name is refused,
// never followed), its mode set with fchmod on that descriptor, and, to
// replace a file, written under a fresh name and renamed over the old one
// (rename replaces a link at the name; it never writes through it).
// docs/reliability.md lists every file the project creates.
#pragma once

#include <string>
#include <string_view>

#include "shmcast/shmcast.hpp"

namespace shmcast {

// Creates `path`, which must not exist, for reading and writing, with
// exactly `mode` (fchmod, whatever the umask). Returns the descriptor
// (O_CLOEXEC; the caller closes it). Throws Error: kExists when something
// (a file, a link, a FIFO) is at the name, kPermission when the directory
// refuses, kNotFound when it is missing.
SHMCAST_API int create_file(const std::string& path, unsigned mode);

// Creates a new file in `dir` named `prefix` followed by 12 random
// characters, as create_file() does (retrying another name when one is
// taken). Returns the descriptor; *path receives the file's path.
SHMCAST_API int create_temp_file(const std::string& dir, std::string_view prefix, unsigned mode,
                                 std::string* path);

// Replaces `path` with a file holding `contents`, mode `mode`: a temporary
// file in the same directory (create_temp_file, prefix "." + the name +
// ".tmp."), written in full, then renamed over `path`. Readers see the old
// file or the new one, never a part. A link or another user's file at
// `path` is replaced as a name, never written through or chmodded. Throws
// Error; leaves no temporary file behind when it throws. Not fsync'ed: for
// state files rewritten often (a status file), not for durable data.
SHMCAST_API void replace_file(const std::string& path, std::string_view contents, unsigned mode);

}  // namespace shmcast
