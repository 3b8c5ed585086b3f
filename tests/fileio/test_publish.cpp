// publish(): a checkpoint reaches consumers in other processes bit-exact;
// shmcast-publish as a process (its options, exit codes, JSON, signals);
// and the round trip publish -> shmcast-inspect dump -> the same tensors.
// Every process is real (fork, or fork/exec of the tools); waits are
// handshakes (a consumer's open, a line the tool prints), each with a
// deadline.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <sstream>
#include <thread>

#include "proc_support.hpp"
#include "st_support.hpp"

using namespace st_test;
using namespace std::chrono_literals;
namespace sf = shmcast::safetensors;
using shmcast::Errc;
using shmcast_test::Child;
using shmcast_test::RegionGuard;
using shmcast_test::unique_name;

namespace {

const std::string kPublish = SHMCAST_PUBLISH_BIN;

using shmcast_test::Proc;

// A run of a tool, its stdout and stderr in files of their own (removed with it).
Proc tool(const std::vector<std::string>& argv, const std::string& tag) {
  const std::string base = "/tmp/shmcast-pubtest-" + tag + "-" + std::to_string(::getpid());
  return Proc::start(argv, {.log = base + ".out", .err = base + ".err", .remove_logs = true});
}

// The last JSON line of a tool's stdout.
json last_json(const std::string& text) {
  std::istringstream in(text);
  std::string line, last;
  while (std::getline(in, line))
    if (!line.empty() && line[0] == '{') last = line;
  return last.empty() ? json() : json::parse(last);
}

shmcast::ConsumerOptions consumer_options() {
  shmcast::ConsumerOptions o;
  o.pin = shmcast::Pin::kNo;
  o.open_timeout = 30s;
  o.chunk_timeout = 30s;
  return o;
}

// Receives one sync and compares every tensor with `want` (by name): 0 when
// bit-exact, 12 on a difference, 13 on a wrong tensor list.
int receive_and_compare(shmcast::Consumer& c, const std::vector<Tensor>& want, std::uint64_t* version = nullptr) {
  const shmcast::SyncInfo& info = c.wait_sync(30s);
  if (version) *version = info.version;
  if (info.tensors.size() != want.size()) return 13;
  std::vector<std::vector<std::uint8_t>> got(info.tensors.size());
  std::vector<void*> dst;
  for (std::size_t i = 0; i < info.tensors.size(); ++i) {
    got[i].assign(info.tensors[i].nbytes, 0xEE);
    dst.push_back(got[i].data());
  }
  c.read_into(dst);
  for (std::size_t i = 0; i < info.tensors.size(); ++i) {
    const Tensor* w = nullptr;
    for (const Tensor& t : want)
      if (t.name == info.tensors[i].name) w = &t;
    if (!w) return 13;
    shmcast::DType d;
    if (!sf::to_shmcast(w->dtype, &d) || d != info.tensors[i].dtype || w->shape != info.tensors[i].shape) return 13;
    if (got[i] != w->data) return 12;
  }
  return 0;
}

// A checkpoint with tensors larger than a 2 MiB slot, sharded in two.
std::vector<Tensor> make_checkpoint(const fs::path& dir) {
  std::vector<Tensor> a = {make_tensor("embed", "BF16", {1500, 1024}, 1), make_tensor("norm", "F32", {1024}, 2),
                           make_tensor("scalar", "I64", {}, 3), make_tensor("empty", "F16", {0, 7}, 4)};
  std::vector<Tensor> b = {make_tensor("layers.0.w", "BF16", {700, 999}, 5), make_tensor("mask", "BOOL", {77}, 6),
                           make_tensor("fp8", "F8_E4M3", {333, 3}, 7), make_tensor("u", "U16", {5, 5}, 8)};
  write_file(dir / "model-1.safetensors", file_bytes(a, {{"format", "pt"}}));
  write_file(dir / "model-2.safetensors", file_bytes(b));
  json wm = json::object();
  for (const Tensor& t : a) wm[t.name] = "model-1.safetensors";
  for (const Tensor& t : b) wm[t.name] = "model-2.safetensors";
  write_text(dir / "model.safetensors.index.json", json{{"weight_map", wm}}.dump());
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

shmcast::ProducerOptions producer_options(const sf::Checkpoint& c) {
  shmcast::ProducerOptions o;
  o.slot_bytes = 2 << 20;
  o.slots = 2;
  o.pin = shmcast::Pin::kNo;
  o.engine = shmcast::CopyEngine::kHost;
  o.consumer_timeout = 30s;
  o.manifest_bytes = sf::manifest_bytes_for(c);
  return o;
}

}  // namespace

// ---------------------------------------------------------------- the library function

TEST(Publish, ConsumerInAnotherProcessGetsEveryByte) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const std::string name = unique_name("pub");
  RegionGuard g{name};
  Child child = Child::spawn([&] {
    shmcast::Consumer c = shmcast::Consumer::open(name, consumer_options());
    return receive_and_compare(c, want);
  });
  const sf::Checkpoint ckpt = sf::open_checkpoint(d.path.string());
  shmcast::Producer p = shmcast::Producer::create(name, producer_options(ckpt));
  sf::PublishOptions o;
  o.wait_consumers = 1;
  o.wait_timeout = 30s;
  o.read.window_bytes = 1 << 20;  // several windows, one tensor larger than a window
  const sf::PublishStats s = sf::publish(p, ckpt, o);
  EXPECT_EQ(child.wait(60s), 0);
  EXPECT_EQ(s.version, 1u);
  EXPECT_EQ(s.consumers, 1u);
  EXPECT_EQ(s.tensors, want.size());
  EXPECT_EQ(s.payload_bytes, ckpt.payload_bytes());
  EXPECT_FALSE(s.read.path.empty());
}

TEST(Publish, EveryIoPathDeliversTheSameBytes) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const sf::Checkpoint ckpt = sf::open_checkpoint(d.path.string());
  for (sf::IoPath path : {sf::IoPath::kDirect, sf::IoPath::kBuffered, sf::IoPath::kPread}) {
    if (path == sf::IoPath::kDirect && !supports_direct(d.path)) continue;
    SCOPED_TRACE(std::string(sf::io_path_name(path)));
    const std::string name = unique_name("pubpath");
    RegionGuard g{name};
    Child child = Child::spawn([&] {
      shmcast::Consumer c = shmcast::Consumer::open(name, consumer_options());
      return receive_and_compare(c, want);
    });
    shmcast::Producer p = shmcast::Producer::create(name, producer_options(ckpt));
    sf::PublishOptions o;
    o.wait_consumers = 1;
    o.read.path = path;
    sf::PublishStats s;
    try {
      s = sf::publish(p, ckpt, o);
    } catch (const shmcast::Error& e) {
      if (e.code() == Errc::kPermission) {  // io_uring denied here: only pread can be forced
        child.kill9();
        continue;
      }
      throw;
    }
    EXPECT_EQ(child.wait(60s), 0);
    EXPECT_EQ(s.read.path, sf::io_path_name(path));
  }
}

TEST(Publish, ReadFailureAbortsTheSyncForConsumers) {
  TempDir d;
  make_checkpoint(d.path);
  const sf::Checkpoint ckpt = sf::open_checkpoint(d.path.string());
  fs::resize_file(d / "model-2.safetensors", fs::file_size(d / "model-2.safetensors") - 100);
  const std::string name = unique_name("pubabort");
  RegionGuard g{name};
  Child child = Child::spawn([&] {
    shmcast::Consumer c = shmcast::Consumer::open(name, consumer_options());
    try {
      const shmcast::SyncInfo& info = c.wait_sync(30s);
      std::vector<std::vector<std::uint8_t>> got(info.tensors.size());
      std::vector<void*> dst;
      for (std::size_t i = 0; i < got.size(); ++i) {
        got[i].resize(info.tensors[i].nbytes);
        dst.push_back(got[i].data());
      }
      c.read_into(dst);
    } catch (const shmcast::Error& e) {
      if (e.code() == Errc::kAborted && std::string(e.what()).find("truncated") != std::string::npos) return 0;
      std::fprintf(stderr, "consumer: %s\n", e.what());
      return 1;
    }
    return 2;
  });
  shmcast::Producer p = shmcast::Producer::create(name, producer_options(ckpt));
  sf::PublishOptions o;
  o.wait_consumers = 1;
  o.read.path = sf::IoPath::kPread;
  try {
    sf::publish(p, ckpt, o);
    ADD_FAILURE() << "publish of a truncated shard succeeded";
  } catch (const shmcast::Error& e) {
    EXPECT_EQ(e.code(), Errc::kCorrupt) << e.what();
  }
  EXPECT_EQ(child.wait(60s), 0);
}

TEST(Publish, StopFlagAbortsTheSync) {
  TempDir d;
  make_checkpoint(d.path);
  const sf::Checkpoint ckpt = sf::open_checkpoint(d.path.string());
  const std::string name = unique_name("pubstop");
  RegionGuard g{name};
  shmcast::Producer p = shmcast::Producer::create(name, producer_options(ckpt));
  std::atomic<bool> stop{true};
  sf::PublishOptions o;
  o.stop = &stop;
  try {
    sf::publish(p, ckpt, o);
    ADD_FAILURE() << "not stopped";
  } catch (const shmcast::Error& e) {
    EXPECT_EQ(e.code(), Errc::kAborted) << e.what();
  }
  stop = false;
  EXPECT_EQ(sf::publish(p, ckpt, o).version, 2u);  // the next sync starts afresh
}

TEST(Publish, ManyTensorsGetTheManifestRoomTheyNeed) {
  TempDir d;
  std::vector<Tensor> ts;
  for (int i = 0; i < 12000; ++i)
    ts.push_back(make_tensor("model.layers." + std::to_string(i) + ".a_rather_long_parameter_name_" +
                                 std::string(40, 'x'),
                             "U8", {1}, static_cast<std::uint64_t>(i)));
  write_file(d / "many.safetensors", file_bytes(ts));
  const sf::Checkpoint ckpt = sf::open_checkpoint((d / "many.safetensors").string());
  EXPECT_GT(sf::manifest_bytes_for(ckpt), 1u << 20);
  const std::string name = unique_name("pubmany");
  RegionGuard g{name};
  shmcast::Producer p = shmcast::Producer::create(name, producer_options(ckpt));
  EXPECT_EQ(sf::publish(p, ckpt).tensors, ts.size());
}

// ---------------------------------------------------------------- the tool

TEST(PublishTool, ConsumerGetsEveryByteAndTheToolReportsJson) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const std::string name = unique_name("tool");
  RegionGuard g{name};
  Proc p = tool({kPublish, d.path.string(), "--region", name, "--slot-mb", "2", "--wait-consumers", "1",
                        "--json", "--window-mb", "1"},
                       "tool");
  shmcast::Consumer c = shmcast::Consumer::open(name, consumer_options());
  EXPECT_EQ(receive_and_compare(c, want), 0);
  ASSERT_EQ(p.wait(), 0) << p.both();
  const json j = last_json(p.stdout_text());
  EXPECT_EQ(j.value("ok", false), true) << p.both();
  EXPECT_EQ(j.value("tensors", 0), static_cast<int>(want.size()));
  EXPECT_EQ(j.value("files", 0), 2);
  EXPECT_EQ(j.value("version", 0), 1);
  EXPECT_EQ(j.value("consumers", 0), 1);
  EXPECT_TRUE(j["io"].contains("path"));
  EXPECT_EQ(::access(shmcast::region_path(name).c_str(), F_OK), -1);  // removed at exit
}

// --store --keep: the checkpoint stays in a store region after the tool
// exits; consumers that come later get it at once, bit-exact.
TEST(PublishTool, StoreKeepsTheCheckpointForConsumersThatComeLater) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const std::string name = unique_name("store");
  RegionGuard g{name};
  Proc p = tool({kPublish, d.path.string(), "--region", name, "--store", "--keep", "--json"}, "tool");
  ASSERT_EQ(p.wait(), 0) << p.both();
  const json j = last_json(p.stdout_text());
  EXPECT_EQ(j.value("mode", ""), "store") << p.both();
  EXPECT_EQ(j.value("consumers", -1), 0);
  ASSERT_EQ(::access(shmcast::region_path(name).c_str(), F_OK), 0) << "--keep left no region";
  for (int k = 0; k < 2; ++k) {  // two consumers, one after the other, the tool long gone
    shmcast::Consumer c = shmcast::Consumer::open(name, consumer_options());
    EXPECT_EQ(c.mode(), shmcast::RegionMode::kStore);
    EXPECT_EQ(receive_and_compare(c, want), 0);
  }
}

TEST(PublishTool, IoOptionSelectsThePath) {
  TempDir d;
  make_checkpoint(d.path);
  std::vector<std::string> paths = {"pread", "buffered"};
  if (supports_direct(d.path)) paths.push_back("direct");
  for (const std::string& io : paths) {
    const std::string name = unique_name("toolio");
    RegionGuard g{name};
    Proc p = tool({kPublish, d.path.string(), "--region", name, "--slot-mb", "2", "--io", io, "--json"},
                         "toolio");
    const int rc = p.wait();
    const json j = last_json(p.stdout_text());
    if (io != "pread" && rc == 1 && p.stderr_text().find("io_uring is not available") != std::string::npos) continue;
    ASSERT_EQ(rc, 0) << io << "\n" << p.both();
    EXPECT_EQ(j["io"].value("path", ""), io) << p.both();
    if (io == "direct") {
      EXPECT_GT(j["io"].value("direct_bytes", 0ull), 0ull);
    }
    if (io == "pread") {
      EXPECT_EQ(j["io"].value("direct_bytes", 1ull), 0ull);
    }
  }
}

TEST(PublishTool, RepeatPublishesSeveralSyncs) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  const std::string name = unique_name("toolrep");
  RegionGuard g{name};
  Proc p = tool({kPublish, d.path.string(), "--region", name, "--slot-mb", "2", "--wait-consumers", "1",
                        "--repeat", "3"},
                       "toolrep");
  shmcast::Consumer c = shmcast::Consumer::open(name, consumer_options());
  for (std::uint64_t v = 1; v <= 3; ++v) {
    std::uint64_t got = 0;
    EXPECT_EQ(receive_and_compare(c, want, &got), 0);
    EXPECT_EQ(got, v);
  }
  ASSERT_EQ(p.wait(), 0) << p.both();
  EXPECT_NE(p.stdout_text().find("published sync 3"), std::string::npos) << p.both();
}

TEST(PublishTool, SigtermWhileWaitingForConsumersExits130AndRemovesTheRegion) {
  TempDir d;
  make_checkpoint(d.path);
  const std::string name = unique_name("toolsig");
  RegionGuard g{name};
  Proc p = tool({kPublish, d.path.string(), "--region", name, "--slot-mb", "2", "--wait-consumers", "1",
                        "--wait-timeout", "60"},
                       "toolsig");
  ASSERT_TRUE(p.wait_stderr("waiting for 1 consumer")) << p.both();
  EXPECT_EQ(::access(shmcast::region_path(name).c_str(), F_OK), 0);
  ::kill(p.pid, SIGTERM);
  EXPECT_EQ(p.wait(), 130) << p.both();
  EXPECT_EQ(::access(shmcast::region_path(name).c_str(), F_OK), -1);
}

TEST(PublishTool, WaitTimeoutExits6) {
  TempDir d;
  make_checkpoint(d.path);
  const std::string name = unique_name("tooltmo");
  RegionGuard g{name};
  Proc p = tool({kPublish, d.path.string(), "--region", name, "--slot-mb", "2", "--wait-consumers", "1",
                        "--wait-timeout", "0.2", "--json"},
                       "tooltmo");
  EXPECT_EQ(p.wait(), 6) << p.both();
  EXPECT_EQ(last_json(p.stdout_text()).value("exit_code", 0), 6);
}

TEST(PublishTool, InvalidCheckpointExits4WithoutCreatingTheRegion) {
  TempDir d;
  write_file(d / "bad.safetensors", raw_file(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,5]}})", 5));
  const std::string name = unique_name("toolbad");
  RegionGuard g{name};
  Proc p = tool({kPublish, (d / "bad.safetensors").string(), "--region", name, "--json"}, "toolbad");
  EXPECT_EQ(p.wait(), 4) << p.both();
  EXPECT_NE(p.stderr_text().find("needs 4"), std::string::npos) << p.both();
  EXPECT_EQ(last_json(p.stdout_text()).value("ok", true), false);
  EXPECT_EQ(::access(shmcast::region_path(name).c_str(), F_OK), -1);
}

TEST(PublishTool, UnsupportedDtypeExits1WithoutCreatingTheRegion) {
  TempDir d;
  write_file(d / "f4.safetensors", file_bytes({make_tensor("q", "F4", {8}, 1)}));
  const std::string name = unique_name("toolf4");
  RegionGuard g{name};
  Proc p = tool({kPublish, (d / "f4.safetensors").string(), "--region", name}, "toolf4");
  EXPECT_EQ(p.wait(), 1) << p.both();
  EXPECT_NE(p.stderr_text().find("F4"), std::string::npos) << p.both();
  EXPECT_EQ(::access(shmcast::region_path(name).c_str(), F_OK), -1);
}

TEST(PublishTool, MissingCheckpointExits3) {
  Proc p = tool({kPublish, "/nonexistent/ckpt", "--region", unique_name("toolnf")}, "toolnf");
  EXPECT_EQ(p.wait(), 3) << p.both();
}

TEST(PublishTool, UsageErrorsExit2) {
  TempDir d;
  make_checkpoint(d.path);
  for (const auto& args : std::vector<std::vector<std::string>>{
           {kPublish, d.path.string()},                                       // no --region
           {kPublish, d.path.string(), "--region", "bad/name"},               // bad region name
           {kPublish, d.path.string(), "--region", "x", "--request-kb", "3"}, // not a power of two
           {kPublish, d.path.string(), "--region", "x", "--io", "mmap"},
           {kPublish, d.path.string(), "--region", "x", "--slots", "1"},
       }) {
    Proc p = tool(args, "toolusage");
    EXPECT_EQ(p.wait(), 2) << args.back() << "\n" << p.both();
  }
}

TEST(PublishTool, ListValidatesAndListsWithoutARegion) {
  TempDir d;
  const auto want = make_checkpoint(d.path);
  Proc p = tool({kPublish, d.path.string(), "--list", "--json"}, "toollist");
  ASSERT_EQ(p.wait(), 0) << p.both();
  const json j = last_json(p.stdout_text());
  EXPECT_EQ(j.value("sharded", false), true);
  ASSERT_EQ(j["tensors"].size(), want.size());
  EXPECT_EQ(j["files"][0]["metadata"].value("format", ""), "pt");
}

#ifdef SHMCAST_INSPECT_BIN
// publish -> shmcast-inspect dump -> a safetensors file with the same
// tensors, bit for bit, and (dump writes the tensors in stream order, which
// publish makes the files' order) a data section equal to the source's.
TEST(PublishTool, RoundTripThroughDumpIsBitExact) {
  TempDir d;
  fs::create_directory(d / "ckpt");
  const auto want = make_checkpoint(d / "ckpt");
  const std::string name = unique_name("tooldump");
  RegionGuard g{name};
  Proc pub = tool({kPublish, (d / "ckpt").string(), "--region", name, "--slot-mb", "2", "--wait-consumers",
                          "1", "--json"},
                         "tooldump-p");
  const fs::path out = d / "dumped.safetensors";
  Proc dump = tool({SHMCAST_INSPECT_BIN, "dump", name, "--out", out.string(), "--timeout", "60", "--json"},
                          "tooldump-d");
  ASSERT_EQ(dump.wait(), 0) << dump.both();
  ASSERT_EQ(pub.wait(), 0) << pub.both();

  const sf::Checkpoint src = sf::open_checkpoint((d / "ckpt").string());
  const sf::Checkpoint back = sf::open_checkpoint(out.string());
  ASSERT_EQ(back.tensors().size(), src.tensors().size());
  std::vector<std::vector<std::uint8_t>> a(src.tensors().size()), b(back.tensors().size());
  std::vector<void*> pa, pb;
  for (std::size_t i = 0; i < a.size(); ++i) {
    a[i].resize(src.tensors()[i].nbytes);
    b[i].resize(back.tensors()[i].nbytes);
    pa.push_back(a[i].data());
    pb.push_back(b[i].data());
  }
  sf::read_tensors(src, pa);
  sf::read_tensors(back, pb);
  for (std::size_t i = 0; i < a.size(); ++i) {
    const sf::TensorEntry& s = src.tensors()[i];
    const sf::TensorEntry& r = back.tensors()[i];  // same order: stream order = file order
    EXPECT_EQ(r.name, s.name);
    EXPECT_EQ(r.dtype, s.dtype);
    EXPECT_EQ(r.shape, s.shape);
    EXPECT_EQ(b[i], a[i]) << s.name;
  }
  // The data sections: the shards' back to back.
  std::vector<std::uint8_t> src_data;
  for (const sf::CheckpointFile& f : src.files()) {
    const auto bytes = read_file(f.path);
    src_data.insert(src_data.end(), bytes.begin() + static_cast<std::ptrdiff_t>(f.header.data_start), bytes.end());
  }
  const auto dumped = read_file(out);
  const std::vector<std::uint8_t> dump_data(dumped.begin() + static_cast<std::ptrdiff_t>(back.files()[0].header.data_start),
                                            dumped.end());
  EXPECT_EQ(dump_data, src_data);
  EXPECT_EQ(back.files()[0].header.metadata.at("shmcast_region"), name);
}
#endif
