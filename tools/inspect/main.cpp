// shmcast-inspect: see inside shmcast regions without disturbing them.
//
//   shmcast-inspect list                     every region in the directory
//   shmcast-inspect show NAME                header, seats, slots, manifest, errors
//   shmcast-inspect watch NAME               live view (Ctrl-C to quit)
//   shmcast-inspect dump NAME --out F        next sync as a .safetensors file
//   shmcast-inspect gc [--dry-run]           remove regions nobody uses any more
//   shmcast-inspect rm NAME [--force]        remove one region
//
// Only dump, gc and rm act; every other verb opens regions read-only and
// never takes a lock or writes a byte. docs/inspect.md documents the JSON
// documents (--json) and the exit codes.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <string>

#include "commands.hpp"
#include "format.hpp"
#include "shmcast/probe.hpp"
#include "shmcast/shmcast.hpp"

using namespace shmcast::inspect;

namespace {

const char* kFooter = R"(Regions are the files shmcast.<name> in the region directory: --dir, else
$SHMCAST_DIR, else /dev/shm.

Region states: creating, ready, closed, dead, corrupt, foreign, newer-version,
older-version, truncated, unreadable, untrusted-owner. Liveness comes from the
OFD locks each participant holds on its byte of the region file, so it is
right across PID namespaces and immune to pid reuse. A file owned by another
user, or writable by users outside the caller's groups, is untrusted-owner:
its bytes are never read, dump refuses it, gc never removes it and rm only
with --force. Symlinks are never followed; FIFOs, sockets, devices and
directories are foreign.

Read-only: list, show and watch open regions read-only and never lock or write.
Acting:    dump attaches as a consumer; gc and rm remove region files.

--json prints one JSON document on stdout (watch: one document per refresh,
one per line). The fields are documented in docs/inspect.md (schema 1).

Exit codes:
  0    success
  1    failure (I/O error, region error during dump, gc could not remove one)
  2    usage error (bad option, bad region name)
  3    region not found
  4    show/dump: the region is corrupt, foreign, truncated, unreadable,
       untrusted-owner or of another layout version (show still prints its
       report); dump: the region was truncated under it, or its manifest
       names a tensor twice
  5    refused: rm while a participant is alive or of an untrusted-owner
       file (use --force); dump when --out exists (use --overwrite)
  6    dump: not done within --timeout (which bounds the whole dump)
  7    dump: not enough free space for the output file
  130  dump: interrupted (the temporary file is removed)

dump never ends by a signal and never leaves its temporary file behind.)";

// Numbers on the command line: finite, within [lo, hi], whole when `whole`.
// (CLI::Range alone lets "nan" through, and "-1" wraps into an unsigned.)
CLI::Validator number(double lo, double hi, bool whole) {
  auto text = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v);
    return std::string(buf);
  };
  const std::string desc = (whole ? "INT in [" : "NUMBER in [") + text(lo) + " - " + text(hi) + "]";
  return CLI::Validator(
      [=](std::string& in) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(in.c_str(), &end);
        if (in.empty() || end != in.c_str() + in.size()) return "'" + in + "' is not a number";
        if (!std::isfinite(v)) return "must be a finite number, not '" + in + "'";
        if (v < lo || v > hi) return "must be between " + text(lo) + " and " + text(hi) + ", not " + in;
        if (whole && v != std::floor(v)) return "must be a whole number, not " + in;
        return {};
      },
      desc);
}

}  // namespace

int main(int argc, char** argv) {
  shmcast::probe::install_bus_guard();

  CLI::App app{"shmcast-inspect: see, watch, dump and clean shmcast shared-memory regions", "shmcast-inspect"};
  app.footer(kFooter);
  app.require_subcommand(1);
  app.set_version_flag("--version", "shmcast-inspect " + std::to_string(shmcast::kVersionMajor) + "." +
                                        std::to_string(shmcast::kVersionMinor) + " (region layout " +
                                        std::to_string(shmcast::probe::layout_version()) + ", JSON schema " +
                                        std::to_string(kSchemaVersion) + ")");
  std::string dir_opt;
  app.add_option("--dir", dir_opt, "Region directory (default: $SHMCAST_DIR, else /dev/shm)");

  bool json = false;
  auto add_json = [&](CLI::App* sub) {
    sub->add_option("--dir", dir_opt, "Region directory (default: $SHMCAST_DIR, else /dev/shm)");
    sub->add_flag("--json", json,
                  sub->get_name() == "watch" ? "Print one JSON document per refresh, one per line (docs/inspect.md)"
                                             : "Print one JSON document on stdout (fields: docs/inspect.md)");
  };

  CLI::App* list = app.add_subcommand("list", "List every region in the directory with its state (read-only)");
  add_json(list);

  std::string name;
  std::size_t limit = 50;
  CLI::App* show = app.add_subcommand(
      "show", "Show one region: header, seats, slots, the current manifest and the last errors (read-only)");
  show->add_option("NAME", name, "Region name")->required();
  show->add_option("--limit", limit, "Tensor rows of the manifest to show (only these are decoded); 0 shows all")
      ->check(number(0, 1e9, true))
      ->capture_default_str();
  add_json(show);

  double interval = 1.0;
  std::uint64_t count = 0;
  CLI::App* watch = app.add_subcommand(
      "watch", "Live view of one region: slot states, sync version, throughput; Ctrl-C quits (read-only)");
  watch->add_option("NAME", name, "Region name")->required();
  watch->add_option("--interval", interval, "Seconds between refreshes")
      ->check(number(0.01, 86400, false))
      ->capture_default_str();
  watch->add_option("--count", count, "Stop after this many refreshes; 0 runs until Ctrl-C")
      ->check(number(0, 1e9, true))
      ->capture_default_str();
  add_json(watch);

  std::string out;
  double timeout = 60.0;
  bool overwrite = false;
  CLI::App* dump = app.add_subcommand(
      "dump", "Attach as a consumer, receive the NEXT sync and write it as a .safetensors file (acts)");
  dump->add_option("NAME", name, "Region name")->required();
  dump->add_option("--out,-o", out, "Output file (written to a temporary file in the same directory, then renamed)")
      ->required();
  dump->add_option("--timeout", timeout,
                    "Seconds the whole dump may take: waiting for the region and the next sync, receiving and "
                    "writing it")
      ->check(number(0, 604800, false))
      ->capture_default_str();
  dump->add_flag("--overwrite", overwrite, "Replace --out if it exists");
  add_json(dump);

  bool dry_run = false;
  double grace = 60.0;
  CLI::App* gc = app.add_subcommand(
      "gc", "Remove regions whose producer and consumers are all dead; never a live one (acts)");
  gc->add_flag("--dry-run,-n", dry_run, "Only report what would be removed");
  gc->add_option("--grace", grace,
                 "Seconds during which a region being created (or a damaged file) is left alone")
      ->check(number(0, 31536000, false))
      ->capture_default_str();
  add_json(gc);

  bool force = false;
  CLI::App* rm = app.add_subcommand("rm", "Remove one region; refused while a participant is alive (acts)");
  rm->add_option("NAME", name, "Region name")->required();
  rm->add_flag("--force,-f", force, "Remove it even while participants are alive (they keep their mapping)");
  add_json(rm);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }

  Common c;
  c.dir = shmcast::probe::resolve_dir(dir_opt);
  c.json = json;
  const char* command = list->parsed()    ? "list"
                        : show->parsed()  ? "show"
                        : watch->parsed() ? "watch"
                        : dump->parsed()  ? "dump"
                        : gc->parsed()    ? "gc"
                                          : "rm";
  try {
    if (list->parsed()) return cmd_list(c);
    if (show->parsed()) return cmd_show(c, name, limit);
    if (watch->parsed()) return cmd_watch(c, name, interval, count);
    if (dump->parsed()) return cmd_dump(c, name, out, timeout, overwrite);
    if (gc->parsed()) return cmd_gc(c, dry_run, grace);
    if (rm->parsed()) return cmd_rm(c, name, force);
  } catch (const std::exception& e) {
    return fail(c, command, kExitFailure, e.what());
  }
  return kExitUsage;
}
