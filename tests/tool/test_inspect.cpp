// shmcast-inspect against real regions: the real binary is run as a child
// process and its --json output parsed. Each test uses a private region
// directory (mkdtemp under /dev/shm) so tests never see each other.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "base/layout.hpp"
#include "protocol/ring.hpp"
#include "region_edit.hpp"
#include "shmcast/probe.hpp"
#include "support.hpp"

using namespace shmcast;
using namespace shmcast_test;
using namespace std::chrono_literals;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr std::uint64_t kSlot = 2ull << 20;

ProducerOptions small_opts(bool unlink_on_close = true) {
  ProducerOptions o;
  o.slot_bytes = kSlot;
  o.slots = 2;
  o.max_consumers = 4;
  o.pin = Pin::kNo;
  o.consumer_timeout = 20s;
  o.unlink_on_close = unlink_on_close;
  return o;
}

// A private region directory, exported as SHMCAST_DIR for the library.
struct TempDir : shmcast_test::RegionDir {
  TempDir() : RegionDir("tooltest") {}
};

// ---- running the tool

struct Proc {
  pid_t pid = -1;
  int out = -1, err = -1;
};

struct Result {
  int rc = -1;  // exit code, 128 + signal, -1 on timeout
  std::string out, err;
  json j() const {
    try {
      return json::parse(out);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not one JSON document: " << e.what() << "\nstdout: " << out << "\nstderr: " << err;
      return json();
    }
  }
};

Proc spawn_tool(const std::vector<std::string>& args) {
  int o[2], e[2];
  if (::pipe2(o, O_CLOEXEC) != 0 || ::pipe2(e, O_CLOEXEC) != 0) throw std::runtime_error("pipe");
  Proc p;
  p.pid = ::fork();
  if (p.pid == 0) {
    ::dup2(o[1], 1);
    ::dup2(e[1], 2);
    std::vector<char*> argv;
    static std::string bin = SHMCAST_INSPECT_BIN;
    argv.push_back(bin.data());
    std::vector<std::string> copy = args;
    for (auto& a : copy) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(bin.c_str(), argv.data());
    ::_exit(127);
  }
  ::close(o[1]);
  ::close(e[1]);
  p.out = o[0];
  p.err = e[0];
  return p;
}

Result finish(Proc p, std::chrono::milliseconds timeout = 30s, struct rusage* usage = nullptr) {
  Result r;
  const auto end = std::chrono::steady_clock::now() + timeout;
  bool out_open = true, err_open = true;
  char buf[65536];
  while ((out_open || err_open) && std::chrono::steady_clock::now() < end) {
    struct pollfd fds[2] = {{out_open ? p.out : -1, POLLIN, 0}, {err_open ? p.err : -1, POLLIN, 0}};
    ::poll(fds, 2, 50);
    for (int i = 0; i < 2; ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n <= 0) {
        (i == 0 ? out_open : err_open) = false;
      } else {
        (i == 0 ? r.out : r.err).append(buf, static_cast<std::size_t>(n));
      }
    }
  }
  int status = 0;
  bool done = false;
  struct rusage ru {};
  while (std::chrono::steady_clock::now() < end) {
    if (::wait4(p.pid, &status, WNOHANG, &ru) == p.pid) {
      done = true;
      if (usage != nullptr) *usage = ru;
      break;
    }
    std::this_thread::sleep_for(5ms);
  }
  if (!done) {
    ::kill(p.pid, SIGKILL);
    ::waitpid(p.pid, &status, 0);
    r.rc = -1;
  } else if (WIFEXITED(status)) {
    r.rc = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.rc = 128 + WTERMSIG(status);
  }
  ::close(p.out);
  ::close(p.err);
  return r;
}

Result tool(const std::vector<std::string>& args, std::chrono::milliseconds timeout = 30s) {
  return finish(spawn_tool(args), timeout);
}

const json* find_region(const json& list, const std::string& name) {
  for (const json& r : list.at("regions"))
    if (r.at("name") == name) return &r;
  return nullptr;
}

std::set<std::string> names_of(const json& arr) {
  std::set<std::string> s;
  for (const json& e : arr) s.insert(e.at("name").get<std::string>());
  return s;
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::lstat(p.c_str(), &st) == 0;
}

// ---- a pipe the children use to say "ready" / "done"

struct Signal {
  int fd[2] = {-1, -1};
  Signal() {
    if (::pipe(fd) != 0) throw std::runtime_error("pipe");
  }
  ~Signal() {
    ::close(fd[0]);
    ::close(fd[1]);
  }
  void post() const {
    const char c = 1;
    (void)!::write(fd[1], &c, 1);
  }
  // Waits for n posts.
  bool wait(int n, std::chrono::milliseconds timeout = 20s) const {
    const auto end = std::chrono::steady_clock::now() + timeout;
    while (n > 0) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      struct pollfd p = {fd[0], POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char c;
      if (::read(fd[0], &c, 1) == 1) --n;
    }
    return true;
  }
};

[[noreturn]] void park() {
  for (;;) ::pause();
}

// Tensors and their bytes for one sync.
struct SyncData {
  std::vector<TensorSpec> specs;
  std::vector<std::vector<std::uint8_t>> bytes;
  std::vector<const void*> ptrs() const {
    std::vector<const void*> v;
    for (const auto& b : bytes) v.push_back(b.data());
    return v;
  }
  std::uint64_t payload() const {
    std::uint64_t n = 0;
    for (const auto& b : bytes) n += b.size();
    return n;
  }
};

SyncData make_sync(std::vector<TensorSpec> specs, std::uint64_t version) {
  SyncData d;
  d.specs = std::move(specs);
  for (std::size_t i = 0; i < d.specs.size(); ++i) {
    d.bytes.emplace_back(d.specs[i].nbytes());
    fill_pattern(d.bytes.back().data(), d.bytes.back().size(), seed_of(version, i));
  }
  return d;
}

std::vector<TensorSpec> small_specs() {
  return {{"w.0", DType::kBF16, {4, 8}}, {"w.1", DType::kF32, {3}}, {"b", DType::kI64, {2, 2, 2}}};
}

// Writes `bytes` at `offset` of a region file (to damage it on purpose).
void patch(const std::string& path, std::uint64_t offset, const void* bytes, std::size_t n) {
  const int fd = ::open(path.c_str(), O_WRONLY);
  ASSERT_GE(fd, 0) << path;
  ASSERT_EQ(::pwrite(fd, bytes, n, static_cast<off_t>(offset)), static_cast<ssize_t>(n));
  ::close(fd);
}

void write_file(const std::string& path, const std::string& content) {
  std::ofstream f(path, std::ios::binary);
  f << content;
}

// A region whose producer closed it without unlinking: state "closed".
void make_closed(const std::string& name) {
  Producer p = Producer::create(name, small_opts(false));
  auto d = make_sync(small_specs(), 1);
  p.send(d.specs, d.ptrs());
  p.close();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream os;
  os << f.rdbuf();
  return os.str();
}

// A region file is about 1 GB, most of it the manifest area's hole, which
// reads as zeros: reading it whole (slurp) took about 20 CPU-seconds each
// time, more under ASan and beside other work. These read only its data
// extents (SEEK_DATA / SEEK_HOLE; a hole is zeros by definition).
std::vector<std::pair<off_t, off_t>> data_extents(int fd, off_t size) {
  std::vector<std::pair<off_t, off_t>> v;
  for (off_t at = 0; at < size;) {
    const off_t from = ::lseek(fd, at, SEEK_DATA);
    if (from < 0) break;  // ENXIO: only a hole after `at`
    off_t to = ::lseek(fd, from, SEEK_HOLE);
    if (to < 0 || to > size) to = size;
    v.emplace_back(from, to);
    at = to;
  }
  return v;
}

// The file's contents as one number: its size and each non-zero 4 KiB
// page's place and bytes. A page of zeros counts as a hole whether tmpfs
// calls it data or not (a page reserved by fallocate becomes data when a
// reader first maps it in, with no byte changed); writing zeros where there
// were none shows in st_blocks instead.
std::uint64_t digest(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  if (fd < 0) return 0;
  struct stat st {};
  EXPECT_EQ(::fstat(fd, &st), 0);
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  XXH3_64bits_update(h, &st.st_size, sizeof st.st_size);
  constexpr off_t kPage = 4096;
  std::vector<char> buf(1 << 20);
  const std::vector<char> zeros(kPage, 0);
  for (const auto& [from, to] : data_extents(fd, st.st_size)) {
    for (off_t at = from; at < to;) {
      const ssize_t n = ::pread(fd, buf.data(), std::min<off_t>(to - at, static_cast<off_t>(buf.size())), at);
      EXPECT_GT(n, 0) << path;
      if (n <= 0) break;
      for (off_t p = 0; p < n; p += kPage) {
        const std::size_t len = static_cast<std::size_t>(std::min<off_t>(kPage, n - p));
        if (std::memcmp(buf.data() + p, zeros.data(), len) == 0) continue;
        const off_t where = at + p;
        XXH3_64bits_update(h, &where, sizeof where);
        XXH3_64bits_update(h, buf.data() + p, len);
      }
      at += n;
    }
  }
  const std::uint64_t d = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  ::close(fd);
  return d;
}

// A copy of `from` with the same bytes (its holes kept holes), then `extra`
// zero bytes.
void copy_sparse(const std::string& from, const std::string& to, off_t extra = 0) {
  const int in = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  const int out = ::open(to.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  ASSERT_GE(in, 0) << from;
  ASSERT_GE(out, 0) << to;
  struct stat st {};
  ASSERT_EQ(::fstat(in, &st), 0);
  ASSERT_EQ(::ftruncate(out, st.st_size + extra), 0);
  std::vector<char> buf(1 << 20);
  for (const auto& [a, b] : data_extents(in, st.st_size))
    for (off_t at = a; at < b;) {
      const ssize_t n = ::pread(in, buf.data(), std::min<off_t>(b - at, static_cast<off_t>(buf.size())), at);
      ASSERT_GT(n, 0) << from;
      ASSERT_EQ(::pwrite(out, buf.data(), static_cast<std::size_t>(n), at), n) << to;
      at += n;
    }
  ::close(in);
  ::close(out);
}

// The first `n` bytes of a file.
std::string head_of(const std::string& path, std::size_t n) {
  std::string s(n, '\0');
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  EXPECT_GE(fd, 0) << path;
  const ssize_t got = fd < 0 ? 0 : ::pread(fd, s.data(), n, 0);
  if (fd >= 0) ::close(fd);
  s.resize(got > 0 ? static_cast<std::size_t>(got) : 0);
  return s;
}

}  // namespace

// ================================================================ help

TEST(Tool, HelpListsEveryVerbAndExitCodes) {
  Result r = tool({"--help"});
  EXPECT_EQ(r.rc, 0);
  for (const char* verb : {"list", "show", "watch", "dump", "gc", "rm", "Exit codes", "--dir", "--json"})
    EXPECT_NE(r.out.find(verb), std::string::npos) << verb;
  for (const char* verb : {"list", "show", "watch", "dump", "gc", "rm"}) {
    Result h = tool({verb, "--help"});
    EXPECT_EQ(h.rc, 0) << verb;
    EXPECT_NE(h.out.find("--json"), std::string::npos) << verb;
  }
  EXPECT_NE(tool({"watch", "--help"}).out.find("--count"), std::string::npos);
  EXPECT_NE(tool({"dump", "--help"}).out.find("--timeout"), std::string::npos);
  EXPECT_NE(tool({"gc", "--help"}).out.find("--dry-run"), std::string::npos);
  EXPECT_NE(tool({"rm", "--help"}).out.find("--force"), std::string::npos);
  EXPECT_EQ(tool({}).rc, 2);
  EXPECT_EQ(tool({"list", "--bogus"}).rc, 2);
  EXPECT_EQ(tool({"frobnicate"}).rc, 2);
  Result bad = tool({"show", "bad/name", "--json"});
  EXPECT_EQ(bad.rc, 2);
  EXPECT_EQ(bad.j().at("ok"), false);
}

// ================================================================ live

TEST(Tool, LiveRegionShowsProducerConsumersAndManifest) {
  TempDir dir;
  const std::string name = "live";
  Producer p = Producer::create(name, small_opts());
  Signal ready, done;
  auto consumer = [&] {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    Consumer c = Consumer::open(name, co);
    ready.post();
    const SyncInfo& info = c.wait_sync(20s);
    std::vector<std::vector<std::uint8_t>> buf(info.tensors.size());
    std::vector<void*> dst;
    for (std::size_t i = 0; i < info.tensors.size(); ++i) {
      buf[i].resize(info.tensors[i].nbytes);
      dst.push_back(buf[i].data());
    }
    c.read_into(dst);
    done.post();
    park();
    return 0;
  };
  Child c1 = Child::spawn(consumer);
  Child c2 = Child::spawn(consumer);
  ASSERT_TRUE(ready.wait(2));
  p.wait_for_consumers(2, 20s);
  SyncData d = make_sync(small_specs(), 1);
  ASSERT_EQ(p.send(d.specs, d.ptrs()), 1u);
  ASSERT_TRUE(done.wait(2));

  Result l = tool({"list", "--json", "--dir", dir.path});
  ASSERT_EQ(l.rc, 0) << l.err;
  json lj = l.j();
  EXPECT_EQ(lj.at("command"), "list");
  EXPECT_EQ(lj.at("dir"), dir.path);
  ASSERT_EQ(lj.at("regions").size(), 1u);
  const json* r = find_region(lj, name);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->at("state"), "ready");
  EXPECT_EQ(r->at("layout_version"), shmcast::probe::layout_version());
  EXPECT_EQ(r->at("size_bytes"), p.region_bytes());
  EXPECT_EQ(r->at("producer").at("pid"), ::getpid());
  EXPECT_EQ(r->at("producer").at("alive"), true);
  EXPECT_EQ(r->at("consumers").at("attached"), 2);
  EXPECT_EQ(r->at("consumers").at("alive"), 2);
  EXPECT_EQ(r->at("consumers").at("max"), 4);
  EXPECT_EQ(r->at("sync_version"), 1);
  EXPECT_EQ(r->at("syncs_done"), 1);
  EXPECT_EQ(r->at("bytes_done"), d.payload());
  EXPECT_EQ(r->at("participants_alive"), true);

  Result s = tool({"show", name, "--json", "--dir", dir.path});
  ASSERT_EQ(s.rc, 0) << s.err;
  json sj = s.j();
  EXPECT_EQ(sj.at("header").at("slot_count"), 2);
  EXPECT_EQ(sj.at("header").at("slot_bytes"), kSlot);
  EXPECT_EQ(sj.at("header").at("max_consumers"), 4);
  EXPECT_EQ(sj.at("header").at("init_state"), "ready");
  EXPECT_EQ(sj.at("header").at("valid"), true);
  EXPECT_EQ(sj.at("producer").at("pid"), ::getpid());
  EXPECT_EQ(sj.at("producer").at("error_code"), 0);
  EXPECT_EQ(sj.at("sync").at("version"), 1);
  EXPECT_EQ(sj.at("sync").at("status"), "published");
  EXPECT_EQ(sj.at("sync").at("chunks"), 1);
  EXPECT_EQ(sj.at("sync").at("chunks_published"), 1);
  std::set<int> pids;
  int active = 0;
  ASSERT_EQ(sj.at("seats").size(), 4u);
  for (const json& seat : sj.at("seats")) {
    if (seat.at("state") != "active") {
      EXPECT_EQ(seat.at("state"), "free");
      EXPECT_EQ(seat.at("alive"), false);
      continue;
    }
    ++active;
    pids.insert(seat.at("pid").get<int>());
    EXPECT_EQ(seat.at("alive"), true);
    EXPECT_EQ(seat.at("enrolled"), true);
    EXPECT_EQ(seat.at("acked_version"), 1);
    EXPECT_EQ(seat.at("released_seq"), 1);
    EXPECT_EQ(seat.at("lag_chunks"), 0);
    EXPECT_EQ(seat.at("syncs_done"), 1);
    EXPECT_EQ(seat.at("bytes_done"), d.payload());
    EXPECT_EQ(seat.at("error_code"), 0);
  }
  EXPECT_EQ(active, 2);
  EXPECT_EQ(pids, (std::set<int>{c1.pid, c2.pid}));
  ASSERT_EQ(sj.at("slots").size(), 2u);
  EXPECT_EQ(sj.at("slots")[0].at("seq"), 1);
  EXPECT_EQ(sj.at("slots")[0].at("version"), 1);
  EXPECT_EQ(sj.at("slots")[0].at("state"), "released");
  EXPECT_EQ(sj.at("slots")[1].at("state"), "empty");
  const json& m = sj.at("manifest");
  ASSERT_EQ(m.at("status"), "ok") << m.dump();
  EXPECT_EQ(m.at("version"), 1);
  EXPECT_EQ(m.at("tensor_count"), 3);
  EXPECT_EQ(m.at("payload_bytes"), d.payload());
  ASSERT_EQ(m.at("tensors").size(), 3u);
  EXPECT_EQ(m.at("tensors")[0].at("name"), "w.0");
  EXPECT_EQ(m.at("tensors")[0].at("dtype"), "bf16");
  EXPECT_EQ(m.at("tensors")[0].at("shape"), json::array({4, 8}));
  EXPECT_EQ(m.at("tensors")[1].at("dtype"), "f32");
  EXPECT_EQ(m.at("tensors")[2].at("name"), "b");
  EXPECT_EQ(m.at("tensors")[2].at("shape"), json::array({2, 2, 2}));
  EXPECT_EQ(sj.at("errors").size(), 0u);

  // --limit bounds the tensor rows.
  json lim = tool({"show", name, "--json", "--limit", "2", "--dir", dir.path}).j();
  EXPECT_EQ(lim.at("manifest").at("tensors").size(), 2u);
  EXPECT_EQ(lim.at("manifest").at("truncated"), true);

  // Human output: aligned tables with the same facts.
  Result h = tool({"show", name, "--dir", dir.path});
  EXPECT_EQ(h.rc, 0);
  EXPECT_NE(h.out.find("SEATS"), std::string::npos);
  EXPECT_NE(h.out.find(std::to_string(c1.pid)), std::string::npos);
  EXPECT_NE(h.out.find("w.0"), std::string::npos);
  Result hl = tool({"list", "--dir", dir.path});
  EXPECT_EQ(hl.rc, 0);
  EXPECT_NE(hl.out.find("live"), std::string::npos);
  EXPECT_NE(hl.out.find("ready"), std::string::npos);

  // A consumer dies: its seat stays active but is no longer alive.
  c1.kill9();
  c1.wait();
  json after = tool({"list", "--json", "--dir", dir.path}).j();
  r = find_region(after, name);
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->at("consumers").at("attached"), 2);
  EXPECT_EQ(r->at("consumers").at("alive"), 1);
}

// ================================================================ dead owners, gc

// A store region: show says so, which version each bank holds and who
// holds it, and decodes the newest version's manifest from its bank.
TEST(Tool, StoreRegionShowsItsModeBanksAndHolders) {
  TempDir dir;
  const std::string name = "store";
  ProducerOptions o = small_opts();
  o.mode = RegionMode::kStore;
  SyncData d1 = make_sync(small_specs(), 1), d2 = make_sync(small_specs(), 2);
  o.store_bytes = store_bytes_needed(d1.specs);
  Producer p = Producer::create(name, o);
  ASSERT_EQ(p.send(d1.specs, d1.ptrs()), 1u);
  ASSERT_EQ(p.send(d2.specs, d2.ptrs()), 2u);
  ConsumerOptions co;
  co.pin = Pin::kNo;
  Consumer c = Consumer::open(name, co);
  ASSERT_EQ(c.wait_sync(0s).version, 2u);
  (void)c.views();  // holds version 2

  Result s = tool({"show", name, "--json", "--dir", dir.path});
  ASSERT_EQ(s.rc, 0) << s.err;
  json sj = s.j();
  EXPECT_EQ(sj.at("mode"), "store");
  EXPECT_NE(sj.at("header").at("feature_names").dump().find("store"), std::string::npos) << sj.at("header");
  ASSERT_EQ(sj.at("slots").size(), 2u);
  std::map<std::uint64_t, std::uint64_t> holders;  // version -> readers holding it
  for (const json& b : sj.at("slots")) holders[b.at("version").get<std::uint64_t>()] = b.at("holders");
  EXPECT_EQ(holders[1], 0u);
  EXPECT_EQ(holders[2], 1u);
  EXPECT_EQ(sj.at("manifest").at("status"), "ok") << sj.at("manifest");
  EXPECT_EQ(sj.at("manifest").at("version"), 2);
  bool seat_holds = false;
  for (const json& e : sj.at("seats")) seat_holds |= e.at("hold_seq").get<std::uint64_t>() != 0;
  EXPECT_TRUE(seat_holds);

  Result t = tool({"show", name, "--dir", dir.path});
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("store (keeps the newest complete version"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("version 2 (1 readers)"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find("newest 2"), std::string::npos) << t.out;
}

// A region of device slots (layout 4), crafted without a GPU and held by
// this process as its producer: list and show say where its slots live (the
// GPU's UUID, the allocation) and where its slot socket is; a host region
// says host; a bad device-slots block is corrupt.
TEST(Tool, DeviceSlotRegionsShowTheirGpuAndAllocation) {
  TempDir dir;
  CraftedDeviceRegion dev(dir.file("dev"), detail::kFeatureDeviceSlots, device_block(6ull << 20));
  detail::DeviceSlotsFixed no_nonce = device_block(4ull << 20);
  no_nonce.nonce = 0;
  CraftedDeviceRegion bad(dir.file("badnonce"), detail::kFeatureDeviceSlots, no_nonce);
  CraftedDeviceRegion small(dir.file("badalloc"), detail::kFeatureDeviceSlots, device_block(2ull << 20));
  Producer host = Producer::create("host", small_opts());

  Result l = tool({"list", "--json", "--dir", dir.path});
  ASSERT_EQ(l.rc, 0) << l.err;
  json lj = l.j();
  const json* d = find_region(lj, "dev");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->at("state"), "ready") << *d;
  EXPECT_EQ(d->at("slot_memory"), "device");
  EXPECT_EQ(d->at("slot_gpu_uuid"), kDeviceBlockUuid);
  EXPECT_EQ(d->at("slot_device_bytes"), 6ull << 20);
  const json* h = find_region(lj, "host");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->at("slot_memory"), "host");
  EXPECT_TRUE(h->at("slot_gpu_uuid").is_null());
  EXPECT_TRUE(h->at("slot_device_bytes").is_null());
  EXPECT_EQ(find_region(lj, "badnonce")->at("state"), "corrupt");
  EXPECT_EQ(find_region(lj, "badalloc")->at("state"), "corrupt");
  Result hl = tool({"list", "--dir", dir.path});
  ASSERT_EQ(hl.rc, 0) << hl.err;
  EXPECT_NE(hl.out.find(std::to_string(detail::kLayoutVersion) + " (device slots)"), std::string::npos) << hl.out;

  Result s = tool({"show", "dev", "--json", "--dir", dir.path});
  ASSERT_EQ(s.rc, 0) << s.err;
  json sj = s.j();
  EXPECT_EQ(sj.at("region").at("slot_memory"), "device");
  const json& hd = sj.at("header");
  EXPECT_EQ(hd.at("valid"), true);
  EXPECT_NE(hd.at("feature_names").dump().find("device-slots"), std::string::npos) << hd;
  EXPECT_EQ(hd.at("slot_memory"), "device");
  EXPECT_EQ(hd.at("slot_gpu_uuid"), kDeviceBlockUuid);
  EXPECT_EQ(hd.at("slot_device_bytes"), 6ull << 20);
  EXPECT_EQ(hd.at("slot_socket"), dir.path + "/shmcast-slots.dev");
  EXPECT_TRUE(hd.at("slot_socket_type").is_null()) << hd;  // nothing there
  EXPECT_EQ(hd.at("total_bytes"), hd.at("data_offset"));
  EXPECT_EQ(sj.at("slots").size(), 2u);

  Result t = tool({"show", "dev", "--dir", dir.path});
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find(std::string("2 x 2.0 MiB on GPU ") + kDeviceBlockUuid + " (device slots, 6.0 MiB allocated)"),
            std::string::npos)
      << t.out;
  EXPECT_NE(t.out.find(", device slots"), std::string::npos) << t.out;
  EXPECT_NE(t.out.find(dir.path + "/shmcast-slots.dev (absent)"), std::string::npos) << t.out;
  // A link planted at the socket's name is reported, not followed.
  ASSERT_EQ(::symlink("/nonexistent", (dir.path + "/shmcast-slots.dev").c_str()), 0);
  json sl = tool({"show", "dev", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(sl.at("header").at("slot_socket_type"), "symlink");

  Result th = tool({"show", "host", "--dir", dir.path});
  ASSERT_EQ(th.rc, 0) << th.err;
  EXPECT_NE(th.out.find("2 x 2.0 MiB in the region file (host slots)"), std::string::npos) << th.out;
  EXPECT_EQ(th.out.find("slot socket"), std::string::npos) << th.out;
  json hj = tool({"show", "host", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(hj.at("header").at("slot_memory"), "host");
  EXPECT_TRUE(hj.at("header").at("slot_socket").is_null());

  for (const auto& [name, why] : {std::pair<std::string, std::string>{"badnonce", "without a channel nonce"},
                                  {"badalloc", "device slot allocation of 2097152 bytes"}}) {
    Result b = tool({"show", name, "--json", "--dir", dir.path});
    EXPECT_EQ(b.rc, 4) << name;
    json bj = b.j();
    EXPECT_EQ(bj.at("region").at("state"), "corrupt") << name;
    EXPECT_NE(bj.at("region").at("reason").get<std::string>().find(why), std::string::npos) << bj.at("region");
    EXPECT_EQ(bj.at("header").at("valid"), false) << name;
  }
}

// The state file shmcast-relay keeps next to a region is shown by `show`,
// and treated as untrusted input: stale when not rewritten, ignored when
// others may write it or it is a link, refused when a field has the wrong
// type, and never able to put control characters on the terminal.
TEST(Tool, ShowReportsTheRelayStatusAndDistrustsBadFiles) {
  TempDir dir;
  const std::string name = "relayed";
  Producer p = Producer::create(name, small_opts());
  const std::string path = dir.path + "/shmcast-relay." + name + ".json";
  const auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
        .count();
  };
  auto write = [&](const std::string& text, mode_t mode = 0600) {
    ::unlink(path.c_str());
    std::ofstream(path) << text;
    ::chmod(path.c_str(), mode);
  };
  auto status = [&](std::int64_t updated_ns, const std::string& last_error = "") {
    json j = {{"region", name}, {"role", "relay"}, {"pid", ::getpid()}, {"state", "connected"},
              {"updated_unix_ns", updated_ns}, {"listen", "0.0.0.0:7000"}, {"checksums", true}, {"syncs", 12},
              {"syncs_aborted", 1}, {"syncs_skipped", 0}, {"bytes_in", 6171877376ull}, {"bytes_out", 6171877376ull},
              {"last_sync", {{"version", 57}, {"bytes", 6171877376ull}, {"seconds", 1.9}, {"gbps", 3.2}}},
              {"last_error", last_error},
              {"region_state", {{"ready", true}, {"slot_bytes", 268435456}, {"version", 57}, {"syncs", 12},
                                {"failed", 0}, {"consumers", 2}, {"last_error", ""}}},
              {"upstream", {{"address", "node0:7000"}, {"state", "connected"}, {"connection", 3}, {"connects", 2},
                            {"since_unix_ns", updated_ns}, {"last_error", ""}}},
              {"downstream", json::array({{{"connection", 1}, {"peer", "10.0.0.7:51234"}, {"state", "ready"},
                                           {"syncs", 12}, {"bytes_sent", 6171877376ull}, {"since_unix_ns", 1}}})},
              {"downstream_ready", 1}, {"refused", 0}};
    return j.dump();
  };

  // No file: nothing in the text, "none" in JSON.
  Result r0 = tool({"show", name, "--json", "--dir", dir.path});
  ASSERT_EQ(r0.rc, 0) << r0.err;
  EXPECT_EQ(r0.j().at("relay").at("status"), "none");
  EXPECT_EQ(tool({"show", name, "--dir", dir.path}).out.find("RELAY"), std::string::npos);

  // A live relay's file.
  write(status(now_ns()));
  Result r1 = tool({"show", name, "--json", "--dir", dir.path});
  ASSERT_EQ(r1.rc, 0) << r1.err;
  const json rel = r1.j().at("relay");
  EXPECT_EQ(rel.at("status"), "ok") << rel;
  EXPECT_FALSE(rel.at("stale").get<bool>()) << rel;
  EXPECT_EQ(rel.at("relay").at("upstream").at("address"), "node0:7000");
  EXPECT_EQ(rel.at("relay").at("downstream").at(0).at("peer"), "10.0.0.7:51234");
  EXPECT_EQ(rel.at("relay").at("last_sync").at("version"), 57);
  Result t1 = tool({"show", name, "--dir", dir.path});
  ASSERT_EQ(t1.rc, 0) << t1.err;
  for (const char* want : {"role relay, state connected", "upstream    node0:7000 connected (connection 3, 2 connects)",
                           "listening on 0.0.0.0:7000; 1 ready of 1, 0 refused", "#1 10.0.0.7:51234 ready, 12 syncs",
                           "last sync   version 57", "12 (1 aborted, 0 skipped)"})
    EXPECT_NE(t1.out.find(want), std::string::npos) << want << "\n" << t1.out;
  EXPECT_EQ(t1.out.find("STALE"), std::string::npos) << t1.out;

  // Not rewritten for a minute: stale.
  write(status(now_ns() - 60'000'000'000ll));
  Result r2 = tool({"show", name, "--json", "--dir", dir.path});
  EXPECT_TRUE(r2.j().at("relay").at("stale").get<bool>()) << r2.out;
  EXPECT_NE(tool({"show", name, "--dir", dir.path}).out.find("[STALE: not updated for"), std::string::npos);

  // Control characters in a string are escaped on the terminal.
  write(status(now_ns(), "\x1b[2Jgone\x07"));
  Result t3 = tool({"show", name, "--dir", dir.path});
  EXPECT_EQ(t3.out.find('\x1b'), std::string::npos) << t3.out;
  EXPECT_EQ(t3.out.find('\x07'), std::string::npos) << t3.out;
  EXPECT_NE(t3.out.find("gone"), std::string::npos) << t3.out;

  // Writable by others, a symbolic link, a FIFO: ignored, never read.
  write(status(now_ns()), 0666);
  Result r4 = tool({"show", name, "--json", "--dir", dir.path});
  EXPECT_EQ(r4.j().at("relay").at("status"), "untrusted") << r4.out;
  EXPECT_NE(r4.j().at("relay").at("why").get<std::string>().find("writable by others"), std::string::npos);
  write(status(now_ns()));
  ::rename(path.c_str(), (path + ".real").c_str());
  ASSERT_EQ(::symlink((path + ".real").c_str(), path.c_str()), 0);
  EXPECT_EQ(tool({"show", name, "--json", "--dir", dir.path}).j().at("relay").at("status"), "untrusted");
  ::unlink(path.c_str());
  ASSERT_EQ(::mkfifo(path.c_str(), 0600), 0);
  Result r5 = tool({"show", name, "--json", "--dir", dir.path}, 10s);
  ASSERT_EQ(r5.rc, 0) << r5.err;  // never blocks on the FIFO
  EXPECT_EQ(r5.j().at("relay").at("status"), "untrusted");
  ::unlink(path.c_str());
  if (::geteuid() == 0) {  // another user's file
    write(status(now_ns()));
    ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);
    Result r6 = tool({"show", name, "--json", "--dir", dir.path});
    EXPECT_EQ(r6.j().at("relay").at("status"), "untrusted") << r6.out;
    EXPECT_NE(r6.j().at("relay").at("why").get<std::string>().find("owned by uid 65534"), std::string::npos);
  }

  // Not JSON, a field of the wrong type, an oversized list: unreadable, and
  // the region itself is still shown (exit 0).
  for (const std::string& bad :
       {std::string("{\"syncs\": 1,"), std::string("{\"syncs\": \"many\"}"), std::string("{\"last_sync\": [1]}"),
        std::string("{\"last_sync\": {\"seconds\": -1}}"), std::string("[1, 2, 3]"),
        "{\"downstream\": [" + [] {
          std::string s;
          for (int i = 0; i < 1100; ++i) s += (i ? ",{}" : "{}");
          return s;
        }() + "]}"}) {
    write(bad);
    Result rb = tool({"show", name, "--json", "--dir", dir.path});
    ASSERT_EQ(rb.rc, 0) << bad << "\n" << rb.err;
    EXPECT_EQ(rb.j().at("relay").at("status"), "unreadable") << bad << "\n" << rb.out;
    Result tb = tool({"show", name, "--dir", dir.path});
    EXPECT_NE(tb.out.find("unreadable: "), std::string::npos) << bad << "\n" << tb.out;
  }
  ::unlink(path.c_str());
}

TEST(Tool, DeadOwnerIsReportedAndGcRemovesOnlyIt) {
  TempDir dir;
  Signal ready;
  // A producer killed with SIGKILL: it cannot unlink its region.
  Child dead = Child::spawn([&] {
    Producer p = Producer::create("dead", small_opts());
    ready.post();
    park();
    return 0;
  });
  ASSERT_TRUE(ready.wait(1));
  dead.kill9();
  dead.wait();
  // A producer that dies while one of its consumers is still attached.
  Child orphan_prod = Child::spawn([&] {
    Producer p = Producer::create("orphan", small_opts());
    ready.post();
    park();
    return 0;
  });
  ASSERT_TRUE(ready.wait(1));
  Child orphan_cons = Child::spawn([&] {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    Consumer c = Consumer::open("orphan", co);
    ready.post();
    park();
    return 0;
  });
  ASSERT_TRUE(ready.wait(1));
  orphan_prod.kill9();
  orphan_prod.wait();
  Producer live = Producer::create("alive", small_opts());

  json lj = tool({"list", "--json", "--dir", dir.path}).j();
  const json* d = find_region(lj, "dead");
  const json* o = find_region(lj, "orphan");
  const json* a = find_region(lj, "alive");
  ASSERT_TRUE(d && o && a) << lj.dump();
  EXPECT_EQ(d->at("state"), "dead");
  EXPECT_EQ(d->at("producer").at("alive"), false);
  EXPECT_EQ(d->at("producer").at("pid"), dead.pid);
  EXPECT_EQ(d->at("participants_alive"), false);
  EXPECT_EQ(o->at("state"), "dead");
  EXPECT_EQ(o->at("consumers").at("alive"), 1);
  EXPECT_EQ(o->at("participants_alive"), true);
  EXPECT_EQ(a->at("state"), "ready");

  // --dry-run names it but removes nothing.
  Result dry = tool({"gc", "--dry-run", "--json", "--dir", dir.path});
  ASSERT_EQ(dry.rc, 0) << dry.err;
  json dj = dry.j();
  EXPECT_EQ(dj.at("dry_run"), true);
  EXPECT_EQ(names_of(dj.at("removed")), (std::set<std::string>{"dead"}));
  EXPECT_TRUE(exists(dir.file("dead")));

  Result gc = tool({"gc", "--json", "--dir", dir.path});
  ASSERT_EQ(gc.rc, 0) << gc.err;
  json gj = gc.j();
  EXPECT_EQ(names_of(gj.at("removed")), (std::set<std::string>{"dead"}));
  EXPECT_EQ(names_of(gj.at("kept")), (std::set<std::string>{"alive", "orphan"}));
  EXPECT_FALSE(exists(dir.file("dead")));
  EXPECT_TRUE(exists(dir.file("alive")));
  EXPECT_TRUE(exists(dir.file("orphan")));
  json after = tool({"list", "--json", "--dir", dir.path}).j();
  ASSERT_NE(find_region(after, "alive"), nullptr);
  EXPECT_EQ(find_region(after, "alive")->at("state"), "ready");

  // Once its last consumer is gone too, the orphan goes; the live one stays.
  orphan_cons.kill9();
  orphan_cons.wait();
  json gj2 = tool({"gc", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(gj2.at("removed")), (std::set<std::string>{"orphan"}));
  EXPECT_FALSE(exists(dir.file("orphan")));
  EXPECT_TRUE(exists(dir.file("alive")));
  EXPECT_EQ(live.consumers(), 0u);  // the live producer still works
}

// ================================================================ damaged files

TEST(Tool, CorruptForeignAndNewerVersionAreReportedNextToGoodOnes) {
  TempDir dir;
  Producer good = Producer::create("good", small_opts());
  make_closed("foreign1");
  make_closed("corrupt1");
  make_closed("newer1");
  make_closed("older1");
  const char garbage[8] = {'G', 'A', 'R', 'B', 'A', 'G', 'E', '!'};
  patch(dir.file("foreign1"), 0, garbage, 8);
  const std::uint32_t zero = 0, two = detail::kLayoutVersion + 1;
  patch(dir.file("corrupt1"), offsetof(detail::HeaderFixed, slot_count), &zero, 4);
  patch(dir.file("newer1"), offsetof(detail::HeaderFixed, layout_version), &two, 4);
  patch(dir.file("older1"), offsetof(detail::HeaderFixed, layout_version), &zero, 4);
  std::string junk(10000, '\0');
  fill_pattern(reinterpret_cast<std::uint8_t*>(junk.data()), junk.size(), 5);
  write_file(dir.file("junk"), junk);
  write_file(dir.file("tiny"), "abc");
  write_file(dir.file("bad name!"), "whatever");
  fs::create_directory(dir.file("adir"));

  Result l = tool({"list", "--json", "--dir", dir.path});
  ASSERT_EQ(l.rc, 0) << l.err;
  json lj = l.j();
  std::map<std::string, std::string> state;
  for (const json& r : lj.at("regions")) state[r.at("name")] = r.at("state");
  EXPECT_EQ(state["good"], "ready");
  EXPECT_EQ(state["foreign1"], "foreign");
  EXPECT_EQ(state["corrupt1"], "corrupt");
  EXPECT_EQ(state["newer1"], "newer-version");
  EXPECT_EQ(state["older1"], "older-version");
  EXPECT_EQ(state["junk"], "foreign");
  EXPECT_EQ(state["tiny"], "truncated");
  EXPECT_EQ(state["bad name!"], "foreign");
  EXPECT_EQ(state["adir"], "foreign");
  EXPECT_EQ(state.size(), 9u);
  EXPECT_EQ(find_region(lj, "newer1")->at("layout_version"), detail::kLayoutVersion + 1);
  EXPECT_EQ(find_region(lj, "good")->at("producer").at("pid"), ::getpid());

  // Human output lists every one of them too.
  Result hl = tool({"list", "--dir", dir.path});
  EXPECT_EQ(hl.rc, 0);
  for (const char* n : {"good", "foreign1", "corrupt1", "newer1", "junk", "tiny", "adir", "newer-version"})
    EXPECT_NE(hl.out.find(n), std::string::npos) << n;

  Result sf = tool({"show", "foreign1", "--json", "--dir", dir.path});
  EXPECT_EQ(sf.rc, 4);
  EXPECT_EQ(sf.j().at("region").at("state"), "foreign");
  Result sc = tool({"show", "corrupt1", "--json", "--dir", dir.path});
  EXPECT_EQ(sc.rc, 4);
  json scj = sc.j();
  EXPECT_EQ(scj.at("region").at("state"), "corrupt");
  EXPECT_NE(scj.at("region").at("reason").get<std::string>().find("slots"), std::string::npos);
  EXPECT_EQ(scj.at("header").at("valid"), false);
  EXPECT_EQ(scj.at("seats").size(), 0u);
  Result sn = tool({"show", "newer1", "--json", "--dir", dir.path});
  EXPECT_EQ(sn.rc, 4);
  EXPECT_EQ(sn.j().at("region").at("state"), "newer-version");
  EXPECT_EQ(tool({"show", "newer1", "--dir", dir.path}).rc, 4);
  EXPECT_EQ(tool({"show", "good", "--dir", dir.path}).rc, 0);

  // gc: damaged files of our layout go once they are older than --grace;
  // foreign files and other versions are never touched.
  json g1 = tool({"gc", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(g1.at("removed")), (std::set<std::string>{}));
  json g2 = tool({"gc", "--json", "--grace", "0", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(g2.at("removed")), (std::set<std::string>{"corrupt1", "tiny"}));
  for (const char* n : {"good", "foreign1", "newer1", "older1", "junk", "bad name!", "adir"})
    EXPECT_TRUE(exists(dir.file(n))) << n;
}

TEST(Tool, TruncatedCopiesAreReportedTruncated) {
  TempDir dir;
  make_closed("src");
  struct stat src_st {};
  ASSERT_EQ(::stat(dir.file("src").c_str(), &src_st), 0);
  ASSERT_GT(src_st.st_size, 8192);
  copy_sparse(dir.file("src"), dir.file("short"));
  ASSERT_EQ(::truncate(dir.file("short").c_str(), 4096 + 512), 0);
  write_file(dir.file("stub"), head_of(dir.file("src"), 100));  // our magic, less than a header
  copy_sparse(dir.file("src"), dir.file("long"), 4096);          // larger than the header says
  write_file(dir.file("empty"), "");                   // young and empty: being created
  write_file(dir.file("zeros"), std::string(8192, '\0'));  // allocated, header not written yet

  json lj = tool({"list", "--json", "--dir", dir.path}).j();
  std::map<std::string, std::string> state;
  for (const json& r : lj.at("regions")) state[r.at("name")] = r.at("state");
  EXPECT_EQ(state["src"], "closed");
  EXPECT_EQ(find_region(lj, "src")->at("sync_version"), 1);  // the last sync outlives the close
  json srcj = tool({"show", "src", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(srcj.at("manifest").at("status"), "ok");
  EXPECT_EQ(srcj.at("manifest").at("tensor_count"), 3);
  EXPECT_EQ(state["short"], "truncated");
  EXPECT_EQ(state["stub"], "truncated");
  EXPECT_EQ(state["long"], "truncated");
  EXPECT_EQ(state["empty"], "creating");
  EXPECT_EQ(state["zeros"], "creating");
  Result s = tool({"show", "short", "--json", "--dir", dir.path});
  EXPECT_EQ(s.rc, 4);
  EXPECT_EQ(s.j().at("region").at("size_bytes"), 4096 + 512);
  // gc never removes a file that is being created.
  json g = tool({"gc", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(g.at("removed")).count("empty"), 0u);
  EXPECT_TRUE(exists(dir.file("empty")));
  EXPECT_EQ(names_of(g.at("removed")), (std::set<std::string>{"src"}));  // closed, nobody attached
  EXPECT_TRUE(exists(dir.file("zeros")));
  // With no grace period, unfinished creations nobody holds are dead and go.
  json g0 = tool({"gc", "--json", "--grace", "0", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(g0.at("removed")), (std::set<std::string>{"empty", "zeros", "short", "stub", "long"}));
  EXPECT_FALSE(exists(dir.file("zeros")));
}

// ================================================================ read-only

TEST(Tool, ReadingVerbsChangeNothing) {
  TempDir dir;
  make_closed("quiet");
  const std::string path = dir.file("quiet");
  const std::uint64_t before = digest(path);
  struct stat st0 {};
  ASSERT_EQ(::stat(path.c_str(), &st0), 0);
  EXPECT_EQ(tool({"list", "--dir", dir.path}).rc, 0);
  EXPECT_EQ(tool({"list", "--json", "--dir", dir.path}).rc, 0);
  EXPECT_EQ(tool({"show", "quiet", "--dir", dir.path}).rc, 0);
  EXPECT_EQ(tool({"show", "quiet", "--json", "--dir", dir.path}).rc, 0);
  EXPECT_EQ(tool({"watch", "quiet", "--count", "2", "--interval", "0.05", "--dir", dir.path}).rc, 0);
  struct stat st1 {};
  ASSERT_EQ(::stat(path.c_str(), &st1), 0);
  EXPECT_EQ(digest(path), before);
  EXPECT_EQ(st0.st_blocks, st1.st_blocks);  // nothing allocated in its holes either
  EXPECT_EQ(st0.st_mtim.tv_sec, st1.st_mtim.tv_sec);
  EXPECT_EQ(st0.st_mtim.tv_nsec, st1.st_mtim.tv_nsec);
  EXPECT_EQ(st0.st_ctim.tv_nsec, st1.st_ctim.tv_nsec);
}

// ================================================================ dump

namespace {

struct Safetensors {
  json header;
  std::string data;
  std::uint64_t header_len = 0;
};

Safetensors read_safetensors(const std::string& path) {
  Safetensors st;
  const std::string all = slurp(path);
  EXPECT_GE(all.size(), 8u);
  if (all.size() < 8) return st;
  for (int b = 7; b >= 0; --b) st.header_len = (st.header_len << 8) | static_cast<unsigned char>(all[b]);
  EXPECT_LE(8 + st.header_len, all.size());
  if (8 + st.header_len > all.size()) return st;
  EXPECT_EQ((8 + st.header_len) % 8, 0u) << "data must start 8-byte aligned";
  st.header = json::parse(all.substr(8, st.header_len));
  st.data = all.substr(8 + st.header_len);
  return st;
}

std::string expected_dtype(DType d) {
  switch (d) {
    case DType::kBF16: return "BF16";
    case DType::kF32: return "F32";
    case DType::kF16: return "F16";
    case DType::kI64: return "I64";
    case DType::kU8: return "U8";
    case DType::kBool: return "BOOL";
    case DType::kF8E4M3FN: return "F8_E4M3";
    case DType::kF8E5M2: return "F8_E5M2";
    default: return "U8";  // no safetensors dtype: raw bytes
  }
}

}  // namespace

TEST(Tool, DumpWritesTheNextSyncAsSafetensorsBitExact) {
  TempDir dir;
  const std::string name = "src";
  Producer p = Producer::create(name, small_opts());
  // Sync 1 goes out before dump attaches: dump must write sync 2.
  SyncData s1 = make_sync(small_specs(), 1);
  ASSERT_EQ(p.send(s1.specs, s1.ptrs()), 1u);

  std::vector<TensorSpec> specs = random_manifest(11, kSlot, 14);  // includes tensors split over slots
  specs.push_back({"fp8", DType::kF8E4M3FN, {3, 5}});
  specs.push_back({"fp8b", DType::kF8E5M2, {9}});
  specs.push_back({"half", DType::kF16, {7, 3}});
  specs.push_back({"fnuz", DType::kF8E4M3FNUZ, {4, 2}});  // no safetensors dtype
  specs.push_back({"big", DType::kU8, {static_cast<std::int64_t>(5 * kSlot + 123)}});
  specs.push_back({"empty", DType::kF32, {0, 4}});
  specs.push_back({"flag", DType::kBool, {}});
  SyncData s2 = make_sync(specs, 2);

  const std::string out = dir.path + "/out.safetensors";
  Proc dump = spawn_tool({"dump", name, "--out", out, "--timeout", "30", "--json", "--dir", dir.path});
  p.wait_for_consumers(1, 20s);
  ASSERT_EQ(p.send(s2.specs, s2.ptrs()), 2u);
  Result r = finish(dump);
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  json rj = r.j();
  EXPECT_EQ(rj.at("sync_version"), 2);
  EXPECT_EQ(rj.at("tensor_count"), specs.size());
  EXPECT_EQ(rj.at("payload_bytes"), s2.payload());
  EXPECT_EQ(rj.at("substituted_dtypes"), 1);

  Safetensors st = read_safetensors(out);
  ASSERT_TRUE(st.header.is_object());
  const json& meta = st.header.at("__metadata__");
  EXPECT_EQ(meta.at("shmcast_region"), name);
  EXPECT_EQ(meta.at("shmcast_sync_version"), "2");
  EXPECT_EQ(meta.at("shmcast_version"), std::to_string(kVersionMajor) + "." + std::to_string(kVersionMinor));
  EXPECT_EQ(st.header.size(), specs.size() + 1);
  EXPECT_EQ(st.data.size(), s2.payload());
  std::uint64_t expect_off = 0;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].name);
    const json& e = st.header.at(specs[i].name);
    EXPECT_EQ(e.at("dtype"), expected_dtype(specs[i].dtype));
    std::vector<std::int64_t> shape = specs[i].shape;
    if (specs[i].dtype == DType::kF8E4M3FNUZ) {
      EXPECT_EQ(e.at("dtype"), "U8");
    }
    EXPECT_EQ(e.at("shape").get<std::vector<std::int64_t>>(), shape);
    const auto off = e.at("data_offsets").get<std::vector<std::uint64_t>>();
    ASSERT_EQ(off.size(), 2u);
    EXPECT_EQ(off[0], expect_off);  // contiguous, in order, no holes
    EXPECT_EQ(off[1] - off[0], specs[i].nbytes());
    ASSERT_LE(off[1], st.data.size());
    EXPECT_TRUE(std::equal(s2.bytes[i].begin(), s2.bytes[i].end(),
                           reinterpret_cast<const std::uint8_t*>(st.data.data()) + off[0]))
        << "bytes of tensor " << i << " differ from the source";
    expect_off = off[1];
  }
  const json subst = json::parse(meta.at("shmcast_dtypes").get<std::string>());
  EXPECT_EQ(subst.at("fnuz").at("dtype"), "f8e4m3fnuz");
  // Nothing left behind but the output, and the producer goes on without the dump.
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 2u);  // the region and out.safetensors
  EXPECT_EQ(p.consumers(), 0u);
  SyncData s3 = make_sync(small_specs(), 3);
  EXPECT_EQ(p.send(s3.specs, s3.ptrs()), 3u);
}

// A store producer SIGKILLed inside its record flip (the record's seqlock
// odd for good): `show` reports the version a consumer recovers from the
// banks, marked as rebuilt, with its manifest; `dump` writes it bit-exact.
// (Before the recovery: a torn record, manifest "changing", dump PeerDied.)
void stop_at_store_4(int store) {
  if (store == 4) ::raise(SIGSTOP);
}

TEST(Tool, StoreRecordTornByAProducerKilledInItsFlipIsShownAndDumped) {
  TempDir dir;
  const std::string name = "torn";
  ProducerOptions o = small_opts();
  o.mode = RegionMode::kStore;
  SyncData d1 = make_sync(small_specs(), 1), d2 = make_sync(small_specs(), 2);
  o.store_bytes = store_bytes_needed(d1.specs);
  const pid_t pid = ::fork();
  if (pid == 0) {
    try {
      Producer p = Producer::create(name, o);
      p.send(d1.specs, d1.ptrs());
      detail::g_announce_store_hook = stop_at_store_4;
      p.send(d2.specs, d2.ptrs());
    } catch (...) {
    }
    ::_exit(50);
  }
  ASSERT_GT(pid, 0);
  int status = 0;
  const auto end = std::chrono::steady_clock::now() + 30s;
  while (std::chrono::steady_clock::now() < end && ::waitpid(pid, &status, WNOHANG | WUNTRACED) != pid)
    std::this_thread::sleep_for(1ms);
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "the producer never stopped in its flip";

  Result s = tool({"show", name, "--json", "--dir", dir.path});
  ASSERT_EQ(s.rc, 0) << s.err;
  json sj = s.j();
  EXPECT_EQ(sj.at("producer").at("alive"), false);
  EXPECT_EQ(sj.at("manifest").at("status"), "ok") << sj.at("manifest");
  EXPECT_EQ(sj.at("manifest").value("version", 0), 2);
  EXPECT_EQ(sj.at("sync").at("version"), 2) << sj.at("sync");
  EXPECT_TRUE(sj.at("sync").value("record_recovered", false)) << sj.at("sync");
  Result t = tool({"show", name, "--dir", dir.path});
  ASSERT_EQ(t.rc, 0) << t.err;
  EXPECT_NE(t.out.find("record rebuilt from its bank"), std::string::npos) << t.out;

  const std::string out = dir.path + "/torn.safetensors";
  Result r = tool({"dump", name, "--out", out, "--timeout", "10", "--json", "--dir", dir.path});
  ASSERT_EQ(r.rc, 0) << r.err << r.out;
  EXPECT_EQ(r.j().at("sync_version"), 2);
  Safetensors st = read_safetensors(out);
  ASSERT_TRUE(st.header.is_object());
  for (std::size_t i = 0; i < d2.specs.size(); ++i) {
    const auto off = st.header.at(d2.specs[i].name).at("data_offsets").get<std::vector<std::uint64_t>>();
    ASSERT_EQ(off.size(), 2u);
    ASSERT_LE(off[1], st.data.size());
    EXPECT_TRUE(std::equal(d2.bytes[i].begin(), d2.bytes[i].end(),
                           reinterpret_cast<const std::uint8_t*>(st.data.data()) + off[0]))
        << "tensor " << i;
  }
}

TEST(Tool, DumpTimesOutRefusesToClobberAndReportsMissing) {
  TempDir dir;
  Producer p = Producer::create("quiet", small_opts());
  const std::string out = dir.path + "/never.safetensors";
  const auto t0 = std::chrono::steady_clock::now();
  Result r = tool({"dump", "quiet", "--out", out, "--timeout", "0.5", "--json", "--dir", dir.path});
  EXPECT_EQ(r.rc, 6) << r.err;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
  EXPECT_EQ(r.j().at("ok"), false);
  EXPECT_FALSE(exists(out));
  std::size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir.path)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1u) << "no temporary file may be left behind";
  EXPECT_EQ(tool({"dump", "missing", "--out", out, "--timeout", "0.2", "--dir", dir.path}).rc, 3);
  write_file(out, "keep me");
  EXPECT_EQ(tool({"dump", "quiet", "--out", out, "--timeout", "0.2", "--dir", dir.path}).rc, 5);
  EXPECT_EQ(slurp(out), "keep me");
  make_closed("broken");
  const std::uint32_t two = detail::kLayoutVersion + 1;
  patch(dir.file("broken"), offsetof(detail::HeaderFixed, layout_version), &two, 4);
  EXPECT_EQ(tool({"dump", "broken", "--out", dir.path + "/b.safetensors", "--timeout", "5", "--dir", dir.path}).rc,
            4);
}

// ================================================================ rm

TEST(Tool, RmRefusesLiveRegionsUnlessForced) {
  TempDir dir;
  Producer p = Producer::create("busy", small_opts());
  Result r = tool({"rm", "busy", "--json", "--dir", dir.path});
  EXPECT_EQ(r.rc, 5) << r.err;
  json rj = r.j();
  EXPECT_EQ(rj.at("ok"), false);
  EXPECT_EQ(rj.at("removed"), false);
  EXPECT_EQ(rj.at("participants_alive"), true);
  EXPECT_TRUE(exists(dir.file("busy")));
  EXPECT_EQ(tool({"rm", "busy", "--dir", dir.path}).rc, 5);
  EXPECT_TRUE(exists(dir.file("busy")));

  Result f = tool({"rm", "busy", "--force", "--json", "--dir", dir.path});
  EXPECT_EQ(f.rc, 0) << f.err;
  EXPECT_EQ(f.j().at("removed"), true);
  EXPECT_EQ(f.j().at("forced"), true);
  EXPECT_FALSE(exists(dir.file("busy")));

  make_closed("done");
  Result d = tool({"rm", "done", "--json", "--dir", dir.path});
  EXPECT_EQ(d.rc, 0) << d.err;
  EXPECT_EQ(d.j().at("forced"), false);
  EXPECT_FALSE(exists(dir.file("done")));
  EXPECT_EQ(tool({"rm", "done", "--dir", dir.path}).rc, 3);
}

// ================================================================ watch

TEST(Tool, WatchRefreshesCountTimesAndReportsThroughput) {
  TempDir dir;
  Producer p = Producer::create("w", small_opts());
  Result h = tool({"watch", "w", "--count", "2", "--interval", "0.1", "--dir", dir.path});
  EXPECT_EQ(h.rc, 0) << h.err;
  std::size_t frames = 0;
  for (std::size_t pos = 0; (pos = h.out.find("SLOTS", pos)) != std::string::npos; ++pos) ++frames;
  EXPECT_EQ(frames, 2u) << h.out;

  // Syncs flow while watch samples: some sample must see bytes moving.
  std::atomic<bool> stop{false};
  std::thread sender([&] {
    std::uint64_t v = 0;
    SyncData d = make_sync({{"x", DType::kU8, {1 << 20}}}, 1);
    while (!stop) {
      p.send(d.specs, d.ptrs());
      ++v;
      std::this_thread::sleep_for(5ms);
    }
  });
  Result j = tool({"watch", "w", "--count", "4", "--interval", "0.2", "--json", "--dir", dir.path});
  stop = true;
  sender.join();
  EXPECT_EQ(j.rc, 0) << j.err;
  std::istringstream lines(j.out);
  std::string line;
  int n = 0;
  double best = 0;
  while (std::getline(lines, line)) {
    json doc = json::parse(line);
    ++n;
    EXPECT_EQ(doc.at("command"), "watch");
    EXPECT_EQ(doc.at("sample"), n);
    EXPECT_EQ(doc.at("region").at("state"), "ready");
    EXPECT_EQ(doc.at("slots").size(), 2u);
    if (n == 1) {
      EXPECT_TRUE(doc.at("rates").at("bytes_per_s").is_null());
    }
    if (n > 1 && doc.at("rates").at("bytes_per_s").is_number())
      best = std::max(best, doc.at("rates").at("bytes_per_s").get<double>());
  }
  EXPECT_EQ(n, 4);
  EXPECT_GT(best, 0.0);

  EXPECT_EQ(tool({"watch", "nothere", "--count", "1", "--dir", dir.path}).rc, 3);
}

TEST(Tool, WatchExitsCleanlyOnSigint) {
  TempDir dir;
  Producer p = Producer::create("w", small_opts());
  Proc w = spawn_tool({"watch", "w", "--interval", "0.05", "--dir", dir.path});
  std::this_thread::sleep_for(400ms);
  ::kill(w.pid, SIGINT);
  Result r = finish(w, 10s);
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("SLOTS"), std::string::npos);
}

// ================================================================ errors

TEST(Tool, ShowReportsAbortsAndEvictions) {
  TempDir dir;
  ProducerOptions o = small_opts();
  o.stall_policy = StallPolicy::kEvict;
  o.consumer_timeout = 300ms;
  Producer p = Producer::create("err", o);
  Signal ready;
  // A consumer that takes the manifest, then never reads: it holds chunk 1.
  Child stall = Child::spawn([&] {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    Consumer c = Consumer::open("err", co);
    ready.post();
    c.wait_sync(20s);
    ready.post();
    park();
    return 0;
  });
  ASSERT_TRUE(ready.wait(1));
  p.wait_for_consumers(1, 20s);
  // Three chunks through two slots: chunk 3 needs chunk 1 back, so the
  // stalled consumer is evicted.
  SyncData big = make_sync({{"a", DType::kU8, {static_cast<std::int64_t>(kSlot)}},
                            {"b", DType::kU8, {static_cast<std::int64_t>(kSlot)}},
                            {"c", DType::kU8, {static_cast<std::int64_t>(kSlot)}}},
                           1);
  ASSERT_EQ(p.send(big.specs, big.ptrs()), 1u);
  ASSERT_TRUE(ready.wait(1));

  json ej = tool({"show", "err", "--json", "--dir", dir.path}).j();
  const json* seat = nullptr;
  for (const json& s : ej.at("seats"))
    if (s.at("pid") == stall.pid) seat = &s;
  ASSERT_NE(seat, nullptr) << ej.dump();
  EXPECT_EQ(seat->at("state"), "evicted");
  EXPECT_EQ(seat->at("alive"), true);
  EXPECT_EQ(seat->at("evict_reason_name"), "Timeout");
  EXPECT_EQ(ej.at("header").at("evictions"), 1);
  bool saw_eviction = false;
  for (const json& e : ej.at("errors"))
    if (e.at("who") == "eviction" && e.at("seat") == seat->at("index")) saw_eviction = true;
  EXPECT_TRUE(saw_eviction) << ej.at("errors").dump();
  EXPECT_EQ(ej.at("sync").at("version"), 1);
  EXPECT_EQ(ej.at("manifest").at("status"), "ok");
  EXPECT_EQ(ej.at("manifest").at("tensor_count"), 3);

  // An aborted sync: the record says so and the producer's error is shown.
  ASSERT_EQ(p.begin_sync(small_specs()), 2u);
  p.abort_sync("trainer hit a NaN");
  Result s = tool({"show", "err", "--json", "--dir", dir.path});
  ASSERT_EQ(s.rc, 0) << s.err;
  json aj = s.j();
  EXPECT_EQ(aj.at("sync").at("version"), 2);
  EXPECT_EQ(aj.at("sync").at("aborted"), true);
  EXPECT_EQ(aj.at("sync").at("status"), "aborted");
  EXPECT_EQ(aj.at("producer").at("error_name"), "Aborted");
  EXPECT_EQ(aj.at("producer").at("error_text"), "trainer hit a NaN");
  ASSERT_GE(aj.at("errors").size(), 1u);
  EXPECT_EQ(aj.at("errors")[0].at("who"), "producer");
  EXPECT_EQ(aj.at("errors")[0].at("text"), "trainer hit a NaN");
  Result h = tool({"show", "err", "--dir", dir.path});
  EXPECT_NE(h.out.find("trainer hit a NaN"), std::string::npos) << h.out;
  EXPECT_NE(h.out.find("evicted"), std::string::npos) << h.out;
}

// ================================================================ hardening
//
// Regions the tool must not trust, names swapped under it, files cut under
// a running dump, huge manifests and bad numbers.

namespace {

// ---- the binary's helper role: a producer run as another user (setpriv).

// Makes region `name` in $SHMCAST_DIR, sends one sync, opens the file to
// everyone (0666), says "R" on stdout, holds the region until stdin closes,
// then closes it without unlinking the name.
int role_foreign_producer(const std::string& name) {
  try {
    Producer p = Producer::create(name, small_opts(false));
    SyncData d = make_sync(small_specs(), 1);
    p.send(d.specs, d.ptrs());
    if (::chmod(p.path().c_str(), 0666) != 0) return 3;
    if (::write(1, "R", 1) != 1) return 4;
    char c;
    while (::read(0, &c, 1) > 0) {
    }
    p.close();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "foreign producer: %s\n", e.what());
    return 2;
  }
}

constexpr std::uint32_t kNobody = 65534;

std::string find_setpriv() {
  for (const char* p : {"/usr/bin/setpriv", "/bin/setpriv", "/usr/sbin/setpriv", "/sbin/setpriv"})
    if (::access(p, X_OK) == 0) return p;
  return {};
}

// The test binary run again as uid/gid 65534 with no supplementary groups.
struct ForeignProducer {
  pid_t pid = -1;
  int in = -1, out = -1, err = -1;
  static ForeignProducer spawn(const std::string& setpriv, const std::string& name) {
    char exe[4096];
    const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) throw std::runtime_error("readlink /proc/self/exe");
    exe[n] = '\0';
    int i[2], o[2], e[2];
    if (::pipe2(i, O_CLOEXEC) != 0 || ::pipe2(o, O_CLOEXEC) != 0 || ::pipe2(e, O_CLOEXEC) != 0)
      throw std::runtime_error("pipe");
    ForeignProducer f;
    f.pid = ::fork();
    if (f.pid == 0) {
      ::dup2(i[0], 0);
      ::dup2(o[1], 1);
      ::dup2(e[1], 2);
      const std::string uid = "--reuid=" + std::to_string(kNobody), gid = "--regid=" + std::to_string(kNobody);
      ::execl(setpriv.c_str(), setpriv.c_str(), uid.c_str(), gid.c_str(), "--clear-groups", exe,
              "--role=foreign-producer", name.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(i[0]);
    ::close(o[1]);
    ::close(e[1]);
    f.in = i[1];
    f.out = o[0];
    f.err = e[0];
    return f;
  }
  // Waits for its "R"; on failure returns what it printed on stderr.
  bool ready(std::string* why) {
    struct pollfd p = {out, POLLIN, 0};
    char c = 0;
    if (::poll(&p, 1, 20000) == 1 && ::read(out, &c, 1) == 1 && c == 'R') return true;
    char buf[4096];
    const ssize_t n = ::read(err, buf, sizeof buf);
    *why = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : "no output";
    return false;
  }
  // Closes its stdin: it closes the region and exits. Returns its exit code.
  int finish() {
    if (in >= 0) ::close(in);
    in = -1;
    Child c;
    c.pid = pid;
    pid = -1;
    return c.wait(20s);
  }
  ~ForeignProducer() {
    if (in >= 0) ::close(in);
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    for (int fd : {out, err})
      if (fd >= 0) ::close(fd);
  }
};

std::vector<std::string> temp_files(const std::string& dir) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp.") != std::string::npos) v.push_back(e.path().string());
  return v;
}

using shmcast_test::rewrite_manifest;

detail::ManifestEntry* manifest_entry(std::string& m, std::size_t i) {
  return reinterpret_cast<detail::ManifestEntry*>(m.data() + sizeof(detail::ManifestHeader) +
                                                  i * sizeof(detail::ManifestEntry));
}

// Stops a tool process and waits until it is stopped.
bool stop_process(pid_t pid) {
  if (::kill(pid, SIGSTOP) != 0) return false;
  int status = 0;
  return ::waitpid(pid, &status, WUNTRACED) == pid && WIFSTOPPED(status);
}

}  // namespace

// ---------------------------------------------------------------- 1. owners

TEST(Tool, ForeignOwnedRegionIsUntrustedByEveryVerb) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a producer as another user";
  const std::string setpriv = find_setpriv();
  if (setpriv.empty()) GTEST_SKIP() << "setpriv is missing";
  TempDir dir;
  ASSERT_EQ(::chmod(dir.path.c_str(), 0777), 0);
  make_closed("mine");
  ForeignProducer theirs = ForeignProducer::spawn(setpriv, "theirs");
  std::string why;
  ASSERT_TRUE(theirs.ready(&why)) << why;
  struct stat st {};
  ASSERT_EQ(::stat(dir.file("theirs").c_str(), &st), 0);
  ASSERT_EQ(st.st_uid, kNobody);
  ASSERT_EQ(st.st_mode & 07777, 0666u);

  // list: a distinct state, the owner and mode, and none of its bytes.
  json lj = tool({"list", "--json", "--dir", dir.path}).j();
  const json* t = find_region(lj, "theirs");
  const json* m = find_region(lj, "mine");
  ASSERT_TRUE(t && m) << lj.dump();
  EXPECT_EQ(t->at("state"), "untrusted-owner");
  EXPECT_EQ(t->at("trusted"), false);
  EXPECT_EQ(t->at("file_type"), "regular");
  EXPECT_EQ(t->at("owner").at("uid"), kNobody);
  EXPECT_EQ(t->at("owner").at("user"), "nobody");
  EXPECT_EQ(t->at("owner").at("mode"), "0666");
  EXPECT_NE(t->at("reason").get<std::string>().find("65534"), std::string::npos) << t->dump();
  EXPECT_TRUE(t->at("layout_version").is_null()) << "its header must not be read";
  EXPECT_TRUE(t->at("producer").at("pid").is_null());
  EXPECT_TRUE(t->at("sync_version").is_null());
  EXPECT_EQ(m->at("state"), "closed");
  EXPECT_EQ(m->at("trusted"), true);
  EXPECT_EQ(m->at("owner").at("uid"), 0);
  EXPECT_EQ(m->at("owner").at("mode"), "0600");
  Result hl = tool({"list", "--dir", dir.path});
  EXPECT_NE(hl.out.find("untrusted-owner"), std::string::npos) << hl.out;

  // show: exit 4, the owner, no header, seats or manifest.
  Result s = tool({"show", "theirs", "--json", "--dir", dir.path});
  EXPECT_EQ(s.rc, 4) << s.err;
  json sj = s.j();
  EXPECT_EQ(sj.at("region").at("state"), "untrusted-owner");
  EXPECT_TRUE(sj.at("header").is_null());
  EXPECT_EQ(sj.at("seats").size(), 0u);
  EXPECT_NE(sj.at("manifest").at("status"), "ok");
  Result hs = tool({"show", "theirs", "--dir", dir.path});
  EXPECT_EQ(hs.rc, 4);
  EXPECT_NE(hs.out.find("NOT TRUSTED"), std::string::npos) << hs.out;
  EXPECT_NE(hs.out.find("nobody"), std::string::npos) << hs.out;

  // watch shows the state; dump refuses at once and writes nothing.
  Result w = tool({"watch", "theirs", "--count", "1", "--json", "--dir", dir.path});
  EXPECT_EQ(w.rc, 0) << w.err;
  EXPECT_EQ(w.j().at("region").at("state"), "untrusted-owner");
  const std::string out = dir.path + "/theirs.safetensors";
  const auto t0 = std::chrono::steady_clock::now();
  Result d = tool({"dump", "theirs", "--out", out, "--timeout", "10", "--json", "--dir", dir.path});
  EXPECT_EQ(d.rc, 4) << d.err;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_NE(d.err.find("untrusted-owner"), std::string::npos) << d.err;
  EXPECT_FALSE(exists(out));
  EXPECT_TRUE(temp_files(dir.path).empty());

  // gc never removes it (mine, closed and trusted, goes); rm only with --force.
  json g = tool({"gc", "--grace", "0", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(g.at("removed")), (std::set<std::string>{"mine"}));
  EXPECT_EQ(names_of(g.at("kept")), (std::set<std::string>{"theirs"}));
  EXPECT_TRUE(exists(dir.file("theirs")));
  EXPECT_EQ(tool({"rm", "theirs", "--dir", dir.path}).rc, 5);
  EXPECT_TRUE(exists(dir.file("theirs")));

  // Its producer leaves (closed, nobody attached): still never collected.
  EXPECT_EQ(theirs.finish(), 0);
  json g2 = tool({"gc", "--grace", "0", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(g2.at("removed")), (std::set<std::string>{}));
  EXPECT_TRUE(exists(dir.file("theirs")));
  Result r = tool({"rm", "theirs", "--json", "--dir", dir.path});
  EXPECT_EQ(r.rc, 5);
  EXPECT_EQ(r.j().at("removed"), false);
  Result f = tool({"rm", "theirs", "--force", "--json", "--dir", dir.path});
  EXPECT_EQ(f.rc, 0) << f.err;
  EXPECT_EQ(f.j().at("forced"), true);
  EXPECT_FALSE(exists(dir.file("theirs")));
}

TEST(Tool, GroupOrOtherWritableRegionsAreUntrusted) {
  TempDir dir;
  for (const char* n : {"private", "readable", "group", "world", "world-nogroup"}) make_closed(n);
  ASSERT_EQ(::chmod(dir.file("readable").c_str(), 0644), 0);
  ASSERT_EQ(::chmod(dir.file("group").c_str(), 0660), 0);  // group_access, the caller's own group
  ASSERT_EQ(::chmod(dir.file("world").c_str(), 0666), 0);
  ASSERT_EQ(::chmod(dir.file("world-nogroup").c_str(), 0602), 0);
  bool foreign_group = false;
  if (::geteuid() == 0) {
    // Group-writable by a group the caller is not in.
    make_closed("other-group");
    ASSERT_EQ(::chown(dir.file("other-group").c_str(), static_cast<uid_t>(-1), kNobody), 0);
    ASSERT_EQ(::chmod(dir.file("other-group").c_str(), 0660), 0);
    foreign_group = ::getegid() != kNobody;
    std::vector<gid_t> groups(static_cast<std::size_t>(std::max(::getgroups(0, nullptr), 0)));
    if (!groups.empty() && ::getgroups(static_cast<int>(groups.size()), groups.data()) > 0)
      for (gid_t g : groups)
        if (g == kNobody) foreign_group = false;
  }
  json lj = tool({"list", "--json", "--dir", dir.path}).j();
  std::map<std::string, std::string> state;
  for (const json& r : lj.at("regions")) state[r.at("name")] = r.at("state");
  EXPECT_EQ(state["private"], "closed");
  EXPECT_EQ(state["readable"], "closed");
  EXPECT_EQ(state["group"], "closed");
  EXPECT_EQ(state["world"], "untrusted-owner");
  EXPECT_EQ(state["world-nogroup"], "untrusted-owner");
  EXPECT_EQ(find_region(lj, "world")->at("owner").at("mode"), "0666");
  EXPECT_NE(find_region(lj, "world")->at("reason").get<std::string>().find("writable by every user"),
            std::string::npos);
  if (foreign_group) {
    EXPECT_EQ(state["other-group"], "untrusted-owner");
    EXPECT_NE(find_region(lj, "other-group")->at("reason").get<std::string>().find("group 65534"),
              std::string::npos);
  }
  json g = tool({"gc", "--grace", "0", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(names_of(g.at("removed")), (std::set<std::string>{"private", "readable", "group"}));
  EXPECT_TRUE(exists(dir.file("world")));
  EXPECT_TRUE(exists(dir.file("world-nogroup")));
  if (foreign_group) {
    EXPECT_TRUE(exists(dir.file("other-group")));
  }
}

// ---------------------------------------------------------------- 2. non-regular files

TEST(Tool, SymlinksFifosSocketsAndDirectoriesAreCleanStates) {
  TempDir dir;
  make_closed("real");
  ASSERT_EQ(::symlink(dir.file("real").c_str(), dir.file("link").c_str()), 0);
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  fs::create_directory(dir.file("adir"));
  const int sock = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(sock, 0);
  struct sockaddr_un addr {};
  addr.sun_family = AF_UNIX;
  const std::string sp = dir.file("sock");
  ASSERT_LT(sp.size(), sizeof addr.sun_path);
  std::memcpy(addr.sun_path, sp.c_str(), sp.size() + 1);
  ASSERT_EQ(::bind(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr), 0);

  Result l = tool({"list", "--json", "--dir", dir.path}, 10s);
  ASSERT_EQ(l.rc, 0) << l.err;
  json lj = l.j();
  const std::map<std::string, std::pair<std::string, std::string>> want = {
      {"link", {"symlink", "symbolic link"}},
      {"fifo", {"fifo", "FIFO"}},
      {"adir", {"directory", "directory"}},
      {"sock", {"socket", "socket"}}};
  for (const auto& [n, w] : want) {
    SCOPED_TRACE(n);
    const json* r = find_region(lj, n);
    ASSERT_NE(r, nullptr);
    EXPECT_EQ(r->at("state"), "foreign");
    EXPECT_EQ(r->at("file_type"), w.first);
    EXPECT_NE(r->at("reason").get<std::string>().find(w.second), std::string::npos) << r->dump();
    Result s = tool({"show", n, "--json", "--dir", dir.path}, 10s);
    EXPECT_EQ(s.rc, 4) << s.err;
  }
  EXPECT_EQ(find_region(lj, "real")->at("state"), "closed");
  // gc removes the real region but none of the others; the link's target
  // was never touched through it.
  json g = tool({"gc", "--grace", "0", "--json", "--dir", dir.path}, 10s).j();
  EXPECT_EQ(names_of(g.at("removed")), (std::set<std::string>{"real"}));
  for (const char* n : {"link", "fifo", "adir", "sock"}) EXPECT_TRUE(exists(dir.file(n))) << n;
  ::close(sock);
}

TEST(Tool, FifoSwappedUnderTheNameNeverHangs) {
  TempDir dir;
  make_closed("image");
  // A hard link keeps a region image whatever gc does to the swapped name.
  const std::string image = dir.path + "/image.keep";
  ASSERT_EQ(::link(dir.file("image").c_str(), image.c_str()), 0);
  ASSERT_EQ(::unlink(dir.file("image").c_str()), 0);
  const std::string target = dir.file("swap");
  const std::string reg = dir.path + "/next.reg", fifo = dir.path + "/next.fifo";
  std::atomic<bool> stop{false};
  std::atomic<std::uint64_t> swaps{0};
  std::thread swapper([&] {
    while (!stop) {
      ::unlink(reg.c_str());
      if (::link(image.c_str(), reg.c_str()) == 0) ::rename(reg.c_str(), target.c_str());
      ::unlink(fifo.c_str());
      if (::mkfifo(fifo.c_str(), 0600) == 0) ::rename(fifo.c_str(), target.c_str());
      swaps.fetch_add(1, std::memory_order_relaxed);
    }
  });
  const auto t_end = std::chrono::steady_clock::now() + 25s;
  int runs = 0;
  std::string failure;
  for (int i = 0; i < 150 && failure.empty() && std::chrono::steady_clock::now() < t_end; ++i) {
    const char* verb = i % 3 == 0 ? "list" : i % 3 == 1 ? "show" : "gc";
    std::vector<std::string> args = {verb, "--json", "--dir", dir.path};
    if (i % 3 == 1) args.insert(args.begin() + 1, "swap");
    Result r = tool(args, 5s);
    ++runs;
    if (r.rc == -1) failure = std::string(verb) + " hung (killed after 5 s)";
    else if (r.rc >= 128) failure = std::string(verb) + " died of signal " + std::to_string(r.rc - 128);
    else if (verb == std::string("list") && r.rc != 0) failure = "list exited " + std::to_string(r.rc) + ": " + r.err;
    else if (verb == std::string("show") && r.rc != 0 && r.rc != 4 && r.rc != 3)  // 3: gc just removed it
      failure = "show exited " + std::to_string(r.rc) + ": " + r.err;
    else if (verb == std::string("gc") && r.rc != 0 && r.rc != 1)  // 1: the name was replaced before unlink
      failure = "gc exited " + std::to_string(r.rc) + ": " + r.err;
  }
  stop = true;
  swapper.join();
  EXPECT_TRUE(failure.empty()) << failure << " (run " << runs << ", " << swaps.load() << " swaps)";
  EXPECT_GT(swaps.load(), 100u);
  EXPECT_GE(runs, 30);
}

// ---------------------------------------------------------------- 3. cut under dump

TEST(Tool, DumpSurvivesTheRegionBeingCutUnderIt) {
  constexpr std::uint64_t kBigSlot = 8ull << 20;
  constexpr int kTensors = 32;  // 256 MiB through two 8 MiB slots
  // Where the file is cut, as a fraction of its size or as an offset.
  const std::vector<std::pair<const char*, std::function<std::uint64_t(const detail::HeaderFixed&)>>> cuts = {
      {"to nothing", [](const detail::HeaderFixed&) { return 0ull; }},
      {"inside the header", [](const detail::HeaderFixed&) { return 1000ull; }},
      {"after the header", [](const detail::HeaderFixed& f) { return f.header_bytes; }},
      {"at the data", [](const detail::HeaderFixed& f) { return f.data_offset; }},
      {"inside slot 0", [](const detail::HeaderFixed& f) { return f.data_offset + kBigSlot / 2; }},
      {"inside slot 1", [](const detail::HeaderFixed& f) { return f.total_bytes - kBigSlot / 2; }},
  };
  for (const auto& [label, cut_at] : cuts) {
    SCOPED_TRACE(label);
    TempDir dir;
    Signal ready;
    Child producer = Child::spawn([&] {
      ProducerOptions o = small_opts();
      o.slot_bytes = kBigSlot;
      Producer p = Producer::create("big", o);
      ready.post();
      p.wait_for_consumers(1, 20s);
      std::vector<std::uint8_t> buf(kBigSlot);
      fill_pattern(buf.data(), buf.size(), 7);
      std::vector<TensorSpec> specs;
      std::vector<const void*> ptrs;
      for (int i = 0; i < kTensors; ++i) {
        specs.push_back({"t." + std::to_string(i), DType::kU8, {static_cast<std::int64_t>(kBigSlot)}});
        ptrs.push_back(buf.data());
      }
      p.send(specs, ptrs);  // dies of SIGBUS once the file is cut: expected
      park();
      return 0;
    });
    ASSERT_TRUE(ready.wait(1));
    const std::string out = dir.path + "/big.safetensors";
    Proc dump = spawn_tool({"dump", "big", "--out", out, "--timeout", "30", "--json", "--dir", dir.path});
    // Mid-dump: its temporary file exists once the sync was announced.
    const auto until = std::chrono::steady_clock::now() + 20s;
    while (temp_files(dir.path).empty() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    ASSERT_FALSE(temp_files(dir.path).empty()) << "dump never started writing";
    ASSERT_TRUE(stop_process(dump.pid));
    detail::HeaderFixed f{};
    const int fd = ::open(dir.file("big").c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pread(fd, &f, sizeof f, 0), static_cast<ssize_t>(sizeof f));
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(cut_at(f))), 0);
    ::close(fd);
    ::kill(dump.pid, SIGCONT);
    Result r = finish(dump, 40s);
    EXPECT_NE(r.rc, -1) << "dump hung";
    EXPECT_LT(r.rc, 128) << "dump died of signal " << r.rc - 128 << "; stderr: " << r.err;
    EXPECT_NE(r.rc, 0) << "dump cannot have received the whole sync";
    EXPECT_NE(r.err.find("shmcast-inspect dump: "), std::string::npos) << r.err;
    if (r.rc > 0 && r.rc < 128) {
      EXPECT_EQ(r.j().at("ok"), false) << r.out;
    }
    EXPECT_EQ(r.err.find("Bad address"), std::string::npos) << r.err;
    EXPECT_FALSE(exists(out));
    EXPECT_TRUE(temp_files(dir.path).empty()) << "a temporary file was left behind";
  }
}

// ---------------------------------------------------------------- 4. big manifests

TEST(Tool, ShowLimitDecodesOnlyTheEntriesItPrints) {
  TempDir dir;
  constexpr int kCount = 1000000;  // about 163 MB of manifest (entries and pieces)
  Signal ready;
  Child producer = Child::spawn([&] {
    ProducerOptions o = small_opts();
    o.manifest_bytes = 192ull << 20;
    Producer p = Producer::create("huge", o);
    std::vector<TensorSpec> specs(kCount);
    char name[64];
    for (int i = 0; i < kCount; ++i) {
      std::snprintf(name, sizeof name, "layer.%07d.weight", i);
      specs[static_cast<std::size_t>(i)] = {name, DType::kF32, {0}};
    }
    const std::uint8_t dummy = 0;
    std::vector<const void*> ptrs(kCount, &dummy);
    p.send(specs, ptrs);
    ready.post();
    park();
    return 0;
  });
  ASSERT_TRUE(ready.wait(1, 50s));
  struct rusage ru {};
  Result r = finish(spawn_tool({"show", "huge", "--limit", "5", "--json", "--dir", dir.path}), 40s, &ru);
  ASSERT_EQ(r.rc, 0) << r.err;
  json j = r.j();
  const json& m = j.at("manifest");
  ASSERT_EQ(m.at("status"), "ok") << m.dump();
  EXPECT_EQ(m.at("tensor_count"), kCount);
  EXPECT_EQ(m.at("shown"), 5);
  EXPECT_EQ(m.at("truncated"), true);
  ASSERT_EQ(m.at("tensors").size(), 5u);
  EXPECT_EQ(m.at("tensors")[0].at("name"), "layer.0000000.weight");
  EXPECT_EQ(m.at("tensors")[4].at("name"), "layer.0000004.weight");
  EXPECT_EQ(m.at("tensors")[4].at("dtype"), "f32");
  // Peak RSS of that show (KiB): far below the manifest's size, and far
  // below the 378 MiB of a show that decodes every entry. ASan's shadow
  // memory and allocator quarantine add their own (161 MiB seen).
#if defined(__SANITIZE_ADDRESS__)
  constexpr long kBoundMiB = 320;
#else
  constexpr long kBoundMiB = 48;
#endif
  EXPECT_LT(ru.ru_maxrss, kBoundMiB * 1024) << "show --limit 5 peaked at " << ru.ru_maxrss / 1024 << " MiB";
}

TEST(Tool, ShowValidatesEntriesItDoesNotPrint) {
  TempDir dir;
  ProducerOptions o = small_opts();
  o.manifest_bytes = 2ull << 20;
  Producer p = Producer::create("many", o);
  std::vector<TensorSpec> specs;
  for (int i = 0; i < 9000; ++i) specs.push_back({"t." + std::to_string(i), DType::kF32, {0}});
  const std::uint8_t dummy = 0;
  std::vector<const void*> ptrs(specs.size(), &dummy);
  p.send(specs, ptrs);
  json ok = tool({"show", "many", "--limit", "3", "--json", "--dir", dir.path}).j();
  ASSERT_EQ(ok.at("manifest").at("status"), "ok") << ok.at("manifest").dump();
  EXPECT_EQ(ok.at("manifest").at("tensor_count"), 9000);
  EXPECT_EQ(ok.at("manifest").at("tensors")[2].at("name"), "t.2");
  json all = tool({"show", "many", "--limit", "0", "--json", "--dir", dir.path}).j();
  ASSERT_EQ(all.at("manifest").at("tensors").size(), 9000u);
  EXPECT_EQ(all.at("manifest").at("tensors")[8999].at("name"), "t.8999");
  EXPECT_EQ(all.at("manifest").at("tensors")[4096].at("name"), "t.4096");
  // A bad entry far past the limit (in the third window of entries) is still found.
  rewrite_manifest(dir.file("many"), [](std::string& m) { manifest_entry(m, 8500)->dtype = 999; });
  json bad = tool({"show", "many", "--limit", "3", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(bad.at("manifest").at("status"), "invalid");
  EXPECT_NE(bad.at("manifest").at("reason").get<std::string>().find("tensor 8500:"), std::string::npos)
      << bad.at("manifest").dump();
  EXPECT_EQ(bad.at("manifest").at("tensors").size(), 0u);
}

// A region with delta syncs: show gives the kind and the sizes of the last
// sync (full, then a delta of a few changed bf16 elements that a consumer
// applies), in JSON and text; a delta piece whose blob cannot carry its
// piece is the manifest's reported problem.
TEST(Tool, ShowGivesTheKindAndSizesOfDeltaSyncs) {
  TempDir dir;
  ProducerOptions o = small_opts();
  o.delta = true;
  o.engine = CopyEngine::kHost;
  Producer p = Producer::create("delta", o);
  const std::vector<TensorSpec> specs{{"w", DType::kBF16, {256, 512}}, {"n", DType::kF32, {1000}}};
  const std::uint64_t logical = specs[0].nbytes() + specs[1].nbytes();
  // Version 1's bytes, and version 2's: 10 elements of "w" changed.
  auto weights = [&](std::uint64_t version) {
    std::vector<std::vector<std::uint8_t>> d;
    for (std::size_t i = 0; i < specs.size(); ++i) {
      d.emplace_back(specs[i].nbytes());
      fill_pattern(d.back().data(), d.back().size(), 0xde17a + i);
    }
    if (version > 1)
      for (std::size_t k = 0; k < 10; ++k) d[0][2 * (k * 9973 % (256 * 512)) + 1] ^= 0x21;
    return d;
  };
  Signal read;
  // The consumer reads each version into the same buffers (so the next may
  // be a delta) and checks it bit-exact.
  Child consumer = Child::spawn([&] {
    ConsumerOptions co;
    co.pin = Pin::kNo;
    Consumer c = Consumer::open("delta", co);
    std::vector<std::vector<std::uint8_t>> got{std::vector<std::uint8_t>(specs[0].nbytes()),
                                               std::vector<std::uint8_t>(specs[1].nbytes())};
    std::vector<void*> dst{got[0].data(), got[1].data()};
    for (std::uint64_t v = 1; v <= 2; ++v) {
      if (c.wait_sync(20s).version != v) return 10;
      c.read_into(dst);
      if (got != weights(v)) return 11;
      read.post();
    }
    park();
    return 0;
  });
  p.wait_for_consumers(1, 20s);
  auto send = [&](std::uint64_t v) {
    const auto d = weights(v);
    std::vector<const void*> ptrs{d[0].data(), d[1].data()};
    return p.send(specs, ptrs);
  };

  ASSERT_EQ(send(1), 1u);
  ASSERT_TRUE(read.wait(1)) << "consumer exit " << consumer.wait(1s);
  json full = tool({"show", "delta", "--json", "--dir", dir.path}).j();
  EXPECT_EQ(full.at("header").at("feature_names"), json::array({"delta"}));
  const json& fm = full.at("manifest");
  ASSERT_EQ(fm.at("status"), "ok") << fm.dump();
  EXPECT_EQ(fm.at("kind"), "full");
  EXPECT_EQ(fm.at("base_version"), 0);
  EXPECT_EQ(fm.at("logical_bytes"), logical);
  EXPECT_EQ(fm.at("payload_bytes"), logical);
  Result full_text = tool({"show", "delta", "--dir", dir.path});
  EXPECT_EQ(full_text.rc, 0) << full_text.err;
  EXPECT_NE(full_text.out.find("delta syncs"), std::string::npos) << full_text.out;
  EXPECT_NE(full_text.out.find("version 1: full, " + probe::human_bytes(logical) + " payload"), std::string::npos)
      << full_text.out;

  ASSERT_EQ(send(2), 2u);
  const SyncReport sent = p.last_sync();
  ASSERT_TRUE(sent.delta);
  ASSERT_TRUE(read.wait(1)) << "consumer exit " << consumer.wait(1s);
  for (const char* limit : {"0", "1"}) {  // --limit 1: "n" is checked but not printed
    Result r = tool({"show", "delta", "--json", "--limit", limit, "--dir", dir.path});
    ASSERT_EQ(r.rc, 0) << r.err;
    json j = r.j();
    const json& m = j.at("manifest");
    ASSERT_EQ(m.at("status"), "ok") << m.dump();
    EXPECT_EQ(m.at("version"), 2);
    EXPECT_EQ(m.at("kind"), "delta");
    EXPECT_EQ(m.at("base_version"), 1);
    EXPECT_EQ(m.at("logical_bytes"), logical);
    EXPECT_EQ(m.at("payload_bytes"), sent.payload_bytes);
    EXPECT_LT(m.at("payload_bytes").get<std::uint64_t>() * 10, logical);
    const json& w = m.at("tensors").at(0).at("pieces").at(0);
    EXPECT_EQ(w.at("nbytes"), specs[0].nbytes());
    EXPECT_EQ(w.at("base_version"), 1);
    EXPECT_LT(w.at("wire_bytes").get<std::uint64_t>(), specs[0].nbytes());
  }
  Result text = tool({"show", "delta", "--dir", dir.path});
  EXPECT_EQ(text.rc, 0) << text.err;
  EXPECT_NE(text.out.find("version 2: delta against version 1, " + probe::human_bytes(logical) + " logical, " +
                          probe::human_bytes(sent.payload_bytes) + " payload"),
            std::string::npos)
      << text.out;
  EXPECT_NE(text.out.find("PAYLOAD"), std::string::npos) << text.out;

  // A blob too small for its piece ("n", past --limit 1 too): the manifest
  // is invalid and says why; show still prints everything else.
  rewrite_manifest(dir.file("delta"), [](std::string& m) {
    auto* h = reinterpret_cast<detail::ManifestHeader*>(m.data());
    auto* pieces = reinterpret_cast<detail::ManifestPiece*>(m.data() + sizeof *h +
                                                            h->tensor_count * sizeof(detail::ManifestEntry) +
                                                            h->world_size * 8);
    h->payload_bytes = h->payload_bytes - pieces[1].nbytes + 4;
    pieces[1].nbytes = 4;
  });
  for (const char* limit : {"0", "1"}) {
    Result r = tool({"show", "delta", "--json", "--limit", limit, "--dir", dir.path});
    EXPECT_EQ(r.rc, 0) << r.err;
    json j = r.j();
    const json& m = j.at("manifest");
    EXPECT_EQ(m.at("status"), "invalid");
    EXPECT_NE(m.at("reason").get<std::string>().find("piece 1: a delta blob of impossible size"), std::string::npos)
        << m.dump();
    EXPECT_EQ(m.at("kind"), nullptr);
    EXPECT_EQ(j.at("sync").at("version"), 2);
  }
  Result bad_text = tool({"show", "delta", "--dir", dir.path});
  EXPECT_EQ(bad_text.rc, 0) << bad_text.err;
  EXPECT_NE(bad_text.out.find("MANIFEST  invalid: piece 1: a delta blob of impossible size"), std::string::npos)
      << bad_text.out;
  EXPECT_EQ(bad_text.out.find("sync kind"), std::string::npos) << bad_text.out;
}

// ---------------------------------------------------------------- 5. numbers

TEST(Tool, NonFiniteNegativeAndAbsurdNumbersAreRejected) {
  TempDir dir;
  Producer p = Producer::create("n", small_opts());
  const std::string out = dir.path + "/n.safetensors";
  const std::vector<std::vector<std::string>> bad = {
      {"watch", "n", "--interval", "nan"},        {"watch", "n", "--interval", "inf"},
      {"watch", "n", "--interval", "-1"},         {"watch", "n", "--interval", "0"},
      {"watch", "n", "--count", "-1"},            {"watch", "n", "--count", "1.5"},
      {"watch", "n", "--count", "1e30"},          {"dump", "n", "--out", out, "--timeout", "nan"},
      {"dump", "n", "--out", out, "--timeout", "-5"}, {"dump", "n", "--out", out, "--timeout", "inf"},
      {"dump", "n", "--out", out, "--timeout", "1e12"}, {"gc", "--grace", "nan"},
      {"gc", "--grace", "-1"},                    {"gc", "--grace", "1e300"},
      {"show", "n", "--limit", "-1"},             {"show", "n", "--limit", "nan"},
  };
  for (std::vector<std::string> args : bad) {
    args.push_back("--dir");
    args.push_back(dir.path);
    std::string line;
    for (const auto& a : args) line += a + " ";
    Result r = tool(args, 5s);
    EXPECT_EQ(r.rc, 2) << line << "\nstderr: " << r.err;
    EXPECT_FALSE(r.err.empty()) << line;
  }
  EXPECT_FALSE(exists(out));
  // Sane values still work.
  EXPECT_EQ(tool({"watch", "n", "--count", "1", "--interval", "0.01", "--dir", dir.path}).rc, 0);
  EXPECT_EQ(tool({"gc", "--grace", "3600", "--dry-run", "--dir", dir.path}).rc, 0);
}

// ---------------------------------------------------------------- 5. dump bounds

TEST(Tool, DumpTimeoutBoundsAStalledSync) {
  TempDir dir;
  Producer p = Producer::create("stall", small_opts());
  const std::string out = dir.path + "/stall.safetensors";
  const auto t0 = std::chrono::steady_clock::now();
  Proc dump = spawn_tool({"dump", "stall", "--out", out, "--timeout", "2", "--json", "--dir", dir.path});
  p.wait_for_consumers(1, 20s);
  // Two slots' worth of tensors; the producer writes the first and stalls.
  std::vector<std::uint8_t> a(kSlot);
  ASSERT_EQ(p.begin_sync({{{"a", DType::kU8, {static_cast<std::int64_t>(kSlot)}},
                           {"b", DType::kU8, {static_cast<std::int64_t>(kSlot)}},
                           {"c", DType::kU8, {16}}}}),
            1u);
  p.write(0, a.data());
  Result r = finish(dump, 20s);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(r.rc, 6) << r.err;
  EXPECT_LT(took, 6.0) << "--timeout 2 must bound the whole dump";
  EXPECT_FALSE(exists(out));
  EXPECT_TRUE(temp_files(dir.path).empty());
  p.abort_sync("test over");
}

TEST(Tool, DumpRefusesDuplicateTensorNames) {
  TempDir dir;
  Producer p = Producer::create("dup", small_opts());
  const std::string out = dir.path + "/dup.safetensors";
  Proc dump = spawn_tool({"dump", "dup", "--out", out, "--timeout", "30", "--json", "--dir", dir.path});
  p.wait_for_consumers(1, 20s);
  // Freeze dump, announce a sync and rename its second tensor after the
  // first (same length, so offsets stay valid), re-hashing the manifest.
  ASSERT_TRUE(stop_process(dump.pid));
  SyncData d = make_sync(small_specs(), 1);  // "w.0", "w.1", "b"
  ASSERT_EQ(p.send(d.specs, d.ptrs()), 1u);
  rewrite_manifest(dir.file("dup"), [](std::string& m) {
    const auto* h = reinterpret_cast<const detail::ManifestHeader*>(m.data());
    const detail::ManifestEntry* e1 = manifest_entry(m, 1);
    ASSERT_EQ(m.compare(h->names_offset + e1->name_offset, 3, "w.1"), 0);
    m.replace(h->names_offset + e1->name_offset, 3, "w.0");
  });
  ::kill(dump.pid, SIGCONT);
  Result r = finish(dump, 20s);
  EXPECT_EQ(r.rc, 4) << r.err << r.out;
  EXPECT_NE(r.err.find("twice"), std::string::npos) << r.err;
  EXPECT_FALSE(exists(out));
  EXPECT_TRUE(temp_files(dir.path).empty());
}

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "--role=foreign-producer") return role_foreign_producer(argv[2]);
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
