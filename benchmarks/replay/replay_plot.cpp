#include "replay_plot.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

extern char** environ;

namespace mkv::replay {
namespace {

/// gnuplot single-quoted string: only '' needs escaping.
std::string gnuplotQuoted(std::string_view text) {
  std::string out = "'";
  for (char c : text) {
    out += c == '\'' ? std::string("''") : std::string(1, c);
  }
  return out + "'";
}

std::string readAll(std::filesystem::path const& path) {
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  return text.str();
}

std::string script(ReplayResult const& r, std::string const& dataPath, std::string const& png) {
  std::string const title =
      fmt::format("mkv-replay: {} requests, mode {}, page {}, pool {} pages", r.requests,
                  toString(r.config.mode), r.config.pageSize, r.poolPages);
  return fmt::format(
      "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {{\n"
      "  set terminal pngcairo size 1100,650 noenhanced\n"
      "}} else {{\n"
      "  set terminal png size 1100,650 noenhanced\n"
      "}}\n"
      "set output {}\n"
      "set title {}\n"
      "set xlabel 'requests completed'\n"
      "set ylabel 'pages in use (leased or cached)'\n"
      "set y2label 'cumulative hit rate (%)'\n"
      "set yrange [0:{}]\n"
      "set y2range [0:100]\n"
      "set ytics nomirror\n"
      "set y2tics\n"
      "set grid\n"
      "set key outside bottom center horizontal\n"
      "plot {} using 1:2 with lines lw 2 title 'pages in use', \\\n"
      "     '' using 1:3 axes x1y2 with lines lw 2 title 'hit rate (%)', \\\n"
      "     {} with lines dt 2 lc rgb 'gray40' title 'pool pages'\n",
      gnuplotQuoted(png), gnuplotQuoted(title), r.poolPages + r.poolPages / 12 + 1,
      gnuplotQuoted(dataPath), r.poolPages);
}

}  // namespace

std::optional<std::string> findInPath(std::string_view name) {
  char const* path = std::getenv("PATH");
  if (path == nullptr) {
    return std::nullopt;
  }
  std::string_view rest(path);
  while (true) {
    std::size_t const colon = rest.find(':');
    std::string_view const dir = rest.substr(0, colon);
    if (!dir.empty()) {
      std::string candidate = fmt::format("{}/{}", dir, name);
      if (::access(candidate.c_str(), X_OK) == 0 && !std::filesystem::is_directory(candidate)) {
        return candidate;
      }
    }
    if (colon == std::string_view::npos) {
      return std::nullopt;
    }
    rest.remove_prefix(colon + 1);
  }
}

PlotOutcome writePlot(ReplayResult const& result, std::string const& pngPath) {
  std::optional<std::string> const gnuplot = findInPath("gnuplot");
  if (!gnuplot) {
    return {
        PlotStatus::kNoGnuplot,
        fmt::format("gnuplot is not installed (not found in PATH); {} was not written", pngPath)};
  }
  std::string pattern =
      (std::filesystem::temp_directory_path() / "mkv-replay-plot-XXXXXX").string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    return {PlotStatus::kFailed,
            fmt::format("cannot create a temporary folder: {}", std::strerror(errno))};
  }
  std::filesystem::path const dir(pattern);
  std::filesystem::path const data = dir / "timeline.dat";
  std::filesystem::path const plot = dir / "plot.gp";
  std::filesystem::path const log = dir / "gnuplot.log";
  {
    std::ofstream out(data);
    out << "# completed pages_in_use hit_rate_percent\n";
    for (TimelinePoint const& point : result.timeline) {
      out << fmt::format("{} {} {:.4f}\n", point.completed, point.pagesInUse,
                         100.0 * point.hitRate);
    }
    std::ofstream(plot) << script(result, data.string(),
                                  std::filesystem::absolute(pngPath).string());
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::string const scriptPath = plot.string();
  std::vector<char*> argv = {const_cast<char*>(gnuplot->c_str()),
                             const_cast<char*>(scriptPath.c_str()), nullptr};
  pid_t pid = 0;
  int const spawned = posix_spawn(&pid, gnuplot->c_str(), &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  PlotOutcome outcome{PlotStatus::kWritten, fmt::format("plot written to {}", pngPath)};
  if (spawned != 0) {
    outcome = {PlotStatus::kFailed,
               fmt::format("cannot run {}: {}", *gnuplot, std::strerror(spawned))};
  } else {
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::string text = readAll(log);
      while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) {
        text.pop_back();
      }
      outcome = {PlotStatus::kFailed, fmt::format("gnuplot failed to write {}: {}", pngPath,
                                                  text.empty() ? std::string("no message") : text)};
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  return outcome;
}

}  // namespace mkv::replay
