"""Builds the native extension (index builders, multi-buffer MD5); everything else is declared in pyproject.toml."""
from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "native._native",
            ["native/index.cpp", "native/md5.cpp"],
            depends=["native/md5_lanes.inc"],
            cxx_std=17,
            extra_compile_args=["-O3"],
        )
    ],
)
