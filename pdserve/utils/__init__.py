"""pdserve.utils: the few helpers every layer may use, importing nothing else of pdserve.

    processes.py  free ports, stopping child processes
    cache.py      where pdserve caches models and built kernels
"""
