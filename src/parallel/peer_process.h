// Telling whether another rank's process on this machine has exited, so that a failed collective
// can name the rank that went away where the transport's error does not say which one it was.
// A process is identified by its PID namespace, PID and start time (so a reused PID is not taken
// for it); ranks in other PID namespaces (other machines, other containers) are never judged.
#pragma once

#include <string>

namespace strata::parallel {

// This process: "NAMESPACE PID STARTTIME" (from /proc/self); "" when /proc cannot say.
std::string own_process_identity();

// True when the process `identity` (own_process_identity() of another process) is in this
// process's PID namespace and has exited (gone, or a zombie not yet reaped); false when it runs
// or cannot be judged.
bool process_has_exited(const std::string& identity);

}  // namespace strata::parallel
