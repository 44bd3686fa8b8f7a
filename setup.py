"""Build of the optional C accelerators; all other metadata is in pyproject.toml.

kvtier._chain chains xxh3 block keys; kvtier._copy moves page chunks between an engine's
pages and tier slots in one copy; kvtier._mla is MLA decode attention read straight from
the paged pool (the reference engine, on a CPU). optional=True: where no C compiler exists the install
still succeeds and kvtier falls back to pure Python / torch paths that give the same bytes.
"""
import platform

from setuptools import Extension, setup

# xxHash's runtime dispatch (AVX2/AVX-512 where the CPU has them) builds only for x86, with
# the baseline flags: -march=native would tie the build to this machine's CPU.
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
chain_sources = ["kvtier/_chain.c"] + (["kvtier/_vendor/xxhash/xxh_x86dispatch.c"] if X86 else [])

setup(
    ext_modules=[
        Extension(
            "kvtier._chain",
            sources=chain_sources,
            include_dirs=["kvtier/_vendor/xxhash"],
            depends=["kvtier/_vendor/xxhash/xxhash.h", "kvtier/_vendor/xxhash/xxh_x86dispatch.h"],
            define_macros=[("KVTIER_XXH_DISPATCH", "1")] if X86 else [],
            optional=True,
        ),
        Extension("kvtier._copy", sources=["kvtier/_copy.c"], optional=True),
        Extension("kvtier._mla", sources=["kvtier/_mla.c"], optional=True),
    ],
)
