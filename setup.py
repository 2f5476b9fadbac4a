"""Packaging beyond pyproject.toml: native/ (C / CUDA sources) ships inside the package as ``kvxfer.native``."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["kvxfer", "kvxfer.*"]), "kvxfer.native"],
    package_dir={"kvxfer.native": "native"},
    package_data={"kvxfer.native": ["*.cu"]},
)
