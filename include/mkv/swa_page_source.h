#pragma once
/// \file swa_page_source.h
/// Where the sliding-window pages of the composed backend (sliding layers plus context reuse)
/// come from and go back to (docs/architecture.md, "Sliding windows with context reuse").

#include <cstdint>
#include <vector>

#include "mkv/types.h"

namespace mkv {

/// The owner of every page of a sliding-window pool whose prompt blocks outlive the window: the
/// free pages and the cached window blocks. A BoundedSwaKVPageManager built with a page source
/// (BoundedSwaResources::pageSource) keeps no free list of its own: it takes its sequences'
/// pages here and gives them back here. A page is free, held (by one or more holders: the
/// sequences whose window maps it) or cached (published, held by nobody, evictable); a cached
/// page may also be held (a window that maps a reused block).
///
/// Thread-safety: single writer (the engine thread), like the manager that drives it.
class SwaPageSource {
 public:
  virtual ~SwaPageSource() = default;

  /// Pages of the pool (ids [0, totalPages())).
  virtual int32_t totalPages() const noexcept = 0;
  /// Pages allocate() can hand out now: free pages plus cached pages nobody holds.
  virtual int32_t availablePages() const noexcept = 0;
  /// Appends `count` pages to `out`, each held once by the caller: free pages first, then the
  /// least recently released cached ones (their blocks are dropped from the cache). Returns
  /// false and changes nothing when fewer than `count` are available.
  virtual bool allocate(int32_t count, std::vector<PageId>& out) = 0;
  /// Adds a holder to `page`, which must be cached or already held (a window that maps a reused
  /// block). Throws mkv::Error (nothing changed) otherwise. A held page is never allocated.
  virtual void hold(PageId page) = 0;
  /// Removes one holder of `page` (which must be held). When none is left, a cached page becomes
  /// the most recently released one and an unpublished page free. Call only once no device work
  /// that reads or writes the page through this holder is pending.
  virtual void release(PageId page) noexcept = 0;
};

}  // namespace mkv
