"""The package's version, in one place: pyproject.toml reads it (setuptools' dynamic version), the CLI prints it."""

VERSION = "0.1.0"
