#include "parallel/peer_process.h"

#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>

namespace strata::parallel {
namespace {

std::string pid_namespace() {
  char buf[128] = {};
  const ssize_t n = ::readlink("/proc/self/ns/pid", buf, sizeof(buf) - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// State (field 3) and start time (field 22) of /proc/PID/stat; false when it does not exist.
bool read_stat(const std::string& pid, char* state, std::string* start) {
  std::ifstream in("/proc/" + pid + "/stat");
  std::string text;
  if (!std::getline(in, text)) return false;
  // The command name (field 2) is in parentheses and may hold spaces: fields follow the last ')'.
  const size_t close = text.rfind(')');
  if (close == std::string::npos) return false;
  std::istringstream rest(text.substr(close + 1));
  std::string field;
  for (int i = 3; i <= 22 && rest >> field; ++i) {
    if (i == 3) *state = field.empty() ? '?' : field[0];
    if (i == 22) *start = field;
  }
  return !start->empty();
}

}  // namespace

std::string own_process_identity() {
  const std::string ns = pid_namespace();
  char state = '?';
  std::string start;
  const std::string pid = std::to_string(::getpid());
  if (ns.empty() || !read_stat(pid, &state, &start)) return "";
  return ns + " " + pid + " " + start;
}

bool process_has_exited(const std::string& identity) {
  std::istringstream in(identity);
  std::string ns, pid, start;
  if (!(in >> ns >> pid >> start) || ns != pid_namespace()) return false;
  char state = '?';
  std::string now;
  if (!read_stat(pid, &state, &now)) return true;  // gone
  if (now != start) return true;                    // the PID went to another process
  return state == 'Z' || state == 'X';
}

}  // namespace strata::parallel
