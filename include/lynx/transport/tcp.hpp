// The TCP transport: the zero-dependency path between a prefill and a decode
// process (POSIX sockets only). One TCP connection per lane (lane 0 anchors,
// lane 1 residuals), so an anchor never queues behind residual bytes in one
// socket buffer. Both connections usually cross one bottleneck, so the sender
// writes residual bytes only once no anchor byte is left unsent in its kernel
// (tcp_options::anchor_first_writes) and keeps few residual bytes unsent there
// (tcp_options::residual_unsent_bytes); the receiver reads residual bytes only
// while no anchor waits to be handed out.
//
// Wire format, per connection (little-endian, as the segment header):
//   connector -> acceptor, once:   hello  {magic "LXTH", version, lane, lanes, session}  16 bytes
//   sender    -> receiver, per post: frame {magic "LXTF", ticket, bytes}                24 bytes,
//                                    then `bytes` bytes: one whole segment (its 128-byte header
//                                    first)
//   receiver  -> sender, per frame:  ack   {magic "LXTA", ticket}                        16 bytes
// The frame carries its own length so a segment whose header was damaged in
// transit still arrives whole and is rejected by its checksum (not by a lost
// stream position); a length over tcp_options::max_segment_bytes is a framing
// error (errc::corrupted_segment), never an allocation.
//
// Completion: "buffer reusable" when the last byte of the frame was written to
// the socket (the sender never copies a segment: it writes from the caller's
// buffer); "delivered" when the receiver's ack for the ticket comes back, which
// the receiver sends when try_receive hands the segment to the application.
// A peer that dies (EOF, ECONNRESET, EPIPE; writes use MSG_NOSIGNAL) is
// errc::peer_failure on both sides. Deadlines are poll() timeouts; nothing here
// starts a thread.
//
// The end of a link is judged lane by lane: TCP orders bytes within one
// connection only, so lane 0's end of stream says nothing of lane 1's acks or
// segments still queued behind it (a receiver that acks its last residual and
// exits ends lane 0 first, with lane 1's acks unread). The sender fails a send
// only when the lane that carries its ack has ended before the ack (every ack
// sent before that end has been read by then); the receiver reads every lane to
// its end and hands out every complete segment before it reports the failure.
#pragma once

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__linux__)
#include <linux/sockios.h>  // SIOCOUTQNSD
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/transport/concepts.hpp"

namespace lynx {

struct tcp_options {
  /// Largest frame (one segment, header included) a receiver accepts. A frame
  /// announcing more is a corrupted length, reported as errc::corrupted_segment
  /// before any allocation. 512 MiB holds an 8-bit layer of 128K tokens x 8 heads x 128.
  std::size_t max_segment_bytes = std::size_t{512} << 20;
  /// Disable Nagle: acks (16 bytes) and anchors must not wait for a full packet.
  bool no_delay = true;
  /// SO_SNDBUF / SO_RCVBUF in bytes; 0 keeps the system's (auto-tuned) sizes.
  int socket_buffer_bytes = 0;
  /// Sender: write residual-lane bytes only once every anchor byte posted so
  /// far has left this host's TCP send queue: the anchor lane has nothing
  /// queued in the transport and nothing unsent in its kernel send buffer
  /// (ioctl SIOCOUTQNSD on Linux). Both connections usually cross one
  /// bottleneck, where TCP shares bandwidth fairly between them; without this
  /// rule a residual segment in flight takes half the link from the anchors,
  /// and a residual written while the anchor socket still holds a send buffer
  /// of unsent anchor bytes (auto-tuned up to 4 MiB) shares the link with them.
  bool anchor_first_writes = true;
  /// Sender, with anchor_first_writes and two lanes: the residual socket's
  /// TCP_NOTSENT_LOWAT, so the kernel holds at most about this many residual
  /// bytes not yet sent (the rest waits in the transport's queue, where an
  /// anchor posted later overtakes it). An anchor posted while a residual is
  /// being written then competes with this much residual plus what the
  /// network already carries. 0 keeps the system's setting (no cap).
  int residual_unsent_bytes = 128 << 10;
};

/// The fixed frames of the TCP wire format (see the top of this header).
namespace tcp_wire {
inline constexpr std::uint32_t hello_magic = 0x48544c58u;  // "XLTH" in memory order
inline constexpr std::uint32_t frame_magic = 0x46544c58u;  // "XLTF"
inline constexpr std::uint32_t ack_magic = 0x41544c58u;    // "XLTA"
inline constexpr std::uint16_t version = 1;

struct hello {
  std::uint32_t magic = hello_magic;
  std::uint16_t version = tcp_wire::version;
  std::uint8_t lane = 0;
  std::uint8_t lanes = 0;
  std::uint64_t session = 0;  // the same for every lane of one connector
};
struct frame {
  std::uint32_t magic = frame_magic;
  std::uint32_t reserved = 0;
  std::uint64_t ticket = 0;  // the sender's ticket, echoed by the ack
  std::uint64_t bytes = 0;   // segment bytes that follow
};
struct ack {
  std::uint32_t magic = ack_magic;
  std::uint32_t reserved = 0;
  std::uint64_t ticket = 0;
};
static_assert(sizeof(hello) == 16 && sizeof(frame) == 24 && sizeof(ack) == 16,
              "TCP wire frames are packed");
}  // namespace tcp_wire

namespace detail {

inline std::string errno_text(int e) {
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}

/// The failure a socket errno means for the transport.
inline errc socket_errc(int e) noexcept {
  return (e == EPIPE || e == ECONNRESET || e == ECONNABORTED || e == ENOTCONN || e == ETIMEDOUT)
             ? errc::peer_failure
             : errc::transport_failure;
}

/// Milliseconds until the deadline for poll(): 0 when past, rounded up so a
/// wait never returns before the deadline, capped to keep the int in range.
inline int poll_timeout_ms(std::chrono::steady_clock::time_point deadline) {
  const auto left = deadline - std::chrono::steady_clock::now();
  if (left <= std::chrono::steady_clock::duration::zero()) return 0;
  const auto ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<std::int64_t>(ms, 1 << 30));
}

inline void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  require(flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, errc::transport_failure,
          "tcp: fcntl(O_NONBLOCK) failed: " + errno_text(errno));
}

/// Waits until fd is ready for `events` or the deadline passes; false on timeout.
inline bool wait_fd(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  while (true) {
    pollfd p{fd, events, 0};
    const int n = ::poll(&p, 1, poll_timeout_ms(deadline));
    if (n > 0) return true;
    if (n == 0) {
      if (std::chrono::steady_clock::now() >= deadline) return false;
      continue;
    }
    if (errno != EINTR) fail(errc::transport_failure, "tcp: poll failed: " + errno_text(errno));
  }
}

/// Writes all of `bytes` to a non-blocking socket before the deadline (setup only).
inline void write_all(int fd, const void* data, std::size_t size,
                      std::chrono::steady_clock::time_point deadline, const char* what) {
  const auto* p = static_cast<const char*>(data);
  while (size) {
    const ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      size -= static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      require(wait_fd(fd, POLLOUT, deadline), errc::timeout,
              std::string("tcp: deadline passed while writing the ") + what);
      continue;
    }
    fail(socket_errc(errno),
         std::string("tcp: writing the ") + what + " failed: " + errno_text(errno));
  }
}

/// Reads exactly `size` bytes from a non-blocking socket before the deadline (setup only).
inline void read_all(int fd, void* data, std::size_t size,
                     std::chrono::steady_clock::time_point deadline, const char* what) {
  auto* p = static_cast<char*>(data);
  while (size) {
    const ssize_t n = ::recv(fd, p, size, MSG_DONTWAIT);
    if (n > 0) {
      p += n;
      size -= static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0)
      fail(errc::peer_failure,
           std::string("tcp: the peer closed the connection before the ") + what);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      require(wait_fd(fd, POLLIN, deadline), errc::timeout,
              std::string("tcp: deadline passed while reading the ") + what);
      continue;
    }
    fail(socket_errc(errno),
         std::string("tcp: reading the ") + what + " failed: " + errno_text(errno));
  }
}

}  // namespace detail

/// An owned socket descriptor (closed on destruction; move-only).
class tcp_socket {
 public:
  tcp_socket() = default;
  explicit tcp_socket(int fd) noexcept : fd_(fd) {}
  tcp_socket(tcp_socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  tcp_socket& operator=(tcp_socket&& o) noexcept {
    if (this != &o) {
      close();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  tcp_socket(const tcp_socket&) = delete;
  tcp_socket& operator=(const tcp_socket&) = delete;
  ~tcp_socket() { close(); }

  [[nodiscard]] int fd() const noexcept { return fd_; }
  [[nodiscard]] bool is_open() const noexcept { return fd_ >= 0; }
  void close() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  /// Closes both directions now (the peer sees EOF) but keeps the descriptor.
  void shutdown() noexcept {
    if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
  }

 private:
  int fd_ = -1;
};

namespace detail {

inline void configure_socket(int fd, const tcp_options& o) {
  if (o.no_delay) {
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  }
  if (o.socket_buffer_bytes > 0) {
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &o.socket_buffer_bytes, sizeof o.socket_buffer_bytes);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &o.socket_buffer_bytes, sizeof o.socket_buffer_bytes);
  }
}

/// TCP_NOTSENT_LOWAT: poll() reports the socket writable, and a write takes
/// more bytes, only while fewer than `bytes` written bytes are unsent (0: the
/// system's setting). Linux only; elsewhere nothing.
inline void set_notsent_lowat(int fd, int bytes) noexcept {
#if defined(TCP_NOTSENT_LOWAT)
  ::setsockopt(fd, IPPROTO_TCP, TCP_NOTSENT_LOWAT, &bytes, sizeof bytes);
#else
  (void)fd;
  (void)bytes;
#endif
}

/// Bytes written to the socket that TCP has not sent yet (Linux: SIOCOUTQNSD);
/// 0 where the system cannot tell.
inline std::size_t unsent_bytes(int fd) noexcept {
#if defined(SIOCOUTQNSD)
  int n = 0;
  if (::ioctl(fd, SIOCOUTQNSD, &n) == 0 && n > 0) return static_cast<std::size_t>(n);
#else
  (void)fd;
#endif
  return 0;
}

inline sockaddr_in resolve_ipv4(const std::string& host, std::uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  require(rc == 0 && found, errc::invalid_argument,
          "tcp: cannot resolve host '" + host + "': " + ::gai_strerror(rc));
  sockaddr_in a{};
  std::memcpy(&a, found->ai_addr, sizeof a);
  ::freeaddrinfo(found);
  a.sin_port = htons(port);
  return a;
}

}  // namespace detail

/// A listening socket. Port 0 lets the OS choose (tests); port() says which.
class tcp_listener {
 public:
  explicit tcp_listener(const std::string& host = "127.0.0.1", std::uint16_t port = 0,
                        int backlog = 16) {
    const sockaddr_in a = detail::resolve_ipv4(host, port);
    socket_ = tcp_socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    detail::require(socket_.is_open(), errc::transport_failure,
                    "tcp_listener: socket() failed: " + detail::errno_text(errno));
    const int one = 1;
    ::setsockopt(socket_.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    detail::require(::bind(socket_.fd(), reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0,
                    errc::transport_failure,
                    "tcp_listener: bind to " + host + ":" + std::to_string(port) +
                        " failed: " + detail::errno_text(errno));
    detail::require(::listen(socket_.fd(), backlog) == 0, errc::transport_failure,
                    "tcp_listener: listen failed: " + detail::errno_text(errno));
    detail::set_nonblocking(socket_.fd());
    sockaddr_in bound{};
    socklen_t len = sizeof bound;
    ::getsockname(socket_.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.sin_port);
  }

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  [[nodiscard]] int fd() const noexcept { return socket_.fd(); }

  /// One incoming connection (non-blocking, configured), or errc::timeout.
  tcp_socket accept(std::chrono::steady_clock::time_point deadline,
                    const tcp_options& options = {}) {
    while (true) {
      const int fd = ::accept4(socket_.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (fd >= 0) {
        detail::configure_socket(fd, options);
        return tcp_socket(fd);
      }
      if (errno == EINTR || errno == ECONNABORTED) continue;
      detail::require(errno == EAGAIN || errno == EWOULDBLOCK, errc::transport_failure,
                      "tcp_listener: accept failed: " + detail::errno_text(errno));
      detail::require(
          detail::wait_fd(socket_.fd(), POLLIN, deadline), errc::timeout,
          "tcp_listener: no connection on port " + std::to_string(port_) + " before the deadline");
    }
  }

 private:
  tcp_socket socket_;
  std::uint16_t port_ = 0;
};

/// Connects to host:port before the deadline (a refused connection is retried
/// every 10 ms until then, so the peer may start listening a little later).
inline tcp_socket tcp_connect(const std::string& host, std::uint16_t port,
                              std::chrono::steady_clock::time_point deadline,
                              const tcp_options& options = {}) {
  const sockaddr_in a = detail::resolve_ipv4(host, port);
  const std::string where = host + ":" + std::to_string(port);
  while (true) {
    tcp_socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    detail::require(s.is_open(), errc::transport_failure,
                    "tcp_connect: socket() failed: " + detail::errno_text(errno));
    detail::configure_socket(s.fd(), options);
    int e = 0;
    if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0) {
      e = errno;
      if (e == EINPROGRESS) {
        detail::require(detail::wait_fd(s.fd(), POLLOUT, deadline), errc::timeout,
                        "tcp_connect: " + where + " did not answer before the deadline");
        socklen_t len = sizeof e;
        ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &e, &len);
      }
    }
    if (e == 0) return s;
    if (e != ECONNREFUSED)
      detail::fail(errc::transport_failure, "tcp_connect: " + where + ": " + detail::errno_text(e));
    detail::require(std::chrono::steady_clock::now() + std::chrono::milliseconds(10) < deadline,
                    errc::timeout,
                    "tcp_connect: " + where + " refused connections until the deadline");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

/// The connecting side of a link: one connection per lane, each announcing its
/// lane in a hello frame. Returns the sockets in lane order.
inline std::vector<tcp_socket> tcp_connect_lanes(const std::string& host, std::uint16_t port,
                                                 int lanes,
                                                 std::chrono::steady_clock::time_point deadline,
                                                 const tcp_options& options = {}) {
  detail::require(lanes == 1 || lanes == 2, errc::invalid_argument,
                  "tcp_connect_lanes: " + std::to_string(lanes) + " lanes requested (1 or 2)");
  std::random_device entropy;
  const std::uint64_t session =
      (std::uint64_t{entropy()} << 32) ^ entropy() ^ static_cast<std::uint64_t>(::getpid());
  std::vector<tcp_socket> result;
  for (int l = 0; l < lanes; ++l) {
    tcp_socket s = tcp_connect(host, port, deadline, options);
    tcp_wire::hello h;
    h.lane = static_cast<std::uint8_t>(l);
    h.lanes = static_cast<std::uint8_t>(lanes);
    h.session = session;
    detail::write_all(s.fd(), &h, sizeof h, deadline, "hello frame");
    result.push_back(std::move(s));
  }
  return result;
}

/// The accepting side: takes connections until every lane of one connector has
/// said hello. Returns the sockets in lane order.
inline std::vector<tcp_socket> tcp_accept_lanes(tcp_listener& listener, int lanes,
                                                std::chrono::steady_clock::time_point deadline,
                                                const tcp_options& options = {}) {
  detail::require(lanes == 1 || lanes == 2, errc::invalid_argument,
                  "tcp_accept_lanes: " + std::to_string(lanes) + " lanes requested (1 or 2)");
  std::vector<tcp_socket> result(static_cast<std::size_t>(lanes));
  std::optional<std::uint64_t> session;
  for (int got = 0; got < lanes; ++got) {
    tcp_socket s = listener.accept(deadline, options);
    tcp_wire::hello h;
    detail::read_all(s.fd(), &h, sizeof h, deadline, "hello frame");
    detail::require(h.magic == tcp_wire::hello_magic && h.version == tcp_wire::version,
                    errc::transport_failure,
                    "tcp_accept_lanes: the peer is not a Lynx TCP transport of version " +
                        std::to_string(tcp_wire::version));
    detail::require(h.lanes == lanes && h.lane < lanes, errc::invalid_argument,
                    "tcp_accept_lanes: the peer connects lane " + std::to_string(h.lane) + " of " +
                        std::to_string(h.lanes) + ", this side expects " + std::to_string(lanes) +
                        " lanes");
    detail::require(!session || *session == h.session, errc::transport_failure,
                    "tcp_accept_lanes: lanes of two different connectors");
    detail::require(!result[h.lane].is_open(), errc::transport_failure,
                    "tcp_accept_lanes: lane " + std::to_string(h.lane) + " connected twice");
    session = h.session;
    result[h.lane] = std::move(s);
  }
  return result;
}

/// The sending endpoint over one connection per lane (a segment_sender).
/// Single-threaded: post() and next_event() do all the socket work.
class tcp_sender {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  /// Takes connected sockets in lane order (1 or 2), e.g. from tcp_connect_lanes.
  explicit tcp_sender(std::vector<tcp_socket> lanes, tcp_options options = {}) : options_(options) {
    detail::require(
        lanes.size() == 1 || lanes.size() == 2, errc::invalid_argument,
        "tcp_sender: " + std::to_string(lanes.size()) + " connections given (1 or 2 lanes)");
    for (auto& s : lanes) {
      detail::require(s.is_open(), errc::invalid_argument, "tcp_sender: a lane's socket is closed");
      detail::set_nonblocking(s.fd());
      lane_state l;
      l.socket = std::move(s);
      lanes_.push_back(std::move(l));
    }
    if (lanes_.size() == 2 && options_.anchor_first_writes && options_.residual_unsent_bytes > 0)
      detail::set_notsent_lowat(lanes_[1].socket.fd(), options_.residual_unsent_bytes);
  }
  /// Connects `lanes` connections to a tcp_receiver's listener.
  static tcp_sender connect(const std::string& host, std::uint16_t port, time_point deadline,
                            tcp_options options = {}, int lanes = 2) {
    return tcp_sender(tcp_connect_lanes(host, port, lanes, deadline, options), options);
  }
  /// Accepts `lanes` connections of a receiver that connects (either side may listen).
  static tcp_sender accept(tcp_listener& listener, time_point deadline, tcp_options options = {},
                           int lanes = 2) {
    return tcp_sender(tcp_accept_lanes(listener, lanes, deadline, options), options);
  }

  tcp_sender(tcp_sender&&) noexcept = default;
  tcp_sender& operator=(tcp_sender&&) noexcept = default;

  [[nodiscard]] time_point now() const { return clock::now(); }
  [[nodiscard]] int lane_count() const noexcept { return static_cast<int>(lanes_.size()); }

  /// Queues the segment on its lane and starts writing it. The bytes are
  /// written from the caller's buffer, which must live until the final event.
  post_result post(const send_request& request) {
    if (request.destination.named()) return {errc::invalid_argument, 0};  // no one-sided writes
    if (broken_ != errc::ok) return {broken_, 0};
    if (request.lane >= lanes_.size()) return {errc::invalid_argument, 0};
    const send_ticket ticket = next_ticket_++;
    outgoing o;
    o.frame.ticket = ticket;
    o.frame.bytes = request.bytes.size();
    o.bytes = request.bytes;
    lanes_[request.lane].queue.push_back(o);
    undelivered_.emplace(ticket, request.lane);
    progress(0);
    return {errc::ok, ticket};
  }

  /// The next completion event, driving the sockets until one comes or the
  /// deadline passes. After a failure every unfinished ticket gets one final
  /// event: delivered when its ack was already on its way (read before its
  /// lane ended), else the failure's status; then nothing more ever comes.
  std::optional<send_event<clock>> next_event(time_point deadline) {
    while (true) {
      if (!events_.empty()) {
        const send_event<clock> e = events_.front();
        events_.pop_front();
        return e;
      }
      if (broken_ != errc::ok && undelivered_.empty()) return std::nullopt;
      const int timeout = detail::poll_timeout_ms(deadline);
      progress(timeout);
      if (events_.empty() && clock::now() >= deadline) return std::nullopt;
    }
  }

  /// ok while the link works; else the failure (peer_failure, transport_failure).
  [[nodiscard]] errc status() const noexcept { return broken_; }
  /// What went wrong, for people (empty while ok).
  [[nodiscard]] const std::string& last_error() const noexcept { return last_error_; }
  /// Posted segments without a final event.
  [[nodiscard]] std::size_t outstanding() const noexcept { return undelivered_.size(); }
  /// Bytes posted and not yet handed to the kernel, frame headers included,
  /// every lane together. The sender never copies a segment: these bytes are
  /// read from the callers' buffers, and grow only with what is posted (under
  /// a stream_scheduler: the anchors plus its residual window).
  [[nodiscard]] std::size_t queued_bytes() const noexcept {
    std::size_t n = 0;
    for (const auto& l : lanes_)
      for (const outgoing& o : l.queue) n += sizeof o.frame + o.bytes.size() - o.written;
    return n;
  }

  /// Closes every lane (the receiver sees EOF); unfinished tickets fail with peer_failure.
  void close() {
    fail(errc::peer_failure, "tcp_sender: closed by the application");
    for (auto& l : lanes_) l.socket.close();
  }

 private:
  struct outgoing {
    tcp_wire::frame frame;
    std::span<const std::byte> bytes;
    std::size_t written = 0;  // of sizeof(frame) + bytes.size()
  };
  struct lane_state {
    tcp_socket socket;
    std::deque<outgoing> queue;  // FIFO: the front is being written
    tcp_wire::ack ack{};
    std::size_t ack_have = 0;     // bytes of `ack` read so far
    bool open = true;             // false once ended (by the peer, or by this side after a failure)
    bool wake_when_sent = false;  // TCP_NOTSENT_LOWAT 1: POLLOUT once nothing is unsent
  };

  // The final event of an unfinished ticket, with a failure's status.
  void fail_ticket(send_ticket ticket, errc status, time_point at) {
    if (undelivered_.erase(ticket))
      events_.push_back({ticket, completion_kind::delivered, status, at});
  }

  void end_socket(lane_state& l) {
    if (!l.open) return;
    l.open = false;
    l.socket.shutdown();  // the peer sees this lane end
  }

  // A failure of the whole link (the application's close, poll, a foreign
  // frame): every unfinished ticket fails now, every lane ends.
  void fail(errc status, std::string why) {
    if (broken_ == errc::ok) {
      broken_ = status;
      last_error_ = std::move(why);
    }
    const time_point at = clock::now();
    while (!undelivered_.empty()) fail_ticket(undelivered_.begin()->first, status, at);
    for (auto& l : lanes_) {
      l.queue.clear();
      end_socket(l);
    }
  }

  // Lane `lane` ended: the peer closed or reset it, and every ack it sent
  // before that was read (read_acks reads up to the end). Its sends without an
  // ack can no longer be delivered. The link is failed from now on: nothing
  // more is posted or written, so frames not wholly written fail on every lane.
  // Sends wholly written on another lane wait for that lane's own acks or end:
  // their acks may still be in flight behind this lane's end.
  void end_lane(std::size_t lane, errc status, std::string why) {
    if (!lanes_[lane].open) return;
    if (broken_ == errc::ok) {
      broken_ = status;
      last_error_ = std::move(why);
    }
    end_socket(lanes_[lane]);
    const time_point at = clock::now();
    for (auto& l : lanes_) {
      for (const outgoing& o : l.queue) fail_ticket(o.frame.ticket, status, at);
      l.queue.clear();
    }
    for (auto it = undelivered_.begin(); it != undelivered_.end();) {
      const auto [ticket, on] = *it++;  // fail_ticket erases the entry
      if (on == lane) fail_ticket(ticket, status, at);
    }
    // A lane with no ack left to wait for ends too, so the peer sees the link go.
    for (std::size_t i = 0; i < lanes_.size(); ++i)
      if (!awaits_ack(i)) end_socket(lanes_[i]);
  }

  [[nodiscard]] bool awaits_ack(std::size_t lane) const noexcept {
    return std::any_of(undelivered_.begin(), undelivered_.end(),
                       [lane](const auto& t) { return t.second == lane; });
  }

  // One round: waits up to timeout_ms for any open socket to be readable
  // (acks, EOF) or, with data queued, writable; then writes lane 0 before lane
  // 1 and reads every ack available on every open lane (a lane's end does not
  // stop the others from being read: their acks may be waiting behind it).
  void progress(int timeout_ms) {
    pollfd fds[2];
    const auto n = lanes_.size();
    bool any_open = false;
    const bool residual_waits = residual_waits_for_anchor_bytes();
    for (std::size_t i = 0; i < n; ++i) {
      any_open = any_open || lanes_[i].open;
      fds[i].fd = lanes_[i].open ? lanes_[i].socket.fd() : -1;  // poll skips a negative fd
      const bool out = may_write(i) || (i == 0 && residual_waits);
      fds[i].events = static_cast<short>(POLLIN | (out ? POLLOUT : 0));
      fds[i].revents = 0;
    }
    if (!any_open) return;
    // The kernel wakes a POLLOUT waiter when acks free space; the last unsent
    // bytes can also leave without one (TCP small queues), so look again soon.
    if (residual_waits && (timeout_ms < 0 || timeout_ms > 2)) timeout_ms = 2;
    const int ready = ::poll(fds, static_cast<nfds_t>(n), timeout_ms);
    if (ready < 0) {
      if (errno != EINTR)
        fail(errc::transport_failure, "tcp_sender: poll failed: " + detail::errno_text(errno));
      return;
    }
    for (std::size_t i = 0; i < n; ++i)
      if (may_write(i)) write_lane(i);
    for (std::size_t i = 0; i < n; ++i)
      if (lanes_[i].open) read_acks(i);
  }

  // Lane 0 always; lane 1 (with anchor_first_writes) only once lane 0 has
  // nothing queued here and nothing unsent in its kernel buffer. Nothing once
  // the link failed (the queues are empty then).
  [[nodiscard]] bool may_write(std::size_t lane) {
    if (!lanes_[lane].open || lanes_[lane].queue.empty()) return false;
    if (lane == 0 || !options_.anchor_first_writes) return true;
    if (!lanes_[0].queue.empty()) return false;
    return !lanes_[0].open || detail::unsent_bytes(lanes_[0].socket.fd()) == 0;
  }

  // Lane 1 has bytes to write and waits only for lane 0's kernel buffer to
  // drain. While it does, lane 0's TCP_NOTSENT_LOWAT is 1 byte, so poll()
  // reports lane 0 writable exactly when its last byte has been sent; it goes
  // back to the system's setting as soon as lane 0 has bytes to write again.
  [[nodiscard]] bool residual_waits_for_anchor_bytes() {
    bool waits = false;
    if (lanes_.size() == 2 && options_.anchor_first_writes && lanes_[0].open &&
        lanes_[0].queue.empty() && lanes_[1].open && !lanes_[1].queue.empty())
      waits = detail::unsent_bytes(lanes_[0].socket.fd()) != 0;
    lane_state& a = lanes_[0];
    if (a.open && waits != a.wake_when_sent && (waits || !a.queue.empty())) {
      detail::set_notsent_lowat(a.socket.fd(), waits ? 1 : 0);
      a.wake_when_sent = waits;
    }
    return waits;
  }

  void write_lane(std::size_t lane) {
    lane_state& l = lanes_[lane];
    if (l.wake_when_sent) {  // a new anchor: write it at full speed
      detail::set_notsent_lowat(l.socket.fd(), 0);
      l.wake_when_sent = false;
    }
    while (!l.queue.empty()) {
      outgoing& o = l.queue.front();
      constexpr std::size_t head = sizeof(tcp_wire::frame);
      iovec iov[2];
      int count = 0;
      if (o.written < head) {
        iov[count++] = {reinterpret_cast<char*>(&o.frame) + o.written, head - o.written};
        if (!o.bytes.empty())
          iov[count++] = {const_cast<std::byte*>(o.bytes.data()), o.bytes.size()};
      } else {
        iov[count++] = {const_cast<std::byte*>(o.bytes.data()) + (o.written - head),
                        o.bytes.size() - (o.written - head)};
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = static_cast<std::size_t>(count);
      const ssize_t w = ::sendmsg(l.socket.fd(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        const int e = errno;
        read_acks(lane);  // acks that came before the failure still count
        end_lane(lane, detail::socket_errc(e),
                 "tcp_sender: writing lane " + std::to_string(lane) +
                     " failed: " + detail::errno_text(e));
        return;
      }
      o.written += static_cast<std::size_t>(w);
      if (o.written == head + o.bytes.size()) {
        // The kernel holds every byte: the caller's buffer is no longer read.
        events_.push_back(
            {o.frame.ticket, completion_kind::buffer_reusable, errc::ok, clock::now()});
        l.queue.pop_front();
      }
    }
  }

  // Reads every ack lane `lane` has, up to its end (EOF or an error ends the lane).
  void read_acks(std::size_t lane) {
    lane_state& l = lanes_[lane];
    while (l.open) {
      const ssize_t r = ::recv(l.socket.fd(), reinterpret_cast<char*>(&l.ack) + l.ack_have,
                               sizeof l.ack - l.ack_have, MSG_DONTWAIT);
      if (r == 0) {
        end_lane(lane, errc::peer_failure,
                 "tcp_sender: the receiver closed lane " + std::to_string(lane));
        return;
      }
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        const int e = errno;
        end_lane(lane, detail::socket_errc(e),
                 "tcp_sender: reading lane " + std::to_string(lane) +
                     " failed: " + detail::errno_text(e));
        return;
      }
      l.ack_have += static_cast<std::size_t>(r);
      if (l.ack_have < sizeof l.ack) continue;
      l.ack_have = 0;
      if (l.ack.magic != tcp_wire::ack_magic) {
        fail(errc::transport_failure,
             "tcp_sender: lane " + std::to_string(lane) + " carried something other than an ack");
        return;
      }
      // An ack of a ticket already final (a segment duplicated in transit) is ignored.
      if (undelivered_.erase(l.ack.ticket))
        events_.push_back({l.ack.ticket, completion_kind::delivered, errc::ok, clock::now()});
      // The link failed and this lane's last awaited ack came: end it too.
      if (broken_ != errc::ok && !awaits_ack(lane)) end_socket(l);
    }
  }

  tcp_options options_;
  std::vector<lane_state> lanes_;
  std::deque<send_event<clock>> events_;
  std::map<send_ticket, std::size_t> undelivered_;  // posted, no final event yet -> its lane
  send_ticket next_ticket_ = 1;
  errc broken_ = errc::ok;
  std::string last_error_;
};

/// The receiving endpoint over one connection per lane (a segment_receiver).
/// Reads every lane as bytes arrive, hands out lane 0's complete segments
/// before lane 1's, and acks each segment when it is handed out.
class tcp_receiver {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  explicit tcp_receiver(std::vector<tcp_socket> lanes, tcp_options options = {})
      : options_(options) {
    detail::require(
        lanes.size() == 1 || lanes.size() == 2, errc::invalid_argument,
        "tcp_receiver: " + std::to_string(lanes.size()) + " connections given (1 or 2 lanes)");
    for (auto& s : lanes) {
      detail::require(s.is_open(), errc::invalid_argument,
                      "tcp_receiver: a lane's socket is closed");
      detail::set_nonblocking(s.fd());
      lane_state l;
      l.socket = std::move(s);
      lanes_.push_back(std::move(l));
    }
  }
  /// Accepts the sender's `lanes` connections on a listener.
  static tcp_receiver accept(tcp_listener& listener, time_point deadline, tcp_options options = {},
                             int lanes = 2) {
    return tcp_receiver(tcp_accept_lanes(listener, lanes, deadline, options), options);
  }
  /// Connects to a sender that listens.
  static tcp_receiver connect(const std::string& host, std::uint16_t port, time_point deadline,
                              tcp_options options = {}, int lanes = 2) {
    return tcp_receiver(tcp_connect_lanes(host, port, lanes, deadline, options), options);
  }

  tcp_receiver(tcp_receiver&&) noexcept = default;
  tcp_receiver& operator=(tcp_receiver&&) noexcept = default;

  [[nodiscard]] time_point now() const { return clock::now(); }
  [[nodiscard]] int lane_count() const noexcept { return static_cast<int>(lanes_.size()); }

  /// The oldest complete segment of the lowest lane that has one. Segments
  /// that arrived before a failure are handed out first (every lane is read to
  /// its end); then the failure: peer_failure (EOF, reset) once every lane has
  /// ended, corrupted_segment once for a frame length over the cap or a
  /// damaged frame header (the stream position is lost, so every later call
  /// answers transport_failure), or timeout at the deadline.
  receive_result<clock> try_receive(time_point deadline) {
    while (true) {
      progress(0);
      for (std::size_t i = 0; i < lanes_.size(); ++i) {
        lane_state& l = lanes_[i];
        if (l.ready.empty()) continue;
        arrived a = std::move(l.ready.front());
        l.ready.pop_front();
        queue_ack(i, a.ticket);
        const std::uint64_t handle = next_handle_++;
        received_segment<clock> seg{std::span<const std::byte>(a.bytes.data(), a.bytes.size()),
                                    static_cast<lane_index>(i), a.at, handle};
        held_.emplace(handle, std::move(a.bytes));  // the buffer's address survives the move
        flush_acks();
        return {errc::ok, seg};
      }
      if (report_once_ != errc::ok) return {std::exchange(report_once_, errc::ok), {}};
      if (broken_ != errc::ok) return {broken_, {}};
      if (clock::now() >= deadline) return {errc::timeout, {}};
      progress(detail::poll_timeout_ms(deadline));
    }
  }

  /// Frees the bytes of a segment handed out by try_receive.
  void release(const received_segment<clock>& segment) { held_.erase(segment.handle); }

  [[nodiscard]] std::size_t held() const noexcept { return held_.size(); }
  /// Complete segments read and not yet handed out, every lane together: a lane
  /// stops reading while max_waiting_segments of its own wait, so a sender
  /// cannot grow the receiver's memory with a flood of small frames.
  [[nodiscard]] std::size_t segments_waiting() const noexcept {
    std::size_t n = 0;
    for (const auto& l : lanes_) n += l.ready.size();
    return n;
  }
  static constexpr std::size_t max_waiting_segments = 64;
  /// Bytes allocated for frames still arriving, every lane together: bounded by
  /// what has arrived (at most max(1 MiB, 2 x received) per lane), never by what
  /// a frame header announces.
  [[nodiscard]] std::size_t body_bytes_in_flight() const noexcept {
    std::size_t n = 0;
    for (const auto& l : lanes_) n += l.in_body ? l.body.size() : 0;
    return n;
  }
  [[nodiscard]] errc status() const noexcept { return broken_; }
  [[nodiscard]] const std::string& last_error() const noexcept { return last_error_; }

  /// Closes every lane (the sender sees EOF), after writing the acks still
  /// queued (without waiting: a 16-byte ack finds room in the socket buffer
  /// unless the sender stopped reading), so a segment handed out counts as delivered.
  void close() {
    if (broken_ == errc::ok) flush_acks();
    for (auto& l : lanes_) {
      l.socket.close();
      l.open = false;
    }
    if (broken_ == errc::ok) broken_ = errc::peer_failure;
  }

 private:
  struct arrived {
    send_ticket ticket = 0;
    aligned_buffer bytes;
    time_point at{};
  };
  struct lane_state {
    tcp_socket socket;
    tcp_wire::frame frame{};
    std::size_t frame_have = 0;  // bytes of `frame` read
    bool in_body = false;
    aligned_buffer body;
    std::size_t body_have = 0;
    std::deque<arrived> ready;
    std::vector<std::byte> acks;  // ack bytes not yet written
    std::size_t acks_sent = 0;
    bool open = true;  // false once the lane ended (EOF, an error, a framing error)
  };

  static constexpr std::size_t first_body_bytes = std::size_t{1} << 20;

  // A body buffer full before its frame is: twice the size (at most the frame's).
  static void grow_body(lane_state& l) {
    const auto total = static_cast<std::size_t>(l.frame.bytes);
    aligned_buffer bigger(std::min(total, std::max(first_body_bytes, 2 * l.body.size())));
    if (l.body_have) std::memcpy(bigger.data(), l.body.data(), l.body_have);
    l.body = std::move(bigger);
  }

  // A framing error: the stream position is lost, fatal to the link.
  void fail(errc status, std::string why) {
    if (broken_ != errc::ok) return;
    last_error_ = std::move(why);
    report_once_ = status;
    broken_ = errc::transport_failure;
    for (auto& l : lanes_) {
      l.socket.shutdown();  // the sender must not wait for acks that cannot come
      l.open = false;
    }
  }

  // Lane `lane` ended (EOF, a socket error) after everything before its end was
  // read. The other lanes are still read to their own ends: the link's
  // failure, `status` of the first lane to end, is reported once every lane has
  // ended and every complete segment has been handed out.
  void end_lane(std::size_t lane, errc status, std::string why) {
    lane_state& l = lanes_[lane];
    if (!l.open) return;
    l.open = false;
    l.socket.shutdown();
    l.acks.clear();  // nobody reads them any more
    l.acks_sent = 0;
    if (ended_ == errc::ok) {
      ended_ = status;
      last_error_ = std::move(why);
    }
    for (const auto& other : lanes_)
      if (other.open) return;
    broken_ = ended_;
  }

  void queue_ack(std::size_t lane, send_ticket ticket) {
    // The link or the lane is gone; the sender learns it from the socket.
    if (broken_ != errc::ok || !lanes_[lane].open) return;
    tcp_wire::ack a;
    a.ticket = ticket;
    const auto* p = reinterpret_cast<const std::byte*>(&a);
    lanes_[lane].acks.insert(lanes_[lane].acks.end(), p, p + sizeof a);
  }

  void flush_acks() {
    for (std::size_t i = 0; i < lanes_.size() && broken_ == errc::ok; ++i) {
      lane_state& l = lanes_[i];
      while (l.open && l.acks_sent < l.acks.size()) {
        const ssize_t w = ::send(l.socket.fd(), l.acks.data() + l.acks_sent,
                                 l.acks.size() - l.acks_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
          l.acks_sent += static_cast<std::size_t>(w);
          continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
        const int e = errno;
        read_lane(i);  // segments that came before the failure are still handed out
        end_lane(i, detail::socket_errc(e),
                 "tcp_receiver: writing an ack on lane " + std::to_string(i) +
                     " failed: " + detail::errno_text(e));
        break;
      }
      if (l.acks_sent == l.acks.size()) {
        l.acks.clear();
        l.acks_sent = 0;
      }
    }
  }

  // One round: waits up to timeout_ms for an open lane to be readable or,
  // with acks queued, writable; then writes the acks and reads the open lanes:
  // lane 0 wholly; lane 1 only while lane 0 has no complete segment waiting,
  // and at most residual_read_bytes of it, so reading (copying) residual bytes
  // never holds back an anchor that has arrived.
  void progress(int timeout_ms) {
    if (broken_ != errc::ok) return;
    pollfd fds[2];
    const auto n = lanes_.size();
    for (std::size_t i = 0; i < n; ++i) {
      fds[i].fd = lanes_[i].open ? lanes_[i].socket.fd() : -1;  // poll skips a negative fd
      fds[i].events = static_cast<short>(POLLIN | (lanes_[i].acks.empty() ? 0 : POLLOUT));
      fds[i].revents = 0;
    }
    const int ready = ::poll(fds, static_cast<nfds_t>(n), timeout_ms);
    if (ready < 0) {
      if (errno != EINTR) {
        last_error_ = "tcp_receiver: poll failed: " + detail::errno_text(errno);
        broken_ = errc::transport_failure;
      }
      return;
    }
    flush_acks();
    if (broken_ == errc::ok && lanes_[0].open) read_lane(0);
    if (n == 2 && broken_ == errc::ok && lanes_[1].open && lanes_[0].ready.empty())
      read_lane(1, lanes_[0].open ? residual_read_bytes : ~std::size_t{0});
  }

  static constexpr std::size_t residual_read_bytes = std::size_t{256} << 10;

  // Reads what lane `lane` has, up to about `budget` bytes: frame headers, then
  // bodies of their announced length.
  void read_lane(std::size_t lane, std::size_t budget = ~std::size_t{0}) {
    lane_state& l = lanes_[lane];
    const std::string name = "lane " + std::to_string(lane);
    std::size_t got = 0;
    while (broken_ == errc::ok && l.open && got < budget && l.ready.size() < max_waiting_segments) {
      char* dst;
      std::size_t want;
      if (!l.in_body) {
        dst = reinterpret_cast<char*>(&l.frame) + l.frame_have;
        want = sizeof l.frame - l.frame_have;
      } else {
        if (l.body_have == l.body.size()) grow_body(l);
        dst = reinterpret_cast<char*>(l.body.data()) + l.body_have;
        want = std::min(l.body.size() - l.body_have, budget - got);
      }
      ssize_t r = 0;
      if (want) {
        r = ::recv(l.socket.fd(), dst, want, MSG_DONTWAIT);
        if (r == 0) {
          end_lane(lane, errc::peer_failure,
                   "tcp_receiver: the sender closed " + name +
                       (l.in_body || l.frame_have ? " in the middle of a segment" : ""));
          return;
        }
        if (r < 0) {
          if (errno == EINTR) continue;
          if (errno == EAGAIN || errno == EWOULDBLOCK) return;
          const int e = errno;
          end_lane(lane, detail::socket_errc(e),
                   "tcp_receiver: reading " + name + " failed: " + detail::errno_text(e));
          return;
        }
      }
      got += static_cast<std::size_t>(r);
      if (!l.in_body) {
        l.frame_have += static_cast<std::size_t>(r);
        if (l.frame_have < sizeof l.frame) continue;
        if (l.frame.magic != tcp_wire::frame_magic) {
          fail(errc::corrupted_segment,
               "tcp_receiver: " + name +
                   ": damaged frame header (magic mismatch); the stream position is lost");
          return;
        }
        if (l.frame.bytes > options_.max_segment_bytes) {
          fail(errc::corrupted_segment,
               "tcp_receiver: " + name + ": a frame announces " + std::to_string(l.frame.bytes) +
                   " bytes, over the cap of " + std::to_string(options_.max_segment_bytes) +
                   " (tcp_options::max_segment_bytes)");
          return;
        }
        // What a frame announces is not trusted with memory: the body grows
        // with what arrives (first_body_bytes, then doubling), so a lane holds
        // at most max(first_body_bytes, 2 x the bytes received) for a frame.
        l.body =
            aligned_buffer(std::min(static_cast<std::size_t>(l.frame.bytes), first_body_bytes));
        l.body_have = 0;
        l.in_body = true;
      } else {
        l.body_have += static_cast<std::size_t>(r);
      }
      if (l.in_body && l.body_have == static_cast<std::size_t>(l.frame.bytes)) {
        l.ready.push_back({l.frame.ticket, std::move(l.body), clock::now()});
        l.body = aligned_buffer();
        l.in_body = false;
        l.frame_have = 0;
      }
    }
  }

  tcp_options options_;
  std::vector<lane_state> lanes_;
  std::map<std::uint64_t, aligned_buffer> held_;  // handle -> bytes handed out, until released
  std::uint64_t next_handle_ = 1;
  errc broken_ = errc::ok;  // the link's failure, reported after every segment handed out
  errc ended_ = errc::ok;   // the first lane's end, the link's failure once every lane ended
  errc report_once_ = errc::ok;
  std::string last_error_;
};

static_assert(check_segment_sender<tcp_sender>());
static_assert(check_segment_receiver<tcp_receiver>());

}  // namespace lynx
