// The UCX transport (UCP active messages; written against UCX 1.13.1, Debian's
// libucx-dev). Optional: this header is empty unless <ucp/api/ucp.h> is found,
// and a program using it links ucp and ucs (CMake target lynx::ucx, which also
// defines LYNX_WITH_UCX). One endpoint per lane, so an anchor never waits
// behind residual bytes on one endpoint (measured on loopback: a 256 MiB
// residual on the same endpoint delayed anchors by ~44 ms).
//
// The sender is the client (ucp_ep_create with UCP_EP_PARAMS_FLAGS_CLIENT_SERVER,
// one endpoint per lane), the receiver the server (ucp_listener_create; an
// endpoint per connection request). Every endpoint uses
// UCP_ERR_HANDLING_MODE_PEER with an error handler: a dead peer becomes
// errc::peer_failure on both sides. Nothing moves unless ucp_worker_progress
// runs: next_event() and try_receive() progress the worker and sleep on its
// wakeup fd (UCP_FEATURE_WAKEUP) until their deadline.
//
// A segment is one active message: header {magic, lane, ticket} (16 bytes,
// kept alive until the send completes: UCX 1.13.1 has no copy-header flag),
// data = the segment's bytes (sent zero-copy from the caller's buffer; UCX
// picks eager or rendezvous). Completion of the send is "buffer reusable" (a
// local completion, not delivery); "delivered" is the receiver's ack message
// carrying the ticket, sent when try_receive hands the segment out.
//
// UCX has no send priorities: two endpoints crossing one bottleneck share it
// fairly, and a send handed to UCX goes out as fast as the network takes it.
// So the sender holds residual-lane sends back itself (ucx_options::
// anchor_first_posts): a lane-1 send is handed to UCX only when every
// lane-0 send posted before it has been delivered (acked). An anchor posted
// while residual sends are already with UCX still shares the link with them:
// the scheduler's residual window bounds those bytes.
#pragma once

#if __has_include(<ucp/api/ucp.h>)
#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/transport/concepts.hpp"

#ifndef LYNX_HAS_UCX
#define LYNX_HAS_UCX 1
#endif

namespace lynx {

struct ucx_options {
  /// Largest segment (header included) a receiver accepts; a larger message is
  /// dropped before any allocation and reported once as errc::corrupted_segment.
  std::size_t max_segment_bytes = std::size_t{512} << 20;
  /// Sender with two lanes: hand a residual-lane send to UCX only while no
  /// anchor-lane send waits for its delivery; until then it waits in the
  /// sender, in posting order. Without it, UCX sends both lanes at once and
  /// the residual takes about half the link from the anchors.
  bool anchor_first_posts = true;
};

namespace detail {

inline constexpr unsigned ucx_segment_am_id = 21;                // sender -> receiver: a segment
inline constexpr unsigned ucx_ack_am_id = 22;                    // receiver -> sender: an ack
inline constexpr std::uint32_t ucx_segment_magic = 0x53554c58u;  // "XLUS"
inline constexpr std::uint32_t ucx_ack_magic = 0x41554c58u;      // "XLUA"

struct ucx_segment_header {
  std::uint32_t magic = ucx_segment_magic;
  std::uint8_t lane = 0;
  std::uint8_t reserved[3] = {};
  std::uint64_t ticket = 0;
};
struct ucx_ack_header {
  std::uint32_t magic = ucx_ack_magic;
  std::uint32_t reserved = 0;
  std::uint64_t ticket = 0;
};

inline void ucx_check(ucs_status_t s, const std::string& what) {
  if (s != UCS_OK)
    fail(errc::transport_failure, "ucx: " + what + " failed: " + ucs_status_string(s));
}

/// Whether a UCX error means the other side is gone.
inline errc ucx_errc(ucs_status_t s) noexcept {
  switch (s) {
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_CANCELED:
    case UCS_ERR_NOT_CONNECTED:
      return errc::peer_failure;
    default:
      return errc::transport_failure;
  }
}

/// A UCP context and one worker with a wakeup fd (single-threaded use).
class ucx_worker {
 public:
  ucx_worker() {
    ucp_config_t* config = nullptr;
    ucx_check(ucp_config_read(nullptr, nullptr, &config), "ucp_config_read");
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    const ucs_status_t s = ucp_init(&params, config, &context_);
    ucp_config_release(config);
    ucx_check(s, "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (const ucs_status_t w = ucp_worker_create(context_, &wp, &worker_); w != UCS_OK) {
      ucp_cleanup(context_);
      ucx_check(w, "ucp_worker_create");
    }
    if (const ucs_status_t e = ucp_worker_get_efd(worker_, &efd_); e != UCS_OK) {
      ucp_worker_destroy(worker_);
      ucp_cleanup(context_);
      ucx_check(e, "ucp_worker_get_efd");
    }
  }
  ucx_worker(const ucx_worker&) = delete;
  ucx_worker& operator=(const ucx_worker&) = delete;
  ~ucx_worker() {
    ucp_worker_destroy(worker_);
    ucp_cleanup(context_);
  }

  [[nodiscard]] ucp_worker_h get() const noexcept { return worker_; }
  void progress() {
    while (ucp_worker_progress(worker_) != 0) {
    }
  }
  /// Progresses, then sleeps on the wakeup fd until something happens or the
  /// deadline (at most 50 ms at a time, so a missed wakeup costs little).
  void wait(std::chrono::steady_clock::time_point deadline) {
    progress();
    const ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) return;  // events arrived meanwhile: progress again
    const auto left =
        std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now())
            .count();
    pollfd p{efd_, POLLIN, 0};
    ::poll(&p, 1, static_cast<int>(std::clamp<std::int64_t>(left, 0, 50)));
    progress();
  }

  /// Flushes every endpoint of the worker: operations posted before the call
  /// (including sends still queued behind an endpoint's wireup) have left this
  /// process when it returns UCS_OK. UCS_ERR_TIMED_OUT when the deadline passed
  /// first (the flush is then cancelled), another status when the flush failed.
  ucs_status_t flush(std::chrono::steady_clock::time_point deadline) {
    ucp_request_param_t p{};
    return finish(ucp_worker_flush_nbx(worker_, &p), deadline);
  }

  /// Waits for a request from a *_nbx call until it completes or the deadline
  /// passes (then cancels it: UCS_ERR_TIMED_OUT), frees it, returns its status.
  ucs_status_t finish(void* r, std::chrono::steady_clock::time_point deadline) {
    if (r == nullptr) return UCS_OK;
    if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
    while (ucp_request_check_status(r) == UCS_INPROGRESS &&
           std::chrono::steady_clock::now() < deadline)
      wait(deadline);
    ucs_status_t s = ucp_request_check_status(r);
    if (s == UCS_INPROGRESS) {
      ucp_request_cancel(worker_, r);
      s = UCS_ERR_TIMED_OUT;
    }
    ucp_request_free(r);
    return s;
  }

  /// Closes an endpoint (flushing it first unless `force`), bounded by the deadline.
  void close_endpoint(ucp_ep_h ep, bool force, std::chrono::steady_clock::time_point deadline) {
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    finish(ucp_ep_close_nbx(ep, &p), deadline);
  }

 private:
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
};

inline sockaddr_in ucx_ipv4(const std::string& host, std::uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  require(::inet_pton(AF_INET, host.c_str(), &a.sin_addr) == 1, errc::invalid_argument,
          "ucx: '" + host + "' is not an IPv4 address");
  return a;
}

}  // namespace detail

/// The sending endpoint (a segment_sender): the UCX client, one endpoint per
/// lane. Neither copyable nor movable (UCX callbacks hold its address).
class ucx_sender {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  /// Connects `lanes` endpoints to a ucx_receiver listening at host:port and
  /// waits (flush) until they are wired up, before the deadline.
  ucx_sender(const std::string& host, std::uint16_t port, time_point deadline, int lanes = 2,
             ucx_options options = {})
      : options_(options) {
    detail::require(lanes == 1 || lanes == 2, errc::invalid_argument,
                    "ucx_sender: " + std::to_string(lanes) + " lanes requested (1 or 2)");
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG;
    h.id = detail::ucx_ack_am_id;
    h.cb = &ucx_sender::on_ack;
    h.arg = this;
    detail::ucx_check(ucp_worker_set_am_recv_handler(worker_.get(), &h),
                      "ucp_worker_set_am_recv_handler");
    const sockaddr_in a = detail::ucx_ipv4(host, port);
    for (int l = 0; l < lanes; ++l) {
      ucp_ep_params_t p{};
      p.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                     UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
      p.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
      p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&a);
      p.sockaddr.addrlen = sizeof a;
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      p.err_handler.cb = &ucx_sender::on_error;
      p.err_handler.arg = this;
      ucp_ep_h ep = nullptr;
      detail::ucx_check(ucp_ep_create(worker_.get(), &p, &ep),
                        "ucp_ep_create to " + host + ":" + std::to_string(port));
      eps_.push_back(ep);
    }
    // A flush completes once the endpoint is connected (or fails when it cannot be).
    for (ucp_ep_h ep : eps_) {
      ucp_request_param_t p{};
      void* r = ucp_ep_flush_nbx(ep, &p);
      detail::require(
          !UCS_PTR_IS_ERR(r), detail::ucx_errc(UCS_PTR_STATUS(r)),
          std::string("ucx_sender: connecting failed: ") + ucs_status_string(UCS_PTR_STATUS(r)));
      if (r == nullptr) continue;
      while (ucp_request_check_status(r) == UCS_INPROGRESS && clock::now() < deadline && !settle())
        worker_.wait(deadline);
      const ucs_status_t s = ucp_request_check_status(r);
      if (s == UCS_INPROGRESS) ucp_request_cancel(worker_.get(), r);
      ucp_request_free(r);
      detail::require(s != UCS_INPROGRESS, errc::timeout,
                      "ucx_sender: " + host + ":" + std::to_string(port) +
                          " not connected before the deadline");
      const bool failed = s != UCS_OK || settle();  // settled before broken_ is read below
      detail::require(!failed, s == UCS_OK ? broken_ : detail::ucx_errc(s),
                      std::string("ucx_sender: connecting to ") + host + ":" +
                          std::to_string(port) + " failed: " + ucs_status_string(s));
    }
  }
  ucx_sender(const ucx_sender&) = delete;
  ucx_sender& operator=(const ucx_sender&) = delete;
  ~ucx_sender() {
    const auto deadline = clock::now() + std::chrono::seconds(2);
    const bool force = broken_ != errc::ok || failing_ != errc::ok;
    for (ucp_ep_h ep : eps_) worker_.close_endpoint(ep, force, deadline);
    worker_.progress();
    pending_.clear();
  }

  [[nodiscard]] time_point now() const { return clock::now(); }
  [[nodiscard]] int lane_count() const noexcept { return static_cast<int>(eps_.size()); }

  post_result post(const send_request& request) {
    if (request.destination.named()) return {errc::invalid_argument, 0};  // active messages only
    if (settle()) return {broken_, 0};
    if (request.lane >= eps_.size()) return {errc::invalid_argument, 0};
    const send_ticket ticket = next_ticket_++;
    auto op = std::make_unique<pending_send>();
    op->owner = this;
    op->header.lane = request.lane;
    op->header.ticket = ticket;
    op->bytes = request.bytes;
    if (request.lane != 0 && holds_residuals()) {  // handed to UCX by release_residuals()
      held_back_.push_back(ticket);
      pending_.emplace(ticket, std::move(op));
      return {errc::ok, ticket};
    }
    pending_send* raw = op.get();
    pending_.emplace(ticket, std::move(op));
    const errc e = start(*raw);
    if (e != errc::ok) {
      pending_.erase(ticket);
      return {e, 0};
    }
    if (request.lane == 0) ++anchors_undelivered_;
    return {errc::ok, ticket};
  }

  std::optional<send_event<clock>> next_event(time_point deadline) {
    while (true) {
      worker_.progress();
      settle();
      release_residuals();
      if (!events_.empty()) {
        const send_event<clock> e = events_.front();
        events_.pop_front();
        return e;
      }
      if (broken_ != errc::ok || clock::now() >= deadline) return std::nullopt;
      worker_.wait(deadline);
    }
  }

  [[nodiscard]] errc status() const noexcept { return broken_; }
  [[nodiscard]] const std::string& last_error() const noexcept { return last_error_; }

 private:
  struct pending_send {
    ucx_sender* owner = nullptr;
    detail::ucx_segment_header header;  // read by UCX until the send completes
    std::span<const std::byte> bytes;   // the caller's buffer
    void* request = nullptr;            // the UCX request while the send is incomplete
    bool reusable = false, final = false;
  };

  // Residual sends wait while an anchor send is undelivered (or earlier
  // residual sends still wait: they keep their order).
  [[nodiscard]] bool holds_residuals() const noexcept {
    return options_.anchor_first_posts && (anchors_undelivered_ != 0 || !held_back_.empty());
  }

  // Hands the residual sends held back to UCX once no anchor send is undelivered.
  void release_residuals() {
    while (!held_back_.empty() && anchors_undelivered_ == 0 && broken_ == errc::ok) {
      const send_ticket ticket = held_back_.front();
      held_back_.pop_front();
      const auto it = pending_.find(ticket);
      if (it == pending_.end() || it->second->final) continue;
      const errc e = start(*it->second);
      if (e != errc::ok) {  // the ticket was given out: it ends with the failure
        it->second->final = true;
        events_.push_back({ticket, completion_kind::delivered, e, clock::now()});
        retire(ticket);
      }
    }
  }

  // Hands one send to UCX; "buffer reusable" at once when UCX took the bytes.
  errc start(pending_send& op) {
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = &ucx_sender::on_sent;
    p.user_data = &op;
    p.flags = UCP_AM_SEND_FLAG_REPLY;  // the receiver acks on the endpoint this came from
    void* r = ucp_am_send_nbx(eps_[op.header.lane], detail::ucx_segment_am_id, &op.header,
                              sizeof op.header, op.bytes.data(), op.bytes.size(), &p);
    if (UCS_PTR_IS_ERR(r)) return detail::ucx_errc(UCS_PTR_STATUS(r));
    if (r == nullptr) {
      events_.push_back(
          {op.header.ticket, completion_kind::buffer_reusable, errc::ok, clock::now()});
      op.reusable = true;
    } else {
      op.request = r;
    }
    return errc::ok;
  }

  void fail(errc status, std::string why) {
    if (broken_ != errc::ok) return;
    broken_ = status;
    last_error_ = std::move(why);
    const time_point at = clock::now();
    for (auto& [ticket, op] : pending_)
      if (!op->final) {
        op->final = true;
        events_.push_back({ticket, completion_kind::delivered, status, at});
      }
    held_back_.clear();
    anchors_undelivered_ = 0;
  }

  // A failure seen inside a UCX callback is only noted there; it becomes final
  // here, after the progress loop it was seen in has drained the worker. An
  // error on one lane's endpoint can come up before the acks already waiting
  // on the other lane's connection are read; failing at once would report
  // segments the receiver holds as lost. Returns whether the sender is broken.
  bool settle() {
    if (failing_ != errc::ok && broken_ == errc::ok) {
      worker_.progress();
      fail(failing_, std::move(failing_why_));
    }
    return broken_ != errc::ok;
  }
  void note_failure(errc status, std::string why) {
    if (failing_ != errc::ok || broken_ != errc::ok) return;
    failing_ = status;
    failing_why_ = std::move(why);
  }

  // Drops the record once it is final and UCX no longer holds its header.
  void retire(send_ticket ticket) {
    const auto it = pending_.find(ticket);
    if (it != pending_.end() && it->second->final && it->second->request == nullptr)
      pending_.erase(it);
  }

  static void on_sent(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<pending_send*>(user_data);
    ucx_sender& self = *op->owner;
    const send_ticket ticket = op->header.ticket;
    ucp_request_free(request);
    op->request = nullptr;
    if (status == UCS_OK) {
      if (!op->final && !op->reusable)
        self.events_.push_back({ticket, completion_kind::buffer_reusable, errc::ok, clock::now()});
      op->reusable = true;
    } else {
      self.note_failure(detail::ucx_errc(status),
                        std::string("ucx_sender: a send failed: ") + ucs_status_string(status));
    }
    self.retire(ticket);
  }

  static ucs_status_t on_ack(void* arg, const void* header, std::size_t header_length, void*,
                             std::size_t, const ucp_am_recv_param_t*) {
    auto& self = *static_cast<ucx_sender*>(arg);
    detail::ucx_ack_header a;
    if (header_length != sizeof a) return UCS_OK;
    std::memcpy(&a, header, sizeof a);
    if (a.magic != detail::ucx_ack_magic) return UCS_OK;
    const auto it = self.pending_.find(a.ticket);
    if (it == self.pending_.end() || it->second->final) return UCS_OK;  // a duplicate ack
    it->second->final = true;
    if (it->second->header.lane == 0) --self.anchors_undelivered_;
    self.events_.push_back({a.ticket, completion_kind::delivered, errc::ok, clock::now()});
    self.retire(a.ticket);
    return UCS_OK;
  }

  static void on_error(void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<ucx_sender*>(arg)->note_failure(
        errc::peer_failure,
        std::string("ucx_sender: endpoint error: ") + ucs_status_string(status));
  }

  ucx_options options_;
  detail::ucx_worker worker_;
  std::vector<ucp_ep_h> eps_;
  std::map<send_ticket, std::unique_ptr<pending_send>> pending_;
  std::deque<send_ticket> held_back_;    // residual sends not yet handed to UCX, in posting order
  std::size_t anchors_undelivered_ = 0;  // lane-0 sends handed to UCX, not final
  std::deque<send_event<clock>> events_;
  send_ticket next_ticket_ = 1;
  errc broken_ = errc::ok, failing_ = errc::ok;  // failing_: noted in a callback, not yet final
  std::string last_error_, failing_why_;
};

/// The receiving endpoint (a segment_receiver): the UCX server. Listens on
/// construction (port 0: the OS chooses; port() says which), accepts the
/// sender's endpoints in accept(). Neither copyable nor movable.
class ucx_receiver {
 public:
  using clock = std::chrono::steady_clock;
  using time_point = clock::time_point;

  explicit ucx_receiver(const std::string& host = "127.0.0.1", std::uint16_t port = 0,
                        ucx_options options = {})
      : options_(options) {
    ucp_am_handler_param_t h{};
    h.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    h.id = detail::ucx_segment_am_id;
    h.cb = &ucx_receiver::on_segment;
    h.arg = this;
    h.flags = UCP_AM_FLAG_WHOLE_MSG;
    detail::ucx_check(ucp_worker_set_am_recv_handler(worker_.get(), &h),
                      "ucp_worker_set_am_recv_handler");
    const sockaddr_in a = detail::ucx_ipv4(host, port);
    ucp_listener_params_t p{};
    p.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    p.sockaddr.addr = reinterpret_cast<const sockaddr*>(&a);
    p.sockaddr.addrlen = sizeof a;
    p.conn_handler.cb = &ucx_receiver::on_connect;
    p.conn_handler.arg = this;
    detail::ucx_check(ucp_listener_create(worker_.get(), &p, &listener_),
                      "ucp_listener_create on " + host + ":" + std::to_string(port));
    ucp_listener_attr_t attr{};
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    detail::ucx_check(ucp_listener_query(listener_, &attr), "ucp_listener_query");
    port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  }
  ucx_receiver(const ucx_receiver&) = delete;
  ucx_receiver& operator=(const ucx_receiver&) = delete;
  ~ucx_receiver() {
    const auto deadline = clock::now() + std::chrono::seconds(2);
    if (listener_) ucp_listener_destroy(listener_);
    for (ucp_ep_h ep : eps_) worker_.close_endpoint(ep, true, deadline);
    worker_.progress();
  }

  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

  /// Waits until `lanes` endpoints of the sender are connected.
  void accept(time_point deadline, int lanes = 2) {
    while (static_cast<int>(eps_.size()) < lanes) {
      detail::require(clock::now() < deadline, errc::timeout,
                      "ucx_receiver: " + std::to_string(eps_.size()) + " of " +
                          std::to_string(lanes) + " lanes connected by the deadline");
      worker_.wait(deadline);
    }
    lanes_ = lanes;
  }

  [[nodiscard]] time_point now() const { return clock::now(); }
  [[nodiscard]] int lane_count() const noexcept { return lanes_; }

  /// As tcp_receiver::try_receive: lane 0 first; failures after the segments that arrived before
  /// them.
  receive_result<clock> try_receive(time_point deadline) {
    while (true) {
      worker_.progress();
      for (auto& lane : ready_) {
        if (lane.empty()) continue;
        arrived a = std::move(lane.front());
        lane.pop_front();
        send_ack(a.reply_ep, a.ticket);
        const std::uint64_t handle = next_handle_++;
        received_segment<clock> seg{std::span<const std::byte>(a.bytes.data(), a.bytes.size()),
                                    a.lane, a.at, handle};
        held_.emplace(handle, std::move(a.bytes));
        return {errc::ok, seg};
      }
      if (report_once_ != errc::ok) return {std::exchange(report_once_, errc::ok), {}};
      if (broken_ != errc::ok) return {broken_, {}};
      if (clock::now() >= deadline) return {errc::timeout, {}};
      worker_.wait(deadline);
    }
  }

  void release(const received_segment<clock>& segment) { held_.erase(segment.handle); }

  /// Pushes out the acks of every segment try_receive has handed out, so the
  /// sender learns of their delivery even if this process exits right after
  /// (an ack is only posted by try_receive; it may still sit behind the reply
  /// endpoint's wireup). errc::ok when they have left this process, timeout
  /// when the deadline passed first, peer_failure/transport_failure otherwise.
  errc flush_acks(time_point deadline) {
    if (broken_ != errc::ok) return broken_;
    const ucs_status_t s = worker_.flush(deadline);
    if (s == UCS_OK) return broken_;
    if (s == UCS_ERR_TIMED_OUT) return errc::timeout;
    fail(detail::ucx_errc(s),
         std::string("ucx_receiver: flushing acks failed: ") + ucs_status_string(s));
    return broken_;
  }

  [[nodiscard]] std::size_t held() const noexcept { return held_.size(); }
  [[nodiscard]] errc status() const noexcept { return broken_; }
  [[nodiscard]] const std::string& last_error() const noexcept { return last_error_; }

 private:
  struct arrived {
    send_ticket ticket = 0;
    lane_index lane = 0;
    ucp_ep_h reply_ep = nullptr;
    aligned_buffer bytes;
    time_point at{};
  };
  struct incoming {  // a rendezvous receive in progress
    ucx_receiver* owner = nullptr;
    arrived segment;
  };
  struct ack_op {  // the ack header lives until its send completes
    detail::ucx_ack_header header;
  };

  void fail(errc status, std::string why) {
    if (broken_ != errc::ok) return;
    broken_ = status;
    last_error_ = std::move(why);
  }

  void send_ack(ucp_ep_h ep, send_ticket ticket) {
    if (broken_ != errc::ok || ep == nullptr) return;
    auto op = std::make_unique<ack_op>();
    op->header.ticket = ticket;
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &ucx_receiver::on_ack_sent;
    p.user_data = op.get();
    void* r =
        ucp_am_send_nbx(ep, detail::ucx_ack_am_id, &op->header, sizeof op->header, nullptr, 0, &p);
    if (UCS_PTR_IS_ERR(r))
      fail(detail::ucx_errc(UCS_PTR_STATUS(r)), "ucx_receiver: sending an ack failed");
    else if (r != nullptr)
      op.release();  // freed by on_ack_sent
  }

  static void on_ack_sent(void* request, ucs_status_t, void* user_data) {
    delete static_cast<ack_op*>(user_data);
    ucp_request_free(request);
  }

  static void on_connect(ucp_conn_request_h request, void* arg) {
    auto& self = *static_cast<ucx_receiver*>(arg);
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.conn_request = request;
    p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &ucx_receiver::on_error;
    p.err_handler.arg = &self;
    ucp_ep_h ep = nullptr;
    if (ucp_ep_create(self.worker_.get(), &p, &ep) == UCS_OK)
      self.eps_.push_back(ep);
    else
      self.fail(errc::transport_failure,
                "ucx_receiver: could not create the endpoint of a connection request");
  }

  static void on_error(void* arg, ucp_ep_h, ucs_status_t status) {
    static_cast<ucx_receiver*>(arg)->fail(
        errc::peer_failure,
        std::string("ucx_receiver: endpoint error: ") + ucs_status_string(status));
  }

  static ucs_status_t on_segment(void* arg, const void* header, std::size_t header_length,
                                 void* data, std::size_t length, const ucp_am_recv_param_t* param) {
    auto& self = *static_cast<ucx_receiver*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    detail::ucx_segment_header h;
    if (header_length == sizeof h) std::memcpy(&h, header, sizeof h);
    if (header_length != sizeof h || h.magic != detail::ucx_segment_magic || h.lane >= 2 ||
        length > self.options_.max_segment_bytes) {
      if (rndv) ucp_am_data_release(self.worker_.get(), data);
      self.report_once_ = errc::corrupted_segment;
      self.last_error_ = "ucx_receiver: a message of " + std::to_string(length) + " bytes with a " +
                         std::to_string(header_length) +
                         "-byte header is not a Lynx segment within the cap of " +
                         std::to_string(self.options_.max_segment_bytes) + " bytes";
      return UCS_OK;
    }
    arrived a;
    a.ticket = h.ticket;
    a.lane = h.lane;
    a.reply_ep = (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
    a.bytes = aligned_buffer(length);
    if (!rndv) {  // eager: the data is valid during this callback only
      if (length) std::memcpy(a.bytes.data(), data, length);
      a.at = clock::now();
      self.ready_[h.lane].push_back(std::move(a));
      return UCS_OK;
    }
    auto in = std::make_unique<incoming>();
    in->owner = &self;
    in->segment = std::move(a);
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.recv_am = &ucx_receiver::on_data;
    p.user_data = in.get();
    void* r = ucp_am_recv_data_nbx(self.worker_.get(), data, in->segment.bytes.data(), length, &p);
    if (UCS_PTR_IS_ERR(r)) {
      self.fail(detail::ucx_errc(UCS_PTR_STATUS(r)),
                "ucx_receiver: receiving a rendezvous segment failed");
      return UCS_OK;
    }
    if (r == nullptr) {  // completed at once
      in->segment.at = clock::now();
      self.ready_[h.lane].push_back(std::move(in->segment));
    } else {
      in.release();  // owned by on_data from now on
    }
    return UCS_OK;
  }

  static void on_data(void* request, ucs_status_t status, std::size_t, void* user_data) {
    std::unique_ptr<incoming> in(static_cast<incoming*>(user_data));
    ucp_request_free(request);
    ucx_receiver& self = *in->owner;
    if (status != UCS_OK) {
      self.fail(
          detail::ucx_errc(status),
          std::string("ucx_receiver: a rendezvous receive failed: ") + ucs_status_string(status));
      return;
    }
    in->segment.at = clock::now();
    self.ready_[in->segment.lane].push_back(std::move(in->segment));
  }

  ucx_options options_;
  detail::ucx_worker worker_;
  ucp_listener_h listener_ = nullptr;
  std::uint16_t port_ = 0;
  std::vector<ucp_ep_h> eps_;
  int lanes_ = 0;
  std::deque<arrived> ready_[2];  // [lane]
  std::map<std::uint64_t, aligned_buffer> held_;
  std::uint64_t next_handle_ = 1;
  errc broken_ = errc::ok;
  errc report_once_ = errc::ok;
  std::string last_error_;
};

static_assert(check_segment_sender<ucx_sender>());
static_assert(check_segment_receiver<ucx_receiver>());

}  // namespace lynx

#endif  // __has_include(<ucp/api/ucp.h>)
