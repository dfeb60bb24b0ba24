# The services' OpenMP spin time is set before anything here imports torch (shared/omp_defaults.py).
from shared.omp_defaults import apply as _apply_omp_defaults

_apply_omp_defaults()
