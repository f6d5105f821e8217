// libFuzzer target: the TCP transport's frame reader (lynx::tcp_receiver) on
// arbitrary byte streams. Each lane is a connected AF_UNIX stream socketpair
// (the receiver only needs a stream socket); the harness writes the input's
// bytes into the peer ends in input-chosen chunks, lanes and orders, with
// try_receive called between chunks, then optionally ends every lane (EOF) and
// drains the receiver.
//
// Input: byte 0 = flags (bit 0: two lanes; bit 1: end the lanes with EOF;
// bits 2-3: tcp_options::max_segment_bytes = 512 MiB, 0, 100 or 4096), then
// operations, each one byte h and its operands:
//   h>>5 == 0,1  raw bytes: the next (h & 0x3f) + 1 input bytes, as they are;
//   h>>5 == 2    a well-formed frame: ticket = next byte, length = next byte,
//                then that many input bytes (zeros past the end);
//   h>>5 == 3    a frame announcing the next 4 bytes (u32) as its length,
//                followed by (h & 0x1f) x 96 KiB of zero bytes (4 MiB per
//                input at most): a large announcement with little or much
//                behind it;
// the lane is h >> 7 (lane 0 with one lane). Bit 7 doubles as the lane bit, so
// with two lanes kinds 0-1 go to lane 0 and kinds 2-3 to lane 1 unless the
// raw bytes carry their own frames.
//
// Checked (any failure aborts):
//  - a reference parser of each lane's stream says which frames are complete
//    before the first framing error (wrong magic, length over the cap); every
//    segment handed out on a lane is the next of those, byte for byte;
//  - with every lane ended and no framing error, every complete frame is
//    handed out and then peer_failure is reported; with a framing error on a
//    lane, corrupted_segment is reported once, then transport_failure stays;
//    a deadline of 2 s passing with every byte written and every lane ended is
//    a hang;
//  - the acks read back on each lane are well formed (magic, reserved 0) and
//    are the tickets of the segments handed out on that lane, in order;
//  - memory: body_bytes_in_flight() <= sum over lanes of max(1 MiB, 2 x bytes
//    written to that lane), whatever a frame announces (the documented bound;
//    run.sh adds -malloc_limit_mb=64, so a buffer sized by an announced length
//    of up to 512 MiB fails as an allocation over the limit).
// Refusals by the receiver are statuses (it does not throw on stream content);
// a lynx::error thrown from try_receive fails.
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Iinclude \
//       tests/fuzz/tcp_frames.cpp -o /tmp/fuzz_tcp_frames
//   /tmp/fuzz_tcp_frames -max_total_time=60 -malloc_limit_mb=64
//   /tmp/fuzz_tcp_frames --make-seeds DIR   # writes valid seed streams, then exits
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/transport/tcp.hpp"

namespace {

using clock_type = std::chrono::steady_clock;

[[noreturn]] void failed(const char* why) {
  std::fprintf(stderr, "tcp_frames: %s\n", why);
  std::abort();
}

struct ref_frame {
  std::uint64_t ticket;
  std::vector<std::byte> body;
};

// Complete frames of one lane's stream before its first framing error.
struct ref_lane {
  std::vector<ref_frame> frames;
  bool framing_error = false;
};

ref_lane parse_reference(const std::vector<std::byte>& s, std::size_t cap) {
  ref_lane r;
  std::size_t at = 0;
  while (s.size() - at >= sizeof(lynx::tcp_wire::frame)) {
    lynx::tcp_wire::frame f;
    std::memcpy(&f, s.data() + at, sizeof f);
    at += sizeof f;
    if (f.magic != lynx::tcp_wire::frame_magic || f.bytes > cap) {
      r.framing_error = true;
      return r;
    }
    if (s.size() - at < f.bytes) return r;
    r.frames.push_back(
        {f.ticket, std::vector<std::byte>(s.begin() + static_cast<std::ptrdiff_t>(at),
                                          s.begin() + static_cast<std::ptrdiff_t>(at + f.bytes))});
    at += static_cast<std::size_t>(f.bytes);
  }
  return r;
}

struct lane_io {
  lynx::tcp_socket peer;             // the sender's end: the harness writes here
  std::vector<std::byte> written;    // every byte written, for the reference parser
  std::vector<ref_frame> handed;     // segments handed out on this lane
  std::vector<std::byte> ack_bytes;  // acks read back, not yet parsed
  std::vector<std::uint64_t> acks;   // tickets acked, in order
};

void read_acks(lane_io& l) {
  std::array<std::byte, 4096> buf;
  while (true) {
    const ssize_t r = ::recv(l.peer.fd(), buf.data(), buf.size(), MSG_DONTWAIT);
    if (r <= 0) break;
    l.ack_bytes.insert(l.ack_bytes.end(), buf.begin(), buf.begin() + r);
  }
  std::size_t at = 0;
  for (; l.ack_bytes.size() - at >= sizeof(lynx::tcp_wire::ack);
       at += sizeof(lynx::tcp_wire::ack)) {
    lynx::tcp_wire::ack a;
    std::memcpy(&a, l.ack_bytes.data() + at, sizeof a);
    if (a.magic != lynx::tcp_wire::ack_magic || a.reserved != 0) failed("a malformed ack");
    l.acks.push_back(a.ticket);
  }
  l.ack_bytes.erase(l.ack_bytes.begin(), l.ack_bytes.begin() + static_cast<std::ptrdiff_t>(at));
}

struct harness {
  std::vector<lane_io> lanes;
  lynx::tcp_receiver receiver;
  std::vector<lynx::errc> statuses;  // every non-ok, non-timeout status, in order

  static std::vector<lynx::tcp_socket> make(std::vector<lane_io>& io, int n) {
    std::vector<lynx::tcp_socket> ends;
    for (int i = 0; i < n; ++i) {
      int sv[2];
      if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) failed("socketpair");
      io.emplace_back();
      io.back().peer = lynx::tcp_socket(sv[0]);
      ends.emplace_back(sv[1]);
    }
    return ends;
  }
  harness(int n, lynx::tcp_options o) : receiver(make(lanes, n), o) {}

  void check_memory() const {
    std::size_t bound = 0;
    for (const auto& l : lanes)
      bound += std::max<std::size_t>(std::size_t{1} << 20, 2 * l.written.size());
    if (receiver.body_bytes_in_flight() > bound)
      failed("frame buffers exceed max(1 MiB, 2 x received)");
  }

  // One try_receive; false when it reported the deadline.
  bool receive_once(clock_type::time_point deadline) {
    lynx::receive_result<clock_type> r;
    try {
      r = receiver.try_receive(deadline);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tcp_frames: try_receive threw: %s\n", e.what());
      std::abort();
    }
    check_memory();
    for (auto& l : lanes) read_acks(l);
    if (r.status == lynx::errc::timeout) return false;
    if (r.status != lynx::errc::ok) {
      statuses.push_back(r.status);
      return true;
    }
    if (r.segment.lane >= lanes.size()) failed("a segment on a lane that does not exist");
    lanes[r.segment.lane].handed.push_back(
        {0, std::vector<std::byte>(r.segment.bytes.begin(), r.segment.bytes.end())});
    receiver.release(r.segment);
    if (receiver.held() != 0) failed("release did not free the segment");
    return true;
  }

  // Writes all of `bytes` to a lane, reading the receiver while the socket is full.
  void write(std::size_t lane, const std::byte* p, std::size_t n) {
    lane_io& l = lanes[lane];
    while (n) {
      const ssize_t w = ::send(l.peer.fd(), p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
      if (w > 0) {
        l.written.insert(l.written.end(), p, p + w);
        p += w;
        n -= static_cast<std::size_t>(w);
        continue;
      }
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
        // The receiver stopped reading this lane (a framing error, or it ended): drop the rest.
        if (!statuses.empty() || receiver.status() != lynx::errc::ok) return;
        receive_once(clock_type::now());  // reads what the socket holds, waits for nothing
        continue;
      }
      return;  // the receiver shut the lane down
    }
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::uint8_t flags = data[0];
  const int n_lanes = (flags & 1) ? 2 : 1;
  const bool end_lanes = (flags & 2) != 0;
  static constexpr std::size_t caps[4] = {std::size_t{512} << 20, 0, 100, 4096};
  lynx::tcp_options options;
  options.max_segment_bytes = caps[(flags >> 2) & 3];
  harness h(n_lanes, options);

  std::size_t at = 1;
  auto byte = [&]() -> std::uint8_t { return at < size ? data[at++] : 0; };
  std::size_t filler_left = std::size_t{4} << 20;
  std::vector<std::byte> scratch;
  while (at < size) {
    const std::uint8_t op = byte();
    const std::size_t lane = (op >> 7) & static_cast<unsigned>(n_lanes - 1);
    const int kind = op >> 5 & 3;
    scratch.clear();
    if (kind <= 1) {
      const std::size_t n = std::min<std::size_t>((op & 0x3f) + 1u, size - at);
      const auto* p = reinterpret_cast<const std::byte*>(data + at);
      scratch.assign(p, p + n);
      at += n;
    } else {
      lynx::tcp_wire::frame f;
      std::size_t body = 0;
      if (kind == 2) {
        f.ticket = byte();
        f.bytes = body = byte();
      } else {
        std::uint32_t announced = 0;
        for (int i = 0; i < 4; ++i) announced |= std::uint32_t{byte()} << (8 * i);
        f.ticket = 1000;
        f.bytes = announced;
        body = std::min<std::size_t>(std::size_t{op & 0x1fu} * (96u << 10), filler_left);
        filler_left -= body;
      }
      const auto* p = reinterpret_cast<const std::byte*>(&f);
      scratch.assign(p, p + sizeof f);
      const std::size_t from_input = kind == 2 ? std::min(body, size - at) : 0;
      scratch.insert(scratch.end(), reinterpret_cast<const std::byte*>(data + at),
                     reinterpret_cast<const std::byte*>(data + at + from_input));
      at += from_input;
      scratch.resize(sizeof f + body);  // zeros past the input's end, and the filler
    }
    h.write(lane, scratch.data(), scratch.size());
    h.receive_once(clock_type::now());
  }

  if (end_lanes)
    for (auto& l : h.lanes) ::shutdown(l.peer.fd(), SHUT_WR);
  // Drain: with the lanes ended every call must make progress to a final status.
  for (int calls = 0;; ++calls) {
    if (calls > 1000000) failed("try_receive never settles");
    const auto deadline =
        clock_type::now() + (end_lanes ? std::chrono::seconds(2) : std::chrono::seconds(0));
    if (!h.receive_once(deadline)) {
      if (end_lanes) failed("timeout with every byte written and every lane ended (a hang)");
      break;
    }
    if (!h.statuses.empty()) {
      // The failure is final: later calls keep failing, and never hand out a segment.
      for (int i = 0; i < 3; ++i) {
        const auto r = h.receiver.try_receive(clock_type::now());
        if (r.status == lynx::errc::ok) failed("a segment handed out after the final failure");
        if (r.status != lynx::errc::timeout) h.statuses.push_back(r.status);
      }
      break;
    }
  }
  for (auto& l : h.lanes) read_acks(l);

  bool any_framing_error = false;
  for (std::size_t i = 0; i < h.lanes.size(); ++i) {
    const lane_io& l = h.lanes[i];
    const ref_lane ref = parse_reference(l.written, options.max_segment_bytes);
    any_framing_error |= ref.framing_error;
    if (l.handed.size() > ref.frames.size()) failed("more segments handed out than were framed");
    for (std::size_t k = 0; k < l.handed.size(); ++k)
      if (l.handed[k].body != ref.frames[k].body) failed("a segment differs from its frame's body");
    if (l.acks.size() > l.handed.size()) failed("more acks than segments handed out");
    for (std::size_t k = 0; k < l.acks.size(); ++k)
      if (l.acks[k] != ref.frames[k].ticket) failed("an ack carries the wrong ticket");
  }
  if (end_lanes) {
    if (h.statuses.empty()) failed("no final status with every lane ended");
    if (any_framing_error) {
      if (h.statuses.front() != lynx::errc::corrupted_segment)
        failed("a framing error not reported as corrupted_segment");
      for (std::size_t i = 1; i < h.statuses.size(); ++i)
        if (h.statuses[i] != lynx::errc::transport_failure)
          failed("after a framing error the link must answer transport_failure");
    } else {
      for (const auto s : h.statuses)
        if (s != lynx::errc::peer_failure) failed("a clean end not reported as peer_failure");
      for (std::size_t i = 0; i < h.lanes.size(); ++i)
        if (h.lanes[i].handed.size() !=
            parse_reference(h.lanes[i].written, options.max_segment_bytes).frames.size())
          failed("a complete frame was never handed out");
    }
  }
  return 0;
}

// --make-seeds DIR: a few valid streams (the format above), then exit.
extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i + 1 < *argc; ++i) {
    if (std::strcmp((*argv)[i], "--make-seeds") != 0) continue;
    const std::string dir = (*argv)[i + 1];
    auto frame = [](std::vector<std::uint8_t>& s, std::uint64_t ticket, std::size_t n) {
      lynx::tcp_wire::frame f;
      f.ticket = ticket;
      f.bytes = n;
      const auto* p = reinterpret_cast<const std::uint8_t*>(&f);
      s.insert(s.end(), p, p + sizeof f);
      for (std::size_t k = 0; k < n; ++k) s.push_back(static_cast<std::uint8_t>(k * 7 + ticket));
    };
    // Raw chunks of at most 64 bytes carrying a given stream to one lane.
    auto raw = [](std::vector<std::uint8_t>& in, const std::vector<std::uint8_t>& s, int lane) {
      for (std::size_t k = 0; k < s.size(); k += 64) {
        const std::size_t n = std::min<std::size_t>(64, s.size() - k);
        in.push_back(static_cast<std::uint8_t>((lane << 7) | (n - 1)));
        in.insert(in.end(), s.begin() + static_cast<std::ptrdiff_t>(k),
                  s.begin() + static_cast<std::ptrdiff_t>(k + n));
      }
    };
    std::vector<std::vector<std::uint8_t>> seeds;
    for (std::uint8_t flags : {0x02, 0x03, 0x00, 0x0e, 0x0b}) {
      std::vector<std::uint8_t> lane0, lane1, in{flags};
      frame(lane0, 1, 128);  // a segment header's worth
      frame(lane0, 2, 0);
      frame(lane1, 3, 300);
      frame(lane0, 4, 40);
      raw(in, lane0, 0);
      raw(in, lane1, flags & 1);
      seeds.push_back(in);
    }
    // Well-formed frames through kind 2, and a large announcement through kind 3.
    seeds.push_back({0x03, 0x40, 7, 3, 'a', 'b', 'c', 0xc0, 8, 0, 0x40});
    seeds.push_back({0x03, 0xe3, 0x00, 0x00, 0x20, 0x00, 0x40, 1, 1, 'x'});
    seeds.push_back({0x02, 0x62, 0x00, 0x00, 0x03, 0x00});
    for (std::size_t k = 0; k < seeds.size(); ++k) {
      std::ofstream out(dir + "/seed_" + std::to_string(k), std::ios::binary);
      out.write(reinterpret_cast<const char*>(seeds[k].data()),
                static_cast<std::streamsize>(seeds[k].size()));
      if (!out) {
        std::fprintf(stderr, "tcp_frames: cannot write seeds in %s\n", dir.c_str());
        std::exit(1);
      }
    }
    std::printf("tcp_frames: %zu seeds written to %s\n", seeds.size(), dir.c_str());
    std::exit(0);
  }
  return 0;
}
