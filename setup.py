"""Build of the optional C accelerators; all other metadata is in pyproject.toml.

kvtier._chain chains xxh3 block keys; kvtier._copy moves page chunks between an engine's
pages and tier slots in one copy; kvtier._mla is MLA decode attention read straight from
the paged pool (the reference engine, on a CPU). optional=True: where no C compiler exists the install
still succeeds and kvtier falls back to pure Python / torch paths that give the same bytes.
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
        ),
        Extension("kvtier._copy", sources=["kvtier/_copy.c"], optional=True),
        Extension("kvtier._mla", sources=["kvtier/_mla.c"], optional=True),
    ],
)
