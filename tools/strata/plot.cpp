// strata plot RUN_DIR [RUN_DIR...] [--out DIR]: SVG charts of a training run's metrics.jsonl, or
// the loss curves of several runs on one chart.
#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/status.h"
#include "core/svg_chart.h"
#include "tools/strata/commands.h"

namespace strata::tools {
namespace {

namespace fs = std::filesystem;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

constexpr const char* kPlotUsage = R"(Usage: strata plot RUN_DIR [--out DIR]
       strata plot RUN_DIR RUN_DIR... [--out DIR]

Draws a training run's metrics as SVG pictures that a browser or GitHub shows as they are.
RUN_DIR is the run.dir of a `strata train` run: it reads RUN_DIR/metrics.jsonl and, before
it, any metrics.restart-K.jsonl that a requeued run set aside (in K order, each restart a
dashed line), and writes into DIR (default RUN_DIR/plots):

  loss.svg        loss per step, and the eval loss where the run evaluated (data.eval_paths);
                  a cross marks each skipped (non-finite) step
  throughput.svg  tokens per second
  memory.svg      bytes on device, host and nvme (stacked) and the process's RSS
  stalls.svg      time compute waited for data, and bytes moved between tiers, per step
  overview.svg    all of the above, one above the other

A resumed run that repeated steps shows the repeat after a gap, with a dashed line at the
resume. Lines that record an event rather than a step ({"event": ...}) are skipped. Files are
written whole (under a temporary name, then renamed) and their paths printed.

With several run directories (runs of one config under different recipes, say) it draws their
losses on one chart, compare-loss.svg (default DIR: the first run's plots folder), each line
named by its run directory, and prints each run's mean loss over its last 10% of steps and how
far that is from the first run's, relative.

Options:
  --out DIR   where to write the pictures (created if missing)
)";

// One line of metrics.jsonl; NaN where the line has no value (an older file, or a skipped
// step's loss, which JSON writes as null).
struct StepRow {
  double x;  // the step, after the steps of earlier attempts
  double loss, tokens_per_s, device, host, nvme, rss, stall_ms, moved;
  double eval_loss;  // NaN on steps that were not evaluated
  bool skipped;
};

// A break in every line.
StepRow gap_row() { return StepRow{kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, kNaN, false}; }

struct RunMetrics {
  std::vector<StepRow> rows;
  std::vector<std::pair<double, std::string>> markers;  // restarts and resumes
  bool restarted = false;
};

// Longer than any line strata writes by far; a longer one is not a metrics line.
constexpr size_t kMaxLine = 64 * 1024;

Result<double> number(const nlohmann::json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kNaN;
  if (!it->is_number())
    return Status::Corruption(fmt::format(
        "{}: \"{}\" is {}, not a number; the file is damaged: fix or remove that line", where, key, it->type_name()));
  return it->get<double>();
}

// Appends the steps of one metrics file, their x after `*offset`; on return *offset is the
// last step's x, where the next attempt begins.
Status read_metrics(const fs::path& path, RunMetrics* run, double* offset) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return Status::IOError(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
  std::vector<char> buffer(kMaxLine + 2);
  const double base = *offset;
  double previous = -1;
  Status status;
  for (long line_no = 1; std::fgets(buffer.data(), static_cast<int>(buffer.size()), f) != nullptr; ++line_no) {
    std::string line(buffer.data());
    const std::string where = fmt::format("{}:{}", path.string(), line_no);
    const bool complete = !line.empty() && line.back() == '\n';
    if (!complete && line.size() > kMaxLine) {
      status = Status::Corruption(where + ": a line longer than 64 KiB; this is not a strata metrics file");
      break;
    }
    if (line.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      if (!complete && std::feof(f)) {
        // A run that died while writing its last line leaves it unfinished; the rest stands.
        std::fprintf(stderr, "strata plot: warning: %s: skipping the unfinished last line (the run stopped while writing it)\n",
                     where.c_str());
        break;
      }
      status = Status::Corruption(fmt::format(
          "{}: not valid JSON (at column {}); the file is damaged: fix or remove that line", where, e.byte));
      break;
    }
    if (!j.is_object()) {
      status = Status::Corruption(where + ": not a JSON object; the file is damaged: fix or remove that line");
      break;
    }
    if (!j.contains("step")) {
      if (j.contains("event")) continue;  // e.g. the run's goodput record at its end
      status = Status::Corruption(where + ": neither \"step\" nor \"event\"; not a strata metrics line");
      break;
    }
    const nlohmann::json& s = j["step"];
    if (!s.is_number_integer() || s.get<int64_t>() < 0) {
      status =
          Status::Corruption(where + ": \"step\" is not a step number; the file is damaged: fix or remove that line");
      break;
    }
    const double step = static_cast<double>(s.get<int64_t>());
    StepRow row{};
    row.x = base + step;
    struct Field {
      const char* key;
      double* into;
    };
    for (const Field& field :
         {Field{"loss", &row.loss}, Field{"tokens_per_s", &row.tokens_per_s}, Field{"device_bytes", &row.device},
          Field{"host_bytes", &row.host}, Field{"nvme_bytes", &row.nvme}, Field{"rss_bytes", &row.rss},
          Field{"stall_ms", &row.stall_ms}, Field{"moved_bytes", &row.moved}, Field{"eval_loss", &row.eval_loss}}) {
      Result<double> v = number(j, field.key, where);
      if (!v.ok()) {
        status = v.status();
        break;
      }
      *field.into = *v;
    }
    if (!status.ok()) break;
    const auto skipped = j.find("skipped");
    row.skipped = (skipped != j.end() && skipped->is_boolean() && skipped->get<bool>()) || !std::isfinite(row.loss);
    if (previous >= 0 && step <= previous) {
      // Resumed from a checkpoint: the steps since it run again. Break the lines there.
      run->markers.emplace_back(row.x, fmt::format("resumed at step {}", static_cast<int64_t>(step)));
      run->rows.push_back(gap_row());
    }
    previous = step;
    *offset = std::max(*offset, row.x);
    run->rows.push_back(row);
  }
  if (status.ok() && std::ferror(f))
    status = Status::IOError(fmt::format("cannot read {}: {}", path.string(), std::strerror(errno)));
  std::fclose(f);
  return status;
}

// metrics.restart-K.jsonl in K order, then metrics.jsonl.
Result<std::vector<fs::path>> metrics_files(const fs::path& run_dir) {
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec))
    return Status::NotFound(
        "run directory '" + run_dir.string() +
        "' does not exist; pass the run.dir of a `strata train` run (it writes metrics.jsonl there)");
  std::map<long, fs::path> restarts;
  bool versions = false;
  for (const fs::directory_entry& e : fs::directory_iterator(run_dir, ec)) {
    const std::string name = e.path().filename().string();
    versions |= name.rfind("version_", 0) == 0;
    long k = 0;
    int used = 0;
    if (std::sscanf(name.c_str(), "metrics.restart-%ld.jsonl%n", &k, &used) == 1 &&
        used == static_cast<int>(name.size()) && k > 0)
      restarts[k] = e.path();
  }
  if (ec) return Status::IOError("cannot list " + run_dir.string() + ": " + ec.message());
  std::vector<fs::path> files;
  for (const auto& [k, p] : restarts) files.push_back(p);
  const fs::path current = run_dir / "metrics.jsonl";
  if (fs::exists(current, ec)) files.push_back(current);
  if (files.empty())
    return Status::NotFound("no metrics.jsonl in " + run_dir.string() +
                            "; `strata train` writes it into run.dir as steps complete" +
                            (versions ? " (unnamed runs go to version_N folders: pass one of those)" : ""));
  return files;
}

struct Charts {
  std::vector<std::pair<std::string, std::string>> files;  // name, SVG text
};

Charts make_charts(const RunMetrics& run) {
  auto column = [&](double StepRow::*field) {
    std::vector<double> v;
    for (const StepRow& r : run.rows) v.push_back(r.*field);
    return v;
  };
  const std::vector<double> x = column(&StepRow::x);
  const std::string x_label = run.restarted ? "step (attempts one after another)" : "step";
  auto chart = [&](const std::string& title, const std::string& y_label, svg::Unit unit) {
    svg::LineChart c;
    c.title = title;
    c.x_label = x_label;
    c.y_label = y_label;
    c.y_unit = unit;
    c.markers = run.markers;
    return c;
  };

  svg::LineChart loss = chart("Loss", "loss", svg::Unit::kPlain);
  loss.y_from_zero = false;
  loss.series.push_back({"loss", x, column(&StepRow::loss)});
  // Evaluations (data.eval_paths) are a line of their own through the steps that had one; a
  // resume breaks it as it breaks the training loss.
  svg::Series eval{"eval loss", {}, {}, svg::Style::kLine};
  for (const StepRow& r : run.rows) {
    if (std::isnan(r.x) && !eval.x.empty()) eval.x.push_back(kNaN), eval.y.push_back(kNaN);
    if (std::isfinite(r.eval_loss)) eval.x.push_back(r.x), eval.y.push_back(r.eval_loss);
  }
  if (!eval.x.empty()) loss.series.push_back(eval);
  // A skipped step has no loss to draw: its cross sits at the last loss before it.
  svg::Series skipped{"skipped step", {}, {}, svg::Style::kPoints};
  double last_loss = kNaN;
  for (const StepRow& r : run.rows) {
    if (r.skipped && !std::isnan(r.x)) {
      skipped.x.push_back(r.x);
      skipped.y.push_back(last_loss);
    }
    if (std::isfinite(r.loss)) last_loss = r.loss;
  }
  // Skipped steps before any finite loss sit at the first one.
  for (double& y : skipped.y)
    if (std::isnan(y))
      for (const StepRow& r : run.rows)
        if (std::isfinite(r.loss)) {
          y = r.loss;
          break;
        }
  if (!skipped.x.empty()) loss.series.push_back(skipped);

  svg::LineChart throughput = chart("Throughput", "tokens/s", svg::Unit::kPlain);
  throughput.series.push_back({"tokens/s", x, column(&StepRow::tokens_per_s)});

  svg::LineChart memory = chart("Memory per tier (stacked) and process RSS", "bytes", svg::Unit::kBytes);
  memory.stacked = true;
  memory.series.push_back({"device", x, column(&StepRow::device)});
  memory.series.push_back({"host", x, column(&StepRow::host)});
  memory.series.push_back({"nvme", x, column(&StepRow::nvme)});
  memory.series.push_back({"RSS", x, column(&StepRow::rss), svg::Style::kLine});

  svg::LineChart stall = chart("Time compute waited for data", "stall per step", svg::Unit::kSeconds);
  std::vector<double> stall_s = column(&StepRow::stall_ms);
  for (double& v : stall_s) v /= 1000;
  stall.series.push_back({"stall", x, stall_s});
  svg::LineChart moved = chart("Bytes moved between tiers", "per step", svg::Unit::kBytes);
  moved.series.push_back({"moved", x, column(&StepRow::moved)});

  Charts out;
  const std::string loss_svg = svg::render_line_chart(loss), throughput_svg = svg::render_line_chart(throughput),
                    memory_svg = svg::render_line_chart(memory), stall_svg = svg::render_line_chart(stall, 900, 300),
                    moved_svg = svg::render_line_chart(moved, 900, 300);
  out.files = {{"loss.svg", loss_svg},
               {"throughput.svg", throughput_svg},
               {"memory.svg", memory_svg},
               {"stalls.svg", svg::stack_vertically({stall_svg, moved_svg})},
               {"overview.svg", svg::stack_vertically({loss_svg, throughput_svg, memory_svg, stall_svg, moved_svg})}};
  return out;
}

// The loss curves of several runs on one chart, and each run's mean loss over its last tenth.
int compare_runs(const std::vector<std::string>& run_dirs, const std::string& out_dir);

int fail(const Status& s) {
  std::fprintf(stderr, "strata plot: error: %s\n", s.message().c_str());
  return 1;
}

int compare_runs(const std::vector<std::string>& run_dirs, const std::string& out_dir) {
  svg::LineChart loss;
  loss.title = "Loss";
  loss.x_label = "step";
  loss.y_label = "loss";
  loss.y_from_zero = false;
  std::vector<double> tails;
  for (const std::string& dir : run_dirs) {
    // Only the run's current metrics: attempts set aside by a requeue would draw over it.
    Result<std::vector<fs::path>> files = metrics_files(dir);
    if (!files.ok()) return fail(files.status());
    RunMetrics run;
    double offset = 0;
    if (Status s = read_metrics(files->back(), &run, &offset); !s.ok()) return fail(s);
    svg::Series series{fs::path(dir).lexically_normal().filename().string(), {}, {}};
    if (series.name.empty()) series.name = dir;
    for (const StepRow& r : run.rows) series.x.push_back(r.x), series.y.push_back(r.loss);
    // The mean of the finite losses of the last 10% of the steps (at least one).
    const size_t n = run.rows.size(), from = n - std::max<size_t>(1, n / 10);
    double sum = 0;
    size_t count = 0;
    for (size_t i = n > 0 ? from : 0; i < n; ++i)
      if (std::isfinite(run.rows[i].loss)) sum += run.rows[i].loss, ++count;
    tails.push_back(count > 0 ? sum / static_cast<double>(count) : kNaN);
    loss.series.push_back(std::move(series));
  }
  const fs::path out = out_dir.empty() ? fs::path(run_dirs.front()) / "plots" : fs::path(out_dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return fail(Status::IOError("cannot create output directory " + out.string() + ": " + ec.message()));
  const fs::path path = out / "compare-loss.svg";
  if (Status s = write_file_atomic(path.string(), svg::render_line_chart(loss)); !s.ok()) return fail(s);
  std::printf("%-32s %12s %10s\n", "run", "last 10%", "vs first");
  for (size_t i = 0; i < run_dirs.size(); ++i) {
    const double rel = (tails[i] - tails[0]) / tails[0];
    std::printf("%-32s %12.5f %9.3f%%\n", loss.series[i].name.c_str(), tails[i], 100 * rel);
  }
  std::printf("wrote %s\n", path.c_str());
  return 0;
}

}  // namespace

int plot_command(const std::vector<std::string>& args) {
  std::string run_dir, out_dir;
  std::vector<std::string> run_dirs;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kPlotUsage, stdout);
      return 0;
    } else if (a == "--out" || a.rfind("--out=", 0) == 0) {
      if (a != "--out")
        out_dir = a.substr(6);
      else if (i + 1 < args.size())
        out_dir = args[++i];
      if (out_dir.empty()) {
        std::fprintf(stderr, "strata plot: error: --out needs a directory (see strata plot --help)\n");
        return 2;
      }
    } else if (!a.empty() && a[0] != '-') {
      if (run_dir.empty()) run_dir = a;
      run_dirs.push_back(a);
    } else {
      std::fprintf(stderr, "strata plot: error: unexpected argument '%s' (see strata plot --help)\n", a.c_str());
      return 2;
    }
  }
  if (run_dir.empty()) {
    std::fprintf(stderr, "strata plot: error: which run? pass its run.dir (see strata plot --help)\n");
    return 2;
  }

  if (run_dirs.size() > 1) return compare_runs(run_dirs, out_dir);

  // Everything is read and drawn before anything is written: bad input leaves no files behind.
  Result<std::vector<fs::path>> files = metrics_files(run_dir);
  if (!files.ok()) return fail(files.status());
  RunMetrics run;
  double offset = 0;
  for (size_t k = 0; k < files->size(); ++k) {
    if (k > 0) {
      run.restarted = true;
      run.markers.emplace_back(offset, fmt::format("restart {}", k));
      run.rows.push_back(gap_row());  // the attempts are not one line
    }
    if (Status s = read_metrics((*files)[k], &run, &offset); !s.ok()) return fail(s);
  }
  if (run.rows.empty())
    std::fprintf(stderr, "strata plot: warning: %s holds no steps yet; the charts say \"no data\"\n",
                 files->back().string().c_str());
  const Charts charts = make_charts(run);

  const fs::path out = out_dir.empty() ? fs::path(run_dir) / "plots" : fs::path(out_dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) return fail(Status::IOError("cannot create output directory " + out.string() + ": " + ec.message()));
  for (const auto& [name, text] : charts.files) {
    const fs::path path = out / name;
    if (Status s = write_file_atomic(path.string(), text); !s.ok()) return fail(s);
    std::printf("wrote %s\n", path.c_str());
  }
  return 0;
}

}  // namespace strata::tools
