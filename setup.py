"""Build of the optional C accelerator kvtier._chain; all other metadata is in pyproject.toml.

optional=True: where no C compiler exists the install still succeeds and kvtier.keys
falls back to its pure-Python key chain.
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier._chain",
            sources=["kvtier/_chain.c"],
            include_dirs=["kvtier/_vendor/xxhash"],
            depends=["kvtier/_vendor/xxhash/xxhash.h"],
            optional=True,
        )
    ],
)
