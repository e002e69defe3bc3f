"""The project's C++ (pybind11), one extension per job: index (Megatron's dataset index builders)
and md5 (multi-buffer MD5 for the sync's S3 ETags)."""
