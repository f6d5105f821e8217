// The timeline table of a request, printed the same way by the demo (virtual
// time on the simulated link) and the two-process example (wall clock): one
// column per run, milliseconds since the request arrived at the prefill node.
#pragma once

#include <cstdio>
#include <string>
#include <vector>

#include "disagg/request.hpp"

namespace lynx_examples::disagg {

/// Seconds as milliseconds with two decimals; "-" for an event that did not happen.
inline std::string ms(double s) {
  if (s < 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", s * 1e3);
  return buf;
}

/// When a user could first see a token after the prefill's: the first provisional
/// token (a draft, retractable) where the run showed any, else the first committed one.
inline double first_shown(const timeline& r) {
  return r.provisional_tokens > 0 && r.first_draft >= 0 ? r.first_draft : r.first_committed;
}

/// "k of n (e events)": provisional tokens taken back; "-" for a run without any.
inline std::string retraction_summary(const timeline& r) {
  if (r.provisional_tokens == 0) return "-";
  return std::to_string(r.retracted_tokens) + " of " + std::to_string(r.provisional_tokens) + " (" +
         std::to_string(r.retractions) + " ev)";
}

inline void print_table(const std::vector<timeline>& runs, const char* bytes_label = "bytes sent") {
  auto row = [&](const char* label, auto get) {
    std::printf("  %-34s", label);
    for (const auto& r : runs) std::printf(" %16s", get(r).c_str());
    std::printf("\n");
  };
  std::printf("\n  %-34s", "ms since the request arrived");
  for (const auto& r : runs) std::printf(" %16s", r.name.c_str());
  std::printf("\n");
  row(bytes_label, [](const timeline& r) { return std::to_string(r.bytes_sent); });
  row("prefill done", [](const timeline& r) { return ms(r.prefill_done); });
  row("encoded (all layers)", [](const timeline& r) { return ms(r.encode_done); });
  row("anchor landed (all layers)", [](const timeline& r) { return ms(r.anchor_landed); });
  row("first draft token", [](const timeline& r) { return ms(r.first_draft); });
  row("residual landed (all layers)", [](const timeline& r) { return ms(r.residual_landed); });
  row("verification done", [](const timeline& r) { return ms(r.verification_done); });
  row("  drafts accepted", [](const timeline& r) {
    return r.verified_drafts || r.verification_done >= 0
               ? std::to_string(r.accepted_drafts) + " of " + std::to_string(r.verified_drafts)
               : std::string("-");
  });
  row("first committed token after prefill's",
      [](const timeline& r) { return ms(r.first_committed); });
  row("first token shown (provisional ok)", [](const timeline& r) { return ms(first_shown(r)); });
  row("  provisional tokens retracted", [](const timeline& r) { return retraction_summary(r); });
  row("all tokens committed", [](const timeline& r) { return ms(r.all_committed); });
}

}  // namespace lynx_examples::disagg
