// The decode side of one request over any transport: receives segments into a
// lynx::layer_set, tells a progressive session the precision level present on
// every layer, steps the session (drafting on the anchor, verifying when the
// residual lands), enforces the request's deadlines and applies its failure
// policy (lynx/speculation/failure_policy.hpp), asking for a resend through a
// hook when the policy says so.
//
// One loop, two kinds of time (the Time parameter):
//
//   wall_time       a transport on std::chrono::steady_clock (TCP, UCX,
//                   loopback): receives wait in the transport, compute takes
//                   the time it takes.
//   simulated_time  the simulated link's virtual clock
//                   (lynx/transport/simulated_link.hpp): a receive that waits
//                   moves the link to its next event (or to the deadline), and
//                   each session step moves it by the step's compute time as
//                   measured on the steady clock, so a request's timeline is
//                   the link's exact arithmetic plus real compute costs.
//
// Receiving and decoding interleave on the caller's thread: between two steps
// the driver takes whatever has arrived (never waiting); when the session must
// wait for planes it waits on the receiver until the next deadline. Every
// segment is accepted into its tensor (which copies it) and released to the
// transport at once. Segments of another generation, damaged, truncated or of
// a layer out of range are refused (counted in the report with their error
// code) and change nothing; duplicates are idempotent. Bytes that are not a
// segment can be claimed by a control-message hook (a request preamble, say);
// the session can be attached from there, once the first token is known.
//
//   lynx::layer_set<plan> received(tensors);
//   lynx::request_driver<lynx::layer_set<plan>, session_type, receiver_type> driver(
//       received, receiver, {.failure = {.policy = lynx::failure_policy::rerequest}});
//   driver.attach(session);            // or from hooks.on_message
//   const auto report = driver.run();  // outcome, refusals, failures, times
#pragma once

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "lynx/core/error.hpp"
#include "lynx/planes/layer_set.hpp"
#include "lynx/planes/segment.hpp"
#include "lynx/speculation/failure_policy.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/transport/concepts.hpp"

namespace lynx {

/// A segment (or control message) the decode side refused, and why.
struct rejected_segment {
  segment_id id;  // from its header when readable
  lane_index lane = 0;
  errc status = errc::ok;  // stale_generation, corrupted_segment, truncated_segment,
                           // layer_mismatch, bad_magic, ...
  std::string what;
};

/// A failure of the transfer as the decode side saw it.
struct transfer_failure {
  errc status = errc::ok;  // peer_failure, transport_failure, timeout (a deadline)
  std::string what;
  double at = -1;  // seconds since the driver started (request_report::started)
  failure_policy applied = failure_policy::fail_request;
};

/// Time over a transport on the steady clock: waits block in the transport.
struct wall_time {
  using clock = std::chrono::steady_clock;
  [[nodiscard]] clock::time_point now() const { return clock::now(); }
  template <segment_receiver R>
  receive_result<clock> wait(R& receiver, clock::time_point deadline) {
    return receiver.try_receive(deadline);
  }
  void computed(std::chrono::steady_clock::duration) noexcept {}  // it has passed already
};

/// What a request_driver needs of its time: now() in the receiver's clock, a
/// receive that waits until a deadline, and a hook told each step's measured
/// compute time (a virtual clock moves by it; the wall clock already has).
template <class T, class Receiver>
concept request_time = segment_receiver<Receiver> &&
    requires(T& t, Receiver& receiver, typename Receiver::clock::time_point deadline,
             std::chrono::steady_clock::duration compute) {
  { t.now() } -> std::same_as<typename Receiver::clock::time_point>;
  { t.wait(receiver, deadline) } -> std::same_as<receive_result<typename Receiver::clock>>;
  t.computed(compute);
};

/// Options of one request's decode side.
struct request_options {
  int target_level = 0;  // the streams the prefill side sends (0: every stream of the plan;
                         // 1: the anchor alone, a blocking low-precision baseline)
  bool hold_until_complete = false;  // tell the session nothing before target_level has landed
                                     // on every layer (a blocking transfer)
  failure_options failure;
  request_deadlines deadlines;
};

/// What happened to one request, in the receiver's clock.
template <class Clock>
struct request_report {
  using time_point = typename Clock::time_point;
  request_outcome outcome = request_outcome::pending;
  std::string failure;  // why the request failed or went unverified (empty when completed)
  std::vector<rejected_segment> rejected;
  std::vector<transfer_failure> failures;  // in order; a resend that worked is followed by none
  int duplicates = 0, stale = 0, rerequests = 0, segments_accepted = 0;
  std::uint64_t bytes_received = 0;  // every message, control messages and refusals included
  int level = 0;                     // the level present on every layer at the end
  time_point started{};              // when run() began
  // [k]: when level k was present on every layer (the arrival time of the
  // segment that completed it); index 0 unused.
  std::vector<std::optional<time_point>> level_at;
  std::optional<time_point> first_draft;      // the first draft step ended
  std::optional<time_point> verification;     // a verification at the requested level ended
  std::optional<time_point> first_committed;  // the token after the prefill's own committed
  std::optional<time_point> finished;         // the session finished (every token committed)
  std::int64_t verified_drafts = 0, accepted_drafts = 0;  // at the verification above
  std::vector<int> step_levels;  // the level available at each session step (a replay)

  [[nodiscard]] int count(errc status) const {
    return static_cast<int>(
        std::count_if(rejected.begin(), rejected.end(),
                      [&](const rejected_segment& r) { return r.status == status; }));
  }
  /// Seconds from `origin` to an event (-1 when it did not happen).
  [[nodiscard]] static double seconds(const std::optional<time_point>& t, time_point origin) {
    return t ? std::chrono::duration<double>(*t - origin).count() : -1.0;
  }
};

/// Drives one request's decode side (see the top of this header). Received is
/// a lynx::layer_set; Session a lynx::progressive_session (or anything with
/// its set_available_level / step / fail / continue_unverified / finished /
/// unverified / available_level / requested_level); Receiver the transport's
/// receiver; Time wall_time or simulated_time.
template <class Received, class Session, segment_receiver Receiver,
          request_time<Receiver> Time = wall_time>
class request_driver {
 public:
  using plan_type = typename Received::plan_type;
  using clock = typename Receiver::clock;
  using time_point = typename clock::time_point;
  using report_type = request_report<clock>;

  struct hooks {
    /// rerequest policy: ask the prefill side to resend `request` and return
    /// the receiver the resend arrives on (the old one may be dead), or nullptr
    /// when no resend can be arranged. The caller owns the returned receiver.
    std::function<Receiver*(const resend_request& request)> rerequest;
    /// Offered every message before it is taken as a segment: true when it was
    /// a control message the hook consumed (it may attach the session, or
    /// refuse the message with reject()). The driver releases it either way.
    std::function<bool(const received_segment<clock>& message)> on_message;
    /// Every segment accepted (its id, the level now present on every layer).
    std::function<void(const segment_id& id, int level)> on_segment;
    /// The level present on every layer rose to `level` (at the arrival time of
    /// the segment that completed it); target_level: the transfer is complete.
    std::function<void(int level, time_point at)> on_level;
  };

  request_driver(Received& received, Receiver& receiver, request_options options, hooks h = {},
                 Time time = {})
      : received_(received),
        rx_(&receiver),
        options_(options),
        hooks_(std::move(h)),
        time_(std::move(time)),
        target_(options.target_level == 0 ? plan_type::streams : options.target_level) {
    detail::require(target_ >= 1 && target_ <= plan_type::streams, errc::invalid_argument,
                    "request_driver: target_level " + std::to_string(options.target_level) +
                        " for a plan of " + std::to_string(plan_type::streams) + " streams");
    detail::require(options.failure.max_rerequests >= 0, errc::invalid_argument,
                    "request_driver: max_rerequests must be >= 0");
    detail::require(options.failure.after_rerequests != failure_policy::rerequest,
                    errc::invalid_argument,
                    "request_driver: after_rerequests must be fail_request or continue_unverified");
    report_.level_at.resize(static_cast<std::size_t>(target_) + 1);
  }

  /// The session to drive: now, or from hooks.on_message once it can be made.
  /// It learns the level already present.
  void attach(Session& session) {
    detail::require(session_ == nullptr, errc::invalid_argument,
                    "request_driver: a session is attached already");
    session_ = &session;
    if (level_ > 0 && (!options_.hold_until_complete || level_ == target_))
      session_->set_available_level(level_);
  }

  /// Records a refused message (for hooks.on_message).
  void reject(segment_id id, lane_index lane, errc status, std::string what) {
    if (status == errc::stale_generation) ++report_.stale;
    report_.rejected.push_back({id, lane, status, std::move(what)});
  }

  [[nodiscard]] Session* session() const noexcept { return session_; }
  [[nodiscard]] int level() const noexcept { return level_; }
  [[nodiscard]] const report_type& report() const noexcept { return report_; }
  [[nodiscard]] Time& time() noexcept { return time_; }

  /// Runs the request to its end: every token committed, or failed. Once.
  report_type run() {
    detail::require(!ran_, errc::invalid_argument, "request_driver: run() was called already");
    ran_ = true;
    start_ = time_.now();
    report_.started = start_;
    anchor_deadline_ = start_ + to_clock(options_.deadlines.anchor);
    request_deadline_ = start_ + to_clock(options_.deadlines.request);
    update_level(start_);  // planes present before the request began (accepted by the caller)

    while (!failed_ && !(session_ && session_->finished())) {
      if (!link_done_) {
        while (!link_done_ && !failed_ && take(rx_->try_receive(time_.now()))) {
        }
        check_deadlines();
        if (failed_) break;
      } else if (time_.now() >= request_deadline_) {
        report_.failures.push_back({errc::timeout, "the request deadline passed", since_start(),
                                    failure_policy::fail_request});
        give_up("the request deadline passed");
        break;
      }
      if (!session_) {
        if (link_done_) {  // every segment, but nothing attached a session: it cannot come now
          on_failure(errc::timeout,
                     "every segment landed but no session was attached (the "
                     "request's first token never came)");
          continue;
        }
        take(time_.wait(*rx_, next_deadline()));
        continue;
      }
      const std::size_t before = session_->committed().size();
      report_.step_levels.push_back(session_->available_level());
      const auto t0 = std::chrono::steady_clock::now();
      const step_result step = session_->step();
      if (step.kind == step_kind::idle) {
        detail::require(!link_done_, errc::internal,
                        "request_driver: the session waits for planes but the transfer is over");
        take(time_.wait(*rx_, next_deadline()));
        continue;
      }
      time_.computed(std::chrono::steady_clock::now() - t0);
      const time_point now = time_.now();
      if (step.kind == step_kind::draft && !report_.first_draft) report_.first_draft = now;
      if (step.kind == step_kind::verify && step.level == session_->requested_level()) {
        report_.verification = now;
        report_.verified_drafts += step.drafted;
        report_.accepted_drafts += step.accepted;
      }
      if (before < 2 && session_->committed().size() >= 2 && !report_.first_committed)
        report_.first_committed = now;
    }
    if (session_ && session_->finished()) report_.finished = time_.now();
    report_.level = level_;
    if (failed_)
      report_.outcome = request_outcome::failed;
    else if (session_ && session_->unverified())
      report_.outcome = request_outcome::completed_unverified;
    else
      report_.outcome = request_outcome::completed;
    return report_;
  }

 private:
  template <class Rep, class Period>
  static typename clock::duration to_clock(std::chrono::duration<Rep, Period> d) {
    // Saturates: a deadline of hours on a picosecond clock must not wrap.
    const double s = std::chrono::duration<double>(d).count();
    const double limit =
        std::chrono::duration<double>(clock::duration::max()).count() / 4;  // room for start + d
    return std::chrono::duration_cast<typename clock::duration>(
        std::chrono::duration<double>(std::min(s, limit)));
  }

  double since_start() const { return std::chrono::duration<double>(time_.now() - start_).count(); }

  void update_level(time_point at) {
    const int l = std::min(target_, received_.level());
    if (l <= level_) return;
    for (int k = level_ + 1; k <= l; ++k) report_.level_at[static_cast<std::size_t>(k)] = at;
    if (level_ == 0)  // the residual deadline runs from the anchor's landing
      residual_deadline_ = at + to_clock(options_.deadlines.residual);
    level_ = l;
    if (level_ == target_) link_done_ = true;
    if (hooks_.on_level) hooks_.on_level(level_, at);
    if (session_ && !session_->unverified() && (!options_.hold_until_complete || level_ == target_))
      session_->set_available_level(level_);
  }

  void handle(const received_segment<clock>& seg) {
    report_.bytes_received += seg.bytes.size();
    if (hooks_.on_message && hooks_.on_message(seg)) {
      rx_->release(seg);
      return;
    }
    segment_id id{};
    try {
      const segment_header h = peek_header(seg.bytes);
      id = {h.layer, static_cast<int>(h.stream), h.generation};
      if (received_.accept(seg.bytes).result == accept_result::duplicate)
        ++report_.duplicates;
      else
        ++report_.segments_accepted;
    } catch (const error& e) {
      reject(id, seg.lane, e.code(), e.what());
      rx_->release(seg);
      return;
    }
    rx_->release(seg);  // the tensor holds its own copy
    update_level(seg.arrival);
    if (hooks_.on_segment) hooks_.on_segment(id, level_);
  }

  [[nodiscard]] std::vector<segment_id> missing() const {
    std::vector<segment_id> m = received_.missing();
    std::erase_if(m, [&](const segment_id& id) { return id.stream >= target_; });
    return m;
  }

  void give_up(const std::string& why) {
    report_.failure = why;
    failed_ = true;
    if (session_) session_->fail(why);
  }

  // The link broke or a deadline passed with streams missing: apply the policy.
  void on_failure(errc status, const std::string& what) {
    transfer_failure f{status, what, since_start(), options_.failure.policy};
    failure_policy policy = options_.failure.policy;
    if (policy == failure_policy::rerequest) {
      if (attempts_ < options_.failure.max_rerequests && hooks_.rerequest) {
        // The request's generation: the tensors' (they refuse segments of any other).
        const std::uint64_t generation = received_.layers() > 0 ? received_[0].generation() : 0;
        const resend_request request{generation, missing(), attempts_ + 1};
        Receiver* next = hooks_.rerequest(request);
        if (next != nullptr) {
          ++attempts_;
          ++report_.rerequests;
          report_.failures.push_back(f);
          rx_ = next;
          const time_point t = time_.now();
          if (level_ == 0) anchor_deadline_ = t + to_clock(options_.deadlines.anchor);
          residual_deadline_ =
              level_ == 0 ? time_point::max() : t + to_clock(options_.deadlines.residual);
          return;
        }
      }
      policy = options_.failure.after_rerequests;
    }
    if (policy == failure_policy::continue_unverified && session_ && level_ >= 1) {
      f.applied = policy;
      report_.failures.push_back(f);
      session_->continue_unverified(what);
      report_.failure = what;
      link_done_ = true;
      return;
    }
    f.applied = failure_policy::fail_request;
    report_.failures.push_back(f);
    give_up(what);
  }

  void check_deadlines() {
    if (link_done_ || failed_) return;
    const time_point now = time_.now();
    if (now >= request_deadline_) {
      report_.failures.push_back({errc::timeout, "the request deadline passed", since_start(),
                                  failure_policy::fail_request});
      give_up("the request deadline passed");
    } else if (level_ == 0 && now >= anchor_deadline_) {
      on_failure(errc::timeout, "the anchor deadline passed with " +
                                    std::to_string(missing().size()) + " segments missing");
    } else if (level_ > 0 && now >= residual_deadline_) {
      on_failure(errc::timeout, "the residual deadline passed with " +
                                    std::to_string(missing().size()) + " segments missing");
    }
  }

  // Takes one result of a receive; false when nothing came.
  bool take(const receive_result<clock>& r) {
    if (r.ok()) {
      handle(r.segment);
      return true;
    }
    if (r.status == errc::timeout) return false;
    if (r.status == errc::corrupted_segment) {  // a framing error; the link state follows
      reject({}, 0, r.status, "the transport refused a frame");
      return true;
    }
    on_failure(r.status, std::string("the link failed: ") + std::string(to_string(r.status)));
    return true;
  }

  [[nodiscard]] time_point next_deadline() const {
    return std::min(request_deadline_, level_ == 0 ? anchor_deadline_ : residual_deadline_);
  }

  Received& received_;
  Receiver* rx_;
  request_options options_;
  hooks hooks_;
  Time time_;
  int target_;
  Session* session_ = nullptr;
  report_type report_;
  int level_ = 0;
  bool link_done_ = false;  // every stream sent has landed, or the policy let go of the link
  bool failed_ = false;
  bool ran_ = false;
  int attempts_ = 0;
  time_point start_{}, anchor_deadline_{}, request_deadline_{};
  time_point residual_deadline_ = time_point::max();
};

}  // namespace lynx
