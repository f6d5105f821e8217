// libFuzzer target: the UCX receiver's active-message handler (the segment
// header {magic, lane, ticket} and the length cap) on arbitrary headers and
// payloads, and the hand-out path behind it (try_receive, release).
//
// The parsing lives in ucx_receiver::on_segment, a private static callback that
// UCX calls from ucp_worker_progress. Nothing in the library is changed for the
// fuzzer: the callback's address is taken through an explicit template
// instantiation (where access checks do not apply, [temp.spec.general]) and
// called directly on a real receiver, with the header and the payload each in
// a heap block of exactly their length (so an over-read is an ASan report) and
// eager receive attributes (rendezvous needs a real UCX data descriptor and is
// not reachable this way). The receiver is real: a UCX context, worker and
// listener on loopback TCP (UCX_TLS=tcp, UCX_NET_DEVICES=lo), one per process;
// where UCX cannot listen there, the target exits 77 at start-up.
//
// Input: byte 0 selects the receiver (bit 0: max_segment_bytes 512 MiB or 64),
// then messages, each: header length (one byte, mod 25), that many header
// bytes, payload length (two bytes, little-endian, clipped to what is left),
// payload bytes, one flag byte (bit 0: the reply-endpoint attribute set, with a
// null endpoint). Every message is handed to on_segment, then the receiver is
// drained with try_receive.
//
// Checked: a message is taken iff its header is 16 bytes with the segment magic
// and a lane < 2 and its payload is within the cap; the segments handed out are
// those, lane 0's before lane 1's, each lane in order, byte for byte; a refused
// message is reported once as corrupted_segment after the segments; the
// receiver is never broken by a message; nothing is held after release.
// Allocation bound: a segment's buffer is its payload's size (run.sh adds
// -malloc_limit_mb=64).
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Iinclude \
//       tests/fuzz/ucx_header.cpp -o /tmp/fuzz_ucx_header -lucp -lucs
//   /tmp/fuzz_ucx_header -max_total_time=60 -malloc_limit_mb=64
//   /tmp/fuzz_ucx_header --make-seeds DIR
#include <stdlib.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/transport/ucx.hpp"

#if !defined(LYNX_HAS_UCX)
#error "tests/fuzz/ucx_header.cpp needs <ucp/api/ucp.h> (Debian: libucx-dev)"
#endif

namespace {

using clock_type = std::chrono::steady_clock;
using am_callback = ucs_status_t (*)(void*, const void*, std::size_t, void*, std::size_t,
                                     const ucp_am_recv_param_t*);

// The private callback's address, through an explicit instantiation.
am_callback on_segment_address();
template <am_callback F>
struct on_segment_thief {
  friend am_callback on_segment_address() { return F; }
};
template struct on_segment_thief<&lynx::ucx_receiver::on_segment>;

[[noreturn]] void failed(const char* why) {
  std::fprintf(stderr, "ucx_header: %s\n", why);
  std::abort();
}

lynx::ucx_receiver* receivers[2] = {nullptr, nullptr};
constexpr std::size_t small_cap = 64;

void make_receivers() {
  ::setenv("UCX_TLS", "tcp", 0);
  ::setenv("UCX_NET_DEVICES", "lo", 0);
  try {
    receivers[0] = new lynx::ucx_receiver("127.0.0.1", 0);
    lynx::ucx_options o;
    o.max_segment_bytes = small_cap;
    receivers[1] = new lynx::ucx_receiver("127.0.0.1", 0, o);
  } catch (const lynx::error& e) {
    std::fprintf(stderr, "ucx_header: SKIP: UCX cannot listen on loopback here: %s\n", e.what());
    std::exit(77);
  }
}

struct expected_segment {
  std::uint8_t lane;
  std::vector<std::byte> bytes;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const int which = data[0] & 1;
  lynx::ucx_receiver& rx = *receivers[which];
  const std::size_t cap = which ? small_cap : std::size_t{512} << 20;
  std::size_t at = 1;
  auto byte = [&]() -> std::uint8_t { return at < size ? data[at++] : 0; };

  std::vector<expected_segment> expected[2];
  bool refused = false;
  for (int messages = 0; at < size && messages < 64; ++messages) {
    const std::size_t header_length = byte() % 25;
    const std::size_t hn = std::min(header_length, size - at);
    // Exactly-sized heap blocks: reading past either is an ASan report.
    std::unique_ptr<std::uint8_t[]> header(new std::uint8_t[header_length ? header_length : 1]);
    std::memset(header.get(), 0, header_length);
    std::memcpy(header.get(), data + at, hn);
    at += hn;
    std::size_t length = byte();
    length |= std::size_t{byte()} << 8;
    length = std::min(length, size - at);
    std::unique_ptr<std::uint8_t[]> payload(new std::uint8_t[length ? length : 1]);
    std::memcpy(payload.get(), data + at, length);
    at += length;
    const std::uint8_t flags = byte();

    ucp_am_recv_param_t param{};
    param.recv_attr = (flags & 1) ? UCP_AM_RECV_ATTR_FIELD_REPLY_EP : 0;
    param.reply_ep = nullptr;
    const ucs_status_t s =
        on_segment_address()(&rx, header.get(), header_length, payload.get(), length, &param);
    if (s != UCS_OK) failed("on_segment returned a status other than UCS_OK for an eager message");

    lynx::detail::ucx_segment_header h;
    if (header_length == sizeof h) std::memcpy(&h, header.get(), sizeof h);
    const bool valid = header_length == sizeof h && h.magic == lynx::detail::ucx_segment_magic &&
                       h.lane < 2 && length <= cap;
    if (valid) {
      const auto* p = reinterpret_cast<const std::byte*>(payload.get());
      expected[h.lane].push_back({h.lane, std::vector<std::byte>(p, p + length)});
    } else {
      refused = true;
    }
  }

  // Drain: lane 0's segments, then lane 1's, then one corrupted_segment if any was refused.
  std::size_t next[2] = {0, 0};
  bool reported = false;
  for (int calls = 0;; ++calls) {
    if (calls > 10000) failed("try_receive never settles");
    lynx::receive_result<clock_type> r;
    try {
      r = rx.try_receive(clock_type::now());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "ucx_header: try_receive threw: %s\n", e.what());
      std::abort();
    }
    if (r.status == lynx::errc::timeout) break;
    if (r.status == lynx::errc::corrupted_segment) {
      if (reported || !refused) failed("corrupted_segment reported without a refused message");
      if (next[0] != expected[0].size() || next[1] != expected[1].size())
        failed("corrupted_segment reported before the segments that arrived");
      reported = true;
      continue;
    }
    if (r.status != lynx::errc::ok) failed("the receiver broke on a message");
    const auto lane = r.segment.lane;
    if (lane >= 2 || next[lane] >= expected[lane].size()) failed("an unexpected segment");
    if (lane == 1 && next[0] != expected[0].size()) failed("lane 1 handed out before lane 0");
    const auto& want = expected[lane][next[lane]++].bytes;
    if (r.segment.bytes.size() != want.size() ||
        (!want.empty() && std::memcmp(r.segment.bytes.data(), want.data(), want.size()) != 0))
      failed("a segment's bytes differ from its message's payload");
    rx.release(r.segment);
  }
  if (next[0] != expected[0].size() || next[1] != expected[1].size())
    failed("a taken message was never handed out");
  if (refused && !reported) failed("a refused message was never reported");
  if (rx.held() != 0) failed("segments held after release");
  if (rx.status() != lynx::errc::ok) failed("the receiver is broken");
  return 0;
}

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i + 1 < *argc; ++i) {
    if (std::strcmp((*argv)[i], "--make-seeds") != 0) continue;
    const std::string dir = (*argv)[i + 1];
    auto message = [](std::vector<std::uint8_t>& in, std::uint8_t lane, std::uint64_t ticket,
                      std::size_t n, std::uint8_t flags) {
      lynx::detail::ucx_segment_header h;
      h.lane = lane;
      h.ticket = ticket;
      in.push_back(sizeof h);
      const auto* p = reinterpret_cast<const std::uint8_t*>(&h);
      in.insert(in.end(), p, p + sizeof h);
      in.push_back(static_cast<std::uint8_t>(n));
      in.push_back(static_cast<std::uint8_t>(n >> 8));
      for (std::size_t k = 0; k < n; ++k) in.push_back(static_cast<std::uint8_t>(k * 13 + ticket));
      in.push_back(flags);
    };
    std::vector<std::vector<std::uint8_t>> seeds;
    for (std::uint8_t which : {0, 1}) {
      std::vector<std::uint8_t> in{which};
      message(in, 0, 1, 48, 1);
      message(in, 1, 2, 160, 1);
      message(in, 0, 3, 0, 0);
      message(in, 1, 4, 64, 0);
      seeds.push_back(in);
    }
    for (std::size_t k = 0; k < seeds.size(); ++k) {
      std::ofstream out(dir + "/seed_" + std::to_string(k), std::ios::binary);
      out.write(reinterpret_cast<const char*>(seeds[k].data()),
                static_cast<std::streamsize>(seeds[k].size()));
      if (!out) {
        std::fprintf(stderr, "ucx_header: cannot write seeds in %s\n", dir.c_str());
        std::exit(1);
      }
    }
    std::printf("ucx_header: %zu seeds written to %s\n", seeds.size(), dir.c_str());
    std::exit(0);
  }
  make_receivers();
  return 0;
}
