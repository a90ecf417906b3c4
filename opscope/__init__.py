__version__ = "0.1.0"

def __getattr__(name):
    "The package's top-level names, imported on first use: `import opscope` alone loads no torch (mining workers import the package)."
    if name == 'specialize_model':
        from .specialize import specialize_model
        from . import saved   # attaches `Specialized.save`
        return specialize_model
    if name == 'load_specialized':
        from .saved import load_specialized
        return load_specialized
    raise AttributeError(f"module 'opscope' has no attribute {name!r}")
