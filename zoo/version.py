"""The package version, in one place (``zoo.__version__``, ONNX producer metadata, Hub uploads)."""

__version__ = "0.1.0"
