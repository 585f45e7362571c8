#include "mkv/remote_kv_store.h"

namespace mkv {

char const* toString(RemoteStoreStatus status) noexcept {
  switch (status) {
    case RemoteStoreStatus::kOk:
      return "ok";
    case RemoteStoreStatus::kUnavailable:
      return "unavailable";
    case RemoteStoreStatus::kRejected:
      return "rejected";
  }
  return "unknown";
}

}  // namespace mkv
