"""The package version (one place: the package, artifacts and the CLI read it)."""
__version__ = "0.1.0"
