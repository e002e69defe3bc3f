"""Builds the native extensions (index builders; multi-buffer MD5 for the sync's ETags; the
tokenize stage's JSON lines reader); everything else is declared in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension("native._index", ["native/index.cpp"], cxx_std=17, extra_compile_args=["-O3"]),
        Pybind11Extension("native._jsonl", ["native/jsonl.cpp"], cxx_std=17, extra_compile_args=["-O3"]),
        Pybind11Extension("native._md5", ["native/md5.cpp"], depends=["native/md5_lanes.inc"], cxx_std=17,
                          extra_compile_args=["-O3"]),
    ],
)
