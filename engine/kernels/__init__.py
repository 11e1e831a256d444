"""Native CPU kernels (C + OpenMP), compiled once per machine and loaded with ctypes.

The torch backend uses them on CPU when they build; when no C compiler is present the engine logs
why once and keeps the pure-torch path, which computes the same thing.
"""
