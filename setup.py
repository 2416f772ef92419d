"""Build hook for the optional C extension; everything else is in pyproject.toml.

``optional=True``: where it cannot be compiled (no compiler, no Python headers) the
build goes on without it and the package runs its pure-Python code, the reference
(msgq_trio/protocol/framing.py, ``SPEEDUPS``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "msgq_trio.protocol._speedups",
            ["msgq_trio/protocol/_speedups.c"],
            optional=True,
        )
    ]
)
