"""Packaging beyond pyproject.toml: native/'s C source is compiled by the ordinary ``pip install`` into
``kvxfer._kvx`` (scatter/gather socket I/O and copies, block-id checks); the CUDA kernel source ships as
``kvxfer.native`` (``pack.cu``, compiled at run time where a GPU is present)."""

from setuptools import Extension, find_packages, setup

setup(
    packages=[*find_packages(include=["kvxfer", "kvxfer.*"]), "kvxfer.native"],
    package_dir={"kvxfer.native": "native"},
    package_data={"kvxfer.native": ["*.cu"]},
    ext_modules=[
        Extension(
            "kvxfer._kvx",
            ["native/kvx.c"],
            extra_compile_args=["-O3", "-std=c11", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ],
)
