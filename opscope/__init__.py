__version__ = "0.1.0"

def __getattr__(name):
    "The package's top-level names, imported on first use: `import opscope` alone loads no torch (mining workers import the package)."
    if name == 'specialize_model':
        from .specialize import specialize_model
        return specialize_model
    raise AttributeError(f"module 'opscope' has no attribute {name!r}")
