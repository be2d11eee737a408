"""Build hook for the optional C++/CUDA extension; metadata lives in pyproject.toml."""

from setuptools import setup

setup()
