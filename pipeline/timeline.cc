// The pipeline timeline as pictures: a Chrome trace (Perfetto, chrome://tracing) and a self-contained SVG.
#include "tandem/pipeline/timeline.h"

#include <algorithm>
#include <fstream>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "tandem/pipeline/pipeline.h"
#include "tandem/rpc/errors.h"

namespace tandem::pipeline {
namespace {

void write_file(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw RpcError(absl::UnavailableError("pipeline: could not write " + path));
}

int64_t first_start(const std::vector<TimelineEvent>& events) {
  int64_t t0 = std::numeric_limits<int64_t>::max();
  for (const auto& e : events) t0 = std::min(t0, e.start_us);
  return events.empty() ? 0 : t0;
}

}  // namespace

namespace {
struct KindStyle {
  const char* letter;
  const char* name;    // the Chrome trace's category
  const char* legend;  // the picture's
  const char* fill;
};
// By Kind: F, B, I, W, and a replicated stage's sum across the replicas.
constexpr KindStyle kStyles[] = {{"F", "forward", "forward", "#3f7fbf"},
                                 {"B", "backward", "backward", "#4c9a5b"},
                                 {"I", "backward_input", "input gradient", "#e08a2c"},
                                 {"W", "backward_weight", "weight gradient", "#8e5ab5"},
                                 {"R", "allreduce", "sum across replicas", "#b03a2e"}};
constexpr int kKinds = sizeof(kStyles) / sizeof(kStyles[0]);
const KindStyle& kind_of(const TimelineEvent& e) { return kStyles[static_cast<int>(e.kind)]; }
// "F3", "W0"; a sum across replicas is "sum" (it covers every micro-batch).
std::string label(const TimelineEvent& e) {
  return e.kind == Kind::kReduce ? std::string("sum") : absl::StrCat(kind_of(e).letter, e.microbatch);
}
}  // namespace

std::string chrome_trace_json(const std::vector<TimelineEvent>& events) {
  const int64_t t0 = first_start(events);
  std::string out = "{\"traceEvents\":[\n";
  std::vector<std::pair<int, int>> named;  // (worker, stage) rows already named
  for (const auto& e : events) {
    if (std::find(named.begin(), named.end(), std::make_pair(e.worker, e.stage)) == named.end()) {
      named.emplace_back(e.worker, e.stage);
      absl::StrAppend(&out, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":", e.worker,
                      ",\"args\":{\"name\":\"worker ", e.worker, "\"}},\n");
      absl::StrAppend(&out, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":", e.worker, ",\"tid\":", e.stage,
                      ",\"args\":{\"name\":\"stage ", e.stage, "\"}},\n");
    }
  }
  for (size_t i = 0; i < events.size(); ++i) {
    const auto& e = events[i];
    absl::StrAppend(
        &out, "{\"name\":\"", label(e), "\",\"cat\":\"", kind_of(e).name, "\",\"ph\":\"X\",\"pid\":", e.worker,
        ",\"tid\":", e.stage, ",\"ts\":", e.start_us - t0, ",\"dur\":", std::max<int64_t>(1, e.end_us - e.start_us),
        ",\"args\":{\"microbatch\":", e.microbatch, ",\"stage\":", e.stage, "}}", i + 1 < events.size() ? ",\n" : "\n");
  }
  out += "],\"displayTimeUnit\":\"ms\"}\n";
  return out;
}

std::string schedule_svg(const std::vector<TimelineEvent>& events, int n_stages, const std::string& title) {
  const int64_t t0 = first_start(events);
  int64_t t1 = t0 + 1;
  for (const auto& e : events) t1 = std::max(t1, e.end_us);
  const double width = 960, left = 90, row = 34, top = 48;
  const double height = top + row * n_stages + 56;
  const double scale = width / static_cast<double>(t1 - t0);
  std::string svg = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%.0f\" y=\"22\" font-size=\"15\" font-weight=\"bold\">%s</text>\n",
      left + width + 20, height, left, title);
  for (int s = 0; s < n_stages; ++s) {
    const double y = top + row * s;
    absl::StrAppendFormat(&svg, "<rect x=\"%.0f\" y=\"%.1f\" width=\"%.0f\" height=\"%.1f\" fill=\"#f3f3f3\"/>\n", left,
                          y, width, row - 6);
    absl::StrAppendFormat(&svg, "<text x=\"8\" y=\"%.1f\">stage %d</text>\n", y + row / 2, s);
  }
  for (const auto& e : events) {
    const double x = left + static_cast<double>(e.start_us - t0) * scale;
    const double w = std::max(1.0, static_cast<double>(e.end_us - e.start_us) * scale);
    const double y = top + row * e.stage;
    const char* fill = kind_of(e).fill;
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\" stroke=\"white\" "
                          "stroke-width=\"0.5\"><title>%s on worker %d: %.3f ms</title></rect>\n",
                          x, y, w, row - 6, fill, label(e), e.worker,
                          static_cast<double>(e.end_us - e.start_us) / 1000.0);
    if (w >= 14) {
      absl::StrAppendFormat(&svg, "<text x=\"%.2f\" y=\"%.1f\" fill=\"white\" text-anchor=\"middle\">%s</text>\n",
                            x + w / 2, y + row / 2, label(e));
    }
  }
  const double axis = top + row * n_stages + 6;
  const double total_ms = static_cast<double>(t1 - t0) / 1000.0;
  for (int k = 0; k <= 4; ++k) {
    const double x = left + width * k / 4;
    absl::StrAppendFormat(&svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#888\"/>\n", x, axis, x,
                          axis + 5);
    absl::StrAppendFormat(&svg, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.1f ms</text>\n", x, axis + 18,
                          total_ms * k / 4);
  }
  // The legend: the kinds this step ran, then the bubble.
  double lx = left;
  for (int k = 0; k < kKinds; ++k) {
    const KindStyle& style = kStyles[k];
    if (std::none_of(events.begin(), events.end(), [&](const auto& e) { return static_cast<int>(e.kind) == k; })) {
      continue;
    }
    absl::StrAppendFormat(&svg,
                          "<rect x=\"%.0f\" y=\"%.1f\" width=\"12\" height=\"12\" fill=\"%s\"/><text x=\"%.0f\" "
                          "y=\"%.1f\">%s %s</text>\n",
                          lx, axis + 28, style.fill, lx + 16, axis + 38, style.letter, style.legend);
    lx += 160;
  }
  absl::StrAppendFormat(&svg, "<text x=\"%.0f\" y=\"%.1f\" fill=\"#666\">grey: idle (the bubble)</text>\n", lx,
                        axis + 38);
  svg += "</svg>\n";
  return svg;
}

void Pipeline::write_chrome_trace(const std::string& path) const {
  write_file(path, chrome_trace_json(last_timeline()));
}

void Pipeline::write_svg(const std::string& path) const {
  const auto& s = last_stats();
  write_file(path, schedule_svg(last_timeline(), num_stages(),
                                absl::StrFormat("%s, %d stages, %d micro-batches: step %.1f ms",
                                                schedule_name(options().schedule), num_stages(),
                                                static_cast<int>(s.microbatch_sizes.size()), s.step_ms)));
}

}  // namespace tandem::pipeline
