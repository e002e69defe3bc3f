"""Multi-buffer MD5 in C++ (native._md5): byte ranges of open files hashed side by side in SIMD
lanes, the sync's check of S3 ETags (tasks.sync.integrity)."""
from __future__ import annotations

from native._md5 import md5_lanes, md5_ranges

__all__ = ["md5_lanes", "md5_ranges"]
